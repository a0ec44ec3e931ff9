"""Optimizer hyperparameter heuristic (SPEC §4): one function of (T, d, B) gives every optimizer number.

T = total training tokens, d = model width, B = tokens per batch (step). The formulas are the fitted
scaling rules of the public run's design record (Marin's grug MoE heuristic); they are reproduced
verbatim, not re-derived. The hero (T = 46,137,344 x 390,139, d = 6144, B = 46,137,344) gives
adam_lr 7.04e-4, muonh_lr 3.05e-3, beta2 0.95 (clipped), eps 6.04e-15.
"""

from __future__ import annotations

import dataclasses
import math

# Reference batch for the beta2 rule: beta2 = 0.999 at B = 2**17 tokens, and the half-life of the
# second-moment average stays fixed in *tokens* as B grows (SPEC §4).
_BETA2_REF_TOKENS = 131_072


@dataclasses.dataclass(frozen=True)
class OptimizerHyperparams:
    """Peak learning rates and Adam constants for one run (all groups share b1/b2/eps)."""

    adam_lr: float
    muonh_lr: float
    beta1: float
    beta2: float
    eps: float

    def __post_init__(self):
        for name in ("adam_lr", "muonh_lr", "eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be positive")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must lie in [0, 1)")


def optimizer_heuristic(*, total_tokens: float, width: int, batch_tokens: float) -> OptimizerHyperparams:
    """SPEC §4 heuristic from T = total_tokens, d = width, B = batch_tokens."""
    if total_tokens <= 0 or width <= 0 or batch_tokens <= 0:
        raise ValueError(f"total_tokens ({total_tokens}), width ({width}) and batch_tokens ({batch_tokens}) "
                         "must all be positive")
    if batch_tokens > total_tokens:
        raise ValueError(f"batch_tokens ({batch_tokens}) exceeds total_tokens ({total_tokens})")
    t, d, b = float(total_tokens), float(width), float(batch_tokens)
    # Fitted power law (SPEC §4 / grug heuristic): lr falls with horizon and width, grows as sqrt(batch);
    # capped at 0.05 for tiny runs.
    adam_lr = min(0.05, 0.06602 * t ** -0.395 * d ** -0.150 * math.sqrt(b))
    # MuonH peak lr is a fixed 13/3 multiple of Adam's (SPEC §4), same cap.
    muonh_lr = min(0.05, 13.0 / 3.0 * adam_lr)
    # eps grows with the number of steps T/B (SPEC §4); tiny in absolute terms (~6e-15 on the hero).
    eps = 9.676e-18 * math.sqrt(t / b)
    # Constant second-moment half-life in tokens, clipped to [0.95, 0.9999] (SPEC §4).
    beta2 = min(max(0.999 ** (b / _BETA2_REF_TOKENS), 0.95), 0.9999)
    # beta1 is a fixed constant of the recipe (SPEC §4).
    return OptimizerHyperparams(adam_lr=adam_lr, muonh_lr=muonh_lr, beta1=0.9062, beta2=beta2, eps=eps)
