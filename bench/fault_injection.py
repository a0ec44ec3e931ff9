"""Kill a tiny training run at random points, resume it each time, and check that nothing was lost.

    python bench/fault_injection.py [--kills 20] [--steps 40] [--every 4] [--seed 0] [--work DIR]

One uninterrupted reference run, then the same command run again and again on a second run dir, each
attempt killed (SIGKILL: no handler, no cleanup) at a random point until `--kills` kills have landed,
then once more to the end. The points:

  step      MOEJAX_FAULT_KILL=step:S     step S computed, nothing of it written
  metrics   MOEJAX_FAULT_KILL=metrics:S  half of step S's metrics line written (a torn last line)
  save      MOEJAX_FAULT_KILL=save:C     checkpoint C's arrays on disk, no COMMITTED marker
  timer     SIGKILL from outside at a random moment once steps are being logged
  startup   SIGKILL from outside at a random moment of start-up (restore, truncation, compile)

Each hook step is drawn at or after the step the attempt resumes from, so it fires. Checks, all exact:
the loss / grad-norm / param-norm trace equals the reference bit for bit, every step is logged once and
in order, the set of complete checkpoints equals the reference's (no checkpoint lost, no incomplete dir
left), and every checkpoint's state equals the reference's bitwise. Exit 0 when all hold.

A persistent XLA compilation cache (in --work) makes each restart cost seconds instead of a compile.
`tests/test_faults.py` runs `run_campaign` with three fixed kills.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # run as a script from a checkout: the same moejax its runs use

from moejax.xla_flags import without_forced_host_devices  # noqa: E402

TRACE_KEYS = ("train/loss", "train/grad_norm", "train/param_norm")
KINDS = ("step", "metrics", "save", "timer", "startup")
WEIGHTS = (0.25, 0.25, 0.2, 0.15, 0.15)


def train_args(run_dir: Path, steps: int, every: int, extra=()) -> list[str]:
    return ["train", "--preset", "tiny", "--run-dir", str(run_dir), "--steps", str(steps), "--no-progress",
            "--peak-flops", "1e11", "--wandb", "disabled",
            "--set", "model.n_layers=2", "--set", "train.batch_size=4", "--set", "train.seq_len=32",
            "--set", "train.eval_every=0", "--set", "train.eval_batches=0",
            "--set", f"train.checkpoint_every={every}", "--set", "train.temp_checkpoint_minutes=100000", *extra]


def env(cache: Path, fault: str = "") -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MOEJAX_FAULT")}
    # The caller's XLA flags (the test suite's -O0) without a forced device count: the CLI forces its own.
    flags = without_forced_host_devices(os.environ.get("XLA_FLAGS", ""))
    e.update(WANDB_MODE="disabled", XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "src"),
             JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    if fault:
        e["MOEJAX_FAULT_KILL"] = fault
    return e


def cli(args: list[str], cache: Path, fault: str = "", kill_after=None, timeout: float = 1800):
    """Run `moejax ARGS`; `kill_after(proc)` (optional) may SIGKILL it from outside. Returns (rc, stderr)."""
    p = subprocess.Popen([sys.executable, "-m", "moejax.cli", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=env(cache, fault), cwd=ROOT)
    if kill_after is not None:
        kill_after(p)
    _, err = p.communicate(timeout=timeout)
    return p.returncode, err


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def checkpoints(run_dir: Path) -> tuple[list[int], list[int]]:
    from moejax.checkpoint import list_checkpoints

    infos = list_checkpoints(run_dir)
    return [c.step for c in infos if c.complete], [c.step for c in infos if not c.complete]


def resume_step(run_dir: Path) -> int:
    done, _ = checkpoints(run_dir) if (run_dir / "checkpoints").is_dir() else ([], [])
    return max(done, default=0)


def _last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_bytes().splitlines()
        return json.loads(lines[-1])["step"] if lines else -1
    except (OSError, ValueError, KeyError):
        return -1


def timer_killer(run_dir: Path, start: int, rng: random.Random, max_delay: float):
    """SIGKILL at a random moment after this attempt logs its first row (mid-step, mid-save, mid-write)."""

    def kill(p: subprocess.Popen) -> None:
        while p.poll() is None and _last_step(run_dir) < start:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, max_delay))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)

    return kill


def startup_killer(rng: random.Random, max_delay: float):
    def kill(p: subprocess.Popen) -> None:
        deadline = time.monotonic() + rng.uniform(0.5, max_delay)
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)

    return kill


@dataclass
class Campaign:
    kills: dict = field(default_factory=lambda: {k: 0 for k in KINDS})
    attempts: int = 0
    missed: int = 0  # attempts the fault did not hit (the run got past it or finished)
    wall_s: float = 0.0
    log: list = field(default_factory=list)

    @property
    def n_kills(self) -> int:
        return sum(self.kills.values())


def plan_fault(rng: random.Random, start: int, steps: int, every: int, kind: str | None = None):
    """(kind, env value) for an attempt resuming at `start`; hook steps stay close to `start`, so each
    kill costs a few steps of progress and many kills fit in one run."""
    kind = kind or rng.choices(KINDS, WEIGHTS)[0]
    near = lambda: rng.randint(start, min(steps - 1, start + 2 * every))
    if kind in ("step", "metrics"):
        return kind, f"{kind}:{near()}"
    if kind == "save":
        saves = [c for c in range(start + 1, steps + 1) if c % every == 0 or c == steps][:2]
        return (kind, f"save:{rng.choice(saves)}") if saves else plan_fault(rng, start, steps, every, "step")
    return kind, ""


def run_campaign(work: Path, n_kills: int, steps: int, every: int, seed: int = 0, faults=None,
                 log=print, extra=()) -> dict:
    """Reference run + killed-and-resumed run; returns the figures and the checks. `faults`: a fixed list
    of (kind, env value) to use instead of random ones (the fast test); `extra`: more `train` arguments."""
    work.mkdir(parents=True, exist_ok=True)
    cache, ref, run = work / "xla-cache", work / "reference", work / "faulted"
    rng = random.Random(seed)
    t0 = time.perf_counter()
    rc, err = cli(train_args(ref, steps, every, extra), cache)
    if rc != 0:
        raise RuntimeError(f"reference run failed (rc {rc}): {err[-2000:]}")
    ref_s = time.perf_counter() - t0
    log(f"reference: {steps} steps in {ref_s:.0f} s (compiles into {cache})")
    c, fixed = Campaign(), list(faults or [])
    t0 = time.perf_counter()
    while (fixed if faults else c.n_kills < n_kills) and c.attempts < 4 * n_kills + 10:
        start = resume_step(run)
        if start >= steps:
            break
        kind, fault = fixed.pop(0) if fixed else plan_fault(rng, start, steps, every)
        killer = None
        if kind == "timer":
            killer = timer_killer(run, start, rng, max_delay=0.4)
        elif kind == "startup":
            killer = startup_killer(rng, max_delay=8.0)
        rc, err = cli(train_args(run, steps, every, extra), cache, fault, killer)
        c.attempts += 1
        killed = rc == -signal.SIGKILL
        c.kills[kind] += killed
        c.missed += not killed
        c.log.append({"attempt": c.attempts, "resume": start, "kind": kind, "fault": fault, "rc": rc})
        log(f"attempt {c.attempts}: resume at {start}, {kind} {fault or ''} -> rc {rc}")
        if rc not in (0, -signal.SIGKILL):
            raise RuntimeError(f"attempt {c.attempts} ({kind} {fault}) failed with rc {rc}: {err[-2000:]}")
    rc, err = cli(train_args(run, steps, every, extra), cache)  # to the end (a no-op if already finished)
    if rc != 0:
        raise RuntimeError(f"final resume failed (rc {rc}): {err[-2000:]}")
    c.wall_s = time.perf_counter() - t0
    return {**check(ref, run), "kills": c.n_kills, "kills_by_kind": c.kills, "attempts": c.attempts + 1,
            "missed": c.missed, "steps": steps, "checkpoint_every": every, "reference_s": ref_s,
            "faulted_s": c.wall_s, "log": c.log}


def check(ref: Path, run: Path) -> dict:
    a, b = rows(ref), rows(run)
    steps_b = [r["step"] for r in b]
    out = {"steps_logged_once_in_order": steps_b == list(range(len(a))) and len(b) == len(a),
           "trace_bitwise_equal": all([x.get(k) for x in a] == [x.get(k) for x in b] for k in TRACE_KEYS),
           "duplicate_steps": len(steps_b) - len(set(steps_b))}
    (ca, _), (cb, ib) = checkpoints(ref), checkpoints(run)
    out.update(checkpoints_reference=ca, checkpoints_faulted=cb, incomplete_left=ib,
               no_checkpoint_lost=ca == cb and not ib, states_bitwise_equal=_states_equal(ref, run, ca))
    out["ok"] = all(out[k] for k in ("steps_logged_once_in_order", "trace_bitwise_equal", "no_checkpoint_lost",
                                     "states_bitwise_equal"))
    return out


def _states_equal(ref: Path, run: Path, steps: list[int]) -> bool:
    import jax
    import numpy as np

    from moejax.checkpoint import restore, step_dir_name
    from moejax.config import RunConfig
    from moejax.train.optimizer import make_optimizer
    from moejax.train.state import init_state

    cfg = RunConfig.from_dict(json.loads((ref / "config.json").read_text()))
    target = init_state(cfg, make_optimizer(cfg)[0], jax.random.key(0))
    for s in steps:
        (x, _), (y, _) = (restore(d / "checkpoints" / step_dir_name(s), target) for d in (ref, run))
        if not all(np.array_equal(np.asarray(p), np.asarray(q)) for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y))):
            return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=4, help="train.checkpoint_every")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="/tmp/moejax-fault-injection")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    work = Path(a.work)
    for d in ("reference", "faulted"):  # a fresh campaign (the compilation cache is kept)
        shutil.rmtree(work / d, ignore_errors=True)
    sys.path.insert(0, str(ROOT / "src"))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    res = run_campaign(work, a.kills, a.steps, a.every, a.seed)
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print("| kills | by kind | attempts | missed | steps | ckpt every | reference s | faulted s | result |")
        print("|---|---|---|---|---|---|---|---|---|")
        kinds = ", ".join(f"{k} {n}" for k, n in res["kills_by_kind"].items())
        print(f"| {res['kills']} | {kinds} | {res['attempts']} | {res['missed']} | {res['steps']} | "
              f"{res['checkpoint_every']} | {res['reference_s']:.0f} | {res['faulted_s']:.0f} | "
              f"{'OK' if res['ok'] else 'FAIL'} |")
        for k in ("steps_logged_once_in_order", "trace_bitwise_equal", "duplicate_steps", "no_checkpoint_lost",
                  "states_bitwise_equal", "checkpoints_faulted", "incomplete_left"):
            print(f"  {k}: {res[k]}")
    return 0 if res["ok"] and res["kills"] >= a.kills else 1


if __name__ == "__main__":
    sys.exit(main())
