"""The `moejax` console script: the process's host memory first (which may re-execute it), then the CLI.

`moejax.cli` imports jax, so the re-execution has to come before it; `python -m moejax.cli` skips this step.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys

from moejax import faults
from moejax.hostmem import exec_with_host_memory


class _MoejaxLines(logging.Handler):
    """moejax's own log records (a resume falling back past a damaged checkpoint) as its other messages read,
    `moejax: warning: ...`, not the root logger's `WARNING:moejax.checkpoint:...` (the handler absl's first log
    record installs with logging.basicConfig). For the command's duration, here and not in `cli.main`, which
    tests call in-process (their caplog listens at the root)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"moejax: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)

    @classmethod
    @contextlib.contextmanager
    def installed(cls):
        logger, handler = logging.getLogger("moejax"), cls(logging.WARNING)
        logger.addHandler(handler)
        logger.propagate = False
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.propagate = True


def main() -> int:
    exec_with_host_memory()
    with _MoejaxLines.installed():
        return _run()


def _run() -> int:
    # `train` exits 75 on a SIGTERM before it has anything to save (`cli.main`), but importing the CLI (jax) takes
    # ~1 s before that handler exists: a launcher's SIGTERM then killed it with 143, which it wouldn't requeue.
    noted: list[int] = []
    training = sys.argv[1:2] == ["train"]
    if training:
        signal.signal(signal.SIGTERM, lambda signum, frame: noted.append(signum))
        if faults.sigterm_at_import():
            faults.sigterm_now()
    from moejax.cli import main as cli_main, preempted_while_starting

    if training:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if noted:
            return preempted_while_starting(signal.Signals(noted[0]).name)
    return cli_main()
