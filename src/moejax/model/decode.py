"""Incremental decoding with a KV cache: the training forward pass, one chunk of new tokens at a time.

Dimensions: B batch, T new tokens in one call (the whole prompt at prefill, 1 per decode step), N cache
length (prompt + new tokens), W local window, S keys attended (cache slots + T), G projected KV heads
(G_global on global layers), H query heads, Hd head dim, J conv taps, D width, V vocab.

Notable choices:
- No second copy of the model math: the step calls the training functions (`attention.queries/keys/
  values/attend_cached/xsa/attention_output`, `layers.sconv` through `sconv_step`, `moe.layer.moe_mix`, the norms,
  `transformer.embed/lm_logits`); only the cache bookkeeping is new. `tests/test_generate.py` ties it to
  `transformer.forward` token for token.
- Every layer's cache holds slots with the position each slot holds (-1 = empty). Global layers keep the
  whole prefix (N slots, slot = position) and only the first G_global KV heads, all that a global layer
  reads; local layers keep a ring of W slots (slot = position mod W). A call attends over [cache as it
  was ; the T new keys] with the slot positions as key positions, so `block_mask` applies causality and
  the window exactly as in training even when a prefill chunk is longer than W; the new keys are written
  afterwards (the last min(T, slots) of them).
- SConv keeps the last J-1 inputs at each of its three sites (k inside attention, the attention output,
  the MoE output); zeros before the first token equal training's document mask.
- One document per row: segment 1, positions 0, 1, ... from the first prompt token (training restarts
  positions at every document and never attends across one).
- Layers are a Python loop (local and global caches differ in size, so they cannot be scanned); the MoE
  runs the dropless local path, so batch 1 routes exactly as the full forward pass does.
"""

from __future__ import annotations

import functools
from typing import Iterator

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moejax.config import ModelConfig
from moejax.model.attention import Attention, attend_cached, attention_output, keys, kv_head_map, queries, values, xsa
from moejax.model.layers import sconv_step
from moejax.model.moe.layer import moe_mix
from moejax.model.transformer import Transformer, embed, lm_logits

PREFILL_CHUNK = 64  # prompt tokens per prefill call (one extra compilation, for prompts at least this long)
CACHE_BUCKET = 256  # cache length rounded up to a multiple: other prompt/new-token counts reuse the compile
LayerCache = dict  # k, v: [B, slots, G, Hd]; pos: [slots] int32; conv_k / conv_attn / conv_moe: [B, J-1, C]


def cache_slots(cfg: ModelConfig, layer: int, length: int) -> int:
    return length if cfg.is_global(layer) else min(cfg.window, length)


def init_cache(cfg: ModelConfig, batch: int, length: int) -> tuple[LayerCache, ...]:
    """Empty caches for `length` positions (prompt + new tokens), in the compute dtype."""
    dt = jnp.dtype(cfg.compute_dtype)
    hist = cfg.conv_taps - 1
    out = []
    for i in range(cfg.n_layers):
        slots = cache_slots(cfg, i, length)
        g = cfg.n_kv_heads_global if cfg.is_global(i) else cfg.n_kv_heads
        out.append({"k": jnp.zeros((batch, slots, g, cfg.head_dim), dt),
                    "v": jnp.zeros((batch, slots, g, cfg.head_dim), dt),
                    "pos": jnp.full((slots,), -1, jnp.int32),
                    "conv_k": jnp.zeros((batch, hist, cfg.kv_dim), dt),
                    "conv_attn": jnp.zeros((batch, hist, cfg.d_model), dt),
                    "conv_moe": jnp.zeros((batch, hist, cfg.d_model), dt)})
    return tuple(out)


def _write(cache_BSGH, new_BTGH, slots_T):
    return cache_BSGH.at[:, slots_T].set(new_BTGH.astype(cache_BSGH.dtype))


def _attention_step(p: Attention, x: Float[Array, "B T D"], c: LayerCache, pos_T: Int[Array, "T"], is_global: bool,
                    cfg: ModelConfig) -> tuple[Float[Array, "B T D"], LayerCache]:
    bsz, t, _ = x.shape
    positions = jnp.broadcast_to(pos_T, (bsz, t))
    q = queries(p, x, positions, is_global, cfg)
    k_conv, conv_k = sconv_step(x @ p.wk.astype(x.dtype), p.conv_k, c["conv_k"])
    g = c["k"].shape[2]  # global layers read (and cache) only the first G_global heads
    k = keys(k_conv, positions, is_global, cfg)[:, :, :g]
    v = values(p, x, cfg)[:, :, :g]
    k_all = jnp.concatenate([c["k"], k], axis=1)  # [B, S, G, Hd]
    v_all = jnp.concatenate([c["v"], v], axis=1)
    pos_all = jnp.concatenate([c["pos"], pos_T])  # [S]
    head_map = kv_head_map(cfg, is_global)
    seg_k = jnp.broadcast_to((pos_all >= 0).astype(jnp.int32), (bsz, pos_all.shape[0]))  # empty slots: no doc
    out = attend_cached(q, k_all[:, :, head_map], v_all[:, :, head_map], jnp.ones((bsz, t), jnp.int32), seg_k, pos_T,
                        pos_all, is_global, cfg)
    out = xsa(out, v[:, :, head_map])
    y, conv_attn = sconv_step(attention_output(p, x, out, cfg), p.conv_out, c["conv_attn"])
    n_slots = c["pos"].shape[0]
    keep = min(t, n_slots)  # older keys of a long chunk fall out of the ring anyway
    slots = pos_T[t - keep:] % n_slots
    new = {"k": _write(c["k"], k[:, t - keep:], slots), "v": _write(c["v"], v[:, t - keep:], slots),
           "pos": c["pos"].at[slots].set(pos_T[t - keep:]), "conv_k": conv_k, "conv_attn": conv_attn}
    return y, {**c, **new}


def decode_step(params: Transformer, cache: tuple[LayerCache, ...], tokens: Int[Array, "B T"], start,
                cfg: ModelConfig) -> tuple[Float[Array, "B V"], tuple[LayerCache, ...]]:
    """Feed T tokens at positions start..start+T-1; fp32 logits of the last one and the updated cache.

    `params.blocks.moe.router_bias` must hold the router bias the model was trained with (the QB bias).
    """
    bsz, t = tokens.shape
    pos_T = start + jnp.arange(t, dtype=jnp.int32)
    seg = jnp.ones((bsz, t), jnp.int32)
    x = embed(params, tokens, cfg)
    new_cache = []
    for i, is_global in enumerate(cfg.global_layers):
        blk = jax.tree.map(lambda a: a[i], params.blocks)
        h, c = _attention_step(blk.attn, blk.attn_norm(x, cfg.norm_eps), cache[i], pos_T, is_global, cfg)
        x = x + h
        y, _ = moe_mix(blk.moe, blk.moe_norm(x, cfg.norm_eps), seg, cfg)
        h, conv_moe = sconv_step(y, blk.moe.conv_out, c["conv_moe"])
        x = x + h
        new_cache.append({**c, "conv_moe": conv_moe})
    h = params.final_norm(x[:, -1:], cfg.norm_eps)
    return lm_logits(h, params.lm_head)[:, 0], tuple(new_cache)


def sample_next(logits_BV: Float[Array, "B V"], key, temperature, top_p, n_valid: int) -> Int[Array, "B"]:
    """Greedy when temperature == 0, else a sample from softmax(logits / temperature) restricted to the
    smallest set of top tokens whose probability reaches top_p (nucleus). Ids >= n_valid (model vocab
    padding the tokenizer never produces) are never chosen."""
    v = logits_BV.shape[-1]
    logits = jnp.where(jnp.arange(v) < n_valid, logits_BV.astype(jnp.float32), -jnp.inf)
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token: the top one always stays
    choice = jax.random.categorical(key, jnp.where(before < top_p, sorted_logits, -jnp.inf), axis=-1)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "n_valid"), donate_argnums=(1,))
def _step_and_sample(params, cache, tokens, start, key, temperature, top_p, cfg: ModelConfig, n_valid: int):
    logits, cache = decode_step(params, cache, tokens, start, cfg)
    nxt = sample_next(logits, jax.random.fold_in(key, start + tokens.shape[1]), temperature, top_p, n_valid)
    return nxt, logits, cache


def generate_tokens(params: Transformer, cfg: ModelConfig, prompt: list[int], max_new_tokens: int, *,
                    temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
                    n_valid: int | None = None, prefill_chunk: int = PREFILL_CHUNK) -> Iterator[tuple[int, jax.Array]]:
    """Yield (token id, fp32 logits [V] it was drawn from) for up to `max_new_tokens` new tokens, one at a
    time as each is decoded; stops after `eos_id`. The cache holds prompt + new tokens, rounded up to a
    multiple of CACHE_BUCKET (empty slots are masked).

    The prompt goes in chunks of `prefill_chunk` tokens, the remainder one token at a time: a short prompt
    costs no compilation beyond the one-token step. The token at position p is drawn with key
    fold_in(key(seed), p), so a seed reproduces a text.
    """
    n = len(prompt)
    # Committed like the step's outputs: an uncommitted first argument would compile the step twice.
    put = functools.partial(jax.device_put, device=jax.local_devices()[0])
    length = -(-(n + max_new_tokens) // CACHE_BUCKET) * CACHE_BUCKET
    cache = put(init_cache(cfg, 1, length))
    key = put(jax.random.key(seed))
    n_valid = cfg.vocab_size if n_valid is None else n_valid
    ids = put(jnp.asarray([prompt], jnp.int32))
    step = lambda cache, tokens, start: _step_and_sample(params, cache, tokens, start, key, temperature, top_p, cfg,
                                                         n_valid)
    pos = 0
    while pos < n:
        size = prefill_chunk if n - pos >= prefill_chunk > 1 else 1
        nxt, logits, cache = step(cache, ids[:, pos:pos + size], pos)
        pos += size
    for i in range(max_new_tokens):
        tok = int(nxt[0])
        yield tok, logits[0]
        if tok == eos_id or i + 1 == max_new_tokens:
            return
        nxt, logits, cache = step(cache, nxt[:, None], n + i)
