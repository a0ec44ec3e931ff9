"""The training loop: set up once (mesh, data, state, jitted steps), then step, log, evaluate, checkpoint.

The pieces it calls live with their owners: the run directory's files in `train.run_dir`, logging, the
summary's running totals and the routing-health alarms in `train.monitor` / `train.alarms`, the optimizer in
`train.optimizer`, state creation and placement in `train.state`, the MoE backend in `parallel.backends`,
checkpoints in `moejax.checkpoint`, data in `moejax.data.pipeline`.

Never lose a user's data: the run dir is locked for the run's lifetime (`RunLock`); `--init-from` is
validated before anything is written; every step's loss, grad, update and parameter norms (computed in the
jitted step) must be finite before the step is logged or saved, so no checkpoint holds non-finite weights,
and a resume falls back past one that does (an older build could write them); a signal during set-up
exits 75 at once, a signal after the first step finishes the step and saves first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from tqdm import tqdm

from moejax import accounting, faults
from moejax.checkpoint import (MARKER, METADATA, STATE, CheckpointError, CheckpointManager, check_compatible,
                               any_process, list_checkpoints, lost_peer, restore)
from moejax.compile_cache import enable_compile_cache
from moejax.config import ConfigError, RunConfig
from moejax.data.pipeline import make_data
from moejax.export import check_export, init_params_from_export, is_export
from moejax.metrics import MetricsWriter, read_metrics, to_py
from moejax.model import kernel_choice
from moejax.parallel.backends import attention_kernel, layer_weights, local_backend, moe_backend
from moejax.parallel.mesh import REPLICATED, batch_sharding, make_mesh
from moejax.perf import job_peak
from moejax.preemption import EXIT_PREEMPTED, PreemptionGuard, PreemptionSignal
from moejax.train.alarms import LOAD_KEY
from moejax.train.job_start import JobStart, PeerPreempted
from moejax.train.monitor import RunTotals, StepLog, print_alarm
from moejax.train.optimizer import make_optimizer
from moejax.train.profile import ProfileWindow, StepProfiler, trace_dir
from moejax.train.reuse import reused, tree_key
from moejax.train.run_dir import (RunError, RunLock, forget_new_run, json_dict, prepare_run_dir, read_summary,
                                  run_info, truncate_metrics, write_json)
from moejax.train.state import TrainState, init_opt_state, init_state, place_state
from moejax.train.step import make_eval_step, make_train_step
from moejax.xla_flags import init_compiler_options, step_compiler_options


class Preempted(RuntimeError):
    """SIGTERM/SIGINT: the current step finished and a checkpoint was written (temporary, unless the step was due a
    permanent one)."""

    exit_code = EXIT_PREEMPTED


@dataclass(frozen=True)
class RunOptions:
    overwrite: bool = False
    wandb: str = "offline"
    wandb_project: str = "moejax"
    wandb_run_name: str = ""  # default: the run directory's name
    peak_flops: float = 0.0  # per device; 0: measure the matmul peak at start (bf16 on GPU/TPU, fp32 on CPU)
    progress: bool = True
    init_from: str = ""  # a checkpoint dir (a run dir: its newest; or an export dir) whose weights start a *new* run
    profile: ProfileWindow | None = None  # steps jax's profiler traces (--profile START:STOP, `moejax.train.profile`)
    start_timeout_s: float = 300.0  # a multi-process job's wait for every process at start-up (--dist-timeout)


def _primary() -> bool:
    return jax.process_index() == 0


def train(cfg: RunConfig, run_dir: Path, opts: RunOptions = RunOptions()) -> dict:
    """Train (or resume) the run in `run_dir`; returns the summary. Raises RunError/ConfigError for user
    errors, Preempted after SIGTERM/SIGINT (a temporary checkpoint is then on disk if a step had run)."""
    with PreemptionGuard(immediate=True) as guard:  # until the first step: a signal exits 75 at once
        try:
            return _train(cfg, Path(run_dir), opts, guard)
        except PreemptionSignal as e:
            raise Preempted(f"preempted ({e}) before the first step; nothing new to save; "
                            "run the same command again to resume") from None
        except PeerPreempted as e:
            raise Preempted(f"{e}; nothing new to save; run the same command again to resume") from None


# A run dir that can't be written (full, over quota, read-only, not ours, a file where a dir should be): a user's
# problem, one line.
RUN_DIR_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR)


def _train(cfg: RunConfig, run_dir: Path, opts: RunOptions, guard: PreemptionGuard) -> dict:
    enable_compile_cache()  # a restart loads the compiled step instead of compiling it again
    with contextlib.ExitStack() as held:  # the run dir's lock, then the loader: closed in reverse
        mesh, init_from, data, resuming = _start(cfg, run_dir, opts, held)
        try:
            peak_info = job_peak(opts.peak_flops)
            peak = peak_info["peak_flops"]  # the whole job's: MFU is per device of the job
            if _primary():
                profile = {"profile_steps": [opts.profile.start, opts.profile.stop]} if opts.profile else {}
                platform = mesh.devices.flat[0].platform
                write_json(run_dir / "run_info.json", {**run_info(cfg, peak), **peak_info, "data": data.describe(),
                                                       "step_compiler_options": step_compiler_options(platform),
                                                       "init_compiler_options": init_compiler_options(platform),
                                                       **profile})
            return _train_loop(cfg, run_dir, opts, data, resuming, peak, mesh, init_from, guard)
        except InitFromError:
            if not resuming and _primary():  # its start wrote config.json and run_info.json: leave nothing
                forget_new_run(run_dir)
            raise
        except CheckpointError as e:  # e.g. the disk filled up mid-run: one line, the last good checkpoint stays
            raise RunError(str(e)) from None
        except OSError as e:  # the same for run_info.json or metrics.jsonl; other OSErrors (a lost peer) go on
            if e.errno not in RUN_DIR_ERRNOS:
                raise
            where = f" ({e.filename})" if e.filename else ""
            raise RunError(f"cannot write to run dir {run_dir}: {e.strerror or e}{where}; the last complete "
                           "checkpoint stays: fix it and run the same command again") from None


def _start(cfg: RunConfig, run_dir: Path, opts: RunOptions, held: contextlib.ExitStack):
    """Checks, the run dir's lock (process 0) and the loader, with every process of a job agreeing on each
    before the run dir is written (`job_start`): a process that stops here stops the others with its line."""
    start = JobStart(opts.start_timeout_s)
    with start.failures_published():
        start.same_command(run_dir, cfg.to_dict(), {"overwrite": opts.overwrite, "init_from": opts.init_from})
        mesh = make_mesh(cfg.parallel)  # fail on a mesh larger than the machine, or an unknown backend,
        moe_backend(cfg.parallel, mesh)  # before any data work
        init_from = resolve_init_from(opts.init_from, dataclasses.asdict(cfg.model)) if opts.init_from else None
        if init_from is not None and opts.overwrite and _inside(init_from, run_dir):
            raise RunError(f"--init-from {opts.init_from} is inside --run-dir {run_dir}, which --overwrite would "
                           "delete before reading it; copy it elsewhere first")
        if _primary():  # before the first byte is written
            held.callback(RunLock(run_dir).acquire(job=start.token if start.count > 1 else "").release)
        start.same_run_dir(run_dir)
        data = make_data(cfg, process_index=jax.process_index(), process_count=jax.process_count())
        held.callback(data.close)
        start.same_data(data.describe().get("identity", ""))
        resuming = prepare_run_dir(run_dir, cfg, opts.overwrite, data=data.describe()) if _primary() else None
        return mesh, init_from, data, start.from_primary("resuming", resuming)


def _inside(path: Path, root: Path) -> bool:
    """Whether `path` is `root` or below it (symlinks resolved)."""
    path, root = path.resolve(), root.resolve()
    return path == root or root in path.parents


def resolve_init_from(init_from: str, model_cfg: dict) -> Path:
    """The complete checkpoint dir `--init-from` names (a run dir: its newest complete one; or a `moejax
    export` dir), with its model config checked: all before the new run dir is touched, so a bad path fails in
    seconds, leaving nothing."""
    src = Path(init_from)
    if not src.is_dir():
        raise RunError(f"--init-from {src}: no such checkpoint or run directory")
    if is_export(src):  # weights + router bias, no optimizer state
        try:
            check_export(src, model_cfg)
        except (CheckpointError, ConfigError) as e:
            raise RunError(f"--init-from {src}: {e}") from None
        return src
    if (src / "checkpoints").is_dir():
        complete = [c for c in list_checkpoints(src) if c.complete]
        if not complete:
            raise RunError(f"--init-from {src}: no complete checkpoint in {src / 'checkpoints'}")
        src = complete[-1].path
    elif not (src / MARKER).is_file():
        raise RunError(f"--init-from {src}: neither a run dir (with checkpoints/) nor a complete checkpoint "
                       f"(with {METADATA}, {STATE}/ and {MARKER})")
    if not (src / STATE).is_dir():
        raise RunError(f"--init-from {src}: no {STATE}/ directory in this checkpoint")
    try:
        meta = json.loads((src / METADATA).read_text())
    except (OSError, ValueError) as e:
        raise RunError(f"--init-from {src}: unreadable {METADATA} ({type(e).__name__})") from None
    try:
        if isinstance(meta, dict) and "model_config" in meta:
            check_compatible(meta["model_config"], model_cfg)
    except CheckpointError as e:
        raise RunError(f"--init-from {src}: {e}") from None
    return src


@dataclass
class _Session:
    """Everything the step loop needs, built once per (re)start."""

    state: TrainState
    step_fn: Callable  # ContextPhase -> the jitted train step of that phase (built on first use)
    eval_fns: dict[str, Callable]
    to_global: Callable  # this process's numpy rows -> a global array sharded over the batch axes
    ckpt: CheckpointManager
    bytes_per_token: jax.Array  # [V] UTF-8 bytes per id, for bits per byte


def _setup(cfg: RunConfig, run_dir: Path, opts: RunOptions, resuming: bool, data, mesh: Mesh,
           init_from: Path | None) -> _Session:
    m, t = cfg.model, cfg.train
    if faults.sigterm_before_step():
        faults.sigterm_now()
    optimizer, lr_fns = reused(("optimizer", cfg), lambda: make_optimizer(cfg))  # the steps' key holds it
    try:
        ckpt = CheckpointManager(run_dir, permanent_every=t.checkpoint_every,
                                 temporary_every_s=60.0 * t.temp_checkpoint_minutes,
                                 model_config=dataclasses.asdict(m), run_config=cfg.to_dict())
    except CheckpointError as e:
        raise RunError(str(e)) from None
    try:
        return _setup_with(ckpt, cfg, opts, resuming, data, mesh, init_from, optimizer, lr_fns)
    except BaseException:  # a failure (or a signal) before the loop: no async saver left running
        ckpt.close()
        raise


def _setup_with(ckpt: CheckpointManager, cfg: RunConfig, opts: RunOptions, resuming: bool, data, mesh: Mesh,
                init_from: Path | None, optimizer, lr_fns) -> _Session:
    m, t = cfg.model, cfg.train
    state = init_state(cfg, optimizer, jax.random.key(t.seed), mesh)
    state = _initial_state(state, ckpt, resuming, init_from, optimizer, dataclasses.asdict(m))
    state, offload = place_state(state, t.opt_state_memory)
    step_fn, eval_fns = step_functions(cfg, mesh, optimizer, lr_fns, jax.tree.map(lambda x: x.sharding, state),
                                       offload, t.remat and t.remat_saves)
    batch_sh = batch_sharding(mesh)
    return _Session(state, step_fn, eval_fns, lambda b: jax.make_array_from_process_local_data(batch_sh, b), ckpt,
                    jnp.asarray(data.bytes_per_token))


def _compiler_options(mesh: Mesh) -> dict:
    """XLA options of the jitted train steps on `mesh`'s platform (`xla_flags.step_compiler_options`)."""
    return step_compiler_options(mesh.devices.flat[0].platform)


def step_functions(cfg: RunConfig, mesh: Mesh, optimizer, lr_fns, state_sh, offload, remat: bool | str):
    """(phase -> jitted train step, {prefix: jitted eval step}) for `mesh`: the MoE backend, the attention
    kernel and the layers' weights at use bound to it (`parallel.backends`), one train step per (context-parallel
    degree, capacity factors) of the context schedule (the transport's static buffer sizes and the chunk layout
    are baked into it), compiled with the platform's train-step options (`xla_flags.step_compiler_options`; on
    CPU they can't be traced inside another jit or grad, so call them at top level). A process that builds them
    again from equal inputs and kernel choices gets the same functions, traced and compiled once (`reuse`)."""
    options = _compiler_options(mesh)
    kernels = kernel_choice.current()
    key = ("steps", cfg, mesh, optimizer, tuple(sorted(lr_fns.items())), tree_key((state_sh, offload, kernels)),
           remat, tuple(sorted(options.items())))
    return reused(key, lambda: _build_step_functions(cfg, mesh, optimizer, lr_fns, state_sh, offload, remat,
                                                     options, kernels))


def _build_step_functions(cfg: RunConfig, mesh: Mesh, optimizer, lr_fns, state_sh, offload, remat: bool | str,
                          options: dict, kernels: dict):
    """`step_functions`' build: every step is built with the kernel choices of its key, also a phase's step,
    built later on its first use."""
    m, t = cfg.model, cfg.train
    routed, kernel, weights = moe_backend(cfg.parallel, mesh), attention_kernel(mesh), layer_weights(mesh)
    batch_sh = batch_sharding(mesh)

    @functools.cache
    @kernel_choice.pinned(kernels)
    def phase_step(context: int, cf_send: float, cf_recv: float):
        par = dataclasses.replace(cfg.parallel, cf_send=cf_send, cf_recv=cf_recv)
        fn = make_train_step(m, optimizer, lr_fns, moe_backend(par, mesh), remat=remat, offload=offload,
                             context=context, scan_layers=t.scan_layers, attention_kernel=kernel,
                             layer_weights=weights)
        return jax.jit(fn, donate_argnums=0, in_shardings=(state_sh, batch_sh), compiler_options=options,
                       out_shardings=(state_sh, NamedSharding(mesh, REPLICATED)))  # metrics replicated: any host reads them

    eval_fns = {}
    if t.eval_batches:  # 0: no evaluation, so no eval step at all
        with kernel_choice.pinned(kernels):
            # XLA's defaults: YNNPACK's dots run the eval forward faster (xla_flags)
            eval_fns["eval/"] = jax.jit(make_eval_step(m, routed, t.scan_layers, kernel, weights))
            if cfg.parallel.use_ep:  # the same weights on the local path: nothing dropped (SPEC §5)
                eval_fns["eval_dropless/"] = jax.jit(make_eval_step(m, local_backend(mesh), t.scan_layers, kernel,
                                                                    weights))
    return (lambda ph: phase_step(ph.context, ph.cf_send, ph.cf_recv)), eval_fns


def _profiler(window: ProfileWindow | None, run_dir: Path, start: int, steps: int) -> StepProfiler:
    """`--profile`'s profiler for this process: process 0 says what was traced (naming every process's
    directory) and, on GPUs, lists the longest kernels; every process reports its own failures."""
    many = jax.process_count() > 1
    me = f" (process {jax.process_index()})" if many else ""

    def say(line: str) -> None:  # above the progress bar, as the alarms are
        print_alarm(line.removeprefix("moejax: "))

    return StepProfiler(window, trace_dir(run_dir, jax.process_index()), start, steps,
                        say=say if _primary() else (lambda line: None), warn=lambda line: say(line + me),
                        summarize=_primary() and jax.default_backend() == "gpu",
                        where=str(trace_dir(run_dir, "*")) if many else "")


def _eval_metrics(s: _Session, data, n_batches: int, stop=lambda: False) -> dict | None:
    """Every eval path's metrics; None when `stop` (a preemption) says so before one of their batches."""
    params = s.state.compute  # device-resident, with the fp32 router bias the next train step routes with
    out = {}
    for prefix, fn in s.eval_fns.items():
        got = evaluate(fn, params, data.eval, n_batches, s.bytes_per_token, prefix, s.to_global, stop)
        if got is None:
            return None
        out.update(got)
    return out


def _write_owed_final_row(s: _Session, data, run_dir: Path, start: int, eval_batches: int, totals: RunTotals,
                          writer: MetricsWriter) -> None:
    """A run killed in its last step's evaluation (its final checkpoint is saved first) has no last row and no
    summary. That checkpoint's metadata holds the row's training part: evaluate its weights, which this run
    restored, and write the row, before the summary is rebuilt from the rows (or, with a larger --steps, before
    the run goes on). Process 0 decides (only it reads the rows); every process evaluates (a collective)."""
    row = None
    if _primary() and totals.last_train_step != start - 1:  # not an eval-only row (eval_at_start, 1 step)
        final = [c for c in list_checkpoints(run_dir) if c.complete and c.step == start]
        row = (json_dict(final[0].path / METADATA) or {}).get("final_row") if final else None
    if not any_process(isinstance(row, dict)):
        return
    evals = _eval_metrics(s, data, eval_batches)
    if _primary():
        row = {**row, **evals}
        writer.log(start - 1, row)
        totals.add_row({"step": start - 1, **row})  # the summary of a run extended from here covers it
        print(f"moejax: {run_dir}: its last step's evaluation was cut short; the final checkpoint is evaluated and "
              f"step {start - 1}'s row written", file=sys.stderr)


def _train_loop(cfg: RunConfig, run_dir: Path, opts: RunOptions, data, resuming: bool, peak: float,
                mesh: Mesh, init_from: Path | None, guard: PreemptionGuard) -> dict:
    t = cfg.train
    s = _setup(cfg, run_dir, opts, resuming, data, mesh, init_from)
    start = int(s.state.step)
    if resuming and 0 < start < t.steps and _primary():
        print(f"moejax: resuming {run_dir} at step {start} of {t.steps}", file=sys.stderr)
    totals = RunTotals()
    try:
        if _primary():  # rows of steps that run again (also after a crash before the first checkpoint), a torn line
            truncate_metrics(run_dir, start)
            if start and (run_dir / "metrics.jsonl").exists():  # earlier segments: the summary covers the whole run
                totals = RunTotals.from_rows(read_metrics(run_dir))
        writer = MetricsWriter(run_dir, wandb_mode=opts.wandb, project=opts.wandb_project,
                               run_name=opts.wandb_run_name or run_dir.name, config=cfg.to_dict(), primary=_primary())
    except BaseException:
        s.ckpt.close()
        raise
    log = StepLog(cfg, writer, totals, emit=print_alarm if _primary() else lambda line: None)
    fault_at = faults.sigterm_at_step()
    bar = tqdm(total=t.steps, initial=start, disable=not opts.progress, desc=f"train {cfg.name}", unit="step",
               dynamic_ncols=True)
    # only ever saved after _check_finite passed; train_steps: the schedules' length, so that an extension stopped
    # before it saved a step can be taken back (`run_dir._check_same_run`)
    saved = {"data_step": start, "finite": True, "train_steps": t.steps}
    profiler = _profiler(opts.profile, run_dir, start, t.steps)

    def save(at: int, kind: str) -> None:
        writer.sync()  # the rows a checkpoint covers are on disk before it
        s.ckpt.save(at, s.state, kind=kind, extra_metadata=saved)

    final_first = bool(s.eval_fns)  # the final checkpoint goes before the last step's evaluation, if there is one

    def commit_on_signal() -> bool:
        """The last step's evaluation is not stopped by a signal (the summary reports it), but the grace period
        goes to committing the final checkpoint first: once it has, a kill in the evaluation loses nothing."""
        if guard.stop_requested():  # a collective, before the same batch on every process
            s.ckpt.wait()
        return False

    try:
        if start == 0 and t.eval_at_start and s.eval_fns:  # the initial weights: an eval-only row of step 0
            writer.log(0, _eval_metrics(s, data, t.eval_batches))
        if start and final_first:  # resumed from a final checkpoint: its row may still be owed
            _write_owed_final_row(s, data, run_dir, start, t.eval_batches, totals, writer)
        guard.defer()  # from the first step on, for good: a signal finishes the step and saves, and after the loop
        # (final checkpoint, summary) it lets the run finish
        for step in range(start, t.steps):
            profiler.begin(step)  # the trace covers the step's body, its logging and evaluation
            t0 = time.perf_counter()
            phase = data.schedule.phase_at(step)
            s.state, metrics = s.step_fn(phase)(s.state, s.to_global(data.train.batch(step)))
            metrics = jax.device_get(metrics)
            load_LE = np.asarray(metrics.pop(LOAD_KEY))  # [L, E]: to the alarms; to the row only now and then
            metrics = {k: to_py(v) for k, v in metrics.items()}
            if faults.kill_at("step", step):
                faults.kill_now()
            log.check(step, metrics, load_LE)  # first: a non-finite grad norm is an alarm line before the stop
            _check_finite(step, metrics, run_dir)
            s.ckpt.poll()  # a background save that failed (e.g. disk full) stops the run now
            metrics.update(_throughput(cfg, data.train.seq_len_at(step), time.perf_counter() - t0, peak))
            metrics.update({"data/context_parallel": phase.context, "moe/cf_send": phase.cf_send,
                            "moe/cf_recv": phase.cf_recv})
            last = step + 1 == t.steps
            if step + 1 == fault_at:  # fault injection for the preemption tests: a real SIGTERM
                faults.sigterm_now()
            due = last or (t.eval_every and (step + 1) % t.eval_every == 0)
            if last and final_first:
                # The final checkpoint before the final evaluation (the hero's: 4 batches of 704 sequences on both
                # MoE paths, longer than some clouds' preemption notice): its write overlaps the evaluation, which
                # on a signal waits for its commit (`commit_on_signal`); from then on a kill loses no step. The
                # checkpoint's metadata holds this row's training part, so the next run evaluates the checkpoint
                # and writes the row (`_write_owed_final_row`).
                saved.update(data_step=step + 1, final_row=log.final_row(step, metrics, load_LE))
                save(step + 1, "final")
                if faults.kill_at("final_eval", step + 1):
                    s.ckpt.wait()
                    faults.kill_now()
            # A preemption's grace period is for the save: a signal skips the evaluation, or stops it between
            # batches (the hero's: 4 of 704 sequences on both MoE paths); not the last step's, which the summary
            # reports. `stop_requested` is a collective, called before the same batch on every process.
            evals = _eval_metrics(s, data, t.eval_batches, commit_on_signal if last else guard.stop_requested) \
                if due else {}
            skip_eval = evals is None
            metrics.update(evals or {})
            log.record(step, metrics, load_LE, last)
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}",
                            tok_s=f"{metrics['throughput/tokens_per_second']:.0f}",
                            drop=f"{metrics['moe/drop_fraction']:.3f}")
            bar.update(1)
            saved["data_step"] = step + 1
            profiler.end(step)  # the step is done (a preemption's save below is in a trace still running)
            if not last and guard.stop_requested():  # in the last step: finish as usual (final save, summary)
                # a step due a permanent checkpoint keeps it permanent: a temporary one would be deleted once a
                # newer checkpoint exists, and the run would lose one of its permanent steps
                save(step + 1, "permanent" if s.ckpt.permanent_at(step + 1) else "temporary")
                s.ckpt.wait()
                # how long this process took from its signal to the saved checkpoint (a peer that learnt of the
                # stop from another process had none): what a launcher's grace period must cover
                after = "" if guard.since is None else \
                    f", {time.monotonic() - guard.since:.1f} s after the {signal.Signals(guard.signum).name}"
                raise Preempted(f"preempted after step {step + 1}{' (its evaluation skipped)' if skip_eval else ''};"
                                f" checkpoint saved in {run_dir}{after}; run the same command again to resume")
            if not last and (kind := s.ckpt.should_save(step + 1)):
                save(step + 1, kind)
        if int(s.state.step) > start and not final_first:  # a rerun of a finished run keeps its final checkpoint
            save(int(s.state.step), "final")
        if faults.sigterm_at_end():  # fault injection: a signal while the final checkpoint commits
            faults.sigterm_now()
    finally:
        profiler.close()
        bar.close()
        writer.close()
        failure = sys.exc_info()[1]
        if lost_peer(failure) is None:
            s.ckpt.close(collective=failure is None)  # the normal end: every process is here
        else:  # a save in flight waits for the lost process's shards (~90 s in orbax's barrier), never to commit
            s.ckpt.abandon()
    if start >= t.steps:  # the run had already finished: report it again
        return _finished_summary(cfg.name, run_dir, t.steps)
    summary = log.summary(cfg.name, int(s.state.step))
    if faults.kill_at("summary", int(s.state.step)):
        faults.kill_now()
    if _primary():
        write_json(run_dir / "summary.json", summary)
    return summary


def _finished_summary(name: str, run_dir: Path, steps: int) -> dict:
    """A finished run's summary.json, once more. A kill between the final checkpoint and the summary's write
    (a node lost at the very end) left none; the last step's row is in metrics.jsonl (fsynced before the final
    checkpoint, or, when that step has an evaluation, written from the checkpoint by `_write_owed_final_row`)
    and the summary is rebuilt from the rows and written: the requeued job ends as the first would have. (Its
    throughput is the median over the logged rows, every `train.log_every`th step, and its wall time the last
    row's: close to, not exactly, what the run would have written.) Without that row it stays a one-line error."""
    path = run_dir / "summary.json"
    if not path.exists():
        totals = RunTotals.from_rows(read_metrics(run_dir))
        if totals.last_train_step == steps - 1:
            summary = totals.summary(name, steps, totals.wall_before)
            if _primary():
                write_json(path, summary)
                print(f"moejax: {path} was missing; rebuilt from metrics.jsonl", file=sys.stderr)
            return summary
    return read_summary(run_dir)


def _throughput(cfg: RunConfig, seq_len: int, seconds: float, peak: float) -> dict:
    tokens = cfg.train.tokens_per_step
    flops = accounting.train_flops(cfg.model, seq_len, tokens)
    return {"throughput/step_time": seconds, "throughput/tokens_per_second": tokens / seconds,
            "throughput/mfu": flops / seconds / peak, "data/seq_len": seq_len}


class InitFromError(RunError):
    """The --init-from source's data is unusable (damaged on disk, non-finite), found when its weights load:
    after the new run dir was written (its config and files' shapes are checked before), so that start is
    undone (`run_dir.forget_new_run`)."""


def _initial_state(state: TrainState, ckpt: CheckpointManager, resuming: bool, init_from: Path | None, optimizer,
                   model_cfg: dict) -> TrainState:
    """Resume from this run's newest usable checkpoint, or start a new run from another run's weights."""
    try:
        if resuming:
            restored = ckpt.restore_latest(state, check=unusable_state)
            if restored is not None:
                return restored[0]
        if init_from is not None:
            params = _init_weights(Path(init_from), state, model_cfg)
            # A new buffer per leaf, also for the fp32 router bias: the state is donated to the step.
            compute = jax.tree.map(lambda p, c: jnp.array(p, dtype=c.dtype, copy=True), params, state.compute)
            # placed as a fresh state of this run is: optax alone puts its step counts on one device, which a
            # step on a mesh refuses (a multi-device --init-from failed at its first step)
            sharding = jax.tree.leaves(params)[0].sharding
            opt_state = init_opt_state(optimizer, params, getattr(sharding, "mesh", None))
            return TrainState(step=state.step, params=params, compute=compute, opt_state=opt_state, rng=state.rng)
    except CheckpointError as e:
        raise RunError(str(e)) from None
    return state


def _init_weights(init_from: Path, state: TrainState, model_cfg: dict):
    """The fp32 weights of `--init-from` (a checkpoint or an export), placed like `state.params`;
    InitFromError when its data is unusable."""
    try:
        if is_export(init_from):  # `moejax export` output: weights + router bias, no optimizer state
            params, meta = init_params_from_export(init_from, state.params, model_cfg), {}
        else:
            loaded, meta = restore(init_from, state, model_config=model_cfg)
            params = loaded.params
    except (CheckpointError, ConfigError) as e:
        raise InitFromError(f"--init-from {init_from}: {e}") from None
    if why := unusable_state(dataclasses.replace(state, params=params), meta):
        raise InitFromError(f"--init-from {init_from}: {why}")
    return params


def evaluate(eval_fn, params, data, n_batches: int, bpt, prefix: str, to_global=lambda b: b,
             stop=lambda: False) -> dict | None:
    """Held-out loss, bits per byte and drop fraction over the first `n_batches` eval batches (always the same
    ones), each pooled over them: sums of CE over sums of tokens, of bytes, and dropped over valid assignments
    (SPEC §3's drop fraction; a mean of per-batch fractions would weight a batch of padding like a full one).
    None, abandoned, when `stop()` is true before a batch."""
    sums = dict.fromkeys(("ce_sum", "tokens", "bytes", "dropped", "valid"), 0.0)
    for i in range(n_batches):
        if stop():
            return None
        out = jax.device_get(eval_fn(params, to_global(data.batch(i)), bpt))
        sums = {k: v + float(out[k]) for k, v in sums.items()}
    ce = sums["ce_sum"]
    return {f"{prefix}loss": ce / max(sums["tokens"], 1.0), f"{prefix}bpb": ce / np.log(2.0) / max(sums["bytes"], 1.0),
            f"{prefix}drop_fraction": sums["dropped"] / max(sums["valid"], 1.0)}


@jax.jit
def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def unusable_state(state: TrainState, meta: dict) -> str | None:
    """Why a restored checkpoint must not be trained from (non-finite weights), or None. One reduction on
    device, once per restore; a checkpoint whose metadata says so is refused without looking."""
    if meta.get("finite") is False or not bool(_all_finite(state.params)):
        return "non-finite parameters (saved after a divergence)"
    return None


# The step's norms, computed inside the jitted step (no extra pass over the weights): the parameter norm is
# non-finite whenever a parameter is (or when they are so large that its square overflows: a divergence
# too), so checking it before anything is logged or saved keeps non-finite weights off disk.
FINITE_KEYS = ("train/loss", "train/grad_norm", "train/update_norm", "train/param_norm")


def _check_finite(step: int, metrics: dict, run_dir: Path) -> None:
    for key in FINITE_KEYS:
        v = metrics[key]
        if isinstance(v, str) or not np.isfinite(v):
            write_json(run_dir / "nonfinite.json", {"step": step, **metrics}, default=str)
            raise RunError(f"non-finite {key} ({v}) at step {step}; metrics written to {run_dir / 'nonfinite.json'}; "
                           "nothing of this step was saved")

