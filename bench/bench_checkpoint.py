"""Checkpoint cost of `CheckpointManager`: blocking save, time to complete, restore, bytes, step slowdown (not a test).

Two models with the hero optimizer: the tiny preset, and a rung-shaped one that fits a laptop (TINY widened to
d_model 512, 8 layers, 4 heads of 128, 32 experts, expert = latent = shared width 256; the ladder's head and
KV-head rule; top-2 and TINY's vocab/window kept). Per model, in one process:

- slowdown rounds: `--steps` train steps with no save in flight, then `save()` and `--steps` more right after it
  returns (the async write runs under them), then `wait()`. Rounds repeat (`--rounds-tiny`, `--rounds-wide`) so
  the two kinds of step alternate and load from other jobs on a shared machine hits both alike. Reported: median
  step time of each kind, their ratio, and how many after-save steps *started* with the save still in flight
  (no completion marker yet): only those can be slowed down, so their median and ratio are shown too.
- then one save with nothing running: time for `save()` to return (the blocking part: the arrays' checksums, orbax's
  device->host copy and the metadata write; the checksums alone are timed again after it) and for `wait()` to return
  (array write + COMMITTED marker), both measured from the `save()` call, and the bytes of its step directory on
  disk;
- then `restore()` of that newest checkpoint into an abstract state (ShapeDtypeStructs), blocked on, and checked
  equal to the live state; the last round's checkpoint (whose arrays were donated to the next step right after
  `save()` returned) is restored too and checked against a host copy taken before that save.

Checkpoints go to a `tempfile.TemporaryDirectory`. Batches are prepared beforehand; steps are blocked on.
Runs on whatever jax's default backend is (one device, local MoE path).

Usage: python bench/bench_checkpoint.py [--steps 5] [--rounds-tiny 3] [--rounds-wide 1] [--wide-batch-size 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bench_train_step import compiled_step  # bench/ is sys.path[0] when run as a script
from moejax import state_checksum
from moejax.checkpoint import MARKER, CheckpointManager, list_checkpoints, restore
from moejax.config import apply_overrides
from moejax.presets import TINY
from moejax.data.pipeline import make_data

# TINY widened to a rung shape (ladder rule: head dim 128, H = d/128, KV heads H//4, global max(1, H//8),
# expert = latent = shared width = d/2), with fewer experts so the fp32 state fits a laptop.
WIDE_OVERRIDES = ["model.d_model=512", "model.n_layers=8", "model.n_heads=4", "model.head_dim=128",
                  "model.n_kv_heads=1", "model.n_kv_heads_global=1", "model.rope_dim=64",
                  "model.gated_norm_rank=128", "model.n_experts=32", "model.expert_width=256",
                  "model.latent_width=256", "model.shared_width=256"]


def tree_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def trees_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def timed_step(step_fn, state, batch):
    t0 = time.perf_counter()
    state, _ = jax.block_until_ready(step_fn(state, batch))
    return state, time.perf_counter() - t0


def bench_model(cfg, batches: list[dict], steps: int, rounds: int) -> dict:
    no_remat = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, remat=False))
    step_fn, state, compile_s = compiled_step(no_remat, batches[0])  # compile + first step
    state, _ = timed_step(step_fn, state, batches[1])  # one untimed warm step
    nb = len(batches)
    base, after, flight, save_calls = [], [], [], []  # flight[j]: after-save step j started before COMMITTED
    i = 2
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp, \
            CheckpointManager(tmp, permanent_every=10**9, model_config=dataclasses.asdict(cfg.model)) as mgr:
        for r in range(rounds):
            for _ in range(steps):
                state, dt = timed_step(step_fn, state, batches[i % nb]); i += 1
                base.append(dt)
            last_round = r == rounds - 1
            snapshot = jax.tree.map(lambda x: np.array(x, copy=True), state) if last_round else None
            step = int(state.step)
            t0 = time.perf_counter()
            path = mgr.save(step, state, kind="permanent")
            save_calls.append(time.perf_counter() - t0)
            for _ in range(steps):
                flight.append(not (path / MARKER).exists())
                state, dt = timed_step(step_fn, state, batches[i % nb]); i += 1  # donates the saved arrays
                after.append(dt)
            mgr.wait()
            if last_round:
                donated_path = path

        # One save with nothing else running: blocking part and time to completion.
        t0 = time.perf_counter()
        path = mgr.save(int(state.step), state, kind="permanent")
        save_s = time.perf_counter() - t0
        mgr.wait()
        complete_s = time.perf_counter() - t0
        disk = dir_bytes(path)
        t0 = time.perf_counter()  # the arrays' checksums, inside save()'s blocking part (compiled by now)
        state_checksum.checksums(state)
        checksum_s = time.perf_counter() - t0

        newest = [c for c in list_checkpoints(tmp) if c.complete][-1].path
        assert newest == path, (newest, path)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        t0 = time.perf_counter()
        restored, _ = restore(newest, abstract)
        jax.block_until_ready(restored)
        restore_s = time.perf_counter() - t0
        ok_live = trees_equal(restored, state)
        del restored
        donated, _ = restore(donated_path, abstract)
        ok_donated = trees_equal(donated, snapshot)
        del donated, snapshot

    return {"state_bytes": tree_bytes(state), "params": sum(x.size for x in jax.tree.leaves(state.params)),
            "compile_s": compile_s, "save_s": save_s, "checksum_s": checksum_s, "complete_s": complete_s,
            "restore_s": restore_s,
            "disk": disk, "base": base, "after": after, "flight": flight, "save_calls": save_calls,
            "ok": ok_live and ok_donated, "ok_live": ok_live, "ok_donated": ok_donated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per block (no save / right after save)")
    ap.add_argument("--rounds-tiny", type=int, default=3, help="alternating no-save / after-save rounds, tiny")
    ap.add_argument("--rounds-wide", type=int, default=1, help="the same for the wide model (its steps are slow)")
    ap.add_argument("--wide-batch-size", type=int, default=4, help="sequences per step of the wide model")
    args = ap.parse_args()
    if min(args.steps, args.rounds_tiny, args.rounds_wide, args.wide_batch_size) < 1:
        ap.error("--steps, --rounds-tiny, --rounds-wide and --wide-batch-size must be >= 1")

    wide = apply_overrides(TINY, WIDE_OVERRIDES + [f"train.batch_size={args.wide_batch_size}"])
    wide = dataclasses.replace(wide, name="tiny-wide")
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}, {jax.device_count()} device(s)); "
          f"optimizer: {TINY.train.optimizer}; checkpoints under tempfile.TemporaryDirectory")
    print(f"wide = TINY with {' '.join(o.removeprefix('model.') for o in WIDE_OVERRIDES)}")
    print(f"steps per block {args.steps}; rounds tiny {args.rounds_tiny}, wide {args.rounds_wide}\n")

    rows = []
    for cfg, rounds in ((TINY, args.rounds_tiny), (wide, args.rounds_wide)):
        t = cfg.train
        n_batches = 2 + 2 * args.steps * rounds
        with make_data(cfg) as data:
            batches = [jax.device_put(data.train.batch(i)) for i in range(min(n_batches, 8))]  # reused cyclically
        t0 = time.perf_counter()
        res = bench_model(cfg, batches, args.steps, rounds)
        rows.append((cfg, res, time.perf_counter() - t0))

    print("| model | params | state (MB) | on disk (MB) | save() returns (s) | of which checksums (s) | "
          "save complete, wait() (s) | "
          "restore (s) | step, no save (ms) | step after save() (ms) | ratio | steps started in flight | "
          "in-flight step (ms) | in-flight ratio | restore == saved |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cfg, r, _ in rows:
        b, a = float(np.median(r["base"])), float(np.median(r["after"]))
        fl = [x for x, f in zip(r["after"], r["flight"]) if f]
        fm = f"{1e3 * float(np.median(fl)):.1f} | {float(np.median(fl)) / b:.3f}" if fl else "- | -"
        m, t = cfg.model, cfg.train
        name = f"{cfg.name} (d{m.d_model}, L{m.n_layers}, E{m.n_experts}, batch {t.batch_size}x{t.seq_len})"
        print(f"| {name} | {r['params'] / 1e6:.1f}M | {r['state_bytes'] / 2**20:.1f} | {r['disk'] / 2**20:.1f} | "
              f"{r['save_s']:.3f} | {r['checksum_s']:.3f} | {r['complete_s']:.3f} | {r['restore_s']:.3f} | "
              f"{1e3 * b:.1f} | {1e3 * a:.1f} | "
              f"{a / b:.3f} | {sum(r['flight'])}/{len(r['after'])} | {fm} | {'yes' if r['ok'] else 'NO'} |")
    print()
    for cfg, r, wall in rows:
        print(f"{cfg.name}: compile + 1st step {r['compile_s']:.1f} s, model total {wall:.1f} s; save() in rounds "
              f"(s): {', '.join(f'{s:.3f}' for s in r['save_calls'])}")
        print(f"  no-save steps (ms): {' '.join(f'{1e3 * x:.0f}' for x in r['base'])}")
        print(f"  after-save steps (ms, * = started with the save in flight): "
              f"{' '.join(f'{1e3 * x:.0f}' + '*' * f for x, f in zip(r['after'], r['flight']))}")
        if not r["ok"]:
            print(f"  MISMATCH: newest restore equal {r['ok_live']}, donated-after-save restore equal {r['ok_donated']}")


if __name__ == "__main__":
    main()
