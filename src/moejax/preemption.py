"""Preemption: SIGTERM/SIGINT become a checkpoint saved at the next step boundary and exit 75.

`EXIT_PREEMPTED = 75` (sysexits EX_TEMPFAIL, "temporary failure, retry"): the run saved after a SIGTERM/SIGINT
and wants to be restarted; distinct from 143 (128+SIGTERM, killed before saving). A signal before the first
step (start-up, restore, compile) has nothing new to save: an `immediate` PreemptionGuard raises
`PreemptionSignal` at once, which also exits 75. No jax at import: the CLI sets its start-up handler with this
module's exit code before any backend starts.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Iterable

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: saved after preemption, resume me


class PreemptionSignal(BaseException):
    """SIGTERM/SIGINT under an `immediate` PreemptionGuard: nothing new to save, exit EXIT_PREEMPTED now.
    A BaseException, so `except Exception` blocks on the way (orbax, data loading) do not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class PreemptionGuard:
    """Turn SIGTERM/SIGINT into a flag (`requested`) so the loop can save and exit `EXIT_PREEMPTED`.

    With `immediate` (set-up, before the first step: no new state exists yet) the handler raises
    `PreemptionSignal` instead; the loop calls `defer` when its first step starts. Old handlers are
    restored on exit. A second SIGINT while a request is pending raises KeyboardInterrupt (a human
    pressing Ctrl-C twice wants out now). Must be entered in the main thread (a Python signal rule).
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT), immediate: bool = False):
        self.signals = tuple(signals)
        self.immediate = immediate
        self.requested = False
        self.signum: int | None = None
        self.since: float | None = None  # time.monotonic() of the first request: how long the save took after it
        self._old: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.immediate:
            raise PreemptionSignal(signum)
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.requested:
            self.since = time.monotonic()
        self.requested, self.signum = True, signum

    def defer(self) -> None:
        """From now on a signal only sets `requested`; the loop saves and exits at the next step boundary, or
        finishes as usual when the signal lands in the last step or after it."""
        self.immediate = False

    def stop_requested(self) -> bool:
        """`requested` OR-reduced over processes (a collective: call it at the same step everywhere)."""
        from moejax.checkpoint import any_process

        return any_process(self.requested)

    def __enter__(self) -> PreemptionGuard:
        for s in self.signals:
            self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old.clear()
