"""Router of the MoE block (SPEC §2): fp32 logits plus a non-trained bias, top-(K+1) threshold,
sigmoid combine weights from the *unbiased* logits renormalised to sum `combine_scale` (2.5).

Dimensions: T tokens, D width, E experts, K choices.
The margins logit - alpha (alpha = the (K+1)-th biased value) feed quantile balancing; the
load-balancing loss and router z-loss are computed for logging only (QB replaces the auxiliary loss).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from moejax.model import kernel_choice

COMBINE_EPS = 1e-9


class Routing(NamedTuple):
    expert_TK: Int[Array, "T K"]
    weight_TK: Float[Array, "T K"]
    logits_TE: Float[Array, "T E"]  # unbiased, fp32
    threshold_T: Float[Array, "T"]  # alpha: the (K+1)-th biased logit


def _bf16_parts(x: Float[Array, "..."], n: int) -> list[Array]:
    """n bf16 arrays, largest first, whose fp32 sum is x: each takes the next 8 significant bits of what the
    ones before left (3 parts hold an fp32 exactly, but for magnitudes near bf16's subnormal floor, ~1e-33).
    Rounded with reduce_precision, not a bf16 round trip: XLA may drop an f32 -> bf16 -> f32 convert pair
    under excess precision, which would leave every residual 0."""
    x, parts = x.astype(jnp.float32), []
    for _ in range(n - 1):
        part = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
        parts.append(part)
        x = x - part
    return [p.astype(jnp.bfloat16) for p in parts + [x]]


def _side_by_side(parts: list[Array]) -> Array:
    """The parts concatenated on their last axis, as an array in memory: fused into the GEMM, the concatenate
    made XLA's deviceless GB200 compile of the hero's step pick a Triton tiling over its shared memory (295,152
    of 232,448 bytes) and fail."""
    return jax.lax.optimization_barrier(jnp.concatenate(parts, axis=-1))


@jax.custom_vjp
def logits_bf16_matmul(m_TD: Float[Array, "T D"], router_DE: Float[Array, "D E"]) -> Float[Array, "T E"]:
    """fp32 router logits m W (SPEC §2) from one bf16 matmul with fp32 accumulation: the GPU's tensor cores
    instead of its fp32 FMA units, which ran the d1024 rung's router GEMMs at ~45 TFLOP/s (the forward and
    its remat alone 13.8 ms of a 525 ms H200 step, docs/LOG.md 2026-12-04).

    m_TD is bf16 (the compute dtype) and W holds bf16 values: every caller passes the compute copy (the train
    step upcasts it to fp32 for an fp32 gradient; eval and `moejax.weights` read it as it is). So every
    product is exact and the logits are the fp32 matmul's up to the order of the fp32 sums. A W with more bits
    is rounded to bf16 first, as the model reads every other weight. Backward: dW = m^T dlogits from dlogits'
    3 exact bf16 parts side by side (fp32 grade, as the fp32 matmul's); dm from dlogits' two leading parts
    (relative error ~2^-16, then rounded to bf16 anyway: m's dtype)."""
    return jnp.einsum("td,de->te", m_TD, router_DE.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def _logits_fwd(m_TD, router_DE):
    return logits_bf16_matmul(m_TD, router_DE), (m_TD, router_DE)  # the weight as given: its dtype is dW's


def _logits_bwd(res, g_TE):
    m_TD, router_DE = res
    w_DE = router_DE.astype(jnp.bfloat16)
    g1, g2, g3 = _bf16_parts(g_TE, 3)
    dw_D3E = jnp.einsum("td,te->de", m_TD, _side_by_side([g1, g2, g3]), preferred_element_type=jnp.float32)
    dw_DE = functools.reduce(lambda acc, block: acc + block, jnp.split(dw_D3E, 3, axis=-1)[::-1])  # smallest first
    dm_TD = jnp.einsum("te,de->td", _side_by_side([g1, g2]), _side_by_side([w_DE, w_DE]),
                       preferred_element_type=jnp.float32)
    return dm_TD.astype(m_TD.dtype), dw_DE.astype(router_DE.dtype)


logits_bf16_matmul.defvjp(_logits_fwd, _logits_bwd)


def router_logits(m_TD: Float[Array, "T D"], router_DE: Float[Array, "D E"]) -> Float[Array, "T E"]:
    """fp32 logits (SPEC §2): on GPUs with bf16 activations `logits_bf16_matmul`, else one fp32 matmul at
    full precision (CPUs: their fp32 matmul is their fastest)."""
    if kernel_choice.lowering_for_gpu() and m_TD.dtype == jnp.bfloat16:
        return logits_bf16_matmul(m_TD, router_DE.astype(jnp.float32))
    return jnp.einsum("td,de->te", m_TD.astype(jnp.float32), router_DE.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def route(m_TD: Float[Array, "T D"], router_DE: Float[Array, "D E"], bias_E: Float[Array, "E"], top_k: int,
          combine_scale: float) -> Routing:
    logits = router_logits(m_TD, router_DE)
    biased = logits + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    # The barrier keeps XLA from folding the slices below into the top_k, which turns it into a full sort
    # of every row: on CPU 13 vs 1.8 ms at [4096, 32] (k+1 = 5), 273 vs 13 ms at E=384 (k+1 = 9).
    top_vals, top_idx = jax.lax.optimization_barrier(jax.lax.top_k(jax.lax.stop_gradient(biased), top_k + 1))
    expert_TK = top_idx[:, :top_k]
    s = jax.nn.sigmoid(jnp.take_along_axis(logits, expert_TK, axis=-1))
    weight_TK = combine_scale * s / (jnp.sum(s, -1, keepdims=True) + COMBINE_EPS)
    return Routing(expert_TK, weight_TK, logits, top_vals[:, top_k])


def router_stats(r: Routing, mask_T: Bool[Array, "T"]) -> dict[str, jax.Array]:
    """Logged (never optimised) router health: load, entropy, Switch-style LB loss, router z-loss."""
    n_exp = r.logits_TE.shape[-1]
    top_k = r.expert_TK.shape[-1]
    logits = jax.lax.stop_gradient(r.logits_TE)
    w = mask_T.astype(jnp.float32)
    n_valid = jnp.maximum(jnp.sum(w), 1.0)
    load_E = jnp.sum(jax.nn.one_hot(r.expert_TK, n_exp, dtype=jnp.float32) * w[:, None, None], axis=(0, 1))
    probs = jax.nn.softmax(logits, axis=-1)
    entropy = -jnp.sum(probs * jnp.log(probs + 1e-20), -1)
    frac_E = load_E / (n_valid * top_k)
    mean_prob_E = jnp.sum(probs * w[:, None], 0) / n_valid
    lse = jax.nn.logsumexp(logits, -1)
    return {
        "load": load_E,
        "entropy": jnp.sum(entropy * w) / n_valid,
        "load_balancing_loss": n_exp * jnp.sum(frac_E * mean_prob_E),
        "router_z_loss": jnp.sum(lse * lse * w) / n_valid,
        "max_over_mean_load": jnp.max(load_E) / jnp.maximum(jnp.mean(load_E), 1e-9),
    }
