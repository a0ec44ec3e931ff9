"""Routed-expert math on one device: the SwiGLU expert MLP and the dropless local path.

Dimensions: T tokens, K top-k choices, A = T*K assignments, E experts, Z latent width (the routed
experts read and write the latent, SPEC §2), F expert width, R rows per expert (capacity).

The local path is the training path without expert parallelism: assignments are sorted by expert and
the three expert matmuls run as grouped GEMMs (`jax.lax.ragged_dot`), so nothing is ever dropped. The
expert-parallel transport (`moejax.parallel.expert_parallel`) reuses `expert_mlp_batched` on its
[E_loc, R, Z] buffers. Both return the combined latent output in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def expert_mlp_batched(x_ERZ: Float[Array, "E R Z"], w_gate_EZF, w_up_EZF, w_down_EFZ) -> Float[Array, "E R Z"]:
    """SwiGLU per expert on a capacity buffer: W2 (silu(x Wg) * (x Wu))."""
    gate_ERF = jnp.einsum("erz,ezf->erf", x_ERZ, w_gate_EZF)
    up_ERF = jnp.einsum("erz,ezf->erf", x_ERZ, w_up_EZF)
    return jnp.einsum("erf,efz->erz", jax.nn.silu(gate_ERF) * up_ERF, w_down_EFZ)


def expert_mlp_grouped(x_AZ: Float[Array, "A Z"], group_sizes_E: Int[Array, "E"], w_gate_EZF, w_up_EZF,
                       w_down_EFZ) -> Float[Array, "A Z"]:
    """SwiGLU on rows already sorted by expert; group_sizes_E[e] rows belong to expert e."""
    gate_AF = jax.lax.ragged_dot(x_AZ, w_gate_EZF, group_sizes_E)
    up_AF = jax.lax.ragged_dot(x_AZ, w_up_EZF, group_sizes_E)
    return jax.lax.ragged_dot(jax.nn.silu(gate_AF) * up_AF, w_down_EFZ, group_sizes_E)


def routed_local(z_TZ: Float[Array, "T Z"], expert_TK: Int[Array, "T K"], weight_TK: Float[Array, "T K"],
                 mask_T: Bool[Array, "T"], w_gate_EZF, w_up_EZF, w_down_EFZ) -> Float[Array, "T Z"]:
    """Dropless routed experts: sort assignments by expert, grouped GEMMs, weighted fp32 combine.

    Masked (padding) tokens contribute nothing; their rows still flow through the GEMMs (static shapes)
    but are routed to their chosen expert with weight 0.
    """
    n_tok, k = expert_TK.shape
    n_exp = w_gate_EZF.shape[0]
    expert_A = expert_TK.reshape(-1)
    order_A = jnp.argsort(expert_A, stable=True)  # token-major inside each expert
    token_A = order_A // k
    group_sizes_E = jnp.bincount(expert_A, length=n_exp).astype(jnp.int32)
    out_AZ = expert_mlp_grouped(z_TZ[token_A], group_sizes_E, w_gate_EZF, w_up_EZF, w_down_EFZ)
    # Undo the sort with a gather through the inverse permutation (no scatter in the forward pass).
    inverse_A = jnp.argsort(order_A)
    out_TKZ = out_AZ[inverse_A].reshape(n_tok, k, -1).astype(jnp.float32)
    w_TK = jnp.where(mask_T[:, None], weight_TK.astype(jnp.float32), 0.0)
    return jnp.einsum("tk,tkz->tz", w_TK, out_TKZ)
