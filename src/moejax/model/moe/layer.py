"""The MoE block (SPEC §2): router, latent transport, routed experts, shared experts, output SConv.

Dimensions: T tokens (B*S flattened), D width, E experts, K choices, Z latent width, F expert width,
U shared experts, Fs shared width.

The routed experts read and write a Z-wide latent: z = RMSNorm(m W_down_lat), experts combine in latent
space, then W_up_lat maps back to D. *Which* routed implementation runs is a parameter (`routed`): the
dropless local path, the pooled-wave expert-parallel transport, or the dense reference — same weights,
same call (STYLE rule 2). Each returns (y_TZ fp32, DropStats); the choice between them is made in one
place, `moejax.parallel.backends`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moejax.config import ModelConfig
from moejax.model.layers import init_conv, matmul_tokens, pytree_dataclass, rms_norm, sconv, shared_swiglu, trunc_normal
from moejax.model.moe.experts import routed_local
from moejax.model.moe.router import route, router_stats


class DropStats(NamedTuple):
    """Global int32 assignment counts of one MoE layer: kept + sender_dropped + receiver_dropped == valid."""

    valid: jax.Array  # assignments of real (non-padding) tokens: tokens * K
    kept: jax.Array
    sender_dropped: jax.Array  # over the sender pool P (transport only)
    receiver_dropped: jax.Array  # over the receiver capacity R (transport only)
    padding_skipped: jax.Array  # assignments of padding tokens, never sent


# (z_TZ, expert_TK, weight_TK, mask_T, w_gate_EZF, w_up_EZF, w_down_EFZ) -> (y_TZ fp32, DropStats)
RoutedFn = Callable[..., tuple[jax.Array, DropStats]]

# Values a backend tags with `jax.ad_checkpoint.checkpoint_name` so that block rematerialisation keeps
# them: the all-to-all results of the transport (dispatch and return). Recomputing them in the backward
# pass would rerun the collectives (18 all-to-alls per 3-wave layer instead of 12).
SAVE_DISPATCH, SAVE_RETURN = "moe_dispatch", "moe_return"


@pytree_dataclass
class MoE:
    router: Float[Array, "D E"]
    router_bias: Float[Array, "E"]
    lat_down: Float[Array, "D Z"]
    lat_norm: Float[Array, "Z"]
    lat_up: Float[Array, "Z D"]
    w_gate: Float[Array, "E Z F"]
    w_up: Float[Array, "E Z F"]
    w_down: Float[Array, "E F Z"]
    shared_gate: Float[Array, "U D Fs"]
    shared_up: Float[Array, "U D Fs"]
    shared_down: Float[Array, "U Fs D"]
    conv_out: Float[Array, "J D"]

    @staticmethod
    def init(cfg: ModelConfig, key) -> "MoE":
        ks = jax.random.split(key, 9)
        d, z, f, e = cfg.d_model, cfg.latent_width, cfg.expert_width, cfg.n_experts
        ns, fs, std = cfg.n_shared, cfg.shared_width, cfg.init_std
        return MoE(router=trunc_normal(ks[0], (d, e), std), router_bias=jnp.zeros((e,), jnp.float32),
                   lat_down=trunc_normal(ks[1], (d, z), std), lat_norm=jnp.ones((z,), jnp.float32),
                   lat_up=trunc_normal(ks[2], (z, d), std), w_gate=trunc_normal(ks[3], (e, z, f), std),
                   w_up=trunc_normal(ks[4], (e, z, f), std), w_down=trunc_normal(ks[5], (e, f, z), std),
                   shared_gate=trunc_normal(ks[6], (ns, d, fs), std), shared_up=trunc_normal(ks[7], (ns, d, fs), std),
                   shared_down=trunc_normal(ks[8], (ns, fs, d), std), conv_out=init_conv(cfg.conv_taps, d))


def routed_local_with_stats(z_TZ, expert_TK, weight_TK, mask_T, w_gate, w_up, w_down) -> tuple[jax.Array, DropStats]:
    """The dropless local path with the same stats contract as the transport (nothing dropped)."""
    y = routed_local(z_TZ, expert_TK, weight_TK, mask_T, w_gate, w_up, w_down)
    k = expert_TK.shape[1]
    valid = jnp.sum(mask_T).astype(jnp.int32) * k
    zero = jnp.zeros((), jnp.int32)
    return y, DropStats(valid=valid, kept=valid, sender_dropped=zero, receiver_dropped=zero,
                        padding_skipped=(mask_T.shape[0] * k - valid).astype(jnp.int32))


def moe_block(p: MoE, m: Float[Array, "B S D"], segment_ids: Int[Array, "B S"], cfg: ModelConfig,
              routed: RoutedFn = routed_local_with_stats, context: int = 1) -> tuple[Float[Array, "B S D"], dict]:
    """`context` > 1: rows are chunks of sequences; only the output SConv reads across them."""
    y, stats = moe_mix(p, m, segment_ids, cfg, routed)
    return sconv(y, p.conv_out, segment_ids, context), stats


def moe_mix(p: MoE, m: Float[Array, "B S D"], segment_ids: Int[Array, "B S"], cfg: ModelConfig,
            routed: RoutedFn = routed_local_with_stats) -> tuple[Float[Array, "B S D"], dict]:
    """Routed + shared experts, before the output SConv (decoding runs that conv from a cache)."""
    bsz, seq, d = m.shape
    dt = m.dtype
    m_TD = m.reshape(bsz * seq, d)
    mask_T = segment_ids.reshape(-1) > 0
    r = route(m_TD, p.router, p.router_bias, cfg.top_k, cfg.combine_scale)
    z_TZ = rms_norm(matmul_tokens(m_TD, p.lat_down.astype(dt)), p.lat_norm, cfg.norm_eps)
    y_TZ, drops = routed(z_TZ, r.expert_TK, r.weight_TK, mask_T, p.w_gate.astype(dt), p.w_up.astype(dt),
                         p.w_down.astype(dt))
    y_TD = matmul_tokens(y_TZ.astype(dt), p.lat_up.astype(dt))
    if cfg.n_shared:
        y_TD = y_TD + shared_swiglu(m_TD, p.shared_gate.astype(dt), p.shared_up.astype(dt), p.shared_down.astype(dt))
    stats = {**router_stats(r, mask_T), **drops._asdict(),  # margins and mask feed QB (layer hook), then are dropped
             "margins": r.logits_TE - r.threshold_T[:, None], "token_mask": mask_T}
    return y_TD.reshape(bsz, seq, d), stats
