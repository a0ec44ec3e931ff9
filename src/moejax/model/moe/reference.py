"""Dense einsum reference for the routed experts (tests only).

Every expert runs on every token in fp32, then the chosen outputs are picked with a one-hot mask. It is
O(T*E) and obviously correct: the local path and the expert-parallel transport are tested against it.
Dimensions: T tokens, K choices, E experts, Z latent width, F expert width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def routed_reference(z_TZ: Float[Array, "T Z"], expert_TK: Int[Array, "T K"], weight_TK: Float[Array, "T K"],
                     mask_T: Bool[Array, "T"], w_gate_EZF, w_up_EZF, w_down_EFZ,
                     keep_TK: Bool[Array, "T K"] | None = None) -> Float[Array, "T Z"]:
    """sum_k w[t,k] * expert_{e[t,k]}(z[t]) over unmasked tokens (and kept assignments, if given)."""
    f32 = lambda a: a.astype(jnp.float32)
    z, wg, wu, wd = f32(z_TZ), f32(w_gate_EZF), f32(w_up_EZF), f32(w_down_EFZ)
    hp = jax.lax.Precision.HIGHEST
    h_TEF = jax.nn.silu(jnp.einsum("tz,ezf->tef", z, wg, precision=hp)) * jnp.einsum("tz,ezf->tef", z, wu, precision=hp)
    y_TEZ = jnp.einsum("tef,efz->tez", h_TEF, wd, precision=hp)
    n_exp = wg.shape[0]
    w_TK = jnp.where(mask_T[:, None], f32(weight_TK), 0.0)
    if keep_TK is not None:
        w_TK = jnp.where(keep_TK, w_TK, 0.0)
    combine_TE = jnp.einsum("tk,tke->te", w_TK, jax.nn.one_hot(expert_TK, n_exp, dtype=jnp.float32))
    return jnp.einsum("te,tez->tz", combine_TE, y_TEZ, precision=hp)
