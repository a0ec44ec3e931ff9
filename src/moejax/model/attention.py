"""Local/global attention of the hero block (SPEC §2).

Dimensions: B batch, S sequence (queries and keys), D width, H query heads, G projected KV heads,
Hd head dim, Q / K query / key rows of one block.
Notable choices:
- K and V project G heads; local layers use all G (H/G queries per KV head), global layers use only the
  first G_global (H/G_global queries per head); query head h reads KV head h // (H / heads used). The
  XLA path gathers K/V per query head (measured faster on CPU than a grouped [G, H/G] einsum), except in
  the band, where the grouped einsum measured faster; the GPU kernel maps heads in its index map and
  never repeats K/V.
- Local and global layers share one scanned layer body with a traced `is_global` flag; the attention core
  runs under `lax.cond`, so a local layer really runs the windowed path (a `jnp.where` of both would pay
  for both). RoPE and the head map are inside the branches.
- SConv on k (before QK-norm) and on the attention output (after W_o); never across documents.
- QK-norm is parameter-free RMS over Hd (eps 1e-6); q is multiplied by qk_mult = 1.3; scale 1/sqrt(Hd).
- RoPE on the first `rope_dim` dims, adjacent-pair convention (x[2i], x[2i+1]), theta 10,000, local
  layers only; positions restart at every document.
- XSA: each head's output loses its component along the token's own value vector.
- Head gate 2*sigmoid(x W_gate) per head, W_gate zero-initialised (gate = 1 at init).
Attention core, by `attention_impl()`:
- 'gpu_kernel' (default on GPU): the fused Pallas flash kernel of flash_gpu.py (causal, document,
  window, GQA; never [S, S]), run by the caller's `KernelFn`: `flash_kernel` on one device, or
  `parallel.backends.attention_kernel(mesh)`, the same kernel per batch shard under shard_map (a custom
  call left to GSPMD would run replicated). `MOEJAX_ATTENTION=xla|gpu_kernel` chooses explicitly.
- 'xla': `attn_q_block = 0` takes the whole sequence at once: `attend_dense` ([S, S] scores; the reference)
  on global layers, and on local layers `attend_band` (blocks of `window` queries against their own and
  the previous block's keys) once S is a multiple of the window and >= 4 windows. `attn_q_block > 0` (and S larger)
  processes queries in blocks, each rematerialised: global layers score a block against all S keys
  ([B, H, Q, S] live); local layers dynamic_slice only keys [start - window + 1, end) of a front-padded
  K/V, so their FLOPs scale with S * (Q + window) instead of S^2.
- Context parallelism (`context` > 1): rows are chunks of sequences; each chunk's keys are extended with the
  sequence's earlier positions (a window-1 halo on local layers, every earlier chunk on global layers)
  through `layers.front_extend`. XLA: `attend_context` runs the same masked cores on them; the kernel takes
  the extended K/V directly (queries at the end of the keys), padded to whole key blocks.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from moejax.config import ModelConfig
from moejax.model import kernel_choice
from moejax.model.flash_gpu import flash_attention, key_padding
from moejax.model.kernel_choice import ATTENTION, kernel_impl
from moejax.model.layers import front_extend, init_conv, matmul_tokens, pytree_dataclass, rms_normalize, sconv, trunc_normal

XSA_EPS = 1e-6
NEG_INF = -1e30
BAND_MIN_WINDOWS = 4  # `band_applies`: S >= 4 windows, i.e. the band's 2 W S scores at most half of S^2

# The kernel path's attention core: (q [B, S, H, Hd], k/v [B, Sk, G, Hd], segment_ids [B, Sk] (per key; the
# queries are the last S keys), scale, window or None) -> [B, S, H, Hd] fp32. Bound to a mesh by
# `parallel.backends.attention_kernel`.
KernelFn = Callable[..., Array]


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
    def init(cfg: ModelConfig, key) -> "Attention":
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


def attention_impl() -> str:
    """'gpu_kernel' on a GPU backend, else 'xla'; MOEJAX_ATTENTION chooses explicitly (`kernel_choice`)."""
    return kernel_impl(*ATTENTION)


def flash_kernel(q, k, v, segment_ids, scale: float, window: int | None):
    """The flash kernel on this device's rows (interpreted off GPU): one device, or one batch shard."""
    return flash_attention(q, k, v, segment_ids, scale, window, None, kernel_choice.run_interpreted())


def block_mask(seg_q: Int[Array, "B Q"], seg_k: Int[Array, "B K"], q_pos: Int[Array, "Q"], k_pos: Int[Array, "K"],
               window: int | None) -> Bool[Array, "B Q K"]:
    """Causal, same document, real key (k >= 0: front padding is negative) and, when `window` is set
    (local layers), q - k < window."""
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = (diff >= 0) & (k_pos[None, :] >= 0)
    if window is not None:
        allowed &= diff < window
    return allowed[None] & (seg_q[:, :, None] == seg_k[:, None, :])


def attention_mask(segment_ids: Int[Array, "B S"], window: int, is_global: bool) -> Bool[Array, "B 1 S S"]:
    pos = jnp.arange(segment_ids.shape[1])
    return block_mask(segment_ids, segment_ids, pos, pos, None if is_global else window)[:, None]


def _softmax_av(q: Float[Array, "B Q H Hd"], k: Float[Array, "B K H Hd"], v: Float[Array, "B K H Hd"],
                mask: Bool[Array, "B Q K"], scale: float) -> Float[Array, "B Q H Hd"]:
    """softmax(q k^T * scale + mask) v with fp32 scores and output."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, NEG_INF), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(q.dtype), v, preferred_element_type=jnp.float32)


def _softmax_av_grouped(q: Float[Array, "B Q H Hd"], k: Float[Array, "B K G Hd"], v: Float[Array, "B K G Hd"],
                        mask: Bool[Array, "B Q K"], scale: float) -> Float[Array, "B Q H Hd"]:
    """`_softmax_av` on G KV heads (G divides H; query head h reads KV head h // (H/G)): the R = H/G query
    heads of a KV head are rows of one dot, [R*Q, Hd] x [Hd, K], and K/V are never repeated per query head.
    Only the band uses it: there it measured 1.14-1.22x faster than gathering K/V per query head (one local
    core fwd+bwd, issue 11's CPU shape, R = 2), while on the dense core (global layers, R = 4; or R = 1) it
    was slower (docs/LOG.md 2026-12-03, sixteenth session)."""
    bsz, n_q, n_heads, hd = q.shape
    q_grouped = q.reshape(bsz, n_q, k.shape[2], n_heads // k.shape[2], hd)  # [B, Q, G, R, Hd]
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", q_grouped, k, preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, NEG_INF), axis=-1)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", probs.astype(q.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(bsz, n_q, n_heads, hd)


def query_head_map(n_heads: int, n_kv: int) -> np.ndarray:
    """The KV head each of n_heads query heads reads when n_kv KV heads are used: h // (H / n_kv)."""
    return np.arange(n_heads) // (n_heads // n_kv)


def per_query_head(a: Float[Array, "B K G Hd"], n_heads: int) -> Float[Array, "B K H Hd"]:
    """K or V repeated for n_heads query heads (`query_head_map`)."""
    return a[:, :, query_head_map(n_heads, a.shape[2])]


def attend_dense(q, k, v, segment_ids, window: int | None, scale: float):
    """The slow reference: all [S, S] scores at once. q, k, v [B, S, H, Hd] (K/V already per query head)."""
    pos = jnp.arange(q.shape[1])
    return _softmax_av(q, k, v, block_mask(segment_ids, segment_ids, pos, pos, window), scale)


def _query_blocks(q, segment_ids, qb: int):
    """[n, B, qb, ...] blocks of q and the query segment ids, with their block index."""
    bsz, seq = segment_ids.shape
    n = seq // qb
    q_blocks = q.reshape(bsz, n, qb, *q.shape[2:]).swapaxes(0, 1)
    return jnp.arange(n), q_blocks, segment_ids.reshape(bsz, n, qb).swapaxes(0, 1)


def _unblock(out):
    return out.swapaxes(0, 1).reshape(out.shape[1], -1, *out.shape[3:])


def attend_query_blocks(q, k, v, segment_ids, window: int | None, scale: float, qb: int, seg_k=None,
                        q_offset: int = 0):
    """Query blocks (rematerialised one at a time) against all keys: [B, H, qb, K] live scores. By default
    the keys are the queries' own positions; `seg_k` gives longer keys (context parallelism: earlier chunks
    first), the queries then sitting at key positions q_offset + [0, S)."""
    seg_k = segment_ids if seg_k is None else seg_k
    k_pos = jnp.arange(k.shape[1])

    @jax.checkpoint
    def one(xs):
        i, q_blk, seg_blk = xs
        mask = block_mask(seg_blk, seg_k, q_offset + i * qb + jnp.arange(qb), k_pos, window)
        return _softmax_av(q_blk, k, v, mask, scale)

    return _unblock(jax.lax.map(one, _query_blocks(q, segment_ids, qb)))


def attend_window(q, k, v, segment_ids, window: int, scale: float, qb: int):
    """Local layers: query block [i*qb, (i+1)*qb) reads only keys [i*qb - window + 1, (i+1)*qb), sliced
    from K/V front-padded by window - 1 rows (padding has segment id -1, masked). Live scores
    [B, H, qb, qb + window - 1]; FLOPs S * (qb + window - 1) instead of S^2."""
    pad = window - 1
    front = lambda a, fill=0: front_extend(a, pad, 1, fill)
    return _window_core(q, front(k), front(v), segment_ids, front(segment_ids, -1), window, scale, qb)


def _window_core(q, k_ext, v_ext, segment_ids, seg_ext, window: int, scale: float, qb: int):
    """attend_window on keys already extended by window - 1 positions in front (padding or, with context
    parallelism, the previous chunk's halo; its segment id is -1 where there is nothing)."""
    pad, span = window - 1, qb + window - 1

    @jax.checkpoint
    def one(xs):
        i, q_blk, seg_blk = xs
        start = i * qb  # extended row of key position i*qb - pad
        k_blk, v_blk, seg_k = (jax.lax.dynamic_slice_in_dim(a, start, span, axis=1) for a in (k_ext, v_ext, seg_ext))
        mask = block_mask(seg_blk, seg_k, start + pad + jnp.arange(qb), start + jnp.arange(span), window)
        return _softmax_av(q_blk, k_blk, v_blk, mask, scale)

    return _unblock(jax.lax.map(one, _query_blocks(q, segment_ids, qb)))


def attend_context(q, k, v, segment_ids, window: int | None, scale: float, qb: int, context: int,
                   head_map: np.ndarray):
    """Context parallelism: rows are chunks, `context` consecutive rows per sequence; k, v carry the G KV
    heads (mapped to query heads only after the exchange, so G/H of the bytes move).
    Local layers read the previous window - 1 positions of the sequence (a halo from the previous chunk or
    chunks); global layers read every earlier chunk of the sequence, (context - 1) hops of the chunk's K/V
    (the causal half of an all-gather over the sequence's rows: later chunks are never read). The queries
    sit at the end of the extended keys, so one 1-D position vector serves every row and the same masks
    (causal, window, document) apply; keys before the sequence start have segment id -1."""
    seq = q.shape[1]
    n = window - 1 if window is not None else (context - 1) * seq
    k_ext, v_ext = (front_extend(a, n, context, 0)[:, :, head_map] for a in (k, v))
    seg_ext = front_extend(segment_ids, n, context, -1)
    if qb and seq > qb:
        if seq % qb:
            raise ValueError(f"chunk length ({seq}) is not divisible by attn_q_block ({qb})")
        if window is not None:
            return _window_core(q, k_ext, v_ext, segment_ids, seg_ext, window, scale, qb)
        return attend_query_blocks(q, k_ext, v_ext, segment_ids, None, scale, qb, seg_k=seg_ext, q_offset=n)
    mask = block_mask(segment_ids, seg_ext, n + jnp.arange(seq), jnp.arange(n + seq), window)
    return _softmax_av(q, k_ext, v_ext, mask, scale)


def band_applies(seq: int, window: int | None) -> bool:
    """Whether `attend_band` runs a local layer that asked for the whole sequence at once (attn_q_block 0):
    S a whole number of windows and at least BAND_MIN_WINDOWS of them, so that it at least halves the
    dense core's S^2 scores (at S = 2 * window they would be equal, and the blocking is overhead)."""
    return window is not None and seq % window == 0 and seq >= BAND_MIN_WINDOWS * window


def attend_band(q, k, v, segment_ids, window: int, scale: float):
    """Local layers without a loop: queries in blocks of W = window rows, each against its own and the
    previous block's keys ([B, n, 2W] keys, n = S / W). q - k < W never reaches further back, so the
    masks are those of `attend_dense`; FLOPs 2 W S instead of S^2. k, v carry G KV heads (G divides H; the
    grouped core, so the spans are built for G heads, not H). Measured on 2 CPU cores, issue 11's CPU
    shape (S 256, W 64), one process, alternated: one local layer's core fwd+bwd 42 vs 57 ms dense; the
    whole train step (3 local layers of 4) 1.09-1.10x faster (docs/LOG.md 2026-12-02, eleventh session)."""
    bsz, seq = segment_ids.shape
    rows = bsz * seq // window  # (row, block) pairs, each one batch row of the dense core
    blocks = lambda a: a.reshape(bsz, seq // window, window, *a.shape[2:])
    # Each block's keys: the previous block (segment id -1, matching nothing, before the first) and its own.
    span = lambda a, fill: jnp.concatenate([jnp.pad(a[:, :-1], [(0, 0), (1, 0)] + [(0, 0)] * (a.ndim - 2),
                                                    constant_values=fill), a], axis=2).reshape(rows, 2 * window, *a.shape[3:])
    seg_q = blocks(segment_ids)
    mask = block_mask(seg_q.reshape(rows, window), span(seg_q, -1), window + jnp.arange(window),
                      jnp.arange(2 * window), window)
    out = _softmax_av_grouped(q.reshape(rows, window, *q.shape[2:]), span(blocks(k), 0), span(blocks(v), 0), mask,
                              scale)
    return out.reshape(bsz, seq, *out.shape[2:])


def attend_xla(q, k, v, segment_ids, window: int | None, scale: float, qb: int):
    """The XLA attention core, q [B, S, H, Hd], k/v [B, S, G, Hd] (G divides H). qb == 0 or qb >= S: the
    whole sequence at once, local layers in window blocks where `band_applies`, else dense; otherwise
    query blocks of qb rows. All but the band repeat K/V per query head first."""
    seq, n_heads = q.shape[1:3]
    if (not qb or seq <= qb) and band_applies(seq, window):
        return attend_band(q, k, v, segment_ids, window, scale)
    k, v = per_query_head(k, n_heads), per_query_head(v, n_heads)
    if not qb or seq <= qb:
        return attend_dense(q, k, v, segment_ids, window, scale)
    if seq % qb:
        raise ValueError(f"sequence length ({seq}) is not divisible by attn_q_block ({qb})")
    if window is not None and qb + window - 1 < seq:
        return attend_window(q, k, v, segment_ids, window, scale, qb)
    return attend_query_blocks(q, k, v, segment_ids, window, scale, qb)  # the window covers everything


def context_keys(k, v, segment_ids, window: int | None, context: int):
    """The kernel path's keys under context parallelism: K/V (G heads) and segment ids extended in front by
    the sequence's earlier positions (window - 1 on local layers, the (context - 1) earlier chunks on global
    ones; segment id -1 before the sequence start), padded up to whole key blocks."""
    seq = k.shape[1]
    n = key_padding(window - 1 if window is not None else (context - 1) * seq, seq)
    return front_extend(k, n, context, 0), front_extend(v, n, context, 0), front_extend(segment_ids, n, context, -1)


def kv_head_map(cfg: ModelConfig, is_global: bool) -> np.ndarray:
    """Which projected KV head each query head reads: H/G per head locally, H/G_global globally."""
    return query_head_map(cfg.n_heads, cfg.n_kv_heads_global if is_global else cfg.n_kv_heads)


def _rope_local(x: Float[Array, "B S N Hd"], positions, is_global: bool, cfg: ModelConfig):
    return x if is_global else rope(x, positions, cfg.rope_dim, cfg.rope_theta)


def queries(p: Attention, x: Float[Array, "B S D"], positions: Int[Array, "B S"], is_global: bool,
            cfg: ModelConfig) -> Float[Array, "B S H Hd"]:
    """q = RoPE(QKNorm(x W_q)), RoPE on local layers only (static `is_global`)."""
    q = matmul_tokens(x, p.wq.astype(x.dtype)).reshape(*x.shape[:2], cfg.n_heads, cfg.head_dim)
    return _rope_local(rms_normalize(q, cfg.qk_norm_eps).astype(x.dtype), positions, is_global, cfg)


def keys(k_conv: Float[Array, "B S GHd"], positions: Int[Array, "B S"], is_global: bool,
         cfg: ModelConfig) -> Float[Array, "B S G Hd"]:
    """k = RoPE(QKNorm(k_conv)) from the already SConv-ed projection x W_k; all G heads."""
    k = k_conv.reshape(*k_conv.shape[:2], cfg.n_kv_heads, cfg.head_dim)
    return _rope_local(rms_normalize(k, cfg.qk_norm_eps).astype(k_conv.dtype), positions, is_global, cfg)


def values(p: Attention, x: Float[Array, "B S D"], cfg: ModelConfig) -> Float[Array, "B S G Hd"]:
    return matmul_tokens(x, p.wv.astype(x.dtype)).reshape(*x.shape[:2], cfg.n_kv_heads, cfg.head_dim)


def xsa(out: Float[Array, "B S H Hd"], v_h: Float[Array, "B S H Hd"]) -> Float[Array, "B S H Hd"]:
    """XSA: drop from each head's fp32 output its component along the token's own value vector."""
    v32 = v_h.astype(jnp.float32)
    coef = jnp.sum(out * v32, -1, keepdims=True) / (jnp.sum(v32 * v32, -1, keepdims=True) + XSA_EPS)
    return out - coef * v32


def attention_output(p: Attention, x: Float[Array, "B S D"], out: Float[Array, "B S H Hd"],
                     cfg: ModelConfig) -> Float[Array, "B S D"]:
    """Head gate 2*sigmoid(x W_gate) and W_o on the (XSA-ed, fp32) heads; the output SConv is the caller's."""
    dt = x.dtype
    gate = 2.0 * jax.nn.sigmoid(matmul_tokens(x, p.head_gate.astype(dt)).astype(jnp.float32))  # [B, S, H]
    out = (out * gate[..., None]).astype(dt).reshape(*x.shape[:2], cfg.q_dim)
    return matmul_tokens(out, p.wo.astype(dt))


def attend_cached(q, k_h, v_h, seg_q, seg_k, q_pos, k_pos, is_global: bool, cfg: ModelConfig):
    """Queries at q_pos against keys at k_pos (a decode cache: empty slots have k_pos < 0); K/V per query
    head. The dense core with explicit positions; same mask and scale as training."""
    window = None if is_global else cfg.window
    return _softmax_av(q, k_h, v_h, block_mask(seg_q, seg_k, q_pos, k_pos, window), cfg.qk_mult / np.sqrt(cfg.head_dim))


def _attend_heads(is_global: bool, p: Attention, x, k_conv, segment_ids, positions,
                  cfg: ModelConfig, context: int = 1, kernel: KernelFn = flash_kernel) -> Float[Array, "B S H Hd"]:
    """One layer kind (static `is_global`): q/k with RoPE (local), head map, the attention core, XSA."""
    q = queries(p, x, positions, is_global, cfg)
    g = cfg.n_kv_heads_global if is_global else cfg.n_kv_heads
    k, v = keys(k_conv, positions, is_global, cfg)[:, :, :g], values(p, x, cfg)[:, :, :g]
    window = None if is_global else cfg.window
    scale = cfg.qk_mult / np.sqrt(cfg.head_dim)
    head_map = kv_head_map(cfg, is_global)
    if attention_impl() == "gpu_kernel":
        keys_in = context_keys(k, v, segment_ids, window, context) if context > 1 else (k, v, segment_ids)
        out = kernel(q, *keys_in, scale, window)
    elif context > 1:
        out = attend_context(q, k, v, segment_ids, window, scale, cfg.attn_q_block, context, head_map)
    else:
        out = attend_xla(q, k, v, segment_ids, window, scale, cfg.attn_q_block)
    return xsa(out, v[:, :, head_map])


def attention(p: Attention, x: Float[Array, "B S D"], segment_ids: Int[Array, "B S"], positions: Int[Array, "B S"],
              is_global, cfg: ModelConfig, context: int = 1, kernel: KernelFn = flash_kernel) -> Float[Array, "B S D"]:
    """`is_global`: a Python bool, or a traced scalar (the layer scan) that picks a branch by lax.cond.
    `context` > 1: rows are chunks of sequences (context parallelism, `attend_context`); positions and
    segment ids are the whole sequence's. `kernel`: the attention core when the GPU kernel is chosen."""
    k_conv = sconv(matmul_tokens(x, p.wk.astype(x.dtype)), p.conv_k, segment_ids, context)
    branch = lambda glob: functools.partial(_attend_heads, glob, cfg=cfg, context=context, kernel=kernel)
    if isinstance(is_global, (bool, np.bool_)):
        out = branch(bool(is_global))(p, x, k_conv, segment_ids, positions)
    else:
        out = jax.lax.cond(is_global, branch(True), branch(False), p, x, k_conv, segment_ids, positions)
    return sconv(attention_output(p, x, out, cfg), p.conv_out, segment_ids, context)
