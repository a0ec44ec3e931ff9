"""The run directory: what the trainer reads and writes outside checkpoints.

RUN_DIR holds `config.json` (the resolved RunConfig), `run_info.json` (git SHA, library versions, device
topology, derived numbers), `metrics.jsonl` (one object per step), `summary.json`, and `checkpoints/`
(moejax.checkpoint). Every file is published with `fsio.atomic_write`; only the primary process writes.
A running trainer holds `RunLock` (an exclusive flock on RUN_DIR/.lock) so two can never share a run dir.

Never lose a user's data: `--overwrite` deletes only what moejax wrote (RUN_FILES, RUN_DIRS and their
atomic-write temp files), and only in a directory that is empty or recognisably a moejax run.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax

from moejax import accounting, hostmem
from moejax.checkpoint import METADATA, list_checkpoints
from moejax.config import RunConfig
from moejax.diffs import first_difference
from moejax.fsio import atomic_write, atomic_write_chunks
from moejax.metrics import is_json_object
from moejax.model.transformer import param_count
from moejax.train.state import initializer

LIBRARIES = ("jax", "jaxlib", "optax", "orbax-checkpoint", "numpy", "tokenizers")
LOCK = ".lock"
RUN_FILES = ("config.json", "run_info.json", "metrics.jsonl", "summary.json", "nonfinite.json")
# report/: `moejax report`'s default output; profile/: `train --profile`'s traces
RUN_DIRS = ("checkpoints", "wandb", "report", "profile")
SUMMARY_KEYS = ("preset", "steps", "first_loss", "last_loss", "tokens_per_second", "mfu", "wall_seconds",
                "drop_fraction")
_TEMP = re.compile(r"^\.(.+)\.tmp-\d+$")  # fsio.temp_name of a killed writer
_STEP_PREFIX = re.compile(rb'^\{"step": (-?\d+)[,}]')  # MetricsWriter writes "step" first


class RunError(RuntimeError):
    """A user-facing problem with the run directory or the run itself (one line, exit 2)."""


# ---- the lock ----------------------------------------------------------------------------------------
class RunLock:
    """An exclusive `flock` on RUN_DIR/.lock, held for the run's lifetime; the file names the holder.

    The kernel drops the lock when the holder dies (even by kill -9), so a stale file never blocks a
    resume. Release unlinks the file while still holding the lock; an acquirer therefore checks that
    the file it locked is still the one at the path, and retries otherwise.
    """

    def __init__(self, run_dir: Path):
        self.run_dir, self.path = Path(run_dir), Path(run_dir) / LOCK
        self._fd: int | None = None
        self._created = False

    def acquire(self, job: str = "") -> "RunLock":
        """Lock; `job` (a multi-process job's token) goes into the file, where the job's other processes
        look for it to know they see the same directory (`job_start.JobStart.same_run_dir`)."""
        self._created = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            while not self._try_lock():
                pass
        except OSError as e:
            raise RunError(f"cannot lock run dir {self.run_dir}: {e.strerror or e}") from None
        me = f"PID {os.getpid()} on host {socket.gethostname()}" + (f" (job {job})" if job else "")
        try:  # the holder's name informs a second trainer's error; a full disk fails a run elsewhere, except
            os.ftruncate(self._fd, 0)  # that a job's peers must read its token here
            os.pwrite(self._fd, (me + "\n").encode(), 0)
        except OSError as e:
            if job:
                self.release()
                raise RunError(f"cannot write to run dir {self.run_dir}: {e.strerror or e} ({self.path})") from None
        return self

    def _try_lock(self) -> bool:
        """True when locked; False when the file was replaced under us (retry); RunError when held."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunError(f"run dir {self.run_dir} is in use by {holder} (it holds {self.path}); "
                           "wait for that run to end or stop it first") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # still locked here: nobody can take the old file in between
        os.close(self._fd)
        self._fd = None
        if self._created:  # a run that failed before writing anything leaves no empty dir behind
            try:
                self.run_dir.rmdir()
            except OSError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ---- creating, overwriting, resuming -------------------------------------------------------------------
def _written_by_moejax(name: str) -> bool:
    m = _TEMP.match(name)
    return name in RUN_FILES or name in RUN_DIRS or bool(m and m.group(1) in RUN_FILES)


def json_dict(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing, unreadable or not an object."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def is_moejax_run(run_dir: Path) -> bool:
    """A config.json or run_info.json that moejax wrote, or checkpoint step dirs."""
    cfg, info = json_dict(run_dir / "config.json"), json_dict(run_dir / "run_info.json")
    return bool((cfg and {"model", "train", "parallel"} <= set(cfg)) or (info and "accounting" in info)
                or list_checkpoints(run_dir))


def clear_run_dir(run_dir: Path) -> list[str]:
    """--overwrite: delete what moejax wrote in `run_dir`; returns the names of the entries kept.
    Refuses (RunError, nothing deleted) unless the dir is empty or recognisably a moejax run."""
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK)
    if entries and not is_moejax_run(run_dir):
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise RunError(f"--overwrite refused: {run_dir} is not a moejax run (no config.json, run_info.json or "
                       f"checkpoints written by moejax) and is not empty ({shown}); choose another --run-dir")
    for name in entries:
        if _written_by_moejax(name):
            p = run_dir / name
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return [n for n in entries if not _written_by_moejax(n)]


def prepare_run_dir(run_dir: Path, cfg: RunConfig, overwrite: bool, data: dict | None = None) -> bool:
    """Create the run dir and its config.json; True when it already holds this run (resume): the same config
    up to what a restart may change, and (`data`: the loader's `describe()`) the same data.
    Process 0 calls it, with the RunLock held; a job's other processes take its answer (`job_start`)."""
    cfg_path = run_dir / "config.json"
    if cfg_path.exists() and not overwrite:
        if not is_moejax_run(run_dir):  # --overwrite would refuse it too (`clear_run_dir`): don't offer it
            raise RunError(f"run dir {run_dir} holds a config.json that is not a moejax run's (an export's, or "
                           "another tool's); choose another --run-dir")
        old = json_dict(cfg_path)
        if old is None:
            raise RunError(f"run dir {run_dir} has an unreadable config.json; pass --overwrite to start it over")
        same_data = data is not None and check_same_data(run_dir, data)
        _check_same_run(run_dir, old, cfg.to_dict(), store_may_move=same_data)
        try:
            atomic_write(cfg_path, cfg.to_json())  # records the mesh (and steps) this restart runs with
        except OSError as e:
            raise RunError(f"cannot write to run dir {run_dir}: {e.strerror or e}") from None
        return True
    if not overwrite and run_dir.is_dir() and (list_checkpoints(run_dir) or (run_dir / "metrics.jsonl").exists()):
        # config.json is written before anything else, so its loss (or checkpoints restored without it) must not
        # make the run a new one that trains from step 0 into the old run's checkpoints and metrics
        raise RunError(f"run dir {run_dir} holds a run's checkpoints or metrics but no config.json: restore its "
                       "config.json to resume, or pass --overwrite to start it over")
    try:
        if run_dir.exists() and overwrite and (kept := clear_run_dir(run_dir)):
            print(f"moejax: --overwrite kept {len(kept)} entr{'y' if len(kept) == 1 else 'ies'} moejax did not "
                  f"write in {run_dir}: {', '.join(kept)}", file=sys.stderr)
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(cfg_path, cfg.to_json())
    except OSError as e:
        raise RunError(f"cannot write to run dir {run_dir}: {e.strerror or e}") from None
    return False


def forget_new_run(run_dir: Path) -> None:
    """Undo the start of a new run that stopped before its first step (its --init-from source's data was
    unusable): its config.json, run_info.json and still empty checkpoints/ go, so the corrected command
    starts it as new; the lock's release then removes a dir the run created. Not `clear_run_dir`: that also
    takes any other name moejax writes (a stray summary.json, report/) from a dir the user handed over."""
    for name in ("config.json", "run_info.json"):
        (run_dir / name).unlink(missing_ok=True)
    try:
        (run_dir / "checkpoints").rmdir()
    except OSError:  # not empty, or not there: keep it
        pass


# The mesh may change between restarts (checkpoints reshard on load), and so may the alarm thresholds
# (monitoring only) and how the step is laid out (block remat, scanned or unrolled layers: same math); the
# model, data and schedule may not, except that a run may be extended to more steps.
RESTART_MAY_CHANGE = ("parallel", "alarms")
TRAIN_MAY_CHANGE = ("remat", "scan_layers")
# The loader may prefetch more or less; the store may move when its identity shows it holds the same tokens
# (`check_same_data`), not otherwise (a run recorded before identities were).
DATA_MAY_CHANGE = ("prefetch",)


def _comparable(d: dict, store_may_move: bool = False) -> dict:
    def train(v: dict) -> dict:
        return {**{k: x for k, x in v.items() if k not in TRAIN_MAY_CHANGE}, "steps": None}

    def data(v: dict) -> dict:
        return {k: x for k, x in v.items() if k not in DATA_MAY_CHANGE and not (store_may_move and k == "store")}

    section = {"train": train, "data": data}
    return {k: (section[k](v) if k in section and isinstance(v, dict) else v)
            for k, v in d.items() if k not in RESTART_MAY_CHANGE}


def check_same_data(run_dir: Path, data: dict) -> bool:
    """On a resume: the data (`Data.describe()`) must be what the run has trained on, as run_info.json recorded
    it: the same tokenizer and token files (`store.data_identity`), wherever the store is now. A store prepared
    again at the same path (another tokenizer, other sources) would change what every token id means. True when
    the identities match; False for a run recorded before identities existed (its store path is compared)."""
    was = (json_dict(run_dir / "run_info.json") or {}).get("data") or {}
    if not was.get("identity"):
        return False
    if was["identity"] == data.get("identity"):
        return True
    line = lambda d: (f"{d.get('path') or 'the embedded corpus'} ({d.get('tokenizer')}, {d.get('vocab_size')} ids, "
                      f"identity {str(d.get('identity'))[:12]})")
    raise RunError(f"run dir {run_dir} was trained on other data: {line(was)} then, {line(data)} now; "
                   "give data.store the store it trained on, or choose another --run-dir")


def _with_new_fields(old: dict, new: dict) -> dict:
    """`old` with the fields it predates taken from `new`: a setting that did not exist when the run was
    started (a config.json from an older moejax) cannot differ from it. Fields only `old` has still count."""
    out = {**{k: v for k, v in new.items() if k not in old}, **old}
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(old.get(k), dict):
            out[k] = _with_new_fields(old[k], v)
    return out


def _check_same_run(run_dir: Path, old: dict, new: dict, store_may_move: bool = False) -> None:
    diff = first_difference(_comparable(_with_new_fields(old, new), store_may_move), _comparable(new, store_may_move))
    if diff:
        raise RunError(f"run dir {run_dir} already holds a different run ({diff}); "
                       "choose another --run-dir or pass --overwrite")
    was, now = old.get("train", {}).get("steps"), new["train"]["steps"]
    if was == now:
        return
    shorter = isinstance(was, int) and now < was
    saved_under = _steps_saved_under(run_dir) if shorter else None
    if not isinstance(was, int) or (shorter and (saved_under is None or now < saved_under)):
        raise RunError(f"run dir {run_dir} already holds a different run (train.steps: {was} there, {now} now); "
                       "a run can be extended to more steps, not shortened")
    if shorter:  # an extension (or start) stopped before it saved a step under its train.steps
        print(f"moejax: {run_dir} was set to {was} steps but saved no checkpoint under that; it runs {now} steps "
              "now", file=sys.stderr)
        if saved_under in (0, now):
            return
        was = saved_under  # what the run extends from: the steps its checkpoint's schedules had
    # no step named here: the resume may fall back past the newest checkpoint; "resuming ... at step N" follows
    print(f"moejax: extending {run_dir} from {was} to {now} steps: the learning-rate and data schedules, which "
          "scale with train.steps, change from the step it resumes at on", file=sys.stderr)


def _steps_saved_under(run_dir: Path) -> int | None:
    """train.steps when the newest complete checkpoint was saved (its metadata.json's `train_steps`, which the
    loop records): 0 when there is no complete checkpoint (a restart starts over); None when that metadata
    doesn't say (unreadable, or written before it was recorded). Every older checkpoint was saved under as
    many steps or fewer: a change of train.steps is never below it."""
    done = [c for c in list_checkpoints(run_dir) if c.complete]
    if not done:
        return 0
    steps = (json_dict(done[-1].path / METADATA) or {}).get("train_steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


# ---- files ---------------------------------------------------------------------------------------------
def run_info(cfg: RunConfig, peak: float) -> dict:
    """What reproduces the run from its log (STYLE rule 10)."""
    from moejax.model import kernel_choice  # here too: the Pallas kernels' modules
    from moejax.train.optimizer import optimizer_settings  # here: `summary` and `report` read this module, not optax

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return {"git_sha": sha, "python": sys.version.split()[0],
            "versions": {p: importlib.metadata.version(p) for p in LIBRARIES},
            "devices": [str(d) for d in jax.devices()], "process_count": jax.process_count(),
            "glibc_tunables": hostmem.tunables(), "host_allocator": hostmem.allocator(),  # huge pages; mimalloc
            "host_allocator_settings": hostmem.allocator_settings(),  # e.g. when mimalloc hands memory back
            "xla_flags": os.environ.get("XLA_FLAGS", ""),  # with step_compiler_options: how XLA compiled the step
            "peak_flops": peak, "optimizer": optimizer_settings(cfg),  # hero: the heuristic's, not train.b2 etc.
            "kernels": kernel_choice.current()["impl"],  # MOEJAX_* -> "xla" | "gpu_kernel", as the steps are built
            "accounting": accounting.summary(cfg, param_count(cfg.model, initializer(cfg.model)))}


def peak_source(run_dir: Path) -> str:
    """What the run's MFU is against, as `moejax summary` words it: the peak given by --peak-flops when
    run_info.json says so, else the one measured at start (every run's default)."""
    if (json_dict(run_dir / "run_info.json") or {}).get("peak_source") == "--peak-flops":
        return "the peak given by --peak-flops"
    return "measured matmul peak"


def write_json(path: Path, obj: dict, **kw) -> None:
    atomic_write(path, json.dumps(obj, indent=2, **kw))


def _keep_row(line: bytes, start: int) -> bool:
    """A whole row (newline included) of a step before `start`."""
    m = _STEP_PREFIX.match(line)
    return line.endswith(b"\n") and bool(m) and int(m.group(1)) < start


def truncate_metrics(run_dir: Path, start: int) -> None:
    """Before a (re)start at step `start`: drop the rows of steps that will run again and a torn last line,
    so metrics.jsonl has each step once. Streams (the file can be huge): one read pass finds the first row
    to drop; only then is the file rewritten, its kept prefix copied in blocks and the rest filtered line
    by line, into a temp file renamed over it."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    cut = 0
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip() and not _keep_row(raw, start):
                break
            cut += len(raw)
        else:
            return  # nothing to drop: no rewrite

    def chunks():
        with open(path, "rb") as f:
            left = cut
            while left:
                block = f.read(min(left, 1 << 24))
                left -= len(block)
                yield block
            for raw in f:  # normally only rows after the resume step: all dropped
                if _keep_row(raw, start):
                    yield raw
                elif not raw.endswith(b"\n") and _keep_row(raw + b"\n", start) and is_json_object(raw):
                    yield raw + b"\n"  # a whole last row that only lacks its newline

    atomic_write_chunks(path, chunks())


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _summary_damage(s: dict) -> str | None:
    """What in a summary.json (moejax's own file, edited or damaged since) `moejax summary` can't print."""
    kinds = {"steps": int, "first_loss": _number, "last_loss": _number, "wall_seconds": _number, "mfu": _number,
             "drop_fraction": _number, "preset": str, "eval/loss": _number, "eval/bpb": _number, "eval_step": int}
    for key, kind in kinds.items():
        ok = (lambda v: isinstance(v, kind) and not isinstance(v, bool)) if isinstance(kind, type) else kind
        if key in s and not ok(s[key]):
            what = {int: "an integer", str: "a string"}.get(kind, "a number")
            return f"{key} is {s[key]!r}, not {what}"
    if s["tokens_per_second"] is not None and not _number(s["tokens_per_second"]):
        return f"tokens_per_second is {s['tokens_per_second']!r}, not a number"
    if ("eval/loss" in s) != ("eval/bpb" in s):
        return "it has one of eval/loss and eval/bpb without the other"
    alarms = s.get("alarms", {})
    if not isinstance(alarms, dict) or not all(
            isinstance(a, dict) and isinstance(a.get("count"), int) and isinstance(a.get("first"), str)
            and (a["count"] < 2 or isinstance(a.get("last"), str)) for a in alarms.values()):
        return "its alarms are not {kind: {count, first, last}}"
    return None


def read_summary(run_dir: Path) -> dict:
    """summary.json, with a missing, empty or truncated file as one RunError line."""
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        raise RunError(f"no summary.json in {run_dir} (did the run finish?)")
    s = json_dict(path)
    if s is None:
        raise RunError(f"{path} is empty, truncated or not a JSON object; the run's numbers are in metrics.jsonl")
    missing = [k for k in SUMMARY_KEYS if k not in s]
    if missing:
        raise RunError(f"{path} lacks {', '.join(missing)}; the run's numbers are in metrics.jsonl")
    if why := _summary_damage(s):
        raise RunError(f"{path}: {why}; the run's numbers are in metrics.jsonl")
    steps = ((json_dict(Path(run_dir) / "config.json") or {}).get("train") or {}).get("steps")
    if isinstance(steps, int) and isinstance(s["steps"], int) and steps > s["steps"]:  # extended, not yet finished
        raise RunError(f"{path} is from when the run had {s['steps']} steps; it now has {steps} and has not finished "
                       "them (its numbers so far are in metrics.jsonl)")
    return s
