"""Host memory for XLA's CPU buffers: a malloc that keeps freed memory (mimalloc, pinned; else tcmalloc where the
system has it), and glibc's malloc asked for transparent huge pages.

XLA's CPU runtime mallocs an executable's temporaries afresh at every call, and glibc serves anything over
32 MiB with a new mmap, so every step of a training run faults its whole working set in again, 4 KiB at a
time: ~358,000 minor faults and ~1.2 s of kernel time per step at issue 11's CPU shape (a 3.2 s step).
glibc >= 2.35 can `madvise` its memory for transparent huge pages (the `glibc.malloc.hugetlb=1` tunable), which
takes that to ~1,500 faults and the step to 2.3 s, with the same values. The kernel still zeroes every new
huge page: ~150 ms of system time a ~1 s step. An allocator that keeps freed memory for the next call removes
that: mimalloc (`cmeel-mimalloc`, a pinned wheel, so every machine `make` sets up has it), returning memory only
after 10 s unused and on 4 KiB pages (`MIMALLOC_SETTINGS`): a few ms of system time a step and the issue-11 CPU
step's mean ~1.06x faster than on glibc, at glibc's resident memory; gperftools' tcmalloc (a system package,
`libtcmalloc-minimal4`) about the same (docs/LOG.md 2026-12-05, thirty-first to thirty-third sessions).

A tunable is read and LD_PRELOAD applied when the process starts, so the `moejax` command re-executes itself
once with them set (same pid, argv, stdio). The tunable is left out off Linux, on another libc or an older glibc,
where the kernel's transparent huge pages are `never`, where GLIBC_TUNABLES already names it, or with
MOEJAX_HUGE_PAGES=0. The allocator: MOEJAX_ALLOCATOR=auto (the default: mimalloc where a trial process loads it
without a word on stderr, as its wheel needs the system's libatomic; else tcmalloc where installed; else glibc's
own; none on a GPU or TPU host, where it was never measured), mimalloc, tcmalloc or glibc; an allocator already in
LD_PRELOAD is kept (an explicit other choice beside it is an error). Nothing happens for a program read from stdin
or typed in, and in a process this one started by re-executing (a marker in its environment: glibc drops
tunables for setuid or file-capability binaries, and the process must not re-execute forever).
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
ALLOCATOR_VAR = "MOEJAX_ALLOCATOR"
ALLOCATORS = ("auto", "mimalloc", "tcmalloc", "glibc")
MIMALLOC_DIST = "cmeel-mimalloc"  # mimalloc's shared library in a wheel (requirements.lock)
# Hand memory back to the OS only after 10 s unused: a step's buffers are taken again within a step (~1 s), while
# the regions mimalloc leaves behind, when a step's ~1 GB temporary buffer lands in fresh memory, go back (never
# purging, the process grew ~1 GB at a time to ~3x its working set). Arenas on 4 KiB pages, not transparent huge
# pages: mapping such a fresh region cost ~0.3 s on small pages, 1.3-1.8 s on huge pages with the kernel compacting
# memory for them (docs/LOG.md 2026-12-05, thirty-third session). Buffers over mimalloc's default 2 GiB limit stay
# in its arenas too, else it would map and unmap them at every call. (Explicit huge pages,
# MIMALLOC_ALLOW_LARGE_OS_PAGES, would take a reserved hugetlbfs pool's pages.)
MIMALLOC_SETTINGS = {"MIMALLOC_PURGE_DELAY": "10000", "MIMALLOC_ALLOW_THP": "0",
                     "MIMALLOC_ARENA_MAX_OBJECT_SIZE": "16GiB"}
MIMALLOC_TRIAL_QUIET = {"MIMALLOC_VERBOSE": "0", "MIMALLOC_SHOW_STATS": "0", "MIMALLOC_SHOW_ERRORS": "0"}
# An accelerator host (`_accelerator_host`): the NVIDIA driver's proc directory, a TPU VM's first chip.
ACCELERATOR_MARKERS = (Path("/proc/driver/nvidia"), Path("/dev/accel0"))
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


class HostMemoryError(ValueError):
    """MOEJAX_ALLOCATOR names no allocator, or one this machine can't preload (one line, exit 2)."""


def _find_tcmalloc() -> str | None:
    """The library name the dynamic linker resolves for gperftools' tcmalloc, or None where none is installed."""
    return next((lib for lib in map(ctypes.util.find_library, TCMALLOC_NAMES) if lib), None)


def _find_mimalloc() -> str | None:
    """The path of the `cmeel-mimalloc` wheel's libmimalloc.so (whether or not the file is still there; the trial
    says), or None where the wheel is not installed."""
    import importlib.metadata  # here, not at the top: ~24 ms that the re-executed process doesn't need

    try:
        files = importlib.metadata.distribution(MIMALLOC_DIST).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    lib = next((f for f in files if f.name == "libmimalloc.so"), None)
    return str(lib.locate()) if lib is not None else None


def _preload_problem(lib: str, settings: dict[str, str]) -> str | None:
    """None where a trial interpreter (isolated, no site: ~10 ms) with `lib` preloaded exits 0 and says nothing;
    else what went wrong, in one line: the dynamic linker can't find the library or its own dependencies (the
    wheel's needs the system's libatomic.so.1), or the library warns at start. mimalloc's own diagnostics are
    off in the trial (a user debugging mimalloc keeps them in the run)."""
    import subprocess

    if any(c in lib for c in " :"):  # LD_PRELOAD separates its entries with either
        return f"its path {lib!r} has a space or a colon, which LD_PRELOAD can't hold"
    env = {**os.environ, **settings, **MIMALLOC_TRIAL_QUIET, PRELOAD_VAR: lib}
    try:
        p = subprocess.run([sys.executable, "-I", "-S", "-c", ""], env=env, capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"a trial process failed: {e}"
    if p.returncode == 0 and not p.stdout and not p.stderr:
        return None
    said = (p.stderr or p.stdout).strip().splitlines()
    return said[0] if said else f"a trial process with it preloaded exited {p.returncode}"


def _accelerator_host(environ: dict[str, str]) -> bool:
    """An NVIDIA driver or a TPU here, unless JAX_PLATFORMS says the run is on CPU; or JAX_PLATFORMS naming
    another platform. `auto` preloads no allocator there: it was measured on CPU only."""
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms != ["cpu"]
    return any(p.exists() for p in ACCELERATOR_MARKERS)


def _allocator_vars(environ: dict[str, str]) -> dict[str, str]:
    """LD_PRELOAD with the chosen allocator added (and its settings), or {} where that changes nothing."""
    choice = _choice(environ)
    current = environ.get(PRELOAD_VAR, "")
    if "malloc" in current:  # the user's own allocator (tcmalloc, jemalloc, mimalloc) stays
        if choice not in ("auto", "glibc"):
            raise HostMemoryError(f"{ALLOCATOR_VAR}={choice}, but LD_PRELOAD already names an allocator: {current}")
        return {}
    if choice == "glibc" or (choice == "auto" and _accelerator_host(environ)):
        return {}
    preload = lambda lib, settings: {PRELOAD_VAR: " ".join(p for p in (current, lib) if p),
                                     **{k: v for k, v in settings.items() if k not in environ}}
    if choice in ("auto", "mimalloc"):
        lib = _find_mimalloc()
        problem = None if lib is None else _preload_problem(
            lib, {k: environ.get(k, v) for k, v in MIMALLOC_SETTINGS.items()})
        if lib is not None and problem is None:
            return preload(lib, MIMALLOC_SETTINGS)
        if choice == "mimalloc":
            raise HostMemoryError(f"{ALLOCATOR_VAR}=mimalloc, but " + (
                f"{MIMALLOC_DIST} is not installed (pip install -r requirements.lock)" if lib is None else
                f"{lib} does not preload here: {problem}"))
    if choice in ("auto", "tcmalloc"):
        lib = _find_tcmalloc()
        if lib is not None:
            return preload(lib, TCMALLOC_QUIET)
        if choice == "tcmalloc":
            raise HostMemoryError(f"{ALLOCATOR_VAR}=tcmalloc, but the system has no tcmalloc library "
                                  "(Debian/Ubuntu: apt install libtcmalloc-minimal4)")
    return {}


def _choice(environ: dict[str, str]) -> str:
    choice = environ.get(ALLOCATOR_VAR, "auto")
    if choice not in ALLOCATORS:
        raise HostMemoryError(f"{ALLOCATOR_VAR}={choice!r} must be one of {', '.join(ALLOCATORS)}")
    return choice


def host_env(environ: dict[str, str]) -> dict[str, str] | None:
    """`environ` with the huge-page tunable and the allocator added, or None where neither would change anything.
    Raises HostMemoryError for a MOEJAX_ALLOCATOR it can't honour."""
    if EXECUTED in environ:  # the re-executed process: once only, even where glibc dropped the tunable
        return None
    if not sys.platform.startswith("linux"):  # both settings are Linux's
        if _choice(environ) in ("mimalloc", "tcmalloc"):
            raise HostMemoryError(f"{ALLOCATOR_VAR}={environ[ALLOCATOR_VAR]}: moejax preloads an allocator only on "
                                  f"Linux (this is {sys.platform})")
        return None
    changes = {**_huge_page_vars(environ), **_allocator_vars(environ)}
    return {**environ, **changes, EXECUTED: "1"} if changes else None


def allocator() -> str:
    """The malloc this process runs on: the preloaded library's path (mimalloc, tcmalloc, or one the user
    preloaded), else "glibc" (what run_info.json and the bench record)."""
    try:
        maps = MAPS.read_text()
    except OSError:
        return "glibc"
    # a line: address perms offset dev inode [path]; only file-backed mappings have the sixth field
    paths = {f[5] for f in (line.split(None, 5) for line in maps.splitlines()) if len(f) == 6}
    return ", ".join(sorted(p for p in paths if "malloc" in Path(p).name)) or "glibc"


def allocator_settings(environ=os.environ) -> dict[str, str]:
    """The environment's mimalloc and tcmalloc settings (ours and the user's), which the preloaded allocator read
    at start (what run_info.json records beside `allocator`)."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith(("MIMALLOC_", "TCMALLOC_"))}


def exec_with_host_memory() -> None:
    """Re-execute this interpreter, same arguments, with `host_env`'s settings; return where they change nothing.

    Call it first thing in a script's entry point: what was imported before (jax: ~1 s) is imported again.
    """
    argv = getattr(sys, "orig_argv", None)  # the interpreter's own argv (`-m`, `-c`, the script), 3.10+
    # A program from stdin ("-") or typed in ("") can't run again: stdin has been read.
    if not argv or not sys.executable or sys.argv[0] in ("", "-"):
        return
    try:
        env = host_env(dict(os.environ))
    except HostMemoryError as e:  # before anything else runs: one line, exit 2, as every user error
        if sys.stderr is not None:  # None where fd 2 was closed at start
            print(f"moejax: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if env is None:
        return
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None when the fd was closed (`moejax ... >&-`)
            stream.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)
