"""Context-length schedule (SPEC §5): sequence length grows in phases while tokens per step stay fixed.

`ContextSchedule` maps a step to (seq_len, sequences per step). A phase starting at fraction f of the
run begins at step round(f * steps); sequences per step = tokens per step / seq_len, which must divide.
"""

from __future__ import annotations

from dataclasses import dataclass

from moejax.config import ConfigError, DataConfig, TrainConfig

@dataclass(frozen=True)
class ContextSchedule:
    tokens_per_step: int
    boundaries: tuple[tuple[int, int, int], ...]  # (first step, seq_len, sequences per step), ascending

    @staticmethod
    def from_config(train: TrainConfig, data: DataConfig, process_count: int = 1) -> "ContextSchedule":
        tps = train.tokens_per_step
        points = {0: train.seq_len}
        for frac, length in data.schedule_points:
            points[round(frac * train.steps)] = length  # a later phase on the same step wins
        bounds = []
        for step, length in sorted(points.items()):
            if tps % length:
                raise ConfigError(f"context schedule: tokens per step ({tps} = {train.seq_len} x {train.batch_size}) "
                                  f"is not divisible by seq_len {length} (from step {step})")
            bsz = tps // length
            if bsz % process_count:
                raise ConfigError(f"context schedule: {bsz} sequences per step at seq_len {length} (from step {step}) "
                                  f"is not divisible by the process count ({process_count})")
            bounds.append((step, length, bsz))
        return ContextSchedule(tps, tuple(bounds))

    def _at(self, step: int) -> tuple[int, int, int]:
        return max((b for b in self.boundaries if b[0] <= step), key=lambda b: b[0])

    def seq_len_at(self, step: int) -> int:
        return self._at(step)[1]

    def batch_size_at(self, step: int) -> int:
        return self._at(step)[2]

    def describe(self) -> list[dict]:
        return [{"from_step": s, "seq_len": l, "batch_size": b} for s, l, b in self.boundaries]
