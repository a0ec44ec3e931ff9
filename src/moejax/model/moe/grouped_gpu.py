"""Grouped GEMM for GPU: Pallas kernels (Triton lowering) on the block layout of `grouped.py`.

Dimensions: Bk blocks of b rows, each of one expert; E experts; Z input width, F output width; tn output
columns per program, tk contraction chunk; tz x tf the weight-gradient tile.

Why: the XLA path gathers every block's expert weights (`w[expert_Bk]`, Bk*Z*F elements, ~1 GB per
matmul at shape G in bf16) and writes a [Bk, Z, F] fp32 per-block weight gradient before its segment sum.
These kernels read each block's weights in place (the expert id is loaded inside the kernel: Triton has
no scalar prefetch for index maps) and accumulate the weight gradient of each expert over its own blocks
in registers, so the only HBM traffic is the operands and the results.

Three kernels, one per matmul of a block GEMM's forward and backward:
- `_rows_kernel`, grid (Bk, out_cols / tn): y[n] = x[n] @ w[e_n] (forward) or dy[n] @ w[e_n]^T (dx), the
  contraction chunked by tk in a loop. Blocks past the last used one (the layout's static tail) loop zero
  times and write zeros.
- `_wgrad_kernel`, grid (E, Z / tz, F / tf): dw[e] = sum over e's blocks of x[n]^T dy[n], fp32; an expert
  with no rows writes zeros.
Values are the XLA path's: fp32 accumulation, outputs in the operands' dtype, weight gradient in fp32.
`interpret=True` runs the same kernels through the Pallas interpreter (CPU tests; `block_matmul_kernel`
picks it off GPU). Tile sizes are untuned defaults (Triton wants powers of two >= 16); `fits` says
whether a shape can use them. Only plain ref indexing, lax.dot_general and lax.fori_loop are used, so the
kernels lower on jax 0.10 and 0.11 alike.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """Tile sizes and Triton launch parameters (untuned: no GPU was at hand to tune them)."""
    tn: int = 64  # output columns per program (forward / dx)
    tk: int = 64  # contraction chunk (forward / dx)
    tz: int = 64  # weight-gradient tile rows (input width)
    tf: int = 64  # weight-gradient tile columns (output width)
    num_warps: int = 4
    num_stages: int = 2


def _pow2_at_least_16(n: int) -> bool:
    return n >= 16 and not n & (n - 1)


def fits(block: int, z: int, f: int, tiles: GemmTiles = GemmTiles()) -> bool:
    """Whether the kernels take this shape: b a power of two >= 16 and the widths whole tiles."""
    tile = lambda t, d: min(t, d)
    return (_pow2_at_least_16(block)
            and all(_pow2_at_least_16(tile(t, d)) and d % tile(t, d) == 0
                    for t, d in ((tiles.tn, f), (tiles.tk, z), (tiles.tn, z), (tiles.tk, f), (tiles.tz, z),
                                 (tiles.tf, f))))


def _dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """2-D matmul with fp32 accumulation; transposes folded into the dot (Triton lowers them natively)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _rows_kernel(expert_ref, used_ref, x_ref, w_ref, o_ref, *, tk: int, trans_w: bool):
    """o = x @ w[e] (w [E, K, N]) or x @ w[e]^T (trans_w: w [E, N, K]) for one block's [b, tn] output tile."""
    n, j = pl.program_id(0), pl.program_id(1)
    e = expert_ref[n]
    tn = o_ref.shape[-1]
    cols = pl.ds(j * tn, tn)

    def body(c, acc):
        ks = pl.ds(c * tk, tk)
        w = w_ref[e, cols, ks] if trans_w else w_ref[e, ks, cols]
        return acc + _dot(x_ref[:, ks], w, trans_b=trans_w)

    n_chunks = x_ref.shape[-1] // tk
    acc = lax.fori_loop(0, n_chunks * used_ref[n], body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _wgrad_kernel(first_ref, count_ref, x_ref, dy_ref, dw_ref):
    """dw[e] tile = sum of x[n]^T dy[n] over expert e's blocks n (contiguous: the layout sorts them)."""
    e, zi, fi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tz, tf = dw_ref.shape
    zs, fs = pl.ds(zi * tz, tz), pl.ds(fi * tf, tf)
    lo = first_ref[e]

    def body(n, acc):
        return acc + _dot(x_ref[n, :, zs], dy_ref[n, :, fs], trans_a=True)

    dw_ref[...] = lax.fori_loop(lo, lo + count_ref[e], body, jnp.zeros((tz, tf), jnp.float32))


def _rows_call(x_BkbK, w, expert_Bk, used_Bk, out_cols: int, trans_w: bool, tiles: GemmTiles, interpret: bool):
    n_blocks, b, k = x_BkbK.shape
    tn, tk = min(tiles.tn, out_cols), min(tiles.tk, k)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # read in place, indexed in the kernel
    return pl.pallas_call(
        functools.partial(_rows_kernel, tk=tk, trans_w=trans_w),
        grid=(n_blocks, out_cols // tn),
        in_specs=[whole(expert_Bk), whole(used_Bk), pl.BlockSpec((None, b, k), lambda n, j: (n, 0, 0)), whole(w)],
        out_specs=pl.BlockSpec((None, b, tn), lambda n, j: (n, 0, j)),
        out_shape=jax.ShapeDtypeStruct((n_blocks, b, out_cols), jnp.result_type(x_BkbK, w)),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, name="moejax_grouped_dx" if trans_w else "moejax_grouped_fwd",
    )(expert_Bk, used_Bk, x_BkbK, w)


def _used_blocks(expert_Bk, blocks_E):
    """1 for the blocks that hold rows (the first sum(blocks_E)), 0 for the layout's static tail."""
    return (jnp.arange(expert_Bk.shape[0]) < jnp.sum(blocks_E)).astype(jnp.int32)


def matmul(x_BkbZ: Float[Array, "Bk b Z"], w_EZF: Float[Array, "E Z F"], expert_Bk: Int[Array, "Bk"],
           blocks_E: Int[Array, "E"], tiles: GemmTiles = GemmTiles(), interpret: bool = False) -> Float[Array, "Bk b F"]:
    """y[n] = x[n] @ w[expert_Bk[n]]."""
    return _rows_call(x_BkbZ, w_EZF, expert_Bk, _used_blocks(expert_Bk, blocks_E), w_EZF.shape[2], False, tiles,
                      interpret)


def matmul_dx(dy_BkbF: Float[Array, "Bk b F"], w_EZF: Float[Array, "E Z F"], expert_Bk: Int[Array, "Bk"],
              blocks_E: Int[Array, "E"], tiles: GemmTiles = GemmTiles(), interpret: bool = False) -> Float[Array, "Bk b Z"]:
    """dx[n] = dy[n] @ w[expert_Bk[n]]^T."""
    return _rows_call(dy_BkbF, w_EZF, expert_Bk, _used_blocks(expert_Bk, blocks_E), w_EZF.shape[1], True, tiles,
                      interpret)


def matmul_dw(x_BkbZ: Float[Array, "Bk b Z"], dy_BkbF: Float[Array, "Bk b F"], blocks_E: Int[Array, "E"],
              tiles: GemmTiles = GemmTiles(), interpret: bool = False) -> Float[Array, "E Z F"]:
    """dw[e] = sum over e's blocks of x[n]^T dy[n], fp32 (blocks sorted by expert, blocks_E of each)."""
    z, f = x_BkbZ.shape[2], dy_BkbF.shape[2]
    tz, tf = min(tiles.tz, z), min(tiles.tf, f)
    n_exp = blocks_E.shape[0]
    first_E = jnp.cumsum(blocks_E) - blocks_E
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    return pl.pallas_call(
        _wgrad_kernel, grid=(n_exp, z // tz, f // tf),
        in_specs=[whole(first_E), whole(blocks_E), whole(x_BkbZ), whole(dy_BkbF)],
        out_specs=pl.BlockSpec((None, tz, tf), lambda e, zi, fi: (e, zi, fi)),
        out_shape=jax.ShapeDtypeStruct((n_exp, z, f), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, name="moejax_grouped_dw",
    )(first_E.astype(jnp.int32), blocks_E.astype(jnp.int32), x_BkbZ, dy_BkbF)
