"""Learning-rate schedule (SPEC §4): linear warmup over a fraction of steps, then linear decay to a floor.

Warmup starts at 0 (step 0 makes no move) and reaches the peak at step `warmup_steps`; the decay reaches
`min_lr_fraction * peak` at step `total_steps` and stays there.
Built from optax's own `linear_schedule` / `join_schedules`.
"""

from __future__ import annotations

import optax


def warmup_steps_for(total_steps: int, warmup_fraction: float) -> int:
    """Warmup length in steps: round(fraction * total), at least 1 when the fraction is positive."""
    if warmup_fraction <= 0:
        return 0
    return max(1, round(warmup_fraction * total_steps))


def warmup_linear_decay(peak: float, total_steps: int, warmup_fraction: float = 0.01,
                        min_lr_fraction: float = 0.05) -> optax.Schedule:
    """peak * (linear 0 -> 1 over warmup, then linear 1 -> min_lr_fraction until total_steps)."""
    if total_steps < 1:
        raise ValueError(f"total_steps ({total_steps}) must be at least 1")
    if not 0 <= warmup_fraction < 1:
        raise ValueError(f"warmup_fraction ({warmup_fraction}) must lie in [0, 1)")
    if not 0 <= min_lr_fraction <= 1:
        raise ValueError(f"min_lr_fraction ({min_lr_fraction}) must lie in [0, 1]")
    warmup = warmup_steps_for(total_steps, warmup_fraction)
    decay = optax.linear_schedule(peak, min_lr_fraction * peak, max(1, total_steps - warmup))
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])
