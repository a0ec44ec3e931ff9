"""Local/global attention of the hero block (SPEC §2).

Dimensions: B batch, S sequence (queries and keys), D width, H query heads, G projected KV heads,
Hd head dim. Notable choices:
- K and V project G heads; local layers use all G (H/G queries per KV head), global layers use only the
  first G_global (H/G_global queries per head). One code path serves both so layers can be scanned:
  the per-layer `is_global` flag selects the head map, the window and RoPE with `jnp.where`.
- SConv on k (before QK-norm) and on the attention output (after W_o); never across documents.
- QK-norm is parameter-free RMS over Hd (eps 1e-6); q is multiplied by qk_mult = 1.3; scale 1/sqrt(Hd).
- RoPE on the first `rope_dim` dims, adjacent-pair convention (x[2i], x[2i+1]), theta 10,000, local
  layers only; positions restart at every document.
- XSA: each head's output loses its component along the token's own value vector.
- Head gate 2*sigmoid(x W_gate) per head, W_gate zero-initialised (gate = 1 at init).
- `attn_q_block > 0` processes queries in blocks (rematerialised) so [S, S] scores never exist at once;
  a fused flash kernel would also skip fully masked key blocks (not done: the window is not exploited).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from moejax.config import ModelConfig
from moejax.model.layers import init_conv, pytree_dataclass, rms_normalize, sconv, trunc_normal

XSA_EPS = 1e-6
NEG_INF = -1e30


@pytree_dataclass
class Attention:
    wq: Float[Array, "D HHd"]
    wk: Float[Array, "D GHd"]
    wv: Float[Array, "D GHd"]
    wo: Float[Array, "HHd D"]
    head_gate: Float[Array, "D H"]
    conv_k: Float[Array, "J GHd"]
    conv_out: Float[Array, "J D"]

    @staticmethod
    def init(key, cfg: ModelConfig) -> "Attention":
        kq, kk, kv, ko = jax.random.split(key, 4)
        d, std = cfg.d_model, cfg.init_std
        return Attention(wq=trunc_normal(kq, (d, cfg.q_dim), std), wk=trunc_normal(kk, (d, cfg.kv_dim), std),
                         wv=trunc_normal(kv, (d, cfg.kv_dim), std), wo=trunc_normal(ko, (cfg.q_dim, d), std),
                         head_gate=jnp.zeros((d, cfg.n_heads), jnp.float32),
                         conv_k=init_conv(cfg.conv_taps, cfg.kv_dim), conv_out=init_conv(cfg.conv_taps, d))


def rope(x: Float[Array, "B S N Hd"], positions: Int[Array, "B S"], rope_dim: int, theta: float) -> Float[Array, "B S N Hd"]:
    """Rotate adjacent pairs (2i, 2i+1) of the first rope_dim dims by positions * theta^(-2i/rope_dim)."""
    inv_freq = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float32) / rope_dim)  # [rope_dim/2]
    angle = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [B, S, 1, rope_dim/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    xr = x[..., :rope_dim].astype(jnp.float32)
    even, odd = xr[..., 0::2], xr[..., 1::2]
    rot = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(xr.shape)
    return jnp.concatenate([rot.astype(x.dtype), x[..., rope_dim:]], axis=-1)


def block_mask(seg_q: Int[Array, "B Q"], seg_k: Int[Array, "B S"], q_pos: Int[Array, "Q"], window: int,
               is_global, k_pos: Int[Array, "S"] | None = None) -> Bool[Array, "B 1 Q S"]:
    """Causal, same-document, and (local layers) within `window` tokens (q - k < window) for queries at
    sequence positions q_pos against S keys at positions k_pos (default 0..S-1; a decode cache passes
    its slots' positions)."""
    q = q_pos[:, None]
    k = (jnp.arange(seg_k.shape[1]) if k_pos is None else k_pos)[None, :]
    allowed = (k <= q) & jnp.logical_or(is_global, q - k < window)
    same_doc = seg_q[:, :, None] == seg_k[:, None, :]
    return (allowed[None] & same_doc)[:, None]


def attention_mask(segment_ids: Int[Array, "B S"], window: int, is_global) -> Bool[Array, "B 1 S S"]:
    return block_mask(segment_ids, segment_ids, jnp.arange(segment_ids.shape[1]), window, is_global)


def _attend(q, k_h, v_h, seg_q, seg_k, q_pos, is_global, cfg: ModelConfig, k_pos=None):
    """softmax(qk^T * scale + mask) v for one block of queries; fp32 scores and output."""
    scale = cfg.qk_mult / np.sqrt(cfg.head_dim)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k_h, preferred_element_type=jnp.float32) * scale
    mask = block_mask(seg_q, seg_k, q_pos, cfg.window, is_global, k_pos)
    probs = jax.nn.softmax(jnp.where(mask, scores, NEG_INF), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(q.dtype), v_h, preferred_element_type=jnp.float32)


def _attend_blockwise(q, k_h, v_h, segment_ids, is_global, cfg: ModelConfig):
    """Queries in blocks of `attn_q_block` (rematerialised one at a time): live scores are
    [B, H, block, S] instead of [B, H, S, S]. Same values as the dense path."""
    bsz, seq, heads, hd = q.shape
    qb = cfg.attn_q_block
    n_blocks = seq // qb
    q_blocks = q.reshape(bsz, n_blocks, qb, heads, hd).swapaxes(0, 1)
    seg_blocks = segment_ids.reshape(bsz, n_blocks, qb).swapaxes(0, 1)
    pos_blocks = jnp.arange(seq).reshape(n_blocks, qb)

    @jax.checkpoint
    def one(xs):
        q_blk, seg_blk, pos_blk = xs
        return _attend(q_blk, k_h, v_h, seg_blk, segment_ids, pos_blk, is_global, cfg)

    out = jax.lax.map(one, (q_blocks, seg_blocks, pos_blocks))  # [n_blocks, B, qb, H, Hd]
    return out.swapaxes(0, 1).reshape(bsz, seq, heads, hd)


def kv_head_map(cfg: ModelConfig, is_global) -> Int[Array, "H"]:
    """Which projected KV head each query head reads: H/G per head locally, H/G_global globally."""
    heads = np.arange(cfg.n_heads)
    local = heads // (cfg.n_heads // cfg.n_kv_heads)
    glob = heads // (cfg.n_heads // cfg.n_kv_heads_global)
    return jnp.where(is_global, glob, local)


def queries(p: Attention, x: Float[Array, "B S D"], positions: Int[Array, "B S"], is_global,
            cfg: ModelConfig) -> Float[Array, "B S H Hd"]:
    """q = RoPE(QKNorm(x W_q)), RoPE on local layers only."""
    dt = x.dtype
    q = (x @ p.wq.astype(dt)).reshape(*x.shape[:2], cfg.n_heads, cfg.head_dim)
    q = rms_normalize(q, cfg.qk_norm_eps).astype(dt)
    return jnp.where(is_global, q, rope(q, positions, cfg.rope_dim, cfg.rope_theta))


def keys(k_conv: Float[Array, "B S GHd"], positions: Int[Array, "B S"], is_global,
         cfg: ModelConfig) -> Float[Array, "B S G Hd"]:
    """k = RoPE(QKNorm(k_conv)) from the already SConv-ed projection x W_k."""
    dt = k_conv.dtype
    k = k_conv.reshape(*k_conv.shape[:2], cfg.n_kv_heads, cfg.head_dim)
    k = rms_normalize(k, cfg.qk_norm_eps).astype(dt)
    return jnp.where(is_global, k, rope(k, positions, cfg.rope_dim, cfg.rope_theta))


def values(p: Attention, x: Float[Array, "B S D"], cfg: ModelConfig) -> Float[Array, "B S G Hd"]:
    return (x @ p.wv.astype(x.dtype)).reshape(*x.shape[:2], cfg.n_kv_heads, cfg.head_dim)


def attention_output(p: Attention, x: Float[Array, "B S D"], out: Float[Array, "B S H Hd"],
                     v_h: Float[Array, "B S H Hd"], cfg: ModelConfig) -> Float[Array, "B S D"]:
    """XSA, head gate and W_o on the fp32 attention output (the output SConv is the caller's)."""
    dt = x.dtype
    v32 = v_h.astype(jnp.float32)  # XSA: drop the component along the token's own value vector
    coef = jnp.sum(out * v32, -1, keepdims=True) / (jnp.sum(v32 * v32, -1, keepdims=True) + XSA_EPS)
    out = out - coef * v32
    gate = 2.0 * jax.nn.sigmoid((x @ p.head_gate.astype(dt)).astype(jnp.float32))  # [B, S, H]
    out = (out * gate[..., None]).astype(dt).reshape(*x.shape[:2], cfg.q_dim)
    return out @ p.wo.astype(dt)


def attention(p: Attention, x: Float[Array, "B S D"], segment_ids: Int[Array, "B S"], positions: Int[Array, "B S"],
              is_global, cfg: ModelConfig) -> Float[Array, "B S D"]:
    seq = x.shape[1]
    q = queries(p, x, positions, is_global, cfg)
    k = keys(sconv(x @ p.wk.astype(x.dtype), p.conv_k, segment_ids), positions, is_global, cfg)
    v = values(p, x, cfg)
    head_map = kv_head_map(cfg, is_global)
    k_h, v_h = k[:, :, head_map], v[:, :, head_map]  # [B, S, H, Hd]

    if cfg.attn_q_block and seq > cfg.attn_q_block:
        if seq % cfg.attn_q_block:
            raise ValueError(f"sequence length ({seq}) is not divisible by attn_q_block ({cfg.attn_q_block})")
        out = _attend_blockwise(q, k_h, v_h, segment_ids, is_global, cfg)
    else:
        out = _attend(q, k_h, v_h, segment_ids, segment_ids, jnp.arange(seq), is_global, cfg)
    return sconv(attention_output(p, x, out, v_h, cfg), p.conv_out, segment_ids)
