"""The processes of a multi-process job agree on what they start, before anything is written.

Every process must train the same run: the same config and flags, in the same run dir, on a filesystem they
all see, from the same data. A job whose processes disagree used to train and then hang at its first
checkpoint (different run dirs, or a run dir on each host's local disk), fail in a 51-line jax assertion
(different seeds), or requeue forever (process 0 refused a locked run dir while its peers waited in a
collective, then exited 75). Here they compare first and stop together, each with the same one line.

The exchanges go through the coordination service's key-value store, which `jax.distributed` has already
connected, and not through a collective: the job's first gloo collective opens the data-plane connections,
and a process stopped by a signal during set-up would then leave its peers waiting in the next collective
instead of failing in gloo's connection timeout (docs/LOG.md, thirty-fifth session).

Keys: `moejax/start/<n>/<round>/<process>` for a round's values, `moejax/start/<n>/failed/<process>` for a
process that stopped while starting (its one line; `preempted` when a signal stopped it). A waiting process
that sees a peer's failure stops at once: exit 75 if the peer was preempted (the launcher requeues the job),
else the peer's line, exit 2. `n` counts the starts in this process, so a second `train` in one job never
reads the first one's keys.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import jax

from moejax.preemption import PreemptionSignal
from moejax.diffs import find_difference
from moejax.train.run_dir import LOCK, RunError

POLL_S = 0.1
WAIT_REPORT_S = 15.0
_STARTS = itertools.count()


class PeerPreempted(RuntimeError):
    """Another process of the job was preempted while starting: this one has nothing to save either."""


class PeerStopped(RunError):
    """Another process of the job stopped while starting, with this line: this one stops with it."""


class JobStart:
    """The start-up exchanges of one `train` call; every method is a no-op agreement for a one-process job.

    Call the same methods in the same order on every process (as a collective)."""

    def __init__(self, timeout_s: float = 300.0, *, client=None, index: int | None = None,
                 count: int | None = None, start: int | None = None):
        """`client`, `index`, `count`, `start`: jax's by default (tests give a stand-in store per process)."""
        self.index = jax.process_index() if index is None else index
        self.count = jax.process_count() if count is None else count
        self.timeout_s = float(timeout_s)
        self.token = secrets.token_hex(8)  # process 0's is the job's: it goes into the run dir's lock file
        self._client = client if client is not None else (_kv_client() if self.count > 1 else None)
        self._prefix = f"moejax/start/{next(_STARTS) if start is None else start}"

    # --- the agreements -------------------------------------------------------------------------------------

    def same_command(self, run_dir: Path, config: dict, options: dict) -> None:
        """Every process was given the same config and flags; afterwards `token` is process 0's."""
        mine = {"config": config, "options": options, "run_dir": str(Path(run_dir).absolute()),
                "host": socket.gethostname(), "token": self.token}
        entries = self.exchange("command", mine)
        first = entries[0]
        self.token = first["token"]
        for i, e in enumerate(entries[1:], 1):
            d = find_difference({"config": first["config"], "options": first["options"]},
                                {"config": e["config"], "options": e["options"]})
            if d is not None:
                raise RunError(f"process {i} was not started with process 0's command: {_field(d.key)} is "
                               f"{d.old!r} on process 0, {d.new!r} on process {i}; start every process of the "
                               "job with the same command")
        self._run_dirs = [e["run_dir"] for e in entries]
        self._hosts = [e["host"] for e in entries]

    def same_run_dir(self, run_dir: Path) -> None:
        """Every process sees the run dir whose lock process 0 holds (call after process 0 took it): one
        directory, on a filesystem every host shares; a run dir on each host's own disk would hang the job's
        first checkpoint."""
        if self._client is None:
            return
        self.from_primary("locked", True)
        sees = _lock_names(Path(run_dir) / LOCK, self.token)
        for i, saw in enumerate(self.exchange("seen", sees)):
            if not saw:
                raise RunError(f"process {i} does not see the run dir process 0 locked: --run-dir is "
                               f"{self._run_dirs[0]} on process 0 (host {self._hosts[0]}) and {self._run_dirs[i]} "
                               f"on process {i} (host {self._hosts[i]}); give every process the same --run-dir, "
                               "on a filesystem all hosts share")

    def same_data(self, identity: str) -> None:
        """Every process opened a store holding the same tokens (a per-host copy may lie elsewhere)."""
        first, *others = self.exchange("data", identity)
        for i, other in enumerate(others, 1):
            if other != first:
                raise RunError(f"process {i}'s data store holds other tokens than process 0's (identity "
                               f"{other[:12]}… vs {first[:12]}…); give every process the same data.store")

    # --- the primitives -------------------------------------------------------------------------------------

    def exchange(self, name: str, value: Any) -> list:
        """Every process's `value` (JSON), in process order: an allgather over the key-value store."""
        if self._client is None:
            return [value]
        self._client.key_value_set(f"{self._prefix}/{name}/{self.index}", json.dumps(value))
        return self._wait(name, range(self.count))

    def from_primary(self, name: str, value: Any) -> Any:
        """Process 0's `value`, on every process (the others' `value` is ignored)."""
        if self._client is None:
            return value
        if self.index == 0:
            self._client.key_value_set(f"{self._prefix}/{name}/0", json.dumps(value))
            return value
        return self._wait(name, [0])[0]

    @contextlib.contextmanager
    def failures_published(self) -> Iterator[None]:
        """A failure (or a signal) inside reaches the other processes at once, as this process's one line."""
        try:
            yield
        except BaseException as e:
            self._publish_failure(e)
            raise

    def _publish_failure(self, e: BaseException) -> None:
        if self._client is None or isinstance(e, (PeerPreempted, PeerStopped)):
            return  # a peer's failure is already published, by the peer
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        try:
            self._client.key_value_set(f"{self._prefix}/failed/{self.index}",
                                       json.dumps({"line": line, "preempted": isinstance(e, PreemptionSignal)}))
        except Exception:  # noqa: BLE001 -- best effort: the peers then time out with a line naming this process
            pass

    def _wait(self, name: str, who) -> list:
        """The values of round `name` from processes `who`, polled (a signal can stop the wait between polls);
        a peer's published failure or the timeout ends it with one line."""
        t0 = time.monotonic()
        report = t0 + WAIT_REPORT_S
        want = {f"{self._prefix}/{name}/{i}": i for i in who}
        while True:
            got = dict(self._client.key_value_dir_get(f"{self._prefix}/"))
            if all(k in got for k in want):
                return [json.loads(got[k]) for k in want]
            self._check_failures(got)
            now = time.monotonic()
            missing = [i for k, i in want.items() if k not in got]
            if now - t0 > self.timeout_s:
                raise RunError(f"process{'es' if len(missing) > 1 else ''} {_ids(missing)} did not reach the "
                               f"start-up's '{name}' step within {self.timeout_s:g}s (--dist-timeout); is every "
                               "process running the same command?")
            if now >= report:
                print(f"moejax: waiting for process{'es' if len(missing) > 1 else ''} {_ids(missing)} at the "
                      f"start-up's '{name}' step ({now - t0:.0f} s of {self.timeout_s:.0f} s)",
                      file=sys.stderr, flush=True)
                report = now + WAIT_REPORT_S
            time.sleep(POLL_S)

    def _check_failures(self, got: dict) -> None:
        failed = sorted((int(k.rsplit("/", 1)[1]), json.loads(v)) for k, v in got.items()
                        if k.startswith(f"{self._prefix}/failed/") and not k.endswith(f"/{self.index}"))
        if not failed:
            return
        i, f = failed[0]
        if f["preempted"]:
            raise PeerPreempted(f"process {i} was preempted ({f['line']}) while the job started")
        raise PeerStopped(f"process {i} stopped while the job started: {f['line']}")


def _kv_client():
    from jax._src import distributed  # the client jax.distributed.initialize connected (orbax uses it too)

    client = distributed.global_state.client
    if client is None:
        raise RunError(f"{jax.process_count()} processes but no jax.distributed client: start every process with "
                       "--coordinator (or --distributed)")
    return client


def _lock_names(path: Path, token: str) -> bool:
    """Whether the lock file at `path` names the job `token` (read only: nothing is created)."""
    try:
        return token in path.read_text(errors="replace")
    except OSError:
        return False


def _field(key: str) -> str:
    """A differing dotted key as the user would name it: `--overwrite`, or the config field."""
    section, _, rest = key.partition(".")
    return f"--{rest.replace('_', '-')}" if section == "options" else rest


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids))
