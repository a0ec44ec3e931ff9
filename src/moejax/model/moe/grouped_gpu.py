"""Grouped GEMM for GPU: Pallas kernels (Triton lowering) on the block layout of `grouped.py`.

Dimensions: Bk blocks of b rows, each of one expert; E experts; Z input width, F output width; tn output
columns per program, tk contraction chunk; tz x tf the weight-gradient tile.

Why: the XLA path gathers every block's expert weights (`w[expert_Bk]`, Bk*Z*F elements, ~1 GB per
matmul at shape G in bf16) and writes a [Bk, Z, F] fp32 per-block weight gradient before its segment sum.
These kernels read each block's weights in place (the expert id is loaded inside the kernel: Triton has
no scalar prefetch for index maps) and accumulate the weight gradient of each expert over its own blocks
in registers, so the only HBM traffic is the operands and the results.

Three kernels, one per matmul of a block GEMM's forward and backward (and a fourth for SwiGLU, below):
- `_rows_kernel`, grid (out_cols / tn, Bk): y[n] = x[n] @ w[e_n] (forward) or dy[n] @ w[e_n]^T (dx), the
  contraction chunked by tk in a loop. Blocks past the last used one (the layout's static tail) loop zero
  times and write zeros.
- `_wgrad_kernel`, grid (Z / tz, F / tf, E): dw[e] = sum over e's blocks of x[n]^T dy[n], accumulated in
  fp32, written in fp32 or the weights' dtype; an expert with no rows writes zeros.
SwiGLU's down projection (`grouped.swiglu_blocks`) has a fourth: `_dx_act_kernel` ends dx with the
activation's derivative, reading gate and up as one [Bk, b, 2, F] array and writing [d_gate, d_up], so dh is
never stored. (The activation itself is not made inside the forward or weight-gradient kernels: made there
tile by tile, on an H200 those kernels ran at 119 and 109 TFLOP/s against the plain forward's 422 —
docs/LOG.md 2026-12-04 — every output-column tile recomputing it on the CUDA cores beside the MMAs.)
The block (expert) axis is the grid's last: Triton runs axis 0 fastest, so one block's (expert's) tiles
run back to back and share its rows in L2 instead of refetching them per tile.
Contract (what `grouped.to_blocks` and its backward give): padding rows and the tail blocks hold zeros, so
skipping the tail changes nothing. Row maps (below; `grouped.swiglu_rows` uses them): an operand may instead be
the whole [N, width] array of rows, block row r reading row map[r] (zeros where map[r] < 0), and a result may
be written straight to the rows its map names, so the gathers into and out of blocks happen in the kernels'
loads and stores. Values are the XLA path's: fp32 accumulation, outputs in the operands'
(common) dtype, weight gradient in fp32. `interpret=True` runs the same kernels through the Pallas
interpreter (CPU tests; `grouped.block_matmul` picks it off GPU). Tile sizes are untuned defaults
(`bench/bench_grouped.py --tiles` on a GPU); `shape_problem` says why a shape can't use them. Only plain ref
indexing, lax.dot_general, lax.fori_loop and (for row maps) `plgpu.load` / `plgpu.store` with array indices
and masks are used, so the kernels lower on jax 0.10 and 0.11 alike (both tested, interpreted and compiled).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from moejax.model.pallas_util import dot, out_like, plgpu, whole


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """Largest tile sizes and Triton launch parameters. Each tile used is the largest power of two up to
    these that divides its width (`tile`), so any width that is a multiple of 16 fits. Untuned (no GPU
    was at hand): the common Triton GEMM shape of a 128 x 128 fp32 accumulator on 8 warps; 2 stages keep
    dw's pipelined [b, 128] x and dy tiles (2 x 32 KB per stage in bf16) well inside shared memory."""
    tn: int = 128  # output columns per program (forward / dx)
    tk: int = 64  # contraction chunk (forward / dx)
    tz: int = 128  # weight-gradient tile rows (input width)
    tf: int = 128  # weight-gradient tile columns (output width)
    num_warps: int = 8
    num_stages: int = 2


# Triton's tiles (and so blocks) must be powers of two, and its dots at least 16 on each side.
MIN_TILE = 16


def _pow2_tile(n: int) -> bool:
    return n >= MIN_TILE and not n & (n - 1)


def tile(largest: int, width: int) -> int:
    """The largest power of two <= `largest` that divides `width` (may be < MIN_TILE: then it can't)."""
    t = 1
    while t * 2 <= largest and width % (t * 2) == 0:
        t *= 2
    return t


def shape_problem(block: int, z: int, f: int, tiles: GemmTiles = GemmTiles()) -> str | None:
    """Why the kernels can't take blocks of `block` rows from width z to width f with `tiles`, or None."""
    if not _pow2_tile(block):
        return f"block of {block} rows is not a power of two >= {MIN_TILE}"
    for name, t, d in (("tn", tiles.tn, f), ("tk", tiles.tk, z), ("tn", tiles.tn, z), ("tk", tiles.tk, f),
                       ("tz", tiles.tz, z), ("tf", tiles.tf, f)):
        if not _pow2_tile(tile(t, d)):
            return f"width {d} has no tile {name} that is a power of two from {MIN_TILE} to {t} dividing it"
    return None


def fits(block: int, z: int, f: int, tiles: GemmTiles = GemmTiles()) -> bool:
    return shape_problem(block, z, f, tiles) is None


def _check(block: int, z: int, f: int, a_dtype, b_dtype, tiles: GemmTiles) -> None:
    """Raise, with the numbers, on what the kernels would get wrong: partial tiles or mixed dtypes (Triton's
    dot needs one element type; the interpreter would accept it)."""
    problem = shape_problem(block, z, f, tiles)
    if problem:
        raise ValueError(f"grouped GEMM kernel: {problem}")
    if a_dtype != b_dtype:
        raise ValueError(f"grouped GEMM kernel: operands {a_dtype} and weights {b_dtype} differ")



def _block_tile(expert_ref, tn: int):
    """A rows kernel's program (grid (out_cols / tn, Bk)): its block n, the block's expert and its columns."""
    j, n = pl.program_id(0), pl.program_id(1)
    return n, expert_ref[n], pl.ds(j * tn, tn)


# --- row maps: rows read and written in place --------------------------------------------------------------------
# With a row map, an operand is not in blocks but a whole [N, width] array of source rows: block n's row i is
# row rows[n*b + i], or zeros where that index is negative (padding). A result written through a map goes
# straight to its rows of an [N_out, width] array (nothing where negative). The gathers into and out of
# blocks (`grouped.to_blocks`, `from_blocks`) then happen inside the kernels' loads and stores.

def _mapped_rows(rows_ref, n, b: int, padding_row: int = 0):
    """(row indices [b, 1], valid [b, 1]) of block n's rows in a row map, padding rows sent to padding_row.
    Masked lanes touch no memory on a GPU; the Pallas interpreter, though, stores through a scatter that
    writes masked lanes back with the value they read, so a store sends them out of range (dropped there)
    rather than onto a real row, where they could overwrite its new value."""
    rows = rows_ref[pl.ds(n * b, b)]
    valid = rows >= 0
    return jnp.where(valid, rows, padding_row)[:, None], valid[:, None]


def _row_reader(ref, rows_ref, n, b: int, blocked):
    """Block n's [b, size] columns [start, start + size) of an operand, as read(start, size): from its
    blocks (`blocked(start, size)`) when rows_ref is None, else through the row map (a gathered load)."""
    if rows_ref is None:
        return blocked
    safe, valid = _mapped_rows(rows_ref, n, b)

    def read(start, size):
        cols = start + lax.broadcasted_iota(jnp.int32, (1, size), 1)
        return plgpu.load(ref.at[safe, cols], mask=jnp.broadcast_to(valid, (b, size)), other=0)
    return read


def _write_rows(o_ref, rows_ref, n, j, value):
    """Block n's [b, tn] output tile j: into its block (rows_ref None) or through the row map (a scattered
    store; padding rows are not written)."""
    if rows_ref is None:
        o_ref[...] = value
        return
    b, tn = value.shape
    safe, valid = _mapped_rows(rows_ref, n, b, padding_row=o_ref.shape[0])
    cols = j * tn + lax.broadcasted_iota(jnp.int32, (1, tn), 1)
    plgpu.store(o_ref.at[safe, cols], value, mask=jnp.broadcast_to(valid, (b, tn)))


def _split_refs(refs, *present: bool):
    """The optional row-map refs (None where absent) from the front of `refs`, and the rest."""
    out, i = [], 0
    for p in present:
        out.append(refs[i] if p else None)
        i += p
    return (*out, refs[i:])


def _rows_kernel(expert_ref, used_ref, *refs, tk: int, tn: int, trans_w: bool, b: int, map_in: bool,
                 map_out: bool):
    """o = x @ w[e] (w [E, K, N]) or x @ w[e]^T (trans_w: w [E, N, K]) for one block's [b, tn] output tile;
    x read and o written through row maps when given (map_in / map_out)."""
    rows_in, rows_out, (x_ref, w_ref, o_ref) = _split_refs(refs, map_in, map_out)
    n, e, cols = _block_tile(expert_ref, tn)
    read = _row_reader(x_ref, rows_in, n, b, lambda start, size: x_ref[:, pl.ds(start, size)])

    def body(c, acc):
        ks = pl.ds(c * tk, tk)
        w = w_ref[e, cols, ks] if trans_w else w_ref[e, ks, cols]
        return acc + dot(read(c * tk, tk), w, trans_b=trans_w)

    n_chunks = x_ref.shape[-1] // tk
    acc = lax.fori_loop(0, n_chunks * used_ref[n], body, jnp.zeros((b, tn), jnp.float32))
    _write_rows(o_ref, rows_out, n, pl.program_id(0), acc.astype(o_ref.dtype))


def _wgrad_kernel(first_ref, count_ref, *refs, b: int, map_x: bool, map_dy: bool):
    """dw[e] tile = sum of x[n]^T dy[n] over expert e's blocks n (contiguous: the layout sorts them); x and dy
    read through row maps when given."""
    x_rows, dy_rows, (x_ref, dy_ref, dw_ref) = _split_refs(refs, map_x, map_dy)
    zi, fi, e = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tz, tf = dw_ref.shape
    lo = first_ref[e]

    def body(n, acc):
        x = _row_reader(x_ref, x_rows, n, b, lambda start, size: x_ref[n, :, pl.ds(start, size)])(zi * tz, tz)
        dy = _row_reader(dy_ref, dy_rows, n, b, lambda start, size: dy_ref[n, :, pl.ds(start, size)])(fi * tf, tf)
        return acc + dot(x, dy, trans_a=True)

    dw_ref[...] = lax.fori_loop(lo, lo + count_ref[e], body, jnp.zeros((tz, tf), jnp.float32)).astype(dw_ref.dtype)


def _dx_act_kernel(expert_ref, used_ref, *refs, tk: int, b: int, map_dy: bool):
    """dh = dy @ w[e]^T for one block's [b, tn] tile (fp32, never stored), then the SwiGLU activation's
    derivative in the epilogue: d_up = dh silu(g), d_gate = dh u silu'(g), silu'(g) = s (1 + g (1 - s)),
    written as the two halves of dgu's [b, 2, tn] tile. dy read through a row map when given."""
    dy_rows, (dy_ref, w_ref, gu_ref, dgu_ref) = _split_refs(refs, map_dy)
    tn = dgu_ref.shape[-1]
    n, e, cols = _block_tile(expert_ref, tn)
    read = _row_reader(dy_ref, dy_rows, n, b, lambda start, size: dy_ref[:, pl.ds(start, size)])

    def body(c, acc):
        ks = pl.ds(c * tk, tk)
        return acc + dot(read(c * tk, tk), w_ref[e, cols, ks], trans_b=True)

    dh = lax.fori_loop(0, dy_ref.shape[-1] // tk * used_ref[n], body, jnp.zeros((b, tn), jnp.float32))
    g, u = gu_ref[:, 0, cols].astype(jnp.float32), gu_ref[:, 1, cols].astype(jnp.float32)
    sig = 1.0 / (1.0 + jnp.exp(-g))
    dgu_ref[:, 0, :] = (dh * u * sig * (1.0 + g * (1.0 - sig))).astype(dgu_ref.dtype)
    dgu_ref[:, 1, :] = (dh * g * sig).astype(dgu_ref.dtype)


def _launch(tiles: GemmTiles):
    return plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _rows_call(x, w, expert_Bk, used_Bk, out_cols: int, trans_w: bool, tiles: GemmTiles, interpret: bool, b: int,
               rows_in=None, rows_out=None, n_out: int = 0):
    """`_rows_kernel` over every (column tile, block): x [Bk, b, K] blocks, or [N, K] rows read through the
    row map rows_in; the result [Bk, b, out_cols] blocks, or [n_out, out_cols] rows written through rows_out."""
    n_blocks, k = expert_Bk.shape[0], x.shape[-1]
    tn, tk = tile(tiles.tn, out_cols), tile(tiles.tk, k)
    maps = [m.astype(jnp.int32) for m in (rows_in, rows_out) if m is not None]
    x_spec = whole(x) if rows_in is not None else pl.BlockSpec((None, b, k), lambda j, n: (n, 0, 0))
    if rows_out is None:
        out_shape, out_spec = (n_blocks, b, out_cols), pl.BlockSpec((None, b, tn), lambda j, n: (n, 0, j))
    else:  # the whole output: each program stores its tile's rows through the map
        out_shape = (n_out, out_cols)
        out_spec = pl.BlockSpec(out_shape, lambda j, n: (0, 0))
    kernel = functools.partial(_rows_kernel, tk=tk, tn=tn, trans_w=trans_w, b=b, map_in=rows_in is not None,
                               map_out=rows_out is not None)
    return pl.pallas_call(
        kernel, grid=(out_cols // tn, n_blocks),
        in_specs=[whole(expert_Bk), whole(used_Bk), *map(whole, maps), x_spec, whole(w)],
        out_specs=out_spec,
        out_shape=out_like(x, out_shape, jnp.result_type(x, w)),
        compiler_params=_launch(tiles), interpret=interpret,
        name=("moejax_grouped_dx" if trans_w else "moejax_grouped_fwd") + ("_rows" if maps else ""),
    )(expert_Bk, used_Bk, *maps, x, w)


def _used_blocks(expert_Bk, blocks_E):
    """1 for the blocks that hold rows (the first sum(blocks_E)), 0 for the layout's static tail."""
    return (jnp.arange(expert_Bk.shape[0]) < jnp.sum(blocks_E)).astype(jnp.int32)


def _block_rows(x, expert_Bk, rows) -> int:
    """Rows per block: x's own when it is in blocks, else the row map's length over the block count."""
    return x.shape[1] if rows is None else rows.shape[0] // expert_Bk.shape[0]


def matmul(x: Float[Array, "Bk b Z"] | Float[Array, "N Z"], w_EZF: Float[Array, "E Z F"], expert_Bk: Int[Array, "Bk"],
           blocks_E: Int[Array, "E"], tiles: GemmTiles = GemmTiles(), interpret: bool = False,
           rows_in: Int[Array, "Pd"] | None = None, rows_out: Int[Array, "Pd"] | None = None,
           n_out: int = 0) -> Float[Array, "Bk b F"] | Float[Array, "n_out F"]:
    """y[n] = x[n] @ w[expert_Bk[n]]. With row maps (Pd = Bk*b entries, negative for padding): block row r
    reads row rows_in[r] of x [N, Z] (zeros for padding), and its result goes to row rows_out[r] of the
    [n_out, F] output (padding is not written; rows no block row maps to are left undefined)."""
    b = _block_rows(x, expert_Bk, rows_in)
    _check(b, *w_EZF.shape[1:], x.dtype, w_EZF.dtype, tiles)
    return _rows_call(x, w_EZF, expert_Bk, _used_blocks(expert_Bk, blocks_E), w_EZF.shape[2], False, tiles,
                      interpret, b, rows_in, rows_out, n_out)


def matmul_dx(dy: Float[Array, "Bk b F"] | Float[Array, "N F"], w_EZF: Float[Array, "E Z F"],
              expert_Bk: Int[Array, "Bk"], blocks_E: Int[Array, "E"], tiles: GemmTiles = GemmTiles(),
              interpret: bool = False, rows_in: Int[Array, "Pd"] | None = None,
              rows_out: Int[Array, "Pd"] | None = None,
              n_out: int = 0) -> Float[Array, "Bk b Z"] | Float[Array, "n_out Z"]:
    """dx[n] = dy[n] @ w[expert_Bk[n]]^T; row maps as for `matmul`."""
    b = _block_rows(dy, expert_Bk, rows_in)
    _check(b, *w_EZF.shape[1:], dy.dtype, w_EZF.dtype, tiles)
    return _rows_call(dy, w_EZF, expert_Bk, _used_blocks(expert_Bk, blocks_E), w_EZF.shape[1], True, tiles,
                      interpret, b, rows_in, rows_out, n_out)


def matmul_dw(x: Float[Array, "Bk b Z"] | Float[Array, "N Z"], dy: Float[Array, "Bk b F"] | Float[Array, "M F"],
              blocks_E: Int[Array, "E"], tiles: GemmTiles = GemmTiles(), interpret: bool = False,
              out_dtype=jnp.float32, x_rows: Int[Array, "Pd"] | None = None, dy_rows: Int[Array, "Pd"] | None = None,
              block: int | None = None) -> Float[Array, "E Z F"]:
    """dw[e] = sum over e's blocks of x[n]^T dy[n] (blocks sorted by expert, blocks_E of each), accumulated in
    fp32 and written as `out_dtype`: the weights' dtype when the gradient is cast to it anyway (bf16 weights),
    so that no separate [E, Z, F] fp32 array is written and converted (shape G: 3.6 GB a step). x and dy
    are blocks, or rows read through row maps (as for `matmul`); with both mapped, `block` gives b."""
    z, f = x.shape[-1], dy.shape[-1]
    b = x.shape[1] if x_rows is None else dy.shape[1] if dy_rows is None else block
    if b is None:
        raise ValueError("grouped GEMM kernel: with both operands read through row maps, give the block size")
    _check(b, z, f, x.dtype, dy.dtype, tiles)
    return _wgrad_call(x, dy, blocks_E, z, f, tiles, interpret, out_dtype, b, x_rows, dy_rows)


def _wgrad_call(x, dy, blocks_E, z: int, f: int, tiles: GemmTiles, interpret: bool, out_dtype, b: int,
                x_rows=None, dy_rows=None):
    """The [E, z, f] weight gradient by `_wgrad_kernel` over (x, dy) read in place (through their row maps when
    given), one [tz, tf] tile per program."""
    tz, tf = tile(tiles.tz, z), tile(tiles.tf, f)
    n_exp = blocks_E.shape[0]
    first_E = jnp.cumsum(blocks_E) - blocks_E
    maps = [m.astype(jnp.int32) for m in (x_rows, dy_rows) if m is not None]
    kernel = functools.partial(_wgrad_kernel, b=b, map_x=x_rows is not None, map_dy=dy_rows is not None)
    return pl.pallas_call(
        kernel, grid=(z // tz, f // tf, n_exp),
        in_specs=[whole(first_E), whole(blocks_E), *map(whole, maps), whole(x), whole(dy)],
        out_specs=pl.BlockSpec((None, tz, tf), lambda zi, fi, e: (e, zi, fi)),
        out_shape=out_like(x, (n_exp, z, f), out_dtype), compiler_params=_launch(tiles), interpret=interpret,
        name="moejax_grouped_dw" + ("_rows" if maps else ""),
    )(first_E.astype(jnp.int32), blocks_E.astype(jnp.int32), *maps, x, dy)


# --- the down projection's dx with SwiGLU's derivative fused (`grouped.swiglu_blocks` on the kernels) ---------
# Gate and up come as one [Bk, b, 2, F] array, the output of one matmul against the experts' gate and up
# weights side by side ([E, Z, 2F]): x is read once, and dx is one matmul against both.

def matmul_dx_act(dy: Float[Array, "Bk b Z"] | Float[Array, "N Z"], w_EFZ: Float[Array, "E F Z"],
                  gu_Bkb2F: Float[Array, "Bk b 2 F"], expert_Bk: Int[Array, "Bk"], blocks_E: Int[Array, "E"],
                  tiles: GemmTiles = GemmTiles(), interpret: bool = False,
                  dy_rows: Int[Array, "Pd"] | None = None) -> Float[Array, "Bk b 2 F"]:
    """[d_gate, d_up] of `matmul(silu(g) * u, w)`: dh = dy @ w^T in fp32 and the activation's derivative in
    one kernel, no dh written. dy: blocks, or [N, Z] rows read through the row map dy_rows."""
    n_blocks, b, _, f = gu_Bkb2F.shape
    z = w_EFZ.shape[2]
    _check(b, f, z, dy.dtype, w_EFZ.dtype, tiles)
    tn, tk = tile(tiles.tn, f), tile(tiles.tk, z)
    used_Bk = _used_blocks(expert_Bk, blocks_E)
    maps = [] if dy_rows is None else [dy_rows.astype(jnp.int32)]
    dy_spec = whole(dy) if maps else pl.BlockSpec((None, b, z), lambda j, n: (n, 0, 0))
    return pl.pallas_call(
        functools.partial(_dx_act_kernel, tk=tk, b=b, map_dy=bool(maps)), grid=(f // tn, n_blocks),
        in_specs=[whole(expert_Bk), whole(used_Bk), *map(whole, maps), dy_spec,
                  whole(w_EFZ), pl.BlockSpec((None, b, 2, f), lambda j, n: (n, 0, 0, 0))],
        out_specs=pl.BlockSpec((None, b, 2, tn), lambda j, n: (n, 0, 0, j)),
        out_shape=out_like(dy, gu_Bkb2F.shape, gu_Bkb2F.dtype),
        compiler_params=_launch(tiles),
        interpret=interpret, name="moejax_grouped_dx_act" + ("_rows" if maps else ""),
    )(expert_Bk, used_Bk, *maps, dy, w_EFZ, gu_Bkb2F)
