"""`moejax` command line: thin wrappers over the library.

  moejax count PRESET [--json]                       parameter / FLOP accounting
  moejax train --preset P --run-dir DIR [--steps N] [--set section.field=value ...]
  moejax summary RUN_DIR                             first/last loss, tokens/s, MFU, alarms of a finished run
  moejax generate RUN_DIR --prompt TEXT              continue a prompt with the run's newest checkpoint
  moejax export RUN_DIR --out DIR                    weights as safetensors + config + tokenizer

User errors (bad config, preset, run dir) print one line `moejax: error: ...` and exit 2.
SIGTERM/SIGINT during training: the step finishes, a checkpoint is written (temporary, or permanent on a step due
one), exit 75 (EX_TEMPFAIL);
before the first step (start-up, waiting for peers, restore) there is nothing new to save: exit 75 at once.
Running the same command again resumes from the newest complete checkpoint. In a multi-process run, a
collective that fails because another process is gone also exits 75, at once, in one line.
Without --mesh, a preset laid out on one device trains data-parallel on every device (`--mesh data=N`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from moejax.config import apply_overrides, ConfigError, first_line
from moejax.parallel.mesh import mesh_overrides, parse_mesh
from moejax.preemption import EXIT_PREEMPTED
from moejax.presets import PRESET_NAMES, preset
from moejax.xla_flags import FORCED_HOST_DEVICES

EXIT_USAGE = 2
WAIT_REPORT_S = 15.0  # distributed start-up: a "waiting" line this often (a third of --dist-timeout if shorter)


def _cmd_count(args) -> int:
    from moejax import accounting
    from moejax.model.transformer import param_count

    cfg = preset(args.preset)
    s = accounting.summary(cfg, param_count(cfg.model))
    print(json.dumps(s, indent=2) if args.json else accounting.format_summary(s))
    return 0


def _resolve(args):
    """The preset with --mesh, --set, --remat and --steps applied as one set of overrides, validated once with
    the final values: a context phase starts at a fraction of train.steps, so the schedule checked with the
    preset's steps named the wrong step, and refused a schedule that --set train.steps accepted."""
    flags = (["train.remat=true"] if args.remat else []) + ([f"train.steps={args.steps}"] if args.steps is not None
                                                           else [])
    return apply_overrides(preset(args.preset), mesh_overrides(args.mesh) + (args.set or []) + flags)


def _default_mesh(cfg, args):
    """Without --mesh, a one-device preset trains data-parallel on every device of the job
    (`mesh.default_data_parallel`); config.json records the mesh used (parallel.data)."""
    if args.mesh is not None:
        return cfg
    import jax

    from moejax.parallel.mesh import default_data_parallel

    return default_data_parallel(cfg, jax.device_count())


def _report_every(timeout_s: float) -> float:
    return min(WAIT_REPORT_S, max(timeout_s / 3, 0.5))


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """A TCP probe before jax.distributed: an unreachable coordinator makes XLA abort the process with a
    stack trace instead of raising, so we fail first with one line naming the address and the timeout."""
    import socket
    import time

    from moejax.train.loop import RunError

    t0 = time.monotonic()
    next_report = t0
    while True:
        try:
            with socket.create_connection(_host_port(address), timeout=2):
                return
        except OSError as e:
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise RunError(f"coordinator {address} did not answer within {timeout_s}s ({e.strerror or e}); "
                               "is process 0 running and reachable?") from None
            if now >= next_report:
                print(f"moejax: waiting for the coordinator at {address} (process 0): {e.strerror or e} "
                      f"({now - t0:.0f} s of {timeout_s} s)", file=sys.stderr, flush=True)
                next_report = now + _report_every(timeout_s)
            time.sleep(0.5)


def _host_port(address: str) -> tuple[str, int]:
    """HOST:PORT (checked by `_validate_processes`) as a socket address; "[::1]:8476" -> ("::1", 8476)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _answers(address: str) -> bool:
    """Whether something accepts a TCP connection at HOST:PORT now."""
    import socket

    try:
        with socket.create_connection(_host_port(address), timeout=2):
            return True
    except OSError:
        return False


def _env_first(*names: str) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def _env_int(*names: str) -> int | None:
    """The first of these launcher variables that is set, as an int; a ConfigError naming it if it is not one."""
    name = next((n for n in names if os.environ.get(n)), None)
    if name is None:
        return None
    try:
        return int(os.environ[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={os.environ[name]!r} must be an integer") from None


def _distributed_from_env(args) -> None:
    """Fill unset flags from the launcher's environment (docs/LAUNCH.md): only when a coordinator is named
    there, so a stray RANK or SLURM_PROCID alone never turns a run multi-process."""
    if args.coordinator is None:
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        args.coordinator = _env_first("JAX_COORDINATOR_ADDRESS") or (f"{addr}:{port}" if addr and port else None)
    if args.coordinator is None:
        return
    if args.num_processes is None:
        args.num_processes = _env_int("JAX_NUM_PROCESSES", "SLURM_NTASKS", "WORLD_SIZE")
    if args.process_id is None:
        args.process_id = _env_int("JAX_PROCESS_ID", "SLURM_PROCID", "RANK")


def _validate_processes(args) -> None:
    """Process ids checked up front: a wrong one would otherwise wait the whole timeout before failing."""
    n, i = args.num_processes, args.process_id
    if n is not None and n < 1:
        raise ConfigError(f"--num-processes ({n}) must be >= 1")
    if i is not None and (i < 0 or (n is not None and i >= n)):
        raise ConfigError(f"--process-id ({i}) must be in [0, --num-processes={n})" if n is not None
                          else f"--process-id ({i}) must be >= 0")
    if args.dist_timeout <= 0:
        raise ConfigError(f"--dist-timeout ({args.dist_timeout}) must be positive")
    if not (args.coordinator or args.distributed) and ((n or 1) > 1 or (i or 0) > 0):
        # it would train alone, as a one-process job, while its peers wait for it
        given = " ".join(f"{flag} {v}" for flag, v in (("--num-processes", n), ("--process-id", i)) if v is not None)
        raise ConfigError(f"{given} need{'s' if ' --' not in given else ''} --coordinator HOST:PORT (process 0's "
                          "address) or --distributed")
    if args.coordinator:
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--coordinator {args.coordinator!r} is not HOST:PORT (e.g. node0:8476)")
        if not args.distributed and (n is None or i is None):  # jax would fail inside, after the imports
            missing = " and ".join(f for f, v in (("--num-processes", n), ("--process-id", i)) if v is None)
            raise ConfigError(f"--coordinator {args.coordinator} needs {missing} (or the launcher's "
                              "JAX_NUM_PROCESSES / SLURM_NTASKS / WORLD_SIZE and JAX_PROCESS_ID / SLURM_PROCID / "
                              "RANK, docs/LAUNCH.md), or --distributed to let jax find them")


class _StartupWatchdog:
    """While jax.distributed.initialize blocks (every process must join): a waiting line naming the
    coordinator every ~15 s, and at --dist-timeout one line naming what never answered, then exit 2.
    jax gets a longer timeout of its own: when it runs out first, XLA aborts the process with a C++
    stack trace (rc 134) that blames "another task"."""

    def __init__(self, args):
        self.args, self._done = args, threading.Event()
        self._thread = threading.Thread(target=self._watch, name="moejax-dist-watchdog", daemon=True)

    def _what(self) -> str:
        a = self.args
        n = a.num_processes if a.num_processes is not None else "all"
        if a.process_id == 0:
            others = {None: "the other processes", 2: "process 1"}.get(a.num_processes, f"processes 1..{n - 1}"
                                                                         if isinstance(n, int) else "")
            return (f"{others} never joined the coordinator this process (0 of {n}) hosts at {a.coordinator}; "
                    f"are they running the same command with --coordinator {a.coordinator}?")
        who = f"process {a.process_id}" if a.process_id is not None else "this process"
        return (f"{who} reached the coordinator at {a.coordinator or '(auto-detected)'}, but not all {n} "
                "processes joined; is every process running the same command?")

    def _watch(self) -> None:
        timeout, t0 = float(self.args.dist_timeout), time.monotonic()
        while True:
            left = t0 + timeout - time.monotonic()
            if self._done.wait(min(_report_every(timeout), max(left, 0.0))):
                return
            elapsed = time.monotonic() - t0
            if elapsed >= timeout:
                print(f"moejax: error: distributed start-up timed out after {self.args.dist_timeout}s: {self._what()}",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_USAGE)  # the main thread is blocked inside XLA; nothing has been written yet
            print(f"moejax: waiting for all processes to join the coordinator at {self.args.coordinator or '(auto)'} "
                  f"({elapsed:.0f} s of {self.args.dist_timeout} s)", file=sys.stderr, flush=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()


def _init_distributed(args) -> None:
    """Multi-controller JAX: one process per host, all running the same command (docs/LAUNCH.md).
    Flags win over the environment; --distributed alone uses JAX's own cluster auto-detection."""
    _distributed_from_env(args)
    _validate_processes(args)
    if not (args.coordinator or args.distributed):
        return
    import jax

    from moejax.train.loop import RunError

    if args.coordinator and args.process_id:  # process 0 hosts the coordinator; the others wait for it
        _wait_for_coordinator(args.coordinator, args.dist_timeout)
    elif args.coordinator and _answers(args.coordinator):
        # gRPC binds with SO_REUSEPORT: a second coordinator on a live one's port starts without an error, and
        # the jobs' processes then join either one
        raise RunError(f"--coordinator {args.coordinator}: something already answers on that port (another job's "
                       "coordinator?); give this job a free port")
    try:
        with _StartupWatchdog(args):
            jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                       process_id=args.process_id, initialization_timeout=args.dist_timeout + 60)
    except Exception as e:  # jax raises RuntimeError/XlaRuntimeError with multi-line text
        raise RunError(f"jax.distributed.initialize failed (coordinator {args.coordinator}, "
                       f"{args.num_processes} processes, id {args.process_id}, timeout {args.dist_timeout}s): "
                       f"{first_line(e)}")


def _cmd_train(args) -> int:
    from moejax.metrics import check_wandb
    from moejax.model.kernel_choice import check_choices
    from moejax.train.loop import RunOptions, train
    from moejax.train.profile import parse_window

    cfg = _resolve(args)
    if not 0 <= args.peak_flops < float("inf"):  # NaN would also make run_info.json invalid JSON
        raise ConfigError(f"--peak-flops ({args.peak_flops}) must be a finite FLOP/s >= 0 (0: measure it)")
    profile = parse_window(args.profile, cfg.train.steps) if args.profile is not None else None
    check_wandb(args.wandb)  # fail before any waiting, not after set-up
    _init_distributed(args)
    cfg = _default_mesh(cfg, args)
    # MOEJAX_ATTENTION / MOEJAX_GROUPED, at every context phase's row length: before the run dir exists
    check_choices(cfg.model, tuple(ph.chunk for ph in cfg.phases))
    opts = RunOptions(overwrite=args.overwrite, wandb=args.wandb, wandb_project=args.wandb_project,
                      wandb_run_name=args.wandb_run_name or "",
                      peak_flops=args.peak_flops, progress=not args.no_progress,
                      init_from=args.init_from or "", profile=profile, start_timeout_s=args.dist_timeout)
    summary = train(cfg, Path(args.run_dir), opts)
    if threading.current_thread() is threading.main_thread():  # finished: a late SIGTERM is not a preemption
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(json.dumps(summary, indent=2))
    return 0


def _cmd_summary(args) -> int:
    from moejax.train.run_dir import peak_source, read_summary

    s = read_summary(Path(args.run_dir))
    print(f"run {args.run_dir} ({s['preset']}): {s['steps']} steps in {s['wall_seconds']:.0f} s")
    print(f"  train loss  {s['first_loss']:.3f} -> {s['last_loss']:.3f}")
    if "eval/loss" in s:
        at = s.get("eval_step", s["steps"] - 1)  # older summaries: the run's last step, where every run evaluated
        when = f"   (step {at}'s row; later steps were not evaluated)" if at < s["steps"] - 1 else ""
        print(f"  eval loss   {s['eval/loss']:.3f}   eval bits/byte {s['eval/bpb']:.3f}{when}")
    if s["tokens_per_second"]:
        print(f"  throughput  {s['tokens_per_second']:,.0f} tokens/s   "
              f"MFU {100 * s['mfu']:.1f}% of {peak_source(Path(args.run_dir))}")
    else:  # every step was one of a (re)start's first, compile-dominated ones
        print("  throughput  n/a (too few steps after the compile to measure)")
    print(f"  MoE drops   {100 * s['drop_fraction']:.2f}%")
    for line in _alarm_lines(s):
        print(line)
    print(f"  files       {args.run_dir}/metrics.jsonl, config.json, run_info.json, summary.json")
    return 0


def _alarm_lines(s: dict) -> list[str]:
    """The summary's routing-health alarms: per kind, how many were raised, the first and the last."""
    if "alarms" not in s:  # a summary.json written before alarms existed
        return []
    if not s["alarms"]:
        return ["  alarms      none"]
    out = []
    for kind, a in s["alarms"].items():
        out.append(f"  alarms      {kind}: raised {a['count']}x; first: {a['first']}")
        if a["count"] > 1:
            out.append(f"              last:  {a['last']}")
    return out


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a flag's type or choice, an unknown flag) as every other user error: one line,
    `moejax: error: ...`, exit 2, without the usage block. Subcommands' parsers are made of this class too."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"moejax: error: {message} (`{self.prog} --help` lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moejax", description="Mixture-of-Experts pretraining on JAX")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("count", help="parameter and FLOP accounting of a preset")
    c.add_argument("preset", help=f"one of {', '.join(PRESET_NAMES)}")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=_cmd_count)

    t = sub.add_parser("train", help="train a preset")
    t.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESET_NAMES)}")
    t.add_argument("--run-dir", required=True)
    t.add_argument("--steps", type=int)
    t.add_argument("--mesh", help="e.g. replica_dcn=1,data=2,expert=4,model=1 (omitted axes = 1)")
    t.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="config override (repeatable)")
    t.add_argument("--overwrite", action="store_true", help="delete an existing run in --run-dir and start over")
    t.add_argument("--init-from", metavar="CKPT",
                   help="start a new run from the weights of a checkpoint, run or export dir")
    t.add_argument("--wandb", default="offline", choices=["offline", "online", "disabled"])
    t.add_argument("--wandb-project", default="moejax")
    t.add_argument("--wandb-run-name", help="W&B run name (default: the run directory's name)")
    t.add_argument("--peak-flops", type=float, default=0.0, help="peak FLOP/s of one device (one process on CPU) for MFU; default: measured at start (bf16 matmul on GPU/TPU, fp32 on CPU)")
    t.add_argument("--remat", action="store_true",
                   help="rematerialise each block in the backward pass (same as --set train.remat=true)")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--profile", metavar="START:STOP",
                   help="trace steps START .. STOP-1 with jax's profiler into RUN_DIR/profile/ (TensorBoard, Perfetto)")
    t.add_argument("--coordinator", metavar="HOST:PORT", help="jax.distributed coordinator (process 0's address)")
    t.add_argument("--num-processes", type=int, help="number of processes (hosts) in the job")
    t.add_argument("--process-id", type=int, help="this process's index in [0, num-processes)")
    t.add_argument("--distributed", action="store_true", help="jax.distributed with cluster auto-detection")
    t.add_argument("--dist-timeout", type=int, default=300,
                   help="seconds to wait for the coordinator, and for every process at each start-up check")
    t.set_defaults(fn=_cmd_train)

    s = sub.add_parser("summary", help="print the summary of a finished run")
    s.add_argument("run_dir")
    s.set_defaults(fn=_cmd_summary)

    # Subcommands owned by their modules: each `register(sub)` adds parsers whose `fn(args) -> int`
    # raises ConfigError/RunError for user errors (one line, exit 2).
    from moejax.data import cli as data_cli
    from moejax.ladder import cli as ladder_cli
    from moejax import export, generate, report

    for module in (data_cli, ladder_cli, report, generate, export):
        module.register(sub)
    return p


def _backends_started() -> bool:
    """XLA reads XLA_FLAGS when its first backend starts, not when jax is imported (this module imports it)."""
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else bool(getattr(xla_bridge, "_backends", None))


def _ensure_host_devices(args) -> None:
    """On CPU, a mesh of N devices needs N forced host devices, which must be set before jax's backend starts.
    The flag only affects the host platform, so it is harmless on GPU/TPU machines."""
    if getattr(args, "mesh", None) is not None and FORCED_HOST_DEVICES not in os.environ.get("XLA_FLAGS", ""):
        import math

        n = math.prod(parse_mesh(args.mesh).values()) // max(1, getattr(args, "num_processes", None) or 1)
        if n > 1 and not _backends_started():
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FORCED_HOST_DEVICES}={n}"


SHUTDOWN_GRACE_S = 10.0


def _leave_distributed(code: int) -> None:
    """Exit a multi-process run that failed (a lost peer, an error, a preemption), within SHUTDOWN_GRACE_S.
    jax's shutdown barrier is tried first, on a thread:
    peers still alive (one that exited 75 while this one was starting) pass it and exit as they meant to;
    when the peer is dead it would wait out its heartbeat (100 s) and then abort with a C++ stack trace,
    so the process leaves without it. The rows on disk are whole, and a checkpoint cut short has no COMMITTED
    marker, which restores skip."""
    import jax

    sys.stdout.flush()
    sys.stderr.flush()
    left = threading.Event()

    def shutdown():
        try:
            jax.distributed.shutdown()
        except Exception:  # noqa: BLE001 -- leaving anyway
            pass
        left.set()

    threading.Thread(target=shutdown, name="moejax-dist-shutdown", daemon=True).start()
    left.wait(SHUTDOWN_GRACE_S)
    os._exit(code)


class _PreemptedWhileStarting(BaseException):
    """SIGTERM to `train` before the trainer's own handler is set (imports, config, waiting for the
    coordinator): nothing exists to save, so exit 75 at once (the launcher requeues), not 143."""


_preempted_by: str | None = None  # the signal `_raise_preempted` turned into an exception, if one did


def _raise_preempted(signum, frame) -> None:
    global _preempted_by
    _preempted_by = signal.Signals(signum).name
    raise _PreemptedWhileStarting(_preempted_by)


def preempted_while_starting(signal_name: str) -> int:
    """The one line and exit code of a `train` preempted before anything could be saved."""
    print(f"moejax: preempted ({signal_name}) while starting; nothing to save; run the same command again",
          file=sys.stderr)
    return EXIT_PREEMPTED


def main(argv: list[str] | None = None) -> int:
    starting = (argv if argv is not None else sys.argv[1:])[:1] == ["train"]
    starting = starting and threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _raise_preempted) if starting else None
    try:
        code = _main(argv)
    except _PreemptedWhileStarting as e:
        code = preempted_while_starting(str(e))
    except BaseException:
        if _preempted_by is None:
            raise
        # the signal landed inside an extension module's import (tensorstore's), which reraised it as an
        # ImportError: still a preemption while starting
        code = preempted_while_starting(_preempted_by)
    finally:
        if starting:
            signal.signal(signal.SIGTERM, old)
    if code != 0 and _joined_a_job():
        # jax's own shutdown waits for every process at a barrier, unbounded: a peer that is gone, or one still
        # stuck inside jax.distributed's start-up, would hold this one there (or abort it after jax's 100 s
        # heartbeat)
        _leave_distributed(code)
    return code


def _joined_a_job() -> bool:
    """Whether this process started (or is starting) a jax.distributed client."""
    if "jax" not in sys.modules:
        return False
    from jax._src import distributed

    return distributed.global_state.client is not None


def _main(argv: list[str] | None) -> int:
    # Before anything imports jax: subcommand modules may, and the device count is fixed at import.
    pre = _Parser(prog="moejax", add_help=False)
    pre.add_argument("--mesh")
    pre.add_argument("--num-processes", type=int)
    try:
        _ensure_host_devices(pre.parse_known_args(argv)[0])
    except ConfigError as e:
        print(f"moejax: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    args = build_parser().parse_args(argv)
    from moejax.checkpoint import lost_peer
    from moejax.train.loop import Preempted, RunError

    try:
        return args.fn(args)
    except (ConfigError, RunError) as e:
        print(f"moejax: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Preempted as e:
        print(f"moejax: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if (line := lost_peer(e)) is None:
            raise
        print(f"moejax: error: {line}", file=sys.stderr)
        _leave_distributed(EXIT_PREEMPTED)
    except KeyboardInterrupt:
        print("moejax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
