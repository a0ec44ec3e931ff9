"""Fault injection for the crash tests (tests/test_faults.py, bench/fault_injection.py): environment hooks
that do nothing unless set. They make a crash land at an exact point that a timer would hit only by luck.

  MOEJAX_FAULT_KILL=POINT:STEP          SIGKILL this process at POINT of step STEP:
      step      step STEP has been computed, nothing about it written yet
      metrics   half of step STEP's metrics.jsonl line written (a torn last line)
      saving    the checkpoint of step STEP was just issued: its async write is in flight
      save      the checkpoint of step STEP has its arrays on disk but no COMMITTED marker yet
      final_eval  the run's last step is STEP: its final checkpoint committed, the evaluation after it not run
      summary   the run ended at step STEP: final checkpoint committed, summary.json not yet written
  MOEJAX_FAULT_SIGTERM_AT_STEP=N        a real SIGTERM after step N (N >= 1) has run
  MOEJAX_FAULT_SIGTERM_BEFORE_STEP=1    a real SIGTERM during set-up, before the first step
  MOEJAX_FAULT_SIGTERM_AT_IMPORT=1      a real SIGTERM while the `moejax` command imports the CLI (and jax)
  MOEJAX_FAULT_SIGTERM_AT_END=1         a real SIGTERM after the last step (and its evaluation, which the final
                                        checkpoint goes before), while that checkpoint commits or after
"""

from __future__ import annotations

import os
import signal
import sys


def kill_at(point: str, step: int) -> bool:
    """True when MOEJAX_FAULT_KILL names this point and step."""
    want = os.environ.get("MOEJAX_FAULT_KILL", "")
    return bool(want) and want == f"{point}:{step}"


def kill_now() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def sigterm_at_step() -> int:
    return int(os.environ.get("MOEJAX_FAULT_SIGTERM_AT_STEP", "0") or 0)


def sigterm_before_step() -> bool:
    return os.environ.get("MOEJAX_FAULT_SIGTERM_BEFORE_STEP", "") == "1"


def sigterm_at_import() -> bool:
    return os.environ.get("MOEJAX_FAULT_SIGTERM_AT_IMPORT", "") == "1"


def sigterm_at_end() -> bool:
    return os.environ.get("MOEJAX_FAULT_SIGTERM_AT_END", "") == "1"


def sigterm_now() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
