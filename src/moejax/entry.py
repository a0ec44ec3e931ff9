"""The `moejax` console script: the process's host memory first (which may re-execute it), then the CLI.

`moejax.cli` imports jax, so the re-execution has to come before it; `python -m moejax.cli` skips this step.
"""

from __future__ import annotations

from moejax.hostmem import exec_with_host_memory


def main() -> int:
    exec_with_host_memory()
    from moejax.cli import main as cli_main

    return cli_main()
