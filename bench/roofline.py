"""Roofline estimate of the train step (`moejax.roofline`): what the compiled program could reach at best.

GPU (no GPU needed): compiles issue 11's shape G or the real d1024 rung at 8 x 4096 tokens for one H200 with
XLA's GPU compiler on a deviceless topology (`moejax.cuda_aot`, in its subprocess environment), then prints
the estimate: every kernel at max(FLOPs / 989 TFLOP/s, bytes / 4.8 TB/s) + 3 us launch, by part of the step
(forward, remat re-forward, backward, the rest: optimizer and metrics) and by kernel, and the MFU it caps.
CPU: compiles issue 11's CPU-shape step as `bench_train_step.py` builds it, measures this machine's fp32
matmul peak and in-place memory bandwidth, prints the estimate, then times the real step beside it, so the
estimate is checked against a measurement where one can be made.

Usage: python bench/roofline.py --gpu G [--no-remat] [--unrolled] [--optimizer hero|adam] [--path local|capacity]
                                [--by-source] [--top 15]
       python bench/roofline.py --gpu d1024
       python bench/roofline.py --cpu-shape [--optimizer adam] [--steps 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

from moejax import roofline


def gpu(shape: str, remat: bool, optimizer: str, top: int, scan_layers: bool = True, by_source: bool = False,
        path: str = "local") -> None:
    from bench_gpu import moe_backend_of, rung_d1024, shape_g

    from moejax.ladder.lower import lower_train_step

    cfg = {"G": shape_g, "d1024": rung_d1024}[shape]()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, optimizer=optimizer, remat=remat,
                                                             scan_layers=scan_layers),
                              parallel=dataclasses.replace(cfg.parallel, moe_backend=moe_backend_of(path)))
    r = lower_train_step(cfg, compile=True, top=top, by_source=by_source)
    c = r["compiled"]
    print(f"{shape} on one NVIDIA H200, {path} path: batch {r['batch'][0]} x {r['batch'][1]}, remat "
          f"{remat}, layers {'scanned' if scan_layers else 'unrolled'}, optimizer {optimizer}; compiled in {r['compile_s']:.0f} s, XLA's peak "
          f"{c['peak_bytes'] / 1e9:.2f} GB")
    print(roofline.format_estimate(c["roofline"], r["model_flops_per_device"], top=top))


def cpu(optimizer: str, steps: int, top: int, by_source: bool = False) -> None:
    import jax

    from bench_train_step import bench_config, compiled_step
    from moejax import accounting, hostmem
    from moejax.data.pipeline import make_data
    from moejax.perf import measure_bandwidth, measure_matmul_peak

    hostmem.exec_with_host_memory()
    cfg = bench_config(True, optimizer)
    with make_data(cfg) as data:
        batches = [jax.device_put(data.train.batch(i)) for i in range(steps + 2)]
    step_fn, state, _ = compiled_step(cfg, batches[0])
    text = step_fn.lower(state, batches[0]).compile().as_text()
    peak = max(measure_matmul_peak() for _ in range(3))
    bandwidth = max(measure_bandwidth() for _ in range(3))
    model = accounting.train_flops(cfg.model, cfg.train.seq_len, cfg.train.tokens_per_step)
    est = roofline.estimate(text, peak, bandwidth, by_source=by_source)
    times = []
    for b in batches[1:]:
        t0 = time.perf_counter()
        state, _ = jax.block_until_ready(step_fn(state, b))
        times.append(time.perf_counter() - t0)
    measured = float(np.median(times[1:]))
    print(f"issue 11's CPU shape, optimizer {optimizer}, remat off; peak {peak / 1e9:.1f} GFLOP/s (best of 3), "
          f"in-place bandwidth {bandwidth / 1e9:.1f} GB/s (best of 3)")
    print(roofline.format_estimate(est, model, top=top))
    print(f"measured: median {1e3 * measured:.1f} ms, min {1e3 * min(times[1:]):.1f} ms over {len(times) - 1} steps "
          f"= {measured / est['seconds']:.2f}x the roofline; MFU {100 * model / measured / peak:.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpu", choices=("G", "d1024"), help="compile this shape for one H200 (deviceless)")
    where.add_argument("--cpu-shape", action="store_true", help="issue 11's CPU shape on this machine, timed too")
    ap.add_argument("--no-remat", dest="remat", action="store_false", help="GPU: without block remat")
    ap.add_argument("--unrolled", dest="scan_layers", action="store_false",
                    help="GPU: the layers unrolled (train.scan_layers=false) instead of scanned")
    ap.add_argument("--optimizer", choices=("hero", "adam"), default="hero")
    ap.add_argument("--path", choices=("local", "capacity"), default="local",
                    help="GPU: the dropless local path, or the pooled-wave capacity path (the hero's transport, "
                         "parallel.moe_backend=ep on the 1-device mesh, as bench_gpu.py's capacity path)")
    ap.add_argument("--steps", type=int, default=6, help="CPU: timed steps (after one warm-up)")
    ap.add_argument("--top", type=int, default=15, help="largest items listed")
    ap.add_argument("--by-source", action="store_true",
                    help="label items by the Python source line that emitted them, not by jax op")
    args = ap.parse_args()
    if args.cpu_shape:
        return cpu(args.optimizer, args.steps, args.top, args.by_source)
    if not os.environ.get("MOEJAX_ROOFLINE_CHILD"):  # re-run with the CUDA compile kit on the path
        from moejax.cuda_aot import subprocess_env

        env = {**subprocess_env(), "MOEJAX_ROOFLINE_CHILD": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    gpu(args.gpu, args.remat, args.optimizer, args.top, args.scan_layers, args.by_source, args.path)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
