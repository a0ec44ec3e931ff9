"""CPU time of one attention layer, forward + backward, old vs new implementation in the same run (not a
test; numbers go to docs/LOG.md).

"Old" is src/moejax/model/attention.py at git revision `--old-rev` (loaded from `git show` into a
throwaway module), "new" is the working tree's. Both run `attention(params, x, segment_ids, positions,
is_global, cfg)` under jit with grad wrt x and every attention weight, on a packed batch (documents of
random length), fp32, one CPU device, for local and global layers at each sequence length, with
`model.attn_q_block = --q-block`. Reported: median wall time of `--reps` calls
after one warm-up call, old and new alternating.

Usage: python bench/bench_attention.py [--old-rev 41a7389] [--seqs 1024 2048] [--window 256] [--q-block 256]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moejax.presets import HERO_MODEL  # noqa: E402
from moejax.model import attention as new_attention  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load_old(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:src/moejax/model/attention.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "attention_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("attention_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["attention_old"] = mod
    spec.loader.exec_module(mod)
    return mod


def packed_batch(batch: int, seq: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    seg = np.zeros((batch, seq), np.int32)
    pos = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        start, doc = 0, 1
        while start < seq:
            n = min(int(rng.integers(seq // 8, seq // 2)), seq - start)
            seg[b, start:start + n], pos[b, start:start + n] = doc, np.arange(n)
            start, doc = start + n, doc + 1
    return jnp.asarray(seg), jnp.asarray(pos)


def layer_step(mod, cfg, seq: int, is_global: bool, batch: int):
    """A compiled fwd+bwd call of `mod.attention` (grads wrt x and every weight) and its arguments."""
    try:
        p = mod.Attention.init(cfg, jax.random.key(0))
    except (TypeError, AttributeError):  # revisions before init(cfg, key)
        p = mod.Attention.init(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (batch, seq, cfg.d_model))
    seg, pos = packed_batch(batch, seq)
    loss = lambda p, x: jnp.sum(jnp.sin(mod.attention(p, x, seg, pos, is_global, cfg)))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    jax.block_until_ready(step(p, x))
    return lambda: jax.block_until_ready(step(p, x))


def time_pair(calls, reps: int) -> list[float]:
    """Median seconds of each call, alternating them so machine noise hits both alike."""
    times = [[] for _ in calls]
    for _ in range(reps):
        for t, call in zip(times, calls):
            start = time.perf_counter()
            call()
            t.append(time.perf_counter() - start)
    return [float(np.median(t)) for t in times]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-rev", default="41a7389")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--q-block", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    cfg = dataclasses.replace(HERO_MODEL, d_model=256, n_heads=4, head_dim=64, n_kv_heads=2, n_kv_heads_global=1,
                              window=args.window, rope_dim=32, compute_dtype="float32", attn_q_block=args.q_block)
    old = load_old(args.old_rev)
    print(f"jax {jax.__version__} on {jax.default_backend()}; d {cfg.d_model}, {cfg.n_heads} heads x {cfg.head_dim}, "
          f"KV {cfg.n_kv_heads}/{cfg.n_kv_heads_global}, window {cfg.window}, attn_q_block {cfg.attn_q_block}, "
          f"batch {args.batch}, fp32, fwd+bwd, median of {args.reps}")
    print(f"{'seq':>6} {'layer':>7} {'old ms':>9} {'new ms':>9} {'speed-up':>9}")
    for seq in args.seqs:
        for is_global in (False, True):
            calls = [layer_step(m, cfg, seq, is_global, args.batch) for m in (old, new_attention)]
            t_old, t_new = time_pair(calls, args.reps)
            kind = "global" if is_global else "local"
            print(f"{seq:>6} {kind:>7} {1e3 * t_old:>9.1f} {1e3 * t_new:>9.1f} {t_old / t_new:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
