"""The hero MoE transformer: embedding, scanned pre-norm blocks, LM head, and the loss (SPEC §2).

Dimensions: B batch, S sequence, D width, V vocab, L layers.
Notable choices:
- Blocks are stacked along a leading L axis and run with `jax.lax.scan` (compile time independent of
  depth); the per-layer `is_global` flag is scanned alongside, so local and global layers share one body.
- Norm sites: after the embedding, before attention, before the MoE, before the LM head — each RMSNorm +
  GatedNorm. Untied embedding and LM head.
- Compute in `cfg.compute_dtype` (bf16 on the hero); router logits, norm internals and the loss in fp32.
- Loss: next-token cross-entropy with fp32 logits + z-loss 1e-4 * logsumexp^2, averaged over the
  positions whose target lies in the same document. With `loss_vocab_block > 0` the LM head is streamed
  over vocab blocks with an online logsumexp, so [T, V] fp32 logits never exist at once.
- On CPU the train step's LM head runs as matmuls over 1,024-column vocab slices once the vocab has 4,096
  or more (`head_chunk`): the same products, faster there; everywhere else one dot.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moejax.config import ModelConfig
from moejax.model import kernel_choice
from moejax.model.attention import Attention, KernelFn, attention, flash_kernel
from moejax.model.layers import SAVE_HALO, Norm, pytree_dataclass, trunc_normal
from moejax.model.moe.layer import SAVE_DISPATCH, SAVE_RETURN, MoE, RoutedFn, moe_block, routed_local_with_stats


@pytree_dataclass
class Block:
    attn_norm: Norm
    attn: Attention
    moe_norm: Norm
    moe: MoE

    @staticmethod
    def init(cfg: ModelConfig, key) -> "Block":
        k1, k2, k3, k4 = jax.random.split(key, 4)
        rank, std = cfg.gated_norm_rank, cfg.init_std
        return Block(attn_norm=Norm.init(cfg.d_model, rank, std, k1), attn=Attention.init(cfg, k2),
                     moe_norm=Norm.init(cfg.d_model, rank, std, k3), moe=MoE.init(cfg, k4))


@pytree_dataclass
class Transformer:
    embed: Float[Array, "V D"]
    embed_norm: Norm
    blocks: Block  # every leaf has a leading L axis
    final_norm: Norm
    lm_head: Float[Array, "D V"]

    @staticmethod
    def init(cfg: ModelConfig, key) -> "Transformer":
        ke, kn, kb, kf, kh = jax.random.split(key, 5)
        rank, std = cfg.gated_norm_rank, cfg.init_std
        blocks = jax.vmap(lambda k: Block.init(cfg, k))(jax.random.split(kb, cfg.n_layers))
        return Transformer(embed=trunc_normal(ke, (cfg.vocab_size, cfg.d_model), std),
                           embed_norm=Norm.init(cfg.d_model, rank, std, kn), blocks=blocks,
                           final_norm=Norm.init(cfg.d_model, rank, std, kf),
                           lm_head=trunc_normal(kh, (cfg.d_model, cfg.vocab_size), std))


def param_count(cfg: ModelConfig, init: Callable | None = None) -> int:
    """Exact size of the parameter pytree, from the abstract initialisation (never allocated). `init`: the
    initialiser the run itself traces (key -> parameters), so that the count and the run share one trace."""
    init = init or functools.partial(Transformer.init, cfg)
    shapes = jax.eval_shape(init, jax.random.key(0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def embed(params: Transformer, tokens: Int[Array, "B S"], cfg: ModelConfig) -> Float[Array, "B S D"]:
    """Embedding lookup in the compute dtype, then the embedding norm."""
    return params.embed_norm(params.embed[tokens].astype(jnp.dtype(cfg.compute_dtype)), cfg.norm_eps)


def lm_logits(h: Float[Array, "... D"], lm_head: Float[Array, "D V"]) -> Float[Array, "... V"]:
    """fp32 logits of the (final-normed) hidden states."""
    return jnp.einsum("...d,dv->...v", h, lm_head.astype(h.dtype), preferred_element_type=jnp.float32)


# Vocab columns per matmul of `chunked_lse`, the LM head of the training step on CPU (`head_chunk`).
# Measured on 2 CPU cores, issue 11's CPU shape ([4096, 256] @ [256, 8192], fp32), LM head + loss fwd+bwd
# in one process: one dot 859 ms, chunks of 512 / 1,024 / 2,048 600 / 654 / 694 ms; the whole train step
# 1.07-1.10x faster with 512-1,024 in three of four one-process A/Bs (docs/LOG.md 2026-12-02, tenth
# session; measured when the chunks were still joined into [T, V], before `chunked_lse`). XLA:CPU's Eigen
# dots run a [T, 256] x [256, V] product at ~60% of their peak in one piece and near it in column slices.
# The tiny demo (V = 2,048, bf16) gained nothing from two chunks (0.95-1.02x).
CPU_HEAD_CHUNK = 1024
MIN_HEAD_CHUNKS = 4


def head_chunk(vocab_size: int, on_cpu: bool) -> int:
    """`lm_loss`'s vocab_chunk for a train step: CPU_HEAD_CHUNK on CPU when the vocab spans at least
    MIN_HEAD_CHUNKS chunks, else 0. On a GPU one dot: its GEMM library takes it whole at its best."""
    return CPU_HEAD_CHUNK if on_cpu and vocab_size >= MIN_HEAD_CHUNKS * CPU_HEAD_CHUNK else 0


def chunked_lse(h_TD: Float[Array, "T D"], lm_head: Float[Array, "D V"], t_T: Int[Array, "T"],
                chunk: int) -> tuple[Float[Array, "T"], Float[Array, "T"]]:
    """(logsumexp, target logit) of the fp32 logits `lm_logits` would give, from one matmul per `chunk`
    vocab columns (the last may be shorter), forward and backward, never joining the chunks into one
    [T, V] array: at issue 11's CPU shape that join alone was a 128 MB copy taking ~60 ms of the step, and
    slicing its gradient apart again ~18 ms; without them the step ran 1.022-1.032x faster (docs/LOG.md,
    2026-12-03). Backward: per chunk, the softmax gradient and its two dots; dh is summed over the chunks
    (fp32), so only its summation order differs from one dot. The softmax gradient is computed in fp32 from
    the fp32 logits; lowering for a GPU, the two dots then take it in the activations' dtype with fp32
    accumulation, as every other layer's backward takes its cotangent: with bf16 activations they run at the
    bf16 GEMM rate instead of as TF32 dots over an fp32 [T, V] gradient (shape G's roofline 126.1 -> 121.2
    ms, docs/LOG.md 2026-12-04). Elsewhere they run in fp32. On a GPU `lm_loss`'s one-dot head is this with
    a single chunk. Targets must lie in [0, V)."""
    if chunk < 1:
        raise ValueError(f"chunked_lse needs a positive chunk of vocab columns, got {chunk}")
    return _chunked_lse(h_TD, lm_head.astype(h_TD.dtype), t_T, chunk)


def _vocab_slices(v: int, chunk: int) -> list[slice]:
    return [slice(i, min(i + chunk, v)) for i in range(0, v, chunk)]


def _chunk_target(logits_TC: Float[Array, "T C"], t_T: Int[Array, "T"], start: int) -> Float[Array, "T"]:
    """The logit of each row's target where it falls in this chunk of columns (from `start`), else 0."""
    idx_T = t_T - start
    inside_T = (idx_T >= 0) & (idx_T < logits_TC.shape[1])
    picked_T = jnp.take_along_axis(logits_TC, jnp.clip(idx_T, 0, logits_TC.shape[1] - 1)[:, None], axis=1)[:, 0]
    return jnp.where(inside_T, picked_T, 0.0)


def _backward_gemm_dtype(h_TD) -> jnp.dtype:
    """The operand dtype of the LM head's backward dots: the activations' when lowering for a GPU (bf16 GEMMs,
    fp32 accumulation), else fp32 (bf16 dots on XLA:CPU cost more: the tiny demo's step 2-3% slower)."""
    return h_TD.dtype if kernel_choice.lowering_for_gpu() else jnp.dtype(jnp.float32)


def _softmax_grad(logits_TC, col_C, t_T, lse_T, dlse_T, dtarget_T, dtype) -> Float[Array, "T C"]:
    """d(loss)/d(logits) for these columns, from the fp32 logits (softmax * dlse + the target's dtarget), in
    `dtype` for the dots that take it."""
    hit_TC = col_C[None, :] == t_T[:, None]
    g_TC = jnp.exp(logits_TC - lse_T[:, None]) * dlse_T[:, None] + jnp.where(hit_TC, dtarget_T[:, None], 0.0)
    return g_TC.astype(dtype)


_dot32 = functools.partial(jnp.dot, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked_lse(h_TD, w_DV, t_T, chunk: int):
    return _chunked_lse_fwd(h_TD, w_DV, t_T, chunk)[0]


def _chunked_lse_fwd(h_TD, w_DV, t_T, chunk):
    slices = _vocab_slices(w_DV.shape[1], chunk)
    logits = [jnp.dot(h_TD, w_DV[:, s], preferred_element_type=jnp.float32) for s in slices]
    max_T = functools.reduce(jnp.maximum, [jnp.max(l_TC, axis=-1) for l_TC in logits])
    lse_T = max_T + jnp.log(sum(jnp.sum(jnp.exp(l_TC - max_T[:, None]), axis=-1) for l_TC in logits))
    target_T = sum(_chunk_target(l_TC, t_T, s.start) for l_TC, s in zip(logits, slices))
    return (lse_T, target_T), (h_TD, w_DV, t_T, logits, lse_T)


def _chunked_lse_bwd(chunk, res, cotangents):
    h_TD, w_DV, t_T, logits, lse_T = res
    dlse_T, dtarget_T = cotangents
    dt = _backward_gemm_dtype(h_TD)
    h_DT = h_TD.T.astype(dt)
    dh_TD, dw_chunks = 0.0, []
    for l_TC, s in zip(logits, _vocab_slices(w_DV.shape[1], chunk)):
        g_TC = _softmax_grad(l_TC, jnp.arange(s.start, s.stop), t_T, lse_T, dlse_T, dtarget_T, dt)
        dh_TD = dh_TD + _dot32(g_TC, w_DV[:, s].T.astype(dt))
        dw_chunks.append(_dot32(h_DT, g_TC))
    return dh_TD.astype(h_TD.dtype), jnp.concatenate(dw_chunks, axis=-1).astype(w_DV.dtype), None


_chunked_lse.defvjp(_chunked_lse_fwd, _chunked_lse_bwd)


LayerHook = Callable[[dict], dict]
WeightsFn = Callable[["Block"], "Block"]  # one layer's weights as the layer uses them
# What a rematerialised block keeps (TrainConfig.remat_saves): the transport's all-to-all results, or less;
# always the context-parallel halo. Recomputed, the halo was exchanged again inside the global layers'
# branch, where the partitioner made it an all-gather of K and V to every device: the hero's 262K phase
# compiled to 363 GB a device, 241 GB with the halo kept (docs/LOG.md 2026-12-04).
REMAT_POLICIES = {"transport": jax.checkpoint_policies.save_only_these_names(SAVE_DISPATCH, SAVE_RETURN, SAVE_HALO),
                  "dispatch": jax.checkpoint_policies.save_only_these_names(SAVE_DISPATCH, SAVE_HALO),
                  "nothing": jax.checkpoint_policies.save_only_these_names(SAVE_HALO)}
TOKEN_STATS = ("margins", "token_mask")  # [T, E] / [T] per layer: never stacked over layers


def drop_token_stats(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k not in TOKEN_STATS}


def forward(params: Transformer, tokens: Int[Array, "B S"], segment_ids: Int[Array, "B S"],
            positions: Int[Array, "B S"], cfg: ModelConfig, routed: RoutedFn = routed_local_with_stats,
            layer_hook: LayerHook | None = None, remat: bool | str = True,
            context: int = 1, scan_layers: bool = True, attention_kernel: KernelFn = flash_kernel,
            layer_weights: WeightsFn | None = None) -> tuple[Float[Array, "B S D"], dict]:
    """Final hidden states (after the final norm) and per-layer stats stacked along L.

    `layer_hook` maps one layer's raw MoE stats to what is kept (e.g. margins -> QB bias); by default the
    [T, E] margins are dropped so nothing of that size is stacked over layers.
    `context` > 1 (context parallelism): each sequence is `context` consecutive rows of S positions; segment
    ids, positions (and the loss's targets) are the whole sequence's, so only attention and SConv, which
    read earlier positions, look across rows. The MoE sees tokens as ever.
    `scan_layers` False: a Python loop over the layers instead of `lax.scan` (same values; see `run_layers`).
    `remat`: False, or rematerialise every block keeping what `REMAT_POLICIES[remat]` names (True: "transport").
    `routed`, `attention_kernel` and `layer_weights` are where parallelism enters (bound to the mesh by
    `parallel.backends`): the routed experts, the attention core when the GPU kernel is chosen, and a layer's
    weights at use (FSDP's per-layer all-gather; inside the remat, so the backward gathers them again).
    """
    x = embed(params, tokens, cfg)
    hook = layer_hook or drop_token_stats

    def block(x, blk, is_global):
        blk = blk if layer_weights is None else layer_weights(blk)
        h = attention(blk.attn, blk.attn_norm(x, cfg.norm_eps), segment_ids, positions, is_global, cfg, context,
                      attention_kernel)
        x = x + h
        h, stats = moe_block(blk.moe, blk.moe_norm(x, cfg.norm_eps), segment_ids, cfg, routed, context)
        return x + h, hook(stats)

    if remat:  # recompute the block in the backward pass, except what the policy keeps (REMAT_POLICIES)
        # Unrolled, is_global stays a static Python bool: traced, it would put both attention kinds
        # under a lax.cond in every layer.
        policy = REMAT_POLICIES["transport" if remat is True else remat]
        block = jax.checkpoint(block, policy=policy, static_argnums=() if scan_layers else (2,))
    x, stats = run_layers(lambda x, layer: block(x, *layer), x, params.blocks, cfg.global_layers, scan_layers)
    return params.final_norm(x, cfg.norm_eps), stats


def run_layers(body, x, blocks, global_layers: tuple[bool, ...], scan: bool):
    """x through every layer's `body(x, (block, is_global)) -> (x, stats)`; stats stacked along L.

    scan: one compiled body whatever the depth (the hero's 48 layers), with a traced `is_global` and the
    per-layer residuals written into [L, ...] stacks. Unrolled: L copies of the body with a static
    `is_global` (no lax.cond) and no stacking of residuals, which XLA fuses across; on CPU it takes ~22% off
    issue 11's CPU-shape step (4 layers) and ~28% off the tiny demo's, at about the same compile time there.
    """
    if scan:
        return jax.lax.scan(body, x, (blocks, jnp.asarray(global_layers)))
    per_layer = []
    for i, is_global in enumerate(global_layers):
        x, stats = body(x, (jax.tree.map(lambda a: a[i], blocks), bool(is_global)))
        per_layer.append(stats)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *per_layer)


def lm_loss(h: Float[Array, "B S D"], lm_head: Float[Array, "D V"], targets: Int[Array, "B S"],
            loss_mask: Array, z_loss_weight: float, vocab_block: int = 0, vocab_chunk: int = 0) -> dict[str, jax.Array]:
    """Masked mean cross-entropy and z-loss over fp32 logits; `loss` = ce + z_loss_weight * mean(lse^2).
    `vocab_block` > 0: streamed (`_streamed_lse`: a scan that recomputes each block's logits in the
    backward, for memory); else `vocab_chunk` > 0: `chunked_lse`, which keeps its column chunks of logits
    for the backward, never joined (for speed on CPU, `head_chunk`); else one dot: on a GPU `chunked_lse`
    with one chunk (bf16 dots in its backward), elsewhere autodiff's (`lse_reference`)."""
    h_TD = h.reshape(-1, h.shape[-1])
    t_T = targets.reshape(-1)
    w_T = loss_mask.reshape(-1).astype(jnp.float32)
    if vocab_block and vocab_block < lm_head.shape[1]:
        lse, target_logit = _streamed_lse(h_TD, lm_head.astype(h.dtype), t_T, vocab_block)
    elif 0 < vocab_chunk < lm_head.shape[1]:
        lse, target_logit = chunked_lse(h_TD, lm_head, t_T, vocab_chunk)
    elif kernel_choice.lowering_for_gpu():  # one chunk, for its backward's bf16 dots
        lse, target_logit = chunked_lse(h_TD, lm_head, t_T, lm_head.shape[1])
    else:  # on CPU autodiff's one dot ran the tiny demo's step 1-3% faster than one chunk (2026-12-04)
        lse, target_logit = lse_reference(h_TD, lm_head, t_T)
    n = jnp.maximum(jnp.sum(w_T), 1.0)
    ce = jnp.sum((lse - target_logit) * w_T) / n
    z = jnp.sum(lse * lse * w_T) / n
    return {"loss": ce + z_loss_weight * z, "cross_entropy_loss": ce, "z_loss": z, "tokens": jnp.sum(w_T)}


def lse_reference(h_TD: Float[Array, "T D"], lm_head: Float[Array, "D V"],
                  t_T: Int[Array, "T"]) -> tuple[Float[Array, "T"], Float[Array, "T"]]:
    """(logsumexp, target logit) of `lm_logits`, differentiated by autodiff (its backward's dots take the
    fp32 logits' gradient, so they run in fp32): `chunked_lse`'s reference, and the one-dot head off GPUs."""
    logits = lm_logits(h_TD, lm_head)
    return jax.nn.logsumexp(logits, axis=-1), jnp.take_along_axis(logits, t_T[:, None], axis=-1)[:, 0]


def _vocab_blocks(w_DV: Float[Array, "D V"], block: int) -> Float[Array, "N D B"]:
    """The LM head's columns in blocks of `block`, the last padded with zero columns."""
    d, v = w_DV.shape
    n_blocks = -(-v // block)
    return jnp.pad(w_DV, ((0, 0), (0, n_blocks * block - v))).reshape(d, n_blocks, block).transpose(1, 0, 2)


def _block_logits(h_TD, w_DB, i, v: int) -> tuple[Float[Array, "T B"], Int[Array, "B"]]:
    """Block i's fp32 logits (-inf on the padding columns past v) and its column ids."""
    col_B = i * w_DB.shape[1] + jnp.arange(w_DB.shape[1])
    logits = jnp.einsum("td,db->tb", h_TD, w_DB, preferred_element_type=jnp.float32)
    return jnp.where(col_B[None, :] < v, logits, -jnp.inf), col_B


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _streamed_lse(h_TD, w_DV, t_T, block: int):
    """Online logsumexp over vocab blocks: O(T * block) fp32 live logits. Custom VJP: the backward recomputes
    each block's logits and, like `chunked_lse`'s, takes their fp32 softmax gradient into its two dots in
    the activations' dtype when lowering for a GPU (bf16 GEMMs, not TF32 dots over an fp32 gradient: the
    d1024 rung's roofline 307.4 -> 269.1 ms, docs/LOG.md 2026-12-04), in fp32 elsewhere. Autodiff of the
    rematted scan gave the same FLOPs with fp32 dots."""
    return _streamed_fwd(h_TD, w_DV, t_T, block)[0]


def _streamed_fwd(h_TD, w_DV, t_T, block):
    v = w_DV.shape[1]
    w_NDB = _vocab_blocks(w_DV, block)

    def step(carry, xs):
        m, s, tl = carry
        logits, col = _block_logits(h_TD, *xs, v)
        m_new = jnp.maximum(m, jnp.max(logits, -1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new[:, None]), -1)
        tl = tl + jnp.sum(jnp.where(col[None, :] == t_T[:, None], logits, 0.0), -1)
        return (m_new, s, tl), None

    t = h_TD.shape[0]
    init = (jnp.full((t,), -jnp.inf, jnp.float32), jnp.zeros((t,), jnp.float32), jnp.zeros((t,), jnp.float32))
    (m, s, tl), _ = jax.lax.scan(step, init, (w_NDB, jnp.arange(w_NDB.shape[0])))
    lse = m + jnp.log(s)
    return (lse, tl), (h_TD, w_DV, t_T, lse)


def _streamed_bwd(block, res, cotangents):
    h_TD, w_DV, t_T, lse_T = res
    dlse_T, dtarget_T = cotangents
    d, v = w_DV.shape
    dt = _backward_gemm_dtype(h_TD)
    h_DT = h_TD.T.astype(dt)

    def step(dh_TD, xs):
        logits, col = _block_logits(h_TD, *xs, v)
        g_TB = _softmax_grad(logits, col, t_T, lse_T, dlse_T, dtarget_T, dt)
        return dh_TD + _dot32(g_TB, xs[0].T.astype(dt)), _dot32(h_DT, g_TB)

    w_NDB = _vocab_blocks(w_DV, block)
    dh_TD, dw_NDB = jax.lax.scan(step, jnp.zeros(h_TD.shape, jnp.float32), (w_NDB, jnp.arange(w_NDB.shape[0])))
    dw_DV = dw_NDB.transpose(1, 0, 2).reshape(d, -1)[:, :v]
    return dh_TD.astype(h_TD.dtype), dw_DV.astype(w_DV.dtype), None


_streamed_lse.defvjp(_streamed_fwd, _streamed_bwd)


def model_loss(params: Transformer, batch: dict, cfg: ModelConfig, routed: RoutedFn = routed_local_with_stats,
               layer_hook: LayerHook | None = None, remat: bool | str = True, context: int = 1,
               scan_layers: bool = True, attention_kernel: KernelFn = flash_kernel,
               layer_weights: WeightsFn | None = None, vocab_chunk: int = 0) -> tuple[jax.Array, dict]:
    """Scalar training loss and everything worth logging (loss parts + per-layer MoE stats). `context`: rows
    per sequence (context parallelism); the batch's targets and loss mask already cross chunk boundaries.
    `vocab_chunk`: `lm_loss`'s (the train step sets it by `head_chunk`)."""
    h, layer_stats = forward(params, batch["tokens"], batch["segment_ids"], batch["positions"], cfg, routed,
                             layer_hook, remat, context, scan_layers, attention_kernel, layer_weights)
    parts = lm_loss(h, params.lm_head, batch["targets"], batch["loss_mask"], cfg.z_loss_weight,
                    cfg.loss_vocab_block, vocab_chunk)
    return parts["loss"], {**parts, "layers": layer_stats}
