"""Attention core fwd+bwd: the flash kernel vs the XLA paths, and the kernel's block sizes (not a test).

One layer's attention core (after projections, before XSA), forward plus the backward to q, k and v, at
issue 11's shape G: batch 8 x 4096, 8 query heads of 128, GQA on 2 KV heads (local, window 2048) or 1
(global), bf16, packed documents (mean 1024 tokens). Rows:
- flash kernel (`flash_gpu.flash_attention`) at each `--blocks` (q x k forward, q_bwd x k_bwd backward);
- XLA query blocks (`attention.attend_xla`, attn_q_block 512, as shape G's model sets it);
- cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`, causal + window, *no* document mask:
  an upper bound on what a vendor kernel gives, not a path moejax can use as is), where it runs.
FLOPs are the useful ones: 4 * B * H * Hd * (pairs a causal / windowed mask keeps) forward, x 2.5 for
fwd+bwd (the backward's 5 matmuls against the forward's 2), document masking not credited: the flash
kernel skips blocks of other documents (`flash_gpu.document_bounds`; at mean 1024 it takes 0.39 / 0.50 of
the global / local layers' blocks), so its figure is a causal-equivalent rate (the row "no document
skipping" times the same kernel without it), and cuDNN, without documents, does all of the causal work.
`--mean-doc 100000` gives one document a row. Times are the median of --reps after one warm-up call, paths
taking turns rep by rep. A path that fails prints its error.

Usage (GPU): PYTHONPATH=src python bench/bench_flash.py [--blocks 128x64,128x64 128x64,64x64:2:2:4 ...]
CPU check of the script (tiny shapes, the kernel interpreted): PYTHONPATH=src python bench/bench_flash.py --smoke
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bench_gpu import packed_segments  # bench/ is sys.path[0] when run as a script
from bench_grouped import time_interleaved
from moejax.model.attention import attend_xla
from moejax.model.flash_gpu import FlashBlocks, flash_attention


def parse_blocks(text: str) -> FlashBlocks:
    """'128x64,64x64' -> FlashBlocks(q=128, k=64, q_bwd=64, k_bwd=64); a suffix ':S[:SB[:WB]]' sets the
    forward's pipeline stages, and the backward's stages and warps."""
    text, *launch = text.split(":")
    fwd, bwd = text.split(",")
    (q, k), (qb, kb) = (tuple(int(v) for v in part.split("x")) for part in (fwd, bwd))
    names = ("num_stages", "num_stages_bwd", "num_warps_bwd")
    return FlashBlocks(q=q, k=k, q_bwd=qb, k_bwd=kb, **{n: int(v) for n, v in zip(names, launch)})


def useful_flops(batch: int, seq: int, heads: int, head_dim: int, window: int | None) -> float:
    """fwd+bwd FLOPs of the (q, k) pairs a causal (and windowed) mask keeps."""
    w = seq if window is None else min(window, seq)
    pairs = w * (w + 1) / 2 + (seq - w) * w  # per row and head
    return 2.5 * 4 * batch * heads * head_dim * pairs


def fwd_bwd(core):
    """jit of the value and the q/k/v gradients of sum(core(q, k, v) * ct)."""
    def loss(q, k, v, ct):
        return jnp.sum(core(q, k, v).astype(jnp.float32) * ct)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def cases(a, window: int | None, kv_heads: int, interpret: bool):
    keys = jax.random.split(jax.random.key(kv_heads), 4)
    dt = jnp.dtype(a.dtype)
    q = jax.random.normal(keys[0], (a.batch, a.seq, a.heads, a.head_dim), dt)
    k = jax.random.normal(keys[1], (a.batch, a.seq, kv_heads, a.head_dim), dt)
    v = jax.random.normal(keys[2], (a.batch, a.seq, kv_heads, a.head_dim), dt)
    ct = jax.random.normal(keys[3], q.shape, jnp.float32)
    seg = jnp.asarray(packed_segments(a.batch, a.seq, min(a.mean_doc, a.seq), np.random.default_rng(0)))
    scale = 1.3 / np.sqrt(a.head_dim)
    head_map = np.arange(a.heads) // (a.heads // kv_heads)
    args = (q, k, v, ct)
    out = []
    variants = [(text, parse_blocks(text)) for text in a.blocks]
    variants.insert(1, (f"{a.blocks[0]}, no document skipping",
                        dataclasses.replace(variants[0][1], skip_documents=False)))
    for text, blocks in variants:
        core = lambda q, k, v, blocks=blocks: flash_attention(q, k, v, seg, scale, window, blocks, interpret)
        out.append((f"flash {text}", fwd_bwd(core), args))
    if a.xla:
        xla = lambda q, k, v: attend_xla(q, k[:, :, head_map], v[:, :, head_map], seg, window, scale, a.q_block)
        out.append((f"XLA query blocks of {a.q_block}", fwd_bwd(xla), args))
    if jax.default_backend() == "gpu":
        cudnn = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="cudnn",
            local_window_size=None if window is None else (window - 1, 0))
        out.append(("cuDNN causal+window, no documents", fwd_bwd(cudnn), args))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--mean-doc", type=int, default=1024)
    ap.add_argument("--q-block", type=int, default=512, help="the XLA path's attn_q_block")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--blocks", nargs="+",
                    # the default (3:1:8); the default before 2026-12-04; the fastest there (spills 16 B in
                    # dK/dV); around them
                    default=["128x64,128x64", "128x64,128x64:2:1:8", "128x64,128x64:3:2:8", "128x64,128x64:4:1:8",
                             "128x64,128x64:3:2:4", "128x128,128x64:3:1:8", "64x64,128x64:3:1:8"],
                    help="flash block sizes to time: QxK (forward),QxK (backward)[:forward stages[:backward "
                         "stages[:backward warps]]]; the first is the default (FlashBlocks())")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--xla", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the XLA path (5x slower than the kernel on an H200: --no-xla saves device time)")
    ap.add_argument("--smoke", action="store_true", help="CPU-sized shapes, the kernel interpreted")
    a = ap.parse_args()
    if a.smoke:
        a.batch, a.seq, a.heads, a.head_dim, a.window, a.mean_doc, a.q_block = 1, 128, 2, 16, 48, 40, 32
        a.blocks, a.reps, a.dtype = ["32x16,16x32"], 2, "float32"
    interpret = jax.default_backend() != "gpu"
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
          f"B={a.batch} S={a.seq} H={a.heads} Hd={a.head_dim} {a.dtype}, median of {a.reps}"
          + (" (kernel interpreted: a check of the script, not a measurement)" if interpret else ""))
    print("\n| layer | path | ms | TFLOP/s (useful) |\n|---|---|---|---|")
    for kind, window, kv_heads in (("local", a.window, max(1, a.heads // 4)), ("global", None, max(1, a.heads // 8))):
        flops = useful_flops(a.batch, a.seq, a.heads, a.head_dim, window)
        for label, t in time_interleaved(cases(a, window, kv_heads, interpret), a.reps).items():
            if isinstance(t, str):
                print(f"| {kind} | {label} | {t} | |")
            else:
                print(f"| {kind} | {label} | {1e3 * t:.2f} | {flops / t / 1e12:.1f} |", flush=True)


if __name__ == "__main__":
    main()
