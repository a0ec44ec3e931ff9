"""Quantile balancing (QB, SPEC §2): the router bias that makes every expert take T*K/E tokens.

Dimensions: T tokens (the global batch, possibly sharded), E experts, K top-k, Nb histogram bins.

Margins mu[t, e] = logit[t, e] - alpha_t (unbiased logit minus the token's threshold, the (K+1)-th
*biased* value; the caller computes them). Token t chose e roughly iff mu[t, e] > -b_e, so the bias
b_e = -beta_e, where exactly n = T_valid*K/E tokens have mu[., e] > beta_e, would give every expert its
fair share if the thresholds stayed put. The new bias *replaces* the old one at the next step (SPEC §2).

beta_e is estimated from an N-bin histogram over [min mu, max mu] of the valid margins (global extrema,
no gradient) with linear interpolation inside the bin, as in the public run. Counts are int32 scattered
into an [E, N] table, so memory is O(T*E + E*N) (no [T, E, N] tensor) and the counts stay exact far
beyond fp32's 2**24. Everything is plain global jnp: under jit with sharded margins, GSPMD turns the
min/max and the scatter-add into partial results plus all-reduces, so the estimate is the global one.
`qb_bias_exact` (per-expert sort) is the slow reference the tests tie it to.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def _target_count(mask_T: Bool[Array, "T"], top_k: int, num_experts: int) -> Float[Array, ""]:
    if not 0 < top_k < num_experts:
        raise ValueError(f"top_k ({top_k}) must lie in [1, num_experts ({num_experts}) - 1]")
    # (T_valid * K) / E: exact whenever the share is an integer (T_valid * K < 2**24).
    return jnp.sum(mask_T, dtype=jnp.float32) * top_k / num_experts


def _centred_bias(beta_E: Float[Array, "E"], n_valid: Float[Array, ""]) -> Float[Array, "E"]:
    bias_E = -(beta_E - jnp.mean(beta_E))
    return jnp.where(n_valid > 0, bias_E, 0.0)  # an all-padding batch leaves no information: zero bias


def qb_threshold(margins_TE: Float[Array, "T E"], mask_T: Bool[Array, "T"], top_k: int,
                 n_bins: int = 10_000) -> Float[Array, "E"]:
    """Histogram estimate of beta_e: the value that n = T_valid*K/E valid tokens' margins exceed."""
    if n_bins < 1:
        raise ValueError(f"n_bins ({n_bins}) must be at least 1")
    return _histogram_threshold(jnp.asarray(margins_TE), jnp.asarray(mask_T), top_k, n_bins)


def _histogram_threshold(margins_TE, mask_T, top_k: int, n_bins: int):
    num_experts = margins_TE.shape[1]
    mu_TE = jax.lax.stop_gradient(margins_TE).astype(jnp.float32)
    valid_TE = jnp.broadcast_to(mask_T[:, None], mu_TE.shape)
    lo = jnp.min(jnp.where(valid_TE, mu_TE, jnp.inf))
    hi = jnp.max(jnp.where(valid_TE, mu_TE, -jnp.inf))
    n_valid = jnp.sum(mask_T, dtype=jnp.float32)
    lo, hi = jnp.where(n_valid > 0, lo, 0.0), jnp.where(n_valid > 0, hi, 0.0)
    width = (hi - lo) / n_bins
    safe_width = jnp.where(width > 0, width, 1.0)  # all margins equal: every token lands in bin 0

    bin_TE = jnp.clip(jnp.floor((mu_TE - lo) / safe_width), 0, n_bins - 1).astype(jnp.int32)
    flat_TE = bin_TE + n_bins * jnp.arange(num_experts, dtype=jnp.int32)[None, :]
    counts_ENb = jnp.zeros(num_experts * n_bins, jnp.int32).at[flat_TE.ravel()].add(
        valid_TE.ravel().astype(jnp.int32), mode="drop").reshape(num_experts, n_bins)

    # at_or_above_ENb[e, b] = tokens with margin in bin b or higher (reverse cumulative count).
    at_or_above_ENb = jnp.cumsum(counts_ENb[:, ::-1], axis=1)[:, ::-1]
    n = _target_count(mask_T, top_k, num_experts)
    # The crossing bin: the last bin whose lower edge still has >= n tokens at or above it.
    bin_E = jnp.clip(jnp.sum(at_or_above_ENb >= n, axis=1) - 1, 0, n_bins - 1)
    in_bin_E = jnp.take_along_axis(counts_ENb, bin_E[:, None], axis=1)[:, 0].astype(jnp.float32)
    above_E = jnp.take_along_axis(at_or_above_ENb, bin_E[:, None], axis=1)[:, 0].astype(jnp.float32) - in_bin_E
    # Tokens spread uniformly inside the bin: the fraction of the bin above beta holds n - above tokens.
    frac_E = 1.0 - (n - above_E) / jnp.maximum(in_bin_E, 1.0)
    return lo + (bin_E.astype(jnp.float32) + jnp.clip(frac_E, 0.0, 1.0)) * width


def qb_bias(margins_TE: Float[Array, "T E"], mask_T: Bool[Array, "T"], top_k: int,
            n_bins: int = 10_000) -> Float[Array, "E"]:
    """Next step's router bias b = -beta, centred to zero mean over experts (SPEC §2)."""
    beta_E = qb_threshold(margins_TE, mask_T, top_k, n_bins)
    return _centred_bias(beta_E, jnp.sum(mask_T, dtype=jnp.float32))


def qb_threshold_exact(margins_TE: Float[Array, "T E"], mask_T: Bool[Array, "T"], top_k: int) -> Float[Array, "E"]:
    """Reference beta_e: the ceil(n)-th largest valid margin per expert (sort-based; for tests).

    The histogram estimate lies in the same bin as this value, so they differ by at most one bin width.
    """
    return _sorted_threshold(jnp.asarray(margins_TE), jnp.asarray(mask_T), top_k)


def _sorted_threshold(margins_TE, mask_T, top_k: int):
    mu_TE = jax.lax.stop_gradient(margins_TE).astype(jnp.float32)
    num_tokens, num_experts = mu_TE.shape
    descending_TE = -jnp.sort(-jnp.where(mask_T[:, None], mu_TE, -jnp.inf), axis=0)
    n = _target_count(mask_T, top_k, num_experts)
    rank = jnp.clip(jnp.ceil(n).astype(jnp.int32) - 1, 0, num_tokens - 1)
    return descending_TE[rank]


def qb_bias_exact(margins_TE: Float[Array, "T E"], mask_T: Bool[Array, "T"], top_k: int) -> Float[Array, "E"]:
    """`qb_bias` with the exact (sorted) quantile instead of the histogram."""
    beta_E = qb_threshold_exact(margins_TE, mask_T, top_k)
    return _centred_bias(beta_E, jnp.sum(mask_T, dtype=jnp.float32))
