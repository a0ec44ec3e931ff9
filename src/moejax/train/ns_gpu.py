"""Newton-Schulz's polynomial GEMMs for GPU with their adds fused: out[n] = alpha * (A[n] @ B[n]) + beta * C[n]
for a stack of matrices, one Pallas (Triton) kernel.

Dimensions: N matrices; M x K times K x P; bm x bp the output tile of one program, bk the contraction chunk.

Why: each quintic Newton-Schulz step is X X^T, then B = b G + c G G, then X' = a X + B X. XLA fuses the scalar
multiplies into its GEMMs but leaves both adds as separate kernels, each reading two stacks and writing one.
Compiled for one H200, that is 27 add kernels a step at issue 11's shape G (~8 ms of a ~133 ms roofline) and
~42 ms of the d1024 rung's ~335 ms (`bench/roofline.py --gpu`). Here the add is the GEMM's epilogue: C's tile
is read once by the program that writes the output tile, and no [N, M, P] intermediate goes through memory.
Numerics: fp32 accumulation and an fp32 epilogue, rounded once to the output dtype (XLA's path rounds A @ B
to bf16 before the add: the kernel is the more exact of the two).

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
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from moejax.model.moe.grouped_gpu import MIN_TILE, tile
from moejax.model.pallas_util import dot, out_like


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


def _kernel(a_ref, b_ref, c_ref, o_ref, *, alpha: float, beta: float, bk: int):
    """o = alpha * a @ b + beta * c for one [bm, bp] output tile; a [bm, K], b [K, bp] read chunk by chunk."""

    def body(i, acc):
        ks = pl.ds(i * bk, bk)
        return acc + dot(a_ref[:, ks], b_ref[ks, :])

    acc = lax.fori_loop(0, a_ref.shape[-1] // bk, body, jnp.zeros(o_ref.shape, jnp.float32))
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
