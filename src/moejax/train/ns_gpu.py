"""Newton-Schulz's polynomial GEMMs for GPU with their adds fused: out[n] = alpha * (A[n] @ B[n]) + beta * C[n]
for a stack of matrices, one Pallas (Triton) kernel; and the symmetric ones, alpha * A[n] A[n]^T (+ beta C[n]),
computed for the upper tiles only (`gram_add`).

Dimensions: N matrices; M x K times K x P; bm x bp the output tile of one program, bk the contraction chunk.

Why: each quintic Newton-Schulz step is X X^T, then B = b G + c G G, then X' = a X + B X. XLA fuses the scalar
multiplies into its GEMMs but leaves both adds as separate kernels, each reading two stacks and writing one.
Compiled for one H200, that is 27 add kernels a step at issue 11's shape G (~8 ms of a ~133 ms roofline) and
~42 ms of the d1024 rung's ~335 ms (`bench/roofline.py --gpu`). Here the add is the GEMM's epilogue: C's tile
is read once by the program that writes the output tile, and no [N, M, P] intermediate goes through memory.
Numerics: fp32 accumulation and an fp32 epilogue, rounded once to the output dtype (XLA's path rounds A @ B
to bf16 before the add: the kernel is the more exact of the two).

Symmetric results (`gram_add`): each step's Gram G = X X^T and its c G G + b G (G G = G G^T, since G is
symmetric) are symmetric, so only the tiles (i, j) with i <= j are computed, each stored at (i, j) and,
transposed, at (j, i): T(T+1)/2 of the T^2 tiles of an [M, M] result (10 of 16 at M = 512 in 128-row tiles),
and those two GEMMs are 2/3 of a square matrix's Newton-Schulz FLOPs (the d1024 rung's expert matrices; 57
TFLOP a step at d1024, 26% of its roofline). c G G + b G reads G's row blocks for G^T's column blocks, so it
needs G symmetric: off the diagonal the stored G is so by construction, and the diagonal tiles are as the MMA
computes them (`bench/check_gpu_kernels.py` reports any asymmetry on a GPU; none in the interpreter).

`interpret=True` runs the kernel through the Pallas interpreter (CPU tests). Tiles are untuned defaults (no
GPU was at hand), the grouped GEMM's: a 128 x 128 fp32 accumulator on 8 warps. The matrix axis is the grid's
last, so one matrix's tiles run back to back and share its operands in L2. Only plain ref indexing,
lax.dot_general and lax.fori_loop are used, so the kernel lowers on jax 0.10 and 0.11 alike.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from moejax.model.moe.grouped_gpu import MIN_TILE, tile
from moejax.model.pallas_util import dot, out_like, plgpu


@dataclasses.dataclass(frozen=True)
class NsTiles:
    bm: int = 128  # output rows per program
    bp: int = 128  # output columns per program
    bk: int = 64  # contraction chunk
    num_warps: int = 8
    num_stages: int = 2


def shape_problem(m: int, k: int, p: int, tiles: NsTiles = NsTiles()) -> str | None:
    """Why the kernel can't take [M, K] @ [K, P], or None: every width needs a power-of-two tile >= 16."""
    for name, largest, width in (("bm", tiles.bm, m), ("bk", tiles.bk, k), ("bp", tiles.bp, p)):
        if tile(largest, width) < MIN_TILE:
            return f"width {width} has no tile {name} that is a power of two from {MIN_TILE} to {largest} dividing it"
    return None


def _contract(chunk_product, k: int, bk: int, shape: tuple[int, int]):
    """sum over the K/bk contraction chunks ks of chunk_product(ks), in fp32."""
    return lax.fori_loop(0, k // bk, lambda i, acc: acc + chunk_product(pl.ds(i * bk, bk)),
                         jnp.zeros(shape, jnp.float32))


def _kernel(a_ref, b_ref, c_ref, o_ref, *, alpha: float, beta: float, bk: int):
    """o = alpha * a @ b + beta * c for one [bm, bp] output tile; a [bm, K], b [K, bp] read chunk by chunk."""
    acc = _contract(lambda ks: dot(a_ref[:, ks], b_ref[ks, :]), a_ref.shape[-1], bk, o_ref.shape)
    o_ref[...] = (alpha * acc + beta * c_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def matmul_add(a: Float[Array, "N M K"], b: Float[Array, "N K P"], c: Float[Array, "N M P"], alpha: float, beta: float,
               tiles: NsTiles = NsTiles(), interpret: bool = False) -> Float[Array, "N M P"]:
    """alpha * (a[n] @ b[n]) + beta * c[n] for every n, in c's dtype (alpha, beta: Python numbers)."""
    n, m, k = a.shape
    p = b.shape[-1]
    if b.shape != (n, k, p) or c.shape != (n, m, p):
        raise ValueError(f"Newton-Schulz kernel: shapes {a.shape} @ {b.shape} + {c.shape} don't match")
    if a.dtype != b.dtype:
        raise ValueError(f"Newton-Schulz kernel: operands {a.dtype} and {b.dtype} differ")
    problem = shape_problem(m, k, p, tiles)
    if problem:
        raise ValueError(f"Newton-Schulz kernel: {problem}")
    bm, bp, bk = tile(tiles.bm, m), tile(tiles.bp, p), tile(tiles.bk, k)
    return pl.pallas_call(
        functools.partial(_kernel, alpha=float(alpha), beta=float(beta), bk=bk),
        grid=(m // bm, p // bp, n),
        in_specs=[pl.BlockSpec((None, bm, k), lambda i, j, s: (s, i, 0)),
                  pl.BlockSpec((None, k, bp), lambda i, j, s: (s, 0, j)),
                  pl.BlockSpec((None, bm, bp), lambda i, j, s: (s, i, j))],
        out_specs=pl.BlockSpec((None, bm, bp), lambda i, j, s: (s, i, j)),
        out_shape=out_like(a, (n, m, p), c.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, name="moejax_ns_matmul_add",
    )(a, b, c)


def gram_tile(m: int, tiles: NsTiles = NsTiles()) -> int:
    """The square output tile `gram_add` takes for an [M, M] result (`roofline.NS_GRAM_TILE` is the default's)."""
    return tile(tiles.bm, m)


def _gram_kernel(*refs, alpha: float, beta: float, bt: int, bk: int):
    """Tile (i, j) of o = alpha * a a^T (+ beta * c) for i <= j, stored at (i, j) and, transposed, at (j, i);
    programs below the diagonal do nothing. a [M, K] and o [M, M] whole, indexed here."""
    a_ref, c_ref, o_ref = refs if len(refs) == 3 else (refs[0], None, refs[1])
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(i <= j)
    def _():
        rows_i, rows_j = pl.ds(i * bt, bt), pl.ds(j * bt, bt)
        acc = _contract(lambda ks: dot(a_ref[rows_i, ks], a_ref[rows_j, ks], trans_b=True), a_ref.shape[-1], bk,
                        (bt, bt))
        out = alpha * acc
        if c_ref is not None:
            out = out + beta * c_ref[rows_i, rows_j].astype(jnp.float32)
        out = out.astype(o_ref.dtype)
        o_ref[rows_i, rows_j] = out

        @pl.when(i < j)
        def _():
            o_ref[rows_j, rows_i] = out.T


def gram_add(a: Float[Array, "N M K"], c: Float[Array, "N M M"] | None, alpha: float, beta: float,
             tiles: NsTiles = NsTiles(), interpret: bool = False) -> Float[Array, "N M M"]:
    """alpha * (a[n] @ a[n]^T) + beta * c[n] for every n (c None: no add), in a's dtype; c must be
    symmetric. With a symmetric (a = a^T, e.g. a Gram from here) this is alpha * a a + beta * c."""
    n, m, k = a.shape
    if c is not None and (c.shape != (n, m, m) or c.dtype != a.dtype):
        raise ValueError(f"Newton-Schulz Gram kernel: {c.dtype}{list(c.shape)} can't be added to the Gram of "
                         f"{a.dtype}{list(a.shape)}")
    problem = shape_problem(m, k, m, tiles)
    if problem:
        raise ValueError(f"Newton-Schulz kernel: {problem}")
    bt, bk = gram_tile(m, tiles), tile(tiles.bk, k)
    whole_of = lambda rows, cols: pl.BlockSpec((None, rows, cols), lambda i, j, s: (s, 0, 0))
    operands, in_specs = (a,), [whole_of(m, k)]
    if c is not None:
        operands, in_specs = (a, c), in_specs + [whole_of(m, m)]
    return pl.pallas_call(
        functools.partial(_gram_kernel, alpha=float(alpha), beta=float(beta), bt=bt, bk=bk),
        grid=(m // bt, m // bt, n),
        in_specs=in_specs,
        out_specs=whole_of(m, m),
        out_shape=out_like(a, (n, m, m), a.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, name="moejax_ns_gram",
    )(*operands)
