"""Checkpoints: one directory per step, an atomic completion marker, newest-complete resume.

Layout (SPEC §5, STYLE rule 11)::

    run_dir/checkpoints/step_00006000/
        metadata.json   step, wall time, kind, temporary?, config hash, mesh shape, model config, the
                        arrays' checksums, extras
        state/          the whole train state, orbax StandardCheckpointHandler (OCDBT), written async
        COMMITTED       completion marker, written LAST (temp name -> fsync -> rename -> fsync dir)

Notable choices and where they come from:

- Array I/O is orbax's (`AsyncCheckpointer` + `StandardSave`/`StandardRestore`); nothing here writes
  tensors. orbax already commits `state/` by renaming a temp dir, but a step directory is only trusted
  once `COMMITTED` exists, and that file is written by our commit thread strictly after orbax's
  background write has finished. A crash (even kill -9) at any earlier moment leaves no marker, and a
  dir without a marker is ignored by discovery.
- Policy (SPEC §5): permanent every `permanent_every` steps, a rolling temporary when
  `temporary_every_s` elapsed since the last save, a `final` (permanent) one at the end. A temporary
  is superseded by ANY newer complete checkpoint; superseded temporaries and older incomplete dirs are
  deleted only after that newer checkpoint's marker is on disk (marker removed first, so a crash
  mid-delete leaves an incomplete dir, never a complete-looking broken one).
- Restore targets are `jax.ShapeDtypeStruct(shape, dtype, sharding=...)`, so a checkpoint saved on one
  mesh restores onto another (8 devices -> 1, different layout) and into memory kind `pinned_host`.
  Python scalars in the abstract state (e.g. a data position `int`) come back as Python scalars.
- Restore falls back from the newest complete checkpoint to older ones with a one-line warning each;
  if none works, one error lists everything tried. A model-config mismatch is NOT a reason to fall
  back (older checkpoints of the same run share the config): it raises at once.
- Multi-process: every process calls `save`/`restore*`/`should_save`; orbax coordinates the multi-host
  array write; process 0 alone writes JSON, the marker and deletes. `should_save` is process 0's
  decision broadcast to all (wall clocks differ between hosts); restore success and preemption
  flags are OR/AND-reduced across processes so every host takes the same branch. The filesystem
  must be shared. Tests run 2 processes on 127.0.0.1 (tests/test_multiprocess.py): a SIGTERM to one makes
  both save the same step, and the resumed pair follows the uninterrupted trace.
- Preemption (SIGTERM/SIGINT -> a saved checkpoint, exit 75) is `moejax.preemption`'s.
- A checkpoint can be refused after it restores (`check`, e.g. non-finite weights): restore falls back
  past it like past a corrupt one. So it is when its data changed on disk: metadata.json holds three 32-bit
  sums of each array (`state_checksum`; one weighs each word by its place), taken at save, compared after every
  restore (orbax checks none).
- A failed background save is reported at the next `poll()` (every step), as one line: orbax's own
  multi-hundred-line error logs of that failure are filtered out (`_QuietOrbaxErrors`), and so is the
  aftermath printed at exit (`_drop_failed_io_aftermath`): "Event loop is closed" tracebacks from
  tensorstore's late write callbacks, asyncio's "exception was never retrieved" for orbax's write
  futures, and Python's warning of orbax's unawaited write coroutines. Every other error still prints.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import array_metadata_store  # not exported; orbax's default handler uses it

from moejax import faults, state_checksum
from moejax.diffs import find_difference
from moejax.fsio import atomic_write, fsync_dir

log = logging.getLogger(__name__)

MARKER = "COMMITTED"
METADATA = "metadata.json"
STATE = "state"
KINDS = ("permanent", "temporary", "final")
_STEP_RE = re.compile(r"^step_(\d{8,})$")
# orbax splits every replicated array's write across its replicas ("replica-parallel"). Each slice is an eager
# `lax.slice` on one device, compiled per device and shape: ~70 compiles (~5 s here) at the first save of the
# tiny model on 8 devices, for arrays of a few KiB. Only split when each replica's slice (shard bytes /
# replicas) is at least this much; smaller shards are written whole by replica 0, as without replica-parallel.
# The handler is registered in orbax's global registry when this module is imported.
MIN_REPLICA_SLICE_BYTES = 4 << 20


def _register_array_handler() -> None:
    absl = logging.getLogger("absl")  # orbax warns that it overrides its own default handler: say nothing
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        # As orbax's default handler otherwise, with its per-array metadata store (`state/array_metadatas`).
        handler = ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
                                                 array_metadata_store=array_metadata_store.Store())
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl.setLevel(level)


_register_array_handler()


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found or read. Messages are one line."""


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint's model config differs from the current one (never a reason to fall back)."""


# ----------------------------------------------------------------------------- files


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    complete: bool  # has the completion marker


def list_checkpoints(run_dir: str | os.PathLike) -> list[CheckpointInfo]:
    """All step directories under `run_dir/checkpoints`, oldest first (complete or not)."""
    ckdir = Path(run_dir).absolute() / "checkpoints"
    if not ckdir.is_dir():
        return []
    out = []
    for p in ckdir.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append(CheckpointInfo(int(m.group(1)), p, (p / MARKER).is_file()))
    return sorted(out, key=lambda i: i.step)


def ensure_writable(run_dir: str | os.PathLike) -> Path:
    """Create `run_dir/checkpoints` and prove a file can be written there; returns that dir.

    Call before training starts so an unwritable run dir fails in seconds, not at the first save.
    """
    ckdir = Path(run_dir).absolute() / "checkpoints"
    try:
        ckdir.mkdir(parents=True, exist_ok=True)
        probe = ckdir / f".write-probe-{os.getpid()}"
        atomic_write(probe, b"ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"run dir {run_dir} is not writable: {type(e).__name__}: {e}") from None
    return ckdir


def _read_metadata(step_dir: Path) -> dict:
    try:
        meta = json.loads((step_dir / METADATA).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{step_dir}: unreadable {METADATA}: {type(e).__name__}: {e}") from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise CheckpointError(f"{step_dir}: {METADATA} has no 'step' field")
    return meta


def _delete_checkpoint(path: Path) -> None:
    # Marker first: a crash mid-rmtree then leaves an (ignored) incomplete dir.
    (path / MARKER).unlink(missing_ok=True)
    fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- config checks


def _normalize(d: dict) -> dict:
    # JSON round trip, so tuples vs lists (metadata.json has only lists) never count as a mismatch.
    return json.loads(json.dumps(d, sort_keys=True, default=str))


def config_hash(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(_normalize(cfg), sort_keys=True).encode()).hexdigest()[:16]


def check_compatible(saved_model_cfg: dict, current: dict, *, ignore: Iterable[str] = ()) -> None:
    """Raise `IncompatibleCheckpointError` naming the first differing field (dotted for nesting).

    `ignore` lists fields allowed to change across a resume (e.g. sequence length at a context
    extension). Fields are compared in the current config's order, then fields only the checkpoint has.
    """
    d = find_difference(_normalize(saved_model_cfg), _normalize(current), ignore=ignore)
    if d is not None:
        raise IncompatibleCheckpointError(
            f"checkpoint incompatible with the current model config: {d.key} is {d.old!r} "
            f"in the checkpoint but {d.new!r} now"
        )


# ----------------------------------------------------------------------------- multi-process


def _is_primary() -> bool:
    return jax.process_index() == 0


def _broadcast_from_primary(code: int) -> int:
    if jax.process_count() == 1:
        return code
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(code)))


COMMIT_POLL_S = 1.0  # with several processes, how often a wait for a save checks that every process is still there

# What a collective's error says when another process of the job is gone: its connections reset or closed (a
# killed process on a live kernel), jax's heartbeat or unhealthy-task reports, NCCL's remote error; on CPU,
# gloo's set-up key-value timeout (30 s), which a peer that is alive but that late would also raise. Not any
# gloo/NCCL error: a deterministic one (out of memory, a bad config) must not be requeued forever.
_PEER_GONE = re.compile(r"Connection reset by peer|Connection closed by peer|heartbeat|unhealthy|"
                        r"GetKeyValue\(\) timed out|ncclRemoteError|remote process exited|Broken pipe")


def lost_peer(e: BaseException | None) -> str | None:
    """One line for a multi-process run whose collective failed because another process is gone, else None.
    The error may sit under others (`__cause__`/`__context__`): e.g. a step failed, then a cleanup raised.
    Such a run ends like a preempted one (exit 75: the launcher requeues; the same command resumes)."""
    if e is None or jax.process_count() < 2:
        return None
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        # jax raises a collective's failure as JaxRuntimeError, or (multihost_utils' allgathers over gloo, e.g. the
        # checkpoint's commit vote) as a plain ValueError: both name the lost connection in their text
        if isinstance(e, (jax.errors.JaxRuntimeError, ValueError)) and _PEER_GONE.search(str(e)):
            first = str(e).strip().splitlines()[0]
            return (f"process {jax.process_index()} of {jax.process_count()}: a collective failed, another "
                    f"process is gone ({first[:240]}); run the same command on every process again to resume")
        e = e.__cause__ or e.__context__
    return None


def any_process(flag: bool) -> bool:
    """`flag` OR-reduced over the job's processes (a collective: every process calls it at the same point)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array(flag))))


def _mesh_shape(state: Any) -> dict[str, int] | None:
    for leaf in jax.tree.leaves(state):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return {str(k): int(v) for k, v in sharding.mesh.shape.items()}
    return None


def _reject_typed_keys(state: Any) -> None:
    for leaf in jax.tree.leaves(state):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise CheckpointError("train state holds a typed PRNG key; store jax.random.key_data(key)")


def _is_empty(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and 0 in x.shape


def without_empty(tree: Any) -> Any:
    """Zero-size arrays as None: they hold nothing, and orbax refuses to save them (a model with
    `model.n_shared=0` has [L, 0, D, Fs] shared-expert stacks, and the optimizer moments to match)."""
    return jax.tree.map(lambda x: None if _is_empty(x) else x, tree)


def with_empty(target: Any, restored: Any) -> Any:
    """`restored` (saved `without_empty`) with the target's zero-size arrays put back."""
    def leaf(t, r):
        if not _is_empty(t):
            return r
        return np.zeros(t.shape, t.dtype) if isinstance(t, np.ndarray) else jax.device_put(np.zeros(t.shape, t.dtype),
                                                                                          t.sharding)

    return jax.tree.map(leaf, target, restored, is_leaf=lambda x: x is None)


# ----------------------------------------------------------------------------- restore


def abstract_target(abstract_state: Any, shardings: Any = None) -> Any:
    """Restore target: each array leaf -> `ShapeDtypeStruct(shape, dtype, sharding)`.

    Sharding comes from `shardings` (a pytree matching the state, or one Sharding for every leaf),
    else from the leaf itself (a live array or a ShapeDtypeStruct with sharding), else device 0.
    Python scalars and numpy arrays stay as they are (orbax restores them as the same type); note
    `jax.eval_shape` turns a Python int into an int32 ShapeDtypeStruct, which restores as an array.
    """
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def leaf(x, s=None):
        if isinstance(x, (int, float, bool, np.ndarray, np.generic)):
            return x
        sharding = s or getattr(x, "sharding", None) or default
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    if shardings is None:
        return jax.tree.map(leaf, abstract_state)
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: leaf(x, shardings), abstract_state)
    return jax.tree.map(leaf, abstract_state, shardings)


def one_line(e: BaseException, limit: int = 600) -> str:
    """An orbax/tensorstore error as one line. orbax's read error ("Encountered error while reading array
    index: ...") says neither which array nor why; its cause does (`OUT_OF_RANGE: Error reading "embed/0.0"
    ...: Requested byte range ... is not valid for value of size 1000`), so the cause is appended."""

    def text(x: BaseException) -> str:
        t = " / ".join(ln.strip() for ln in str(x).strip().splitlines() if ln.strip())
        for spec in (" [tensorstore_spec", ". See full TensorStore details"):  # kilobytes of JSON spec follow
            t = t.split(spec)[0]
        return f"{type(x).__name__}: {t}"

    line, why = text(e), text(e.__cause__) if e.__cause__ is not None else ""
    if why and why.split(": ", 1)[1] not in line:
        line += f" (from {why})"
    # Too long: keep both ends, since the OS reason (e.g. "No space left on device") comes last.
    return line if len(line) <= limit else line[: limit // 2] + " ... " + line[-limit // 2:]


def restore(step_dir: str | os.PathLike, abstract_state: Any, shardings: Any = None, *,
            model_config: dict | None = None, ignore: Iterable[str] = ()) -> tuple[Any, dict]:
    """Restore one specific complete checkpoint (e.g. `--init-from`). Returns (state, metadata).

    With `model_config`, the saved model config is checked first (`IncompatibleCheckpointError`).
    Any other failure is a one-line `CheckpointError` naming the directory.
    """
    step_dir = Path(step_dir).absolute()  # orbax needs absolute paths
    if not (step_dir / MARKER).is_file():
        raise CheckpointError(f"{step_dir}: incomplete checkpoint (no {MARKER} marker)")
    meta = _read_metadata(step_dir)
    if model_config is not None and "model_config" in meta:
        check_compatible(meta["model_config"], model_config, ignore=ignore)
    target = abstract_target(abstract_state, shardings)
    with reading(step_dir):
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
            state = with_empty(target, ckptr.restore(step_dir / STATE,
                                                      args=ocp.args.StandardRestore(without_empty(target))))
    check_checksums(step_dir, meta, state)
    return state, meta


def check_checksums(step_dir: Path, meta: dict, restored: Any) -> None:
    """CheckpointError when a restored array's data is not what was saved (a flipped bit, a stale or damaged
    file); checkpoints saved before checksums pass unchecked."""
    try:
        bad = state_checksum.mismatches(meta.get("checksums"), restored)
    except TypeError as e:  # a damaged or edited metadata.json must not turn the check off
        raise CheckpointError(f"{step_dir}: {METADATA}'s checksums are {e}, not a map of array to checksum") from None
    if bad:
        raise CheckpointError(f"{step_dir}: its data changed on disk since it was saved: checksum of "
                              f"{state_checksum.named(bad)} differs from metadata.json's")

Check = Callable[[Any, dict], "str | None"]  # (restored state, metadata) -> why it is unusable, or None


def restore_latest(run_dir: str | os.PathLike, abstract_state: Any, shardings: Any = None, *,
                   model_config: dict | None = None, ignore: Iterable[str] = (),
                   check: Check | None = None) -> tuple[Any, dict] | None:
    """Newest complete checkpoint that restores (and passes `check`), falling back to older ones; None if
    there is none.

    Incomplete dirs are skipped silently. Each unusable complete one logs a one-line warning; if all
    fail, `CheckpointError` lists every directory tried and why.
    """
    candidates = [i for i in reversed(list_checkpoints(run_dir)) if i.complete]
    if not candidates:
        return None
    tried = []
    for info in candidates:
        try:
            result, err = restore(info.path, abstract_state, shardings, model_config=model_config, ignore=ignore), None
        except IncompatibleCheckpointError:
            raise
        except CheckpointError as e:
            result, err = None, e
        if result is not None and check is not None and (why := check(*result)):
            result, err = None, CheckpointError(f"{info.path}: {why}")
        if not any_process(err is not None):  # every host must take the same branch
            return result
        msg = str(err) if err is not None else f"{info.path}: restore failed on another process"
        log.warning("checkpoint unusable, falling back to an older one: %s", msg)
        tried.append(msg)
    raise CheckpointError(f"no usable checkpoint in {Path(run_dir) / 'checkpoints'}; tried: " + " | ".join(tried))


# ----------------------------------------------------------------------------- manager


class CheckpointManager:
    """Save policy + async saving with an atomic completion marker + garbage collection.

    Typical loop::

        ckpt = CheckpointManager(run_dir, permanent_every=6000, model_config=cfg_dict)
        restored = ckpt.restore_latest(abstract_state)
        with preemption.PreemptionGuard() as guard:
            for step in ...:
                state = train_step(state)
                if guard.stop_requested():
                    ckpt.save(step, state, kind="final"); ckpt.wait(); sys.exit(preemption.EXIT_PREEMPTED)
                if kind := ckpt.should_save(step):
                    ckpt.save(step, state, kind=kind)
        ckpt.save(last_step, state, kind="final"); ckpt.close()
    """

    def __init__(self, run_dir: str | os.PathLike, *, permanent_every: int, temporary_every_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic, model_config: dict | None = None,
                 run_config: dict | None = None):
        if permanent_every <= 0:
            raise ValueError(f"permanent_every ({permanent_every}) must be positive")
        if temporary_every_s <= 0:
            raise ValueError(f"temporary_every_s ({temporary_every_s}) must be positive")
        self.run_dir = Path(run_dir).absolute()  # orbax needs absolute paths
        self.ckpt_dir = ensure_writable(run_dir)
        self.permanent_every = permanent_every
        self.temporary_every_s = temporary_every_s
        self._clock = clock
        self._model_config = model_config
        self._run_config = run_config
        self._last_save_time = clock()
        self._ckptr = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
        self._commit_thread: threading.Thread | None = None
        self._commit_error: BaseException | None = None
        self._completed: set[int] = set()  # steps this manager saved and committed
        self._last_checksums: tuple[int | None, dict] = (None, {})
        self._quiet = _QuietOrbaxErrors().install()
        _drop_failed_io_aftermath()

    # -- policy

    def permanent_at(self, step: int) -> bool:
        """Whether `step` is one of the permanent checkpoints' steps (every `permanent_every`)."""
        return step > 0 and step % self.permanent_every == 0

    def decide(self, step: int, now: float | None = None) -> str | None:
        """This process's policy decision (pure): "permanent", "temporary" or None."""
        now = self._clock() if now is None else now
        if self.permanent_at(step):
            return "permanent"
        if now - self._last_save_time >= self.temporary_every_s:
            return "temporary"
        return None

    def should_save(self, step: int, now: float | None = None) -> str | None:
        """Process 0's `decide` broadcast to every process (a collective when multi-process)."""
        codes = (None, "permanent", "temporary")
        return codes[_broadcast_from_primary(codes.index(self.decide(step, now)))]

    # -- saving

    def _metadata(self, step: int, kind: str, state: Any, extra: dict | None) -> dict:
        meta = {"step": int(step), "wall_time": time.time(), "kind": kind, "temporary": kind == "temporary",
                "config_hash": config_hash(self._run_config or self._model_config or {}),
                "mesh_shape": _mesh_shape(state), "process_count": jax.process_count(),
                "model_config": self._model_config, "checksums": self._checksums(step, state)}
        return {**meta, **_normalize(extra or {})}

    def _checksums(self, step: int, state: Any) -> dict:
        """The state's checksums, taken once per step: the final save right after a permanent one of the same
        step only rewrites metadata.json, and a pass over the hero's offloaded state takes seconds."""
        if self._last_checksums[0] != step:
            self._last_checksums = (step, state_checksum.checksums(state))
        return self._last_checksums[1]

    def save(self, step: int, state: Any, *, kind: str = "permanent", extra_metadata: dict | None = None) -> Path:
        """Start an async save of `state` at `step`; returns the step dir (not yet complete).

        Blocks only for the previous save to finish and for orbax's device->host copy; the write and
        the marker happen in the background. kind: "permanent" | "temporary" | "final" (permanent).
        Saving a step this manager already committed (e.g. "final" right after a permanent at the
        same step) only rewrites metadata.json; any other dir of the same step (a crashed save, or a
        broken one left behind by a fallback restore) is replaced.
        """
        if kind not in KINDS:
            raise ValueError(f"kind ({kind!r}) must be one of {KINDS}")
        _reject_typed_keys(state)
        self._finish_pending(collective=True)  # every process saves at the same steps
        path = self.ckpt_dir / step_dir_name(step)
        meta = json.dumps(self._metadata(step, kind, state, extra_metadata), indent=1).encode()
        if step in self._completed:
            if kind != "temporary" and _is_primary():  # upgrade in place; never downgrade to temporary
                atomic_write(path / METADATA, meta)
            return path
        if _is_primary():
            if path.exists():
                _delete_checkpoint(path)
            path.mkdir()
            atomic_write(path / METADATA, meta)
        self._ckptr.save(path / STATE, args=ocp.args.StandardSave(without_empty(state)))  # all processes
        self._last_save_time = self._clock()
        self._commit_thread = threading.Thread(target=self._commit, args=(step, path), name=f"ckpt-commit-{step}")
        self._commit_thread.start()
        if faults.kill_at("saving", step):  # a save just issued, its write in flight on every process
            faults.kill_now()
        return path

    def _commit(self, step: int, path: Path) -> None:
        try:
            self._ckptr.wait_until_finished()  # orbax's background write (and multi-host barriers)
            if faults.kill_at("save", step):  # arrays on disk, no marker: a crash mid-save
                faults.kill_now()
            if _is_primary():
                atomic_write(path / MARKER, f"{step}\n".encode())
                self._collect_garbage(step)
            self._completed.add(step)
        except BaseException as e:  # surfaced by the next save()/wait()
            self._commit_error = e

    def _collect_garbage(self, newest_complete: int) -> None:
        """Delete temporaries and incomplete dirs older than the checkpoint that just completed."""
        for info in list_checkpoints(self.run_dir):
            if info.step >= newest_complete:
                continue
            if not info.complete:
                _delete_checkpoint(info.path)
                continue
            try:
                temporary = bool(_read_metadata(info.path).get("temporary"))
            except CheckpointError:
                continue  # never delete what we cannot identify
            if temporary:
                _delete_checkpoint(info.path)

    def _finish_pending(self, collective: bool = False) -> None:
        """Wait for the save in flight and raise its error. `collective`: every process calls this at the same
        point (before a save, `wait`, the normal end), so with several processes the wait can watch for a lost
        one (`_await_every_commit`)."""
        if collective and jax.process_count() > 1:
            self._await_every_commit()
        if self._commit_thread is not None:
            self._commit_thread.join()
            self._commit_thread = None
        if self._commit_error is not None:
            err, self._commit_error = self._commit_error, None
            raise CheckpointError(f"checkpoint save failed: {one_line(err)}") from err

    def _await_every_commit(self) -> None:
        """Wait until no process's save is running, in COMMIT_POLL_S slices, each ending in a collective that
        asks just that. A process lost meanwhile fails that collective at once (its connections reset), where
        the commit thread would wait ~90 s in orbax's barrier before the process aborted. Every process runs the
        same collectives here whatever its own save's state (`poll` may have ended it already on one process
        and not on another)."""
        while True:
            thread = self._commit_thread
            if thread is not None:
                thread.join(COMMIT_POLL_S)
            if not any_process(thread is not None and thread.is_alive()):
                return

    def poll(self) -> None:
        """Raise CheckpointError now if the background save has already failed (never blocks): call it
        every step, so a full disk is reported at once, not at the next save. (No collective here: whether
        this process's save has ended differs between processes.)"""
        if self._commit_thread is not None and not self._commit_thread.is_alive():
            self._finish_pending()

    def wait(self) -> None:
        """Block until the in-flight save is complete (marker written, old temporaries deleted). Every process
        calls it at the same point."""
        self._finish_pending(collective=True)

    def close(self, collective: bool = False) -> None:
        """Finish the save in flight and release orbax. `collective`: every process closes here, at the run's
        normal end (not on an error path, which other processes may not take)."""
        try:
            self._finish_pending(collective)
        except BaseException as e:
            if lost_peer(e) is not None:  # orbax's own close would wait for the lost process's shards too
                self.abandon()
            else:
                self._close_orbax()
            raise
        self._close_orbax()

    def _close_orbax(self) -> None:
        try:
            self._ckptr.close()
        finally:
            self._quiet.remove()

    def abandon(self) -> None:
        """Leave without waiting: another process of the job is gone, so a save in flight waits for its shards
        and can never commit. Its directory stays without a COMMITTED marker, which restores skip. The caller
        exits next (`moejax train` within ~10 s); its orbax and commit threads are left as they are."""
        self._quiet.remove()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- restoring

    def restore_latest(self, abstract_state: Any, shardings: Any = None, *, ignore: Iterable[str] = (),
                       check: Check | None = None):
        """`restore_latest(run_dir, ...)` with this manager's model config checked."""
        self._finish_pending()
        return restore_latest(self.run_dir, abstract_state, shardings, model_config=self._model_config, ignore=ignore,
                              check=check)


ORBAX_TMP = "orbax-checkpoint-tmp"  # in the name of the directory orbax writes a save into before its rename


_FAILED_READS: set[str] = set()  # state dirs (absolute) whose restore failed and was reported in one line


@contextlib.contextmanager
def reading(step_dir: Path):
    """Around one orbax restore of `step_dir` (absolute): a failure becomes one CheckpointError line, and
    what the failed read prints afterwards is dropped (`_drop_failed_io_aftermath`): orbax's other read
    coroutines fail too, each with a traceback holding the tensorstore spec, which names the dir."""
    _drop_failed_io_aftermath()
    try:
        yield
    except Exception as e:  # orbax/tensorstore raise many types; all mean "this one is unusable"
        _FAILED_READS.add(str(step_dir / STATE))
        raise CheckpointError(f"{step_dir}: restore failed: {one_line(e)}") from e


def _names_a_failed_read(exc: BaseException | None) -> bool:
    return exc is not None and any(d in str(exc) for d in _FAILED_READS)


# The array-write coroutine of orbax's serialization (its qualified name, as Python's warning gives it), which a
# failed save can leave unawaited: a RuntimeWarning at exit, with its "Enable tracemalloc" line.
UNAWAITED_ORBAX_WRITE = r"coroutine 'async_serialize_from_host\.<locals>\.write_fragment' was never awaited"


def _drop_failed_io_aftermath() -> None:
    """Install process-wide filters for what a failed async save or restore prints long after its one
    CheckpointError line, much of it at exit:
    - each of tensorstore's pending callbacks raises RuntimeError("Event loop is closed") into orbax's
      closed event loop (an unraisable exception, 7 lines apiece, hundreds in all);
    - a failed restore's other read coroutines are collected with their own errors (unraisable too);
    - asyncio logs "exception was never retrieved" (with a traceback) for each of orbax's failed futures;
    - Python warns at exit of orbax's array-write coroutines that a failed save left unawaited (two lines: one
      clean-clone suite's full-disk test, docs/LOG.md forty-second session).
    One truncated data file printed ~30 such tracebacks after its line (docs/LOG.md, thirty-sixth session)."""
    # at every call, not once: warning filters can be reset under us (pytest restores them after each test)
    warnings.filterwarnings("ignore", UNAWAITED_ORBAX_WRITE, RuntimeWarning)
    prev = sys.unraisablehook
    if getattr(prev, "_moejax", False):
        return

    def hook(u) -> None:
        if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
            return
        if _names_a_failed_read(u.exc_value):
            return
        prev(u)

    hook._moejax = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_unretrieved_orbax_failure)


def _unretrieved_orbax_failure(record: logging.LogRecord) -> bool:
    """False (drop) for asyncio's "exception was never retrieved" of a future that failed inside orbax: its
    traceback passes through orbax, or (a tensorstore future, whose traceback may hold no Python frame) its
    error names the checkpoint's temporary directory or a failed restore's. Seen in 1 of 2 clean-clone suites
    (docs/LOG.md, thirty-fifth session): three such records after the save's one line."""
    if "exception was never retrieved" not in str(record.msg):
        return True
    if record.exc_info and (ORBAX_TMP in str(record.exc_info[1]) or _names_a_failed_read(record.exc_info[1])):
        return False
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None:
        if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
            return False
        tb = tb.tb_next
    return True


class _QuietOrbaxErrors(logging.Filter):
    """Drop orbax's ERROR records (each with a ~190-line traceback) while a manager is open: every save
    failure they describe reaches the user as one CheckpointError line. Warnings and info pass."""

    LOGGER = "absl"  # orbax logs through absl.logging

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)

    def install(self) -> "_QuietOrbaxErrors":
        logging.getLogger(self.LOGGER).addFilter(self)
        return self

    def remove(self) -> None:
        logging.getLogger(self.LOGGER).removeFilter(self)
