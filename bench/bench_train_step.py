"""Tokens/s and MFU of the jitted training step of the tiny preset, a boolean knob off and on (not a test).

MFU = 3 x `accounting.fwd_flops_per_token` x tokens per step / step time / peak, where peak is the fp32
matmul FLOP/s of device 0 measured in this same run (`perf.measure_matmul_peak`), so numbers from different
(or busy) machines stay comparable. The peak is measured before the steps and again after every round of
them, and MFU divides by the highest reading: on a shared machine one reading swings by 1.5x within a
minute (118-175 GFLOP/s on 2 CPU cores, docs/LOG.md 2026-12-02), and a peak caught in a slow moment would
inflate MFU. The tiny model computes in bf16; on CPU that is usually *slower* than
fp32, so MFU against the fp32 peak is the honest figure there. Step times are the median of `--steps` timed
steps after `--warmup` untimed ones (compile excluded), each blocked on, with the mean beside it: a training
run's tokens/s is the mean, and one slow step in twenty (the host allocator mapping fresh memory) moves it and
not the median. Batches are prepared beforehand, so data loading is not timed. The knob's two settings
(`--compare`: `remat` by default, or `scan_layers`, the other one staying at the preset's value) alternate step
by step, so a busy shared machine slows both alike rather than skewing their ratio. Runs on whatever jax's
default backend is (one device, local MoE path).
Like the `moejax` command, it first re-executes itself with glibc's malloc on transparent huge pages
(`moejax.hostmem`; MOEJAX_HUGE_PAGES=0 measures without), and prints the GLIBC_TUNABLES it ran with; the
steps compile with the training loop's XLA options (`xla_flags.step_compiler_options`: on CPU, YNNPACK
fusions off unless XLA_FLAGS sets them), also printed.

`--cpu-shape` swaps in issue 11's CPU shape (d256, 4 layers, 4 heads x 64, 32 experts top-4, expert and
latent width 128, vocab 8,192, seq 256, batch 16, fp32; the rest as the tiny preset, e.g. 2 shared experts).
`--optimizer adam` times the step with plain optax Adam instead of the preset's hero optimizer (SPEC §4): the
like-for-like figure next to a PyTorch stack trained with AdamW. Hero's Newton-Schulz iterations on every
matrix are optimizer work, not model FLOPs, so they lower MFU without counting in it (docs/LOG.md).

Usage: python bench/bench_train_step.py [--steps 10] [--warmup 2] [--batch-size 16] [--seq-len 128] [--cpu-shape]
                                      [--compare remat|scan_layers] [--optimizer hero|adam]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np

from moejax import accounting, hostmem
from moejax.presets import TINY
from moejax.data.pipeline import make_data
from moejax.perf import measure_matmul_peak
from moejax.train.optimizer import make_optimizer
from moejax.train.state import init_state
from moejax.train.step import make_train_step
from moejax.xla_flags import step_compiler_options


# Issue 11's CPU benchmark shape (model fields; batch 16 x seq 256 set in main).
CPU_SHAPE_MODEL = dict(d_model=256, n_layers=4, n_heads=4, head_dim=64, n_kv_heads=2, n_kv_heads_global=1,
                       n_experts=32, top_k=4, expert_width=128, latent_width=128, vocab_size=8192,
                       compute_dtype="float32")


def bench_config(cpu_shape: bool, optimizer: str, batch_size: int = TINY.train.batch_size,
                 seq_len: int = TINY.train.seq_len):
    """The tiny preset with this optimizer and batch shape, or with issue 11's CPU shape (batch 16 x seq 256)."""
    cfg = dataclasses.replace(TINY, train=dataclasses.replace(TINY.train, batch_size=batch_size, seq_len=seq_len,
                                                              optimizer=optimizer))
    if cpu_shape:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **CPU_SHAPE_MODEL),
                                  train=dataclasses.replace(cfg.train, batch_size=16, seq_len=256))
    return cfg


def compiled_step(cfg, batch: dict):
    """(jitted step, fresh state, compile + first step seconds) of the train step as `cfg.train` sets it."""
    optimizer, lr_fn = make_optimizer(cfg)
    state = init_state(cfg, optimizer, jax.random.key(cfg.train.seed))
    # fp32 compute: the compute copy is the master's own buffer (astype to the same dtype), and donating
    # one buffer twice is an error, so the fp32 state is not donated.
    donate = () if cfg.model.compute_dtype == "float32" else 0
    step_fn = jax.jit(make_train_step(cfg.model, optimizer, lr_fn, remat=cfg.train.remat,
                                      scan_layers=cfg.train.scan_layers),
                      donate_argnums=donate, compiler_options=step_compiler_options(jax.default_backend()))
    t0 = time.perf_counter()
    state, _ = jax.block_until_ready(step_fn(state, batch))
    return step_fn, state, time.perf_counter() - t0


def time_interleaved(cfg, knob: str, batches: list[dict], warmup: int) -> tuple[dict, list[float]]:
    """Per setting of the train config's boolean `knob`: (timed step seconds, compile seconds, last loss); and
    the matmul peak (FLOP/s) read after each round of steps. The two settings alternate step by step, so load
    from other processes on a shared machine hits both alike instead of biasing the ratio."""
    with_knob = lambda v: dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **{knob: v}))
    runs = {v: compiled_step(with_knob(v), batches[0]) for v in (False, True)}
    states = {v: r[1] for v, r in runs.items()}
    times, losses, peaks = {False: [], True: []}, {}, []
    for i, batch in enumerate(batches[1:], start=1):
        for v in (False, True) if i % 2 else (True, False):
            t0 = time.perf_counter()
            states[v], metrics = jax.block_until_ready(runs[v][0](states[v], batch))
            times[v].append(time.perf_counter() - t0)
            losses[v] = float(metrics["train/loss"])
        peaks.append(measure_matmul_peak(repeats=3))
    return {v: (times[v][warmup - 1:], runs[v][2], losses[v]) for v in (False, True)}, peaks


def main() -> None:
    hostmem.exec_with_host_memory()  # host buffers as the `moejax` command has them (moejax.hostmem); may re-execute
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per setting")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    ap.add_argument("--batch-size", type=int, default=TINY.train.batch_size)
    ap.add_argument("--seq-len", type=int, default=TINY.train.seq_len)
    ap.add_argument("--cpu-shape", action="store_true", help="issue 11's CPU shape instead of the tiny preset")
    ap.add_argument("--compare", choices=("remat", "scan_layers"), default="remat",
                    help="the train-config knob timed off and on")
    ap.add_argument("--optimizer", choices=("hero", "adam"), default=TINY.train.optimizer,
                    help="train.optimizer for both settings (hero: the preset's, SPEC §4; adam: plain optax Adam)")
    args = ap.parse_args()
    if args.warmup < 1 or args.steps < 1:
        ap.error(f"--warmup ({args.warmup}) and --steps ({args.steps}) must be >= 1: the first step compiles")

    cfg = bench_config(args.cpu_shape, args.optimizer, args.batch_size, args.seq_len)
    m, t = cfg.model, cfg.train
    with make_data(cfg) as data:
        batches = [jax.device_put(data.train.batch(i)) for i in range(args.warmup + args.steps)]

    first_peak = measure_matmul_peak()
    fwd = accounting.fwd_flops_per_token(m, t.seq_len)
    flops_per_step = accounting.train_flops(m, t.seq_len, t.tokens_per_step)

    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}, {jax.device_count()} device(s))")
    print(f"{'issue-11 CPU shape' if args.cpu_shape else 'tiny preset'}: {m.n_layers} layers, d_model {m.d_model}, "
          f"{m.n_experts} experts top-{m.top_k}, "
          f"batch {t.batch_size} x seq {t.seq_len} = {t.tokens_per_step:,} tokens/step, {m.compute_dtype}, "
          f"optimizer {t.optimizer}")
    print(f"forward FLOPs/token {fwd:.4g}; training FLOPs/step (3 x fwd x tokens) {flops_per_step:.4g}")
    print(f"host memory: GLIBC_TUNABLES={hostmem.tunables()!r}, allocator {hostmem.allocator()} (moejax.hostmem)")
    print(f"step compiler options: {step_compiler_options(jax.default_backend())} (moejax.xla_flags)")
    print(f"timed: median of {args.steps} steps after {args.warmup} warm-up steps; "
          f"remat {t.remat}, scan_layers {t.scan_layers} unless compared")

    results, peaks = time_interleaved(cfg, args.compare, batches, args.warmup)
    peak = max(first_peak, *peaks)
    print(f"fp32 matmul peak (1024^3): {peak / 1e9:.1f} GFLOP/s, the highest of {len(peaks) + 1} readings "
          f"(before the steps and after each round; lowest {min(first_peak, *peaks) / 1e9:.1f})\n")
    print(f"| {args.compare} | compile + 1st step (s) | step time (ms, median) | min / max (ms) | tokens/s | MFU | "
          f"mean step (ms) | MFU at the mean | last loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    medians = {}
    for v, (times, first, loss) in results.items():
        med = medians[v] = float(np.median(times))
        mean = float(np.mean(times))  # what a run's tokens/s sees: a slow step counts in full
        print(f"| {'on' if v else 'off'} | {first:.1f} | {1e3 * med:.1f} | {1e3 * min(times):.1f} / "
              f"{1e3 * max(times):.1f} | {t.tokens_per_step / med:,.0f} | {100 * flops_per_step / med / peak:.2f}% | "
              f"{1e3 * mean:.1f} | {100 * flops_per_step / mean / peak:.2f}% | {loss:.3f} |")
    print(f"\nstep time {args.compare} on / off: {medians[True] / medians[False]:.3f}")


if __name__ == "__main__":
    main()
