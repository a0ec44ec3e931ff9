"""Pieces shared by our Pallas (Triton) kernels, `flash_gpu` and `moe.grouped_gpu`.

- `dot`: the kernels' 2-D matmul, fp32 accumulation, transposes folded into the dot.
- `whole`: a BlockSpec of a whole operand, read in place and indexed inside the kernel (expert ids, block
  bounds, weights).
- `plgpu`: Pallas's Triton backend, which every kernel here is written for, or None in a jax without it
  (0.11 deprecates it in favour of Mosaic GPU; a later jax drops it). Then `kernel_choice` runs every op on
  its XLA path and refuses an explicit kernel choice with one line.
- `out_like`: output shapes that also hold inside `shard_map`. Under shard_map (check_vma on, the default)
  Pallas needs every output's varying manual axes, since it can't infer them from the kernel body; the
  per-device kernels (`parallel.backends`) run there. The outputs vary exactly as the given operand does
  (every operand of our kernels is per-shard data, or weights cast to varying first). Outside shard_map the
  operand's manual-axis type is empty and nothing changes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:
    plgpu = None


def dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """2-D matmul with fp32 accumulation; transposes folded into the dot (Triton lowers them natively)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def whole(a) -> pl.BlockSpec:
    """The whole array as one block: read in place, indexed inside the kernel."""
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def out_like(operand, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    """A Pallas out_shape of `shape` / `dtype`, varying over the manual mesh axes `operand` varies over."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(operand).manual_axis_type)
