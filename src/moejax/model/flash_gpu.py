"""Fused flash attention for GPU: a Pallas kernel (Triton lowering), forward and backward.

Dimensions: B batch, S query positions, Sk >= S key positions (the queries are the last S of them: keys
extended in front by context parallelism's earlier chunks or halo; Sk = S otherwise), H query heads, G KV
heads (H % G == 0), Hd head dim, bq / bk query / key block sizes, off = Sk - S.
What it computes (SPEC §2 attention core): out = softmax(scale * q k^T + mask) v with the mask
causal AND same document (segment ids equal; -1 on keys before a sequence matches nothing) AND, when
`window` is set, q - k < window, positions counted along the keys (query i sits at key position off + i).
Notable choices:
- Adapted from jax.experimental.pallas.ops.gpu.attention (Apache-2.0; FlashAttention-2 with base-2
  exponentials): that kernel has causal + segment masks but no sliding window and no GQA. Added here:
  the window, with key blocks outside [q - window + 1, q] skipped by the loop bounds (local layers cost
  S * (bq + window), not S^2 / 2); GQA by index map (query head h reads KV head h // (H/G), no repeated
  K/V in memory); fp32 output (the XLA path's dtype, so XSA downstream sees the same values).
- Document skipping: the loops also skip blocks whose segment-id ranges are disjoint, which can share no
  document (`document_bounds`, per row, computed by XLA beside the kernels): on packed rows of ~1K-token
  documents at S = 4096 the global layers take 0.39 and the local ones 0.50 of the causal (and windowed)
  key blocks. Exact whatever the ids: the masks still decide every pair inside the blocks taken.
- Backward as two kernels (dK/dV looping over query blocks, dQ looping over key blocks) with the same
  block skipping; each dK/dV program sums over the H/G query heads of its KV head in registers, so no
  per-query-head [B, Sk, H, Hd] fp32 gradient is written (at the hero's 48 heads on 12/6 that would be 4-8x
  the K/V gradient's size). delta = rowsum(o * dO) is an XLA reduction.
- Every query sees at least itself (the diagonal is same-document and inside any window >= 1), so no
  row is fully masked; a masked block processed before the diagonal is wiped by the running-max
  correction (exp2(MASK - m) = 0), as in the upstream kernel.
- `interpret=True` runs the same kernels through the Pallas interpreter on CPU (tests only).
- Single-device math: on a mesh, `parallel.backends.attention_kernel` runs it per batch shard (shard_map).
Only plain ref indexing, lax.dot_general and lax.fori_loop are used so the kernel lowers on jax 0.10
and 0.11 alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from moejax.model.pallas_util import dot, out_like, plgpu, whole

LOG2E = math.log2(math.e)
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: exp2(MASK - m) is 0, never NaN


@dataclasses.dataclass(frozen=True)
class FlashBlocks:
    """Tile sizes (Triton wants powers of two >= 16) and launch parameters. The forward's are the upstream
    kernel's. The backward's are the largest tiles whose dQ and dK/dV kernels compile for an H200 with no
    register spills (a static sweep through XLA's GPU compiler and ptxas, `moejax.cuda_aot`; docs/LOG.md
    2026-12-01, fourth session): 64 x 64 on 4 warps, the earlier default, spilled ~0.4 KB per thread in dK/dV,
    128 x 128 needs more shared memory than an SM has. Pipeline stages: on an H200 (docs/LOG.md 2026-12-04)
    3 forward stages beat 2 by 2-3% on local and global bf16 layers; 2 backward stages gained another 2%,
    inside the machine's noise, and spill in dK/dV (ptxas: 164 B a thread with the document bounds), so the
    backward keeps 1. fp32 tiles take twice the shared memory a stage, more than an SM has at 3: `for_dtype`
    keeps 2 for them."""
    q: int = 128
    k: int = 64
    q_bwd: int = 128
    k_bwd: int = 64
    num_stages: int = 3  # forward
    num_stages_bwd: int = 1
    num_warps_bwd: int = 8
    # False: the loops skip only future, out-of-window and pre-sequence (-1) keys, not other documents (to time
    # what `document_bounds` saves; the values are the same either way)
    skip_documents: bool = True

    @classmethod
    def for_dtype(cls, dtype) -> "FlashBlocks":
        """The default tiles for q/k/v of this dtype: fewer pipeline stages for 4-byte elements."""
        return cls() if jnp.dtype(dtype).itemsize <= 2 else cls(num_stages=2)


def _compiler_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _mask(q_pos, k_pos, seg_q, seg_k, window: int | None):
    diff = q_pos[:, None] - k_pos[None, :]
    ok = (diff >= 0) & (seg_q[:, None] == seg_k[None, :])
    return ok if window is None else ok & (diff < window)


def document_bounds(segment_ids, seq: int, bq: int, bk: int):
    """Which blocks can hold a same-document (q, k) pair at all, per row, from each block's range of
    segment ids: a query block and a key block whose [min, max] id ranges are disjoint share no document,
    whatever the ids' order. Returns, flattened row-major (one scalar a program reads): each query block's
    first key block that shares an id range with it [B * S/bq], and each key block's first and one-past-last
    such query block [B * Sk/bk] x 2 (0, 0 when none). Packed rows number their documents in order
    (`data.loader.pack_windows`), so the blocks in between share documents too: on rows of many short
    documents the loops skip what no mask would keep (global layers over 1K-token documents at S = 4096
    touch about a third of the causal blocks). The keys' ids before a sequence (-1: context parallelism's
    padding) meet no query block, so those key blocks are skipped too."""
    rows = segment_ids.shape[0]
    ids = lambda a, b: (a.reshape(rows, -1, b).min(axis=-1), a.reshape(rows, -1, b).max(axis=-1))
    (q_min, q_max), (k_min, k_max) = ids(segment_ids[:, -seq:], bq), ids(segment_ids, bk)
    meet = (k_max[:, None, :] >= q_min[:, :, None]) & (k_min[:, None, :] <= q_max[:, :, None])  # [B, nq, nk]
    has = meet.any(axis=1)
    first_k = jnp.argmax(meet, axis=2)  # every query block meets its own diagonal keys
    first_q = jnp.where(has, jnp.argmax(meet, axis=1), 0)
    end_q = jnp.where(has, meet.shape[1] - jnp.argmax(meet[:, ::-1], axis=1), 0)
    return tuple(a.reshape(-1).astype(jnp.int32) for a in (first_k, first_q, end_q))


def _key_block_range(i, bq: int, bk: int, window: int | None, off: int = 0, first=0):
    """Key blocks a query block i touches: up to the diagonal, from the window's first key and from
    `first`, the first key block that can share its documents (`document_bounds`)."""
    hi = lax.div(off + (i + 1) * bq + bk - 1, bk)
    if window is None:
        return first, hi
    return jnp.maximum(lax.div(jnp.maximum(off + i * bq - window + 1, 0), bk), first), hi


def _query_block_range(j, bq: int, bk: int, window: int | None, n_q: int, off: int = 0, first=0, end=None):
    """Query blocks that see key block j: from the diagonal to the last query inside the window, within
    [first, end), the query blocks that can share its documents (`document_bounds`); none (hi <= lo) when
    the block lies wholly before the first query's window."""
    lo = jnp.maximum(lax.div(jnp.maximum(j * bk - off, 0), bq), first)
    # A typed constant: in Pallas's Triton lowering a `where` whose cases are all weak-typed Python ints
    # types them like its boolean predicate, and the loop bound became an i1 (XLA refused the module).
    hi = jnp.int32(n_q) if end is None else jnp.minimum(end, n_q)
    if window is not None:
        last = (j + 1) * bk + window - 2 - off  # the last query (local index) that sees the block's last key
        hi = jnp.where(last < 0, 0, jnp.minimum(lax.div(jnp.maximum(last, 0), bq) + 1, hi))
    return lo, hi


def _first_key_block(first_ref, n_q: int):
    """A query-blocked program's (grid: query block, row, head) first key block from `document_bounds`."""
    i = pl.program_id(0)
    return i, first_ref[pl.program_id(1) * n_q + i]


def _fwd_kernel(first_ref, q_ref, k_ref, v_ref, seg_ref, o_ref, lse_ref, *, scale, window, bq, bk, off, n_q):
    i, first = _first_key_block(first_ref, n_q)
    q = q_ref[...]
    q_pos = off + i * bq + jnp.arange(bq)  # along the keys
    seg_q = seg_ref[pl.ds(off + i * bq, bq)]

    def body(j, carry):
        o, m, l = carry
        ks = pl.ds(j * bk, bk)
        s = dot(q, k_ref[ks, :], trans_b=True) * (scale * LOG2E)  # [bq, bk], log2 units
        s = jnp.where(_mask(q_pos, j * bk + jnp.arange(bk), seg_q, seg_ref[ks], window), s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        o = corr[:, None] * o + dot(p.astype(v_ref.dtype), v_ref[ks, :])
        return o, m_new, corr * l + jnp.sum(p, axis=-1)

    init = (jnp.zeros((bq, q.shape[-1]), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    o, m, l = lax.fori_loop(*_key_block_range(i, bq, bk, window, off, first), body, init)
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def _dq_kernel(first_ref, q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, window, bq,
               bk, off, n_q):
    i, first = _first_key_block(first_ref, n_q)
    q, do = q_ref[...], do_ref[...].astype(q_ref.dtype)
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = off + i * bq + jnp.arange(bq)
    seg_q = seg_ref[pl.ds(off + i * bq, bq)]

    def body(j, dq):
        ks = pl.ds(j * bk, bk)
        k = k_ref[ks, :]
        s = dot(q, k, trans_b=True) * (scale * LOG2E)
        s = jnp.where(_mask(q_pos, j * bk + jnp.arange(bk), seg_q, seg_ref[ks], window), s, MASK_VALUE)
        p = jnp.exp2(s - lse[:, None])
        ds = p * (dot(do, v_ref[ks, :], trans_b=True) - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(*_key_block_range(i, bq, bk, window, off, first), body,
                       jnp.zeros((bq, q.shape[-1]), jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(first_ref, end_ref, q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                scale, window, bq, bk, n_q, n_k, off, rep):
    """dK/dV of one key block of one KV head, summed in registers over the `rep` query heads that read it
    (q/do blocks [S, rep, Hd], lse/delta [rep, S]): head by head, each over its query blocks, into one
    accumulator pair. The heads are a loop, not unrolled: unrolled, each head's loop kept its own
    accumulators and ptxas spilled up to 12 KB per thread (H200, GQA 8/1)."""
    j = pl.program_id(0)
    row_block = pl.program_id(1) * n_k + j
    first, end = first_ref[row_block], end_ref[row_block]
    k, v = k_ref[...], v_ref[...]
    k_pos = j * bk + jnp.arange(bk)
    seg_k = seg_ref[pl.ds(j * bk, bk)]

    def body(i, carry, r):
        dk, dv = carry
        qs = pl.ds(i * bq, bq)
        q, do = q_ref[qs, r, :], do_ref[qs, r, :].astype(k.dtype)
        s = dot(q, k, trans_b=True) * (scale * LOG2E)  # [bq, bk]
        seg_q = seg_ref[pl.ds(off + i * bq, bq)]
        s = jnp.where(_mask(off + i * bq + jnp.arange(bq), k_pos, seg_q, seg_k, window), s, MASK_VALUE)
        p = jnp.exp2(s - lse_ref[r, qs][:, None])
        dv = dv + dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (dot(do, v, trans_b=True) - delta_ref[r, qs][:, None])
        return dk + dot(ds.astype(q.dtype), q, trans_a=True), dv

    zeros = jnp.zeros((bk, k.shape[-1]), jnp.float32)
    lo, hi = _query_block_range(j, bq, bk, window, n_q, off, first, end)
    heads = lambda r, carry: lax.fori_loop(lo, hi, functools.partial(body, r=r), carry)
    dk, dv = lax.fori_loop(0, rep, heads, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def shape_problem(seq: int, heads: int, kv_heads: int, head_dim: int, blocks: FlashBlocks = FlashBlocks(),
                  interpret: bool = False, key_seq: int | None = None) -> str | None:
    """Why the kernel can't take this attention shape (`key_seq`: keys, if more than the queries), or None."""
    if heads % kv_heads:
        return f"query heads ({heads}) not divisible by KV heads ({kv_heads})"
    key_seq = seq if key_seq is None else key_seq
    if key_seq < seq:
        return f"fewer keys ({key_seq}) than queries ({seq})"
    for name, b, n in (("q", blocks.q, seq), ("k", blocks.k, key_seq), ("q_bwd", blocks.q_bwd, seq),
                       ("k_bwd", blocks.k_bwd, key_seq)):
        what, t = "sequence" if n == seq else "key", min(b, n)
        if n % t:
            return f"{what} length ({n}) not divisible by block {name} ({b})"
        if not interpret and (t < 16 or t & (t - 1)):  # a length shorter than the block is the tile
            return f"{what} length ({n}) makes block {name} a tile of {t} rows: not a power of two >= 16 (Triton)"
    if not interpret and (head_dim < 16 or head_dim & (head_dim - 1)):
        return f"head_dim ({head_dim}) is not a power of two >= 16 (Triton's tiles)"
    return None


def key_padding(n: int, seq: int, blocks: FlashBlocks = FlashBlocks()) -> int:
    """The smallest n' >= n earlier key positions for which seq + n' keys are whole key blocks: a multiple
    of the largest key block, or, when shorter, a power of two (then one block, as Triton wants)."""
    kb = max(blocks.k, blocks.k_bwd)  # powers of two: a multiple of both
    total = n + seq
    total = -(-total // kb) * kb if total > kb else 1 << (total - 1).bit_length()
    return total - seq


def _check(q, k, v, segment_ids, blocks: FlashBlocks, interpret: bool):
    if v.shape != k.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"flash attention: q {q.shape}, k {k.shape} and v {v.shape} must share batch and head dim, "
                         f"k and v their whole shape")
    problem = shape_problem(q.shape[1], q.shape[2], k.shape[2], q.shape[3], blocks, interpret, k.shape[1])
    if problem:
        raise ValueError(f"flash attention: {problem}")
    if segment_ids.shape != k.shape[:2]:
        raise ValueError(f"flash attention: segment ids {segment_ids.shape} are not per key {k.shape[:2]}")


def _query_specs(q, k, rows_q: int):
    """BlockSpecs of the query-blocked kernels (grid: query block, row, query head h): q/do blocks of
    `rows_q`, all keys of KV head h // (H/G), per-key segment ids, lse/delta [B, H, S] blocks."""
    sk, hd = k.shape[1], q.shape[3]
    rep = q.shape[2] // k.shape[2]
    q_spec = pl.BlockSpec((None, rows_q, None, hd), lambda n, b, h: (b, n, h, 0))
    kv_spec = pl.BlockSpec((None, sk, None, hd), lambda n, b, h: (b, 0, h // rep, 0))
    seg_spec = pl.BlockSpec((None, sk), lambda n, b, h: (b, 0))  # per key; the queries' are the last S
    row_spec = pl.BlockSpec((None, None, rows_q), lambda n, b, h: (b, h, n))
    return q_spec, kv_spec, seg_spec, row_spec


def _bounds_ids(segment_ids, blocks: FlashBlocks):
    """The ids `document_bounds` reads: the segment ids, or with `skip_documents` off every real key as one
    document (only the -1 keys before a sequence stay apart)."""
    return segment_ids if blocks.skip_documents else jnp.where(segment_ids >= 0, 0, -1)


def _forward(q, k, v, segment_ids, scale, window, blocks, interpret):
    bsz, s, h, hd = q.shape
    sk = k.shape[1]
    bq, bk = min(blocks.q, s), min(blocks.k, sk)
    q_spec, kv_spec, seg_spec, row_spec = _query_specs(q, k, bq)
    first_k, _, _ = document_bounds(_bounds_ids(segment_ids, blocks), s, bq, bk)
    kernel = functools.partial(_fwd_kernel, scale=scale, window=window, bq=bq, bk=bk, off=sk - s, n_q=s // bq)
    return pl.pallas_call(
        kernel, grid=(s // bq, bsz, h), in_specs=[whole(first_k), q_spec, kv_spec, kv_spec, seg_spec],
        out_specs=[q_spec, row_spec],
        out_shape=[out_like(q, q.shape, jnp.float32), out_like(q, (bsz, h, s), jnp.float32)],
        compiler_params=_compiler_params(8 if hd > 64 else 4, blocks.num_stages),  # upstream's heuristic
        interpret=interpret, name="moejax_flash_fwd",
    )(first_k, q, k, v, segment_ids)


def _backward(q, k, v, segment_ids, o, lse, do, scale, window, blocks, interpret):
    bsz, s, h, hd = q.shape
    sk, g = k.shape[1], k.shape[2]
    bq, bk = min(blocks.q_bwd, s), min(blocks.k_bwd, sk)
    # The kernels form dP = dO V^T from dO in the operands' dtype, so delta = rowsum(O * dO) must read dO rounded
    # the same way: each row of dS = P (dP - delta) then sums to ~0, as it does exactly. From the fp32 dO, bf16
    # dQ/dK carried an error that did not shrink with the gradient (window 1: dQ = dK = 0 exactly, the kernel gave
    # ~0.06; docs/LOG.md 2026-12-05, thirty-fourth session). reduce_precision, not a convert pair: XLA may drop
    # a round trip through bf16 as excess precision. The kernels also read dO in that dtype: half the bytes.
    do_r = lax.reduce_precision(do.astype(jnp.float32), jnp.finfo(q.dtype).nexp, jnp.finfo(q.dtype).nmant)
    delta = jnp.einsum("bshd,bshd->bhs", o, do_r)  # rowsum(o * dO), [B, H, S]
    first_k, first_q, end_q = document_bounds(_bounds_ids(segment_ids, blocks), s, bq, bk)
    ins = (q, k, v, segment_ids, do.astype(q.dtype), lse, delta)
    q_spec, kv_spec, seg_spec, row_spec = _query_specs(q, k, bq)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, window=window, bq=bq, bk=bk, off=sk - s, n_q=s // bq),
        grid=(s // bq, bsz, h),
        in_specs=[whole(first_k), q_spec, kv_spec, kv_spec, seg_spec, q_spec, row_spec, row_spec],
        out_specs=q_spec, out_shape=out_like(q, q.shape, jnp.float32),
        compiler_params=_compiler_params(blocks.num_warps_bwd, blocks.num_stages_bwd), interpret=interpret,
        name="moejax_flash_dq",
    )(first_k, *ins)
    # dK/dV: one program per (key block, row, KV head), looping over the query heads of its group.
    rep = h // g
    q_group = pl.BlockSpec((None, s, rep, hd), lambda n, b, kh: (b, 0, kh, 0))
    rows_group = pl.BlockSpec((None, rep, s), lambda n, b, kh: (b, kh, 0))  # lse / delta of the group's heads
    kv_block = pl.BlockSpec((None, bk, None, hd), lambda n, b, kh: (b, n, kh, 0))
    seg_spec = pl.BlockSpec((None, sk), lambda n, b, kh: (b, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, window=window, bq=bq, bk=bk, n_q=s // bq, n_k=sk // bk,
                          off=sk - s, rep=rep),
        grid=(sk // bk, bsz, g),
        in_specs=[whole(first_q), whole(end_q), q_group, kv_block, kv_block, seg_spec, q_group, rows_group,
                  rows_group],
        out_specs=[kv_block, kv_block], out_shape=[out_like(q, k.shape, k.dtype), out_like(q, v.shape, v.dtype)],
        compiler_params=_compiler_params(blocks.num_warps_bwd, blocks.num_stages_bwd), interpret=interpret,
        name="moejax_flash_dkv",
    )(first_q, end_q, *ins)
    return dq.astype(q.dtype), dk, dv


def flash_attention(q, k, v, segment_ids, scale: float, window: int | None = None,
                    blocks: FlashBlocks | None = None, interpret: bool = False):
    """q [B, S, H, Hd], k/v [B, Sk, G, Hd], segment_ids [B, Sk] int32 (per key; the queries are the last S
    keys) -> out [B, S, H, Hd] fp32.

    Causal + same-segment masking; `window` (None = global) limits q - k < window. `blocks`: the tiles,
    by default `FlashBlocks.for_dtype(q.dtype)`."""
    blocks = FlashBlocks.for_dtype(q.dtype) if blocks is None else blocks
    return _flash(q, k, v, segment_ids, scale, window, blocks, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q, k, v, segment_ids, scale: float, window: int | None, blocks: FlashBlocks, interpret: bool):
    _check(q, k, v, segment_ids, blocks, interpret)
    return _forward(q, k, v, segment_ids, scale, window, blocks, interpret)[0]


def _flash_fwd(q, k, v, segment_ids, scale, window, blocks, interpret):
    _check(q, k, v, segment_ids, blocks, interpret)
    o, lse = _forward(q, k, v, segment_ids, scale, window, blocks, interpret)
    return o, (q, k, v, segment_ids, o, lse)


def _flash_bwd(scale, window, blocks, interpret, res, do):
    q, k, v, segment_ids, o, lse = res
    dq, dk, dv = _backward(q, k, v, segment_ids, o, lse, do, scale, window, blocks, interpret)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)
