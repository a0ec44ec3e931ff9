"""Data pipeline throughput: tokenisation MB/s, loader sequences/s, and the stall a step sees with and
without the prefetch thread, against what the tiny preset's step consumes (~6 steps/s x 16 x 128).

    .venv/bin/python bench/bench_data.py [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import replace

from moejax.config import DataConfig
from moejax.presets import TINY
from moejax.data.pipeline import make_data
from moejax.data.prepare import prepare

TINY_STEPS_PER_S = 6.0  # the tiny preset's training step on this class of CPU (docs/LOG.md demo runs)


def bench_tokenise(tmp: str) -> None:
    t0 = time.perf_counter()
    m = prepare({"kjv": ["builtin:kjv"]}, "bpe:2048", f"{tmp}/a", progress=False)
    t_train = time.perf_counter() - t0
    mb = m["sources"]["kjv"]["text_bytes"] / 1e6
    t0 = time.perf_counter()
    prepare({"kjv": ["builtin:kjv"]}, f"{tmp}/a/tokenizer.json", f"{tmp}/b", progress=False)
    t_enc = time.perf_counter() - t0
    print(f"tokenise KJV ({mb:.1f} MB, {m['sources']['kjv']['tokens']:,} tokens, {os.cpu_count()} CPUs):")
    print(f"  bpe:2048 train + encode + write  {t_train:6.2f} s  {mb / t_train:6.2f} MB/s")
    print(f"  tokenizer.json encode + write    {t_enc:6.2f} s  {mb / t_enc:6.2f} MB/s")


def bench_loader(cfg, label: str, steps: int, step_s: float) -> None:
    need = cfg.train.batch_size * TINY_STEPS_PER_S
    for prefetch in (0, 2):
        c = replace(cfg, data=replace(cfg.data, prefetch=prefetch))
        with make_data(c) as data:
            data.train.batch(0)
            t0 = time.perf_counter()
            for s in range(1, steps + 1):
                data.train.batch(s)
            free = time.perf_counter() - t0
        with make_data(c) as data:  # a consumer that computes for step_s per step, like the train step
            data.train.batch(0)
            stall = 0.0
            for s in range(1, steps + 1):
                t = time.perf_counter()
                data.train.batch(s)
                stall += time.perf_counter() - t
                time.sleep(step_s)
        seqs = steps * cfg.train.batch_size / free
        print(f"  {label} prefetch={prefetch}: {seqs:9,.0f} seq/s back-to-back ({seqs / need:6.0f}x the tiny step's "
              f"{need:.0f} seq/s); stall per {1e3 * step_s:.0f} ms step {1e3 * stall / steps:7.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench_tokenise(tmp)
    print("loader (embedded KJV, one process):")
    bench_loader(TINY, "tiny 16x128  ", args.steps, 1 / TINY_STEPS_PER_S)
    big = replace(TINY, train=replace(TINY.train, seq_len=4096, batch_size=64), data=DataConfig())
    bench_loader(big, "     64x4096 ", args.steps // 3, 1 / TINY_STEPS_PER_S)


if __name__ == "__main__":
    main()
