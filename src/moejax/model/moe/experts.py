"""Routed-expert math on one device: the SwiGLU expert MLP and the dropless local path.

Dimensions: T tokens, K top-k choices, A = T*K assignments, E experts, Z latent width (the routed
experts read and write the latent, SPEC §2), F expert width, R rows per expert (capacity).

The local path is the training path without expert parallelism: assignments are sorted by expert, padded
per expert to whole blocks, and the three expert matmuls run as batched block GEMMs
(`moejax.model.moe.grouped`; `jax.lax.ragged_dot` is a dense E x emulation on CPU and GPU), so nothing
is ever dropped. The expert-parallel transport (`moejax.parallel.expert_parallel`) reuses
`expert_mlp_batched` on its [E_loc, R, Z] buffers. Both return the combined latent output in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from moejax.model.layers import swiglu_act
from moejax.model.moe.grouped import make_layout, swiglu_rows


def expert_mlp_batched(x_ERZ: Float[Array, "E R Z"], w_gate_EZF, w_up_EZF, w_down_EFZ) -> Float[Array, "E R Z"]:
    """SwiGLU per expert on a capacity buffer: W2 (silu(x Wg) * (x Wu))."""
    gate_ERF = jnp.einsum("erz,ezf->erf", x_ERZ, w_gate_EZF)
    up_ERF = jnp.einsum("erz,ezf->erf", x_ERZ, w_up_EZF)
    return jnp.einsum("erf,efz->erz", swiglu_act(gate_ERF, up_ERF), w_down_EFZ)


def routed_local(z_TZ: Float[Array, "T Z"], expert_TK: Int[Array, "T K"], weight_TK: Float[Array, "T K"],
                 mask_T: Bool[Array, "T"], w_gate_EZF, w_up_EZF, w_down_EFZ) -> Float[Array, "T Z"]:
    """Dropless routed experts: sort assignments by expert, block grouped GEMMs, weighted fp32 combine.

    Masked (padding) tokens contribute nothing; their rows still flow through the GEMMs (static shapes)
    but are routed to their chosen expert with weight 0.
    """
    n_tok, k = expert_TK.shape
    # One layout per layer, shared by the gate, up and down matmuls; rows gather straight from z_TZ.
    layout = make_layout(expert_TK.reshape(-1), w_gate_EZF.shape[0])
    y_AZ = swiglu_rows(z_TZ, layout, w_gate_EZF, w_up_EZF, w_down_EFZ, rows_per_source=k)
    out_TKZ = y_AZ.reshape(n_tok, k, -1).astype(jnp.float32)
    w_TK = jnp.where(mask_T[:, None], weight_TK.astype(jnp.float32), 0.0)
    return jnp.einsum("tk,tkz->tz", w_TK, out_TKZ)
