"""Scatter-free row movement for the expert-parallel transport (SPEC §3, step 6).

Every data movement in the pooled-wave transport is a *gather through a static-shape index map*, and
every map comes with its inverse, so the backward pass is again a gather (never the scatter-add that
autodiff would emit as the transpose of a gather):

- `gather_rows`: out[o] = src[idx[o]] (masked). Each source row is read by at most I output rows, listed
  by the inverse map [N, I]; the cotangent is the gather-sum d_src[n] = sum_i d_out[inv[n, i]].
  I = K for the dispatch (a token feeds up to K send rows), I = 1 for the receiver's compaction and
  expansion (partial permutations).
- `combine_rows`: y[t] = sum_k w[t,k] * src[idx[t,k]], accumulated in fp32. Its cotangent w.r.t. src is
  the gather d_src[n] = w[a(n)] * dy[t(n)] through the inverse map n -> assignment a(n).
- `rank_in_groups`: the stable rank of each element among elements with the same key, by sorting (no
  bincount, which lowers to a scatter-add).

Dimensions: N source rows, O output rows, I readers per source row, T tokens, K choices, Z latent width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def _masked_take(src_NZ: Array, idx_O: Array, valid_O: Array) -> Array:
    rows_OZ = jnp.take(src_NZ, idx_O, axis=0, mode="clip")
    return jnp.where(valid_O[:, None], rows_OZ, jnp.zeros((), src_NZ.dtype))


@jax.custom_vjp
def gather_rows(src_NZ: Float[Array, "N Z"], idx_O: Int[Array, "O"], valid_O: Bool[Array, "O"],
                inv_idx_NI: Int[Array, "N I"], inv_valid_NI: Bool[Array, "N I"]) -> Float[Array, "O Z"]:
    """out[o] = src[idx[o]] where valid[m], else 0. (inv_idx, inv_valid) must list, for every source row,
    exactly the valid output rows that read it; only the backward pass uses them."""
    return _masked_take(src_NZ, idx_O, valid_O)


def _gather_rows_fwd(src_NZ, idx_O, valid_O, inv_idx_NI, inv_valid_NI):
    return _masked_take(src_NZ, idx_O, valid_O), (inv_idx_NI, inv_valid_NI)


def _gather_rows_bwd(res, d_out_OZ):
    inv_idx_NI, inv_valid_NI = res
    d_src_NZ = sum(_masked_take(d_out_OZ, inv_idx_NI[:, j], inv_valid_NI[:, j]).astype(jnp.float32)
                   for j in range(inv_idx_NI.shape[1]))
    return d_src_NZ.astype(d_out_OZ.dtype), None, None, None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _combine(src_NZ, w_TK, idx_TK, kept_TK):
    acc_TZ = jnp.zeros((w_TK.shape[0], src_NZ.shape[1]), jnp.float32)
    for k in range(w_TK.shape[1]):  # K is small and static: no [T, K, Z] fp32 intermediate
        w_T = jnp.where(kept_TK[:, k], w_TK[:, k].astype(jnp.float32), 0.0)
        acc_TZ = acc_TZ + w_T[:, None] * jnp.take(src_NZ, idx_TK[:, k], axis=0, mode="clip").astype(jnp.float32)
    return acc_TZ


@jax.custom_vjp
def combine_rows(src_NZ: Float[Array, "N Z"], w_TK: Float[Array, "T K"], idx_TK: Int[Array, "T K"],
                 kept_TK: Bool[Array, "T K"], inv_assign_N: Int[Array, "N"],
                 inv_valid_N: Bool[Array, "N"]) -> Float[Array, "T Z"]:
    """y[t] = sum_k kept[t,k] * w[t,k] * src[idx[t,k]] in fp32. inv_assign[n] = t*K + k of the kept
    assignment that reads row n (inv_valid[n] False if none); only the backward pass uses it."""
    return _combine(src_NZ, w_TK, idx_TK, kept_TK)


def _combine_fwd(src_NZ, w_TK, idx_TK, kept_TK, inv_assign_N, inv_valid_N):
    return _combine(src_NZ, w_TK, idx_TK, kept_TK), (src_NZ, w_TK, idx_TK, kept_TK, inv_assign_N, inv_valid_N)


def _combine_bwd(res, dy_TZ):
    src_NZ, w_TK, idx_TK, kept_TK, inv_assign_N, inv_valid_N = res
    n_tok, k = w_TK.shape
    # d_src[n] = w[a(n)] * dy[t(n)]: a gather through the inverse map, not a scatter-add.
    w_N = jnp.where(inv_valid_N, jnp.take(w_TK.reshape(-1), inv_assign_N, mode="clip").astype(jnp.float32), 0.0)
    d_src_NZ = w_N[:, None] * jnp.take(dy_TZ, inv_assign_N // k, axis=0, mode="clip")
    d_w_TK = jnp.stack([jnp.where(kept_TK[:, j], jnp.einsum(
        "tz,tz->t", dy_TZ, jnp.take(src_NZ, idx_TK[:, j], axis=0, mode="clip").astype(jnp.float32)), 0.0)
        for j in range(k)], axis=1)
    return d_src_NZ.astype(src_NZ.dtype), d_w_TK.astype(w_TK.dtype), None, None, None, None


combine_rows.defvjp(_combine_fwd, _combine_bwd)


class GroupRank(NamedTuple):
    """Stable grouping of N keys into G groups (key == G: ignored, sorted last)."""

    rank_N: Int[Array, "N"]  # position of each element among the elements with its key, in index order
    order_N: Int[Array, "N"]  # stable sort permutation (sorted position -> element)
    starts_G: Int[Array, "G"]  # sorted position of each group's first element
    counts_G: Int[Array, "G"]  # elements per group

    def member(self, group: Array, r: Array) -> tuple[Array, Array]:
        """Element index of the r-th member of `group`, and whether it exists (same shapes as inputs)."""
        exists = r < jnp.take(self.counts_G, group)
        pos = jnp.take(self.starts_G, group) + r
        return jnp.take(self.order_N, pos, mode="clip"), exists


def rank_in_groups(key_N: Int[Array, "N"], n_groups: int) -> GroupRank:
    """Rank every element among those with the same key (in index order) with two stable sorts."""
    n = key_N.shape[0]
    order_N = jnp.argsort(key_N, stable=True)
    sorted_N = jnp.take(key_N, order_N)
    # unrolled (no device while loop; see grouped.make_layout)
    bounds = jnp.searchsorted(sorted_N, jnp.arange(n_groups + 1, dtype=key_N.dtype), side="left",
                              method="scan_unrolled").astype(jnp.int32)
    rank_sorted_N = jnp.arange(n, dtype=jnp.int32) - jnp.take(bounds, sorted_N)
    rank_N = jnp.take(rank_sorted_N, jnp.argsort(order_N))  # undo the sort with a gather (second sort)
    return GroupRank(rank_N, order_N.astype(jnp.int32), bounds[:-1], bounds[1:] - bounds[:-1])
