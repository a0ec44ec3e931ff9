"""Host memory for XLA's CPU buffers: glibc's malloc asked for transparent huge pages.

XLA's CPU runtime mallocs an executable's temporaries afresh at every call, and glibc serves anything over
32 MiB with a new mmap, so every step of a training run faults its whole working set in again, 4 KiB at a
time: ~358,000 minor faults and ~1.2 s of kernel time per step at issue 11's CPU shape (a 3.2 s step).
glibc >= 2.35 can `madvise` its memory for transparent huge pages (the `glibc.malloc.hugetlb=1` tunable), which
takes that to ~1,500 faults and the step to 2.3 s, with the same values. A tunable is read when the
process starts, so the `moejax` command re-executes itself once with it set (same pid, argv, stdio).

Nothing happens off Linux, on another libc or an older glibc, where the kernel's transparent huge pages are
`never`, where GLIBC_TUNABLES already names the tunable, with MOEJAX_HUGE_PAGES=0, for a program read from
stdin or typed in, and in a process this one started by re-executing (a marker in its environment: glibc drops
tunables for setuid or file-capability binaries, and the process must not re-execute forever).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TUNABLES_VAR = "GLIBC_TUNABLES"  # glibc reads it once, at process start
TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "MOEJAX_HUGE_PAGES"
EXECUTED = "MOEJAX_HUGE_PAGES_EXECUTED"  # set in the re-executed process's environment
MIN_GLIBC = (2, 35)  # the first glibc with glibc.malloc.hugetlb
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _glibc_version() -> tuple[int, ...] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        return tuple(int(v) for v in version.split(".")[:2]) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):  # no confstr, not glibc, an odd version string
        return None


def _thp_mode() -> str:
    """The kernel's mode, the bracketed word of e.g. "always [madvise] never"; "" when unreadable."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def tunables(environ=os.environ) -> str:
    """The glibc tunables a process started with ("" for none): what run_info.json and the bench record."""
    return environ.get(TUNABLES_VAR, "")


def huge_page_env(environ: dict[str, str]) -> dict[str, str] | None:
    """`environ` with the tunable added to GLIBC_TUNABLES, or None where it would change nothing."""
    current = tunables(environ)
    if (environ.get(OPT_OUT) == "0" or EXECUTED in environ or TUNABLE in current
            or not sys.platform.startswith("linux")):
        return None
    version = _glibc_version()
    if version is None or version < MIN_GLIBC or _thp_mode() not in ("madvise", "always"):
        return None
    return {**environ, TUNABLES_VAR: ":".join(t for t in (current, f"{TUNABLE}=1") if t), EXECUTED: "1"}


def exec_with_huge_pages() -> None:
    """Re-execute this interpreter, same arguments, with the tunable set; return where that changes nothing.

    Call it first thing in a script's entry point: what was imported before (jax: ~1 s) is imported again.
    """
    env = huge_page_env(dict(os.environ))
    argv = getattr(sys, "orig_argv", None)  # the interpreter's own argv (`-m`, `-c`, the script), 3.10+
    # A program from stdin ("-") or typed in ("") can't run again: stdin has been read.
    if env is None or not argv or not sys.executable or sys.argv[0] in ("", "-"):
        return
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None when the fd was closed (`moejax ... >&-`)
            stream.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)
