"""Context-length schedule (SPEC §5): sequence length grows in phases while tokens per step stay fixed.

`ContextSchedule` maps a step to (seq_len, sequences per step). A phase starting at fraction f of the
run begins at step round(f * steps); sequences per step = tokens per step / seq_len, which must divide.
"""

from __future__ import annotations

from dataclasses import dataclass

from moejax.config import ConfigError, ContextPhase, DataConfig, ParallelConfig, TrainConfig, context_phases


@dataclass(frozen=True)
class ContextSchedule:
    tokens_per_step: int
    boundaries: tuple[tuple[int, int, int], ...]  # (first step, seq_len, sequences per step), ascending
    phases: tuple[ContextPhase, ...] = ()  # the same steps with context-parallel degree and capacity factors

    @staticmethod
    def from_config(train: TrainConfig, data: DataConfig, process_count: int = 1,
                    parallel: ParallelConfig | None = None) -> "ContextSchedule":
        """`parallel` resolves each phase's context-parallel degree and capacity factors (None: a 1-device mesh)."""
        phases = context_phases(train, data, parallel or ParallelConfig())
        for ph in phases:
            if ph.sequences % process_count:
                raise ConfigError(f"context schedule: {ph.sequences} sequences per step at seq_len {ph.seq_len} "
                                  f"(from step {ph.start}) is not divisible by the process count ({process_count})")
        return ContextSchedule(train.tokens_per_step, tuple((ph.start, ph.seq_len, ph.sequences) for ph in phases),
                               phases)

    def _at(self, step: int) -> tuple[int, int, int]:
        return max((b for b in self.boundaries if b[0] <= step), key=lambda b: b[0])

    def phase_at(self, step: int) -> ContextPhase:
        return max((ph for ph in self.phases if ph.start <= step), key=lambda ph: ph.start)

    def seq_len_at(self, step: int) -> int:
        return self._at(step)[1]

    def batch_size_at(self, step: int) -> int:
        return self._at(step)[2]

    def describe(self) -> list[dict]:
        return [{"from_step": ph.start, "seq_len": ph.seq_len, "batch_size": ph.sequences, "context": ph.context,
                 "rows": ph.rows, "cf_send": ph.cf_send, "cf_recv": ph.cf_recv} for ph in self.phases]
