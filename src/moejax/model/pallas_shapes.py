"""Output shapes for our Pallas calls that also hold inside `shard_map`.

Under shard_map (check_vma on, the default) Pallas needs every output's varying manual axes, since it
can't infer them from the kernel body; the per-device kernels (`parallel.backends`) run there. The outputs
vary exactly as the given operand does (every operand of our kernels is per-shard data, or weights cast
to varying first). Outside shard_map the operand's manual-axis type is empty and nothing changes.
"""

from __future__ import annotations

import jax


def out_like(operand, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    """A Pallas out_shape of `shape` / `dtype`, varying over the manual mesh axes `operand` varies over."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(operand).manual_axis_type)
