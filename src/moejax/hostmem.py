"""Host memory for XLA's CPU buffers: glibc's malloc asked for transparent huge pages, and tcmalloc preloaded
where the system has it.

XLA's CPU runtime mallocs an executable's temporaries afresh at every call, and glibc serves anything over
32 MiB with a new mmap, so every step of a training run faults its whole working set in again, 4 KiB at a
time: ~358,000 minor faults and ~1.2 s of kernel time per step at issue 11's CPU shape (a 3.2 s step).
glibc >= 2.35 can `madvise` its memory for transparent huge pages (the `glibc.malloc.hugetlb=1` tunable), which
takes that to ~1,500 faults and the step to 2.3 s, with the same values. The kernel still zeroes every new
huge page: ~10 s of system time in a 24-step bench run. tcmalloc (gperftools; Debian's libtcmalloc-minimal4)
keeps freed memory for the next call instead of unmapping it: 3.4 s of system time in the same run, the
issue-11 CPU step 1.06x and the tiny demo's step 1.13x faster, compiles ~1.2x faster, the same values, no
higher peak RSS (docs/LOG.md 2026-12-05, thirty-first session). No wheel ships it, so it is used only where the
system has it.

A tunable is read and LD_PRELOAD applied when the process starts, so the `moejax` command re-executes itself
once with them set (same pid, argv, stdio). The tunable is left out off Linux, on another libc or an older glibc,
where the kernel's transparent huge pages are `never`, where GLIBC_TUNABLES already names it, or with
MOEJAX_HUGE_PAGES=0; tcmalloc where no library is found, where LD_PRELOAD already names an allocator, or with
MOEJAX_TCMALLOC=0. Nothing happens for a program read from stdin or typed in, and in a process this one started
by re-executing (a marker in its environment: glibc drops tunables for setuid or file-capability binaries, and
the process must not re-execute forever).
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

TUNABLES_VAR = "GLIBC_TUNABLES"  # glibc reads it once, at process start
TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "MOEJAX_HUGE_PAGES"
EXECUTED = "MOEJAX_HOST_MEMORY_EXECUTED"  # set in the re-executed process's environment
PRELOAD_VAR = "LD_PRELOAD"
TCMALLOC_OPT_OUT = "MOEJAX_TCMALLOC"
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")  # gperftools' libraries, the allocator alone first
# gperftools can report each allocation over 1 GiB on stderr ("tcmalloc: large alloc ..."; Debian's minimal
# library printed nothing at 8 GiB). A step's buffers are that large, and user errors must stay one line.
TCMALLOC_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 62)}
MAPS = Path("/proc/self/maps")
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


def _huge_page_vars(environ: dict[str, str]) -> dict[str, str]:
    """GLIBC_TUNABLES with the tunable added, or {} where it would change nothing."""
    current = tunables(environ)
    if environ.get(OPT_OUT) == "0" or TUNABLE in current:
        return {}
    version = _glibc_version()
    if version is None or version < MIN_GLIBC or _thp_mode() not in ("madvise", "always"):
        return {}
    return {TUNABLES_VAR: ":".join(t for t in (current, f"{TUNABLE}=1") if t)}


def _find_tcmalloc() -> str | None:
    """The library name the dynamic linker resolves for gperftools' tcmalloc, or None where none is installed."""
    return next((lib for lib in map(ctypes.util.find_library, TCMALLOC_NAMES) if lib), None)


def _allocator_vars(environ: dict[str, str]) -> dict[str, str]:
    """LD_PRELOAD with tcmalloc added (and its large-allocation reports off), or {} where that changes nothing."""
    current = environ.get(PRELOAD_VAR, "")
    if environ.get(TCMALLOC_OPT_OUT) == "0" or "malloc" in current:
        return {}  # "malloc" in LD_PRELOAD: the user's own allocator (tcmalloc, jemalloc, mimalloc) stays
    lib = _find_tcmalloc()
    if lib is None:
        return {}
    quiet = {k: v for k, v in TCMALLOC_QUIET.items() if k not in environ}
    return {PRELOAD_VAR: " ".join(p for p in (current, lib) if p), **quiet}


def host_env(environ: dict[str, str]) -> dict[str, str] | None:
    """`environ` with the huge-page tunable and tcmalloc added, or None where neither would change anything."""
    # the re-executed process: once only, even where glibc dropped the tunable; both settings are Linux's
    if EXECUTED in environ or not sys.platform.startswith("linux"):
        return None
    changes = {**_huge_page_vars(environ), **_allocator_vars(environ)}
    return {**environ, **changes, EXECUTED: "1"} if changes else None


def allocator() -> str:
    """The malloc this process runs on: the preloaded library's path (tcmalloc, or one the user preloaded), else
    "glibc" (what run_info.json and the bench record)."""
    try:
        maps = MAPS.read_text()
    except OSError:
        return "glibc"
    # a line: address perms offset dev inode [path]; only file-backed mappings have the sixth field
    paths = {f[5] for f in (line.split(None, 5) for line in maps.splitlines()) if len(f) == 6}
    return ", ".join(sorted(p for p in paths if "malloc" in Path(p).name)) or "glibc"


def exec_with_host_memory() -> None:
    """Re-execute this interpreter, same arguments, with `host_env`'s settings; return where they change nothing.

    Call it first thing in a script's entry point: what was imported before (jax: ~1 s) is imported again.
    """
    env = host_env(dict(os.environ))
    argv = getattr(sys, "orig_argv", None)  # the interpreter's own argv (`-m`, `-c`, the script), 3.10+
    # A program from stdin ("-") or typed in ("") can't run again: stdin has been read.
    if env is None or not argv or not sys.executable or sys.argv[0] in ("", "-"):
        return
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None when the fd was closed (`moejax ... >&-`)
            stream.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)
