"""The `moejax` command's host memory: glibc's malloc asked for transparent huge pages, and an allocator that keeps
freed memory (mimalloc from its pinned wheel, else tcmalloc where the system has it) preloaded, by re-executing
once."""

import json
import os
import subprocess
import sys

import pytest

from moejax import hostmem

# A child that re-executes itself, then prints the tunables it runs with and the minor page faults of three
# calls that each produce a fresh 128 MiB output (32,768 pages of 4 KiB each).
CHILD = """
import os, resource, sys
from moejax.hostmem import exec_with_host_memory
exec_with_host_memory()
import jax, jax.numpy as jnp
x = jnp.ones((4096, 256)); w = jnp.ones((256, 8192))
f = jax.jit(lambda a, b: a @ b)
f(x, w).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    f(x, w).block_until_ready()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3
print(os.environ.get("GLIBC_TUNABLES", ""), faults, os.getpid(), sep="|")
"""
PAGES_4K = 4096 * 8192 * 4 // 4096


HOST_VARS = (hostmem.TUNABLES_VAR, hostmem.OPT_OUT, hostmem.EXECUTED, hostmem.PRELOAD_VAR, hostmem.ALLOCATOR_VAR,
             *hostmem.TCMALLOC_QUIET, *hostmem.MIMALLOC_SETTINGS)
TCMALLOC = "libtcmalloc_minimal.so.4"
QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 62)}
MIMALLOC = "/venv/site-packages/cmeel.prefix/lib/libmimalloc.so"
MIMALLOC_ENV = {"MIMALLOC_PURGE_DELAY": "10000", "MIMALLOC_ALLOW_THP": "0", "MIMALLOC_ARENA_MAX_OBJECT_SIZE": "16GiB"}


@pytest.fixture(autouse=True)
def cpu_host(monkeypatch):
    """These tests describe a CPU host (no NVIDIA driver, no TPU), whatever runs them."""
    monkeypatch.setattr(hostmem, "ACCELERATOR_MARKERS", ())


def _unset_env() -> dict[str, str]:
    """This environment without any host-memory setting: a child decides for itself."""
    return {k: v for k, v in os.environ.items() if k not in HOST_VARS}


def test_env_adds_the_tunable_where_glibc_and_the_kernel_can_and_respects_the_user(monkeypatch):
    monkeypatch.setattr(hostmem.sys, "platform", "linux")
    monkeypatch.setattr(hostmem, "_glibc_version", lambda: (2, 36))
    monkeypatch.setattr(hostmem, "_thp_mode", lambda: "madvise")
    monkeypatch.setattr(hostmem, "_find_tcmalloc", lambda: None)  # the tunable alone
    monkeypatch.setattr(hostmem, "_find_mimalloc", lambda: None)
    env = hostmem.host_env({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1", "HOME": "/h"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1:glibc.malloc.hugetlb=1", "HOME": "/h",
                   hostmem.EXECUTED: "1"}
    assert hostmem.host_env({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert hostmem.host_env(env) is None  # the re-executed process: once only
    assert hostmem.host_env({hostmem.EXECUTED: "1"}) is None  # even where glibc dropped the tunable
    assert hostmem.host_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None  # the user's choice
    assert hostmem.host_env({hostmem.OPT_OUT: "0"}) is None
    monkeypatch.setattr(hostmem, "_thp_mode", lambda: "always")
    assert hostmem.host_env({}) is not None
    for thp, glibc, platform in [("never", (2, 36), "linux"), ("", (2, 36), "linux"), ("madvise", (2, 34), "linux"),
                                 ("madvise", None, "linux"), ("madvise", (2, 36), "darwin")]:
        monkeypatch.setattr(hostmem, "_thp_mode", lambda: thp)
        monkeypatch.setattr(hostmem, "_glibc_version", lambda: glibc)
        monkeypatch.setattr(hostmem.sys, "platform", platform)
        assert hostmem.host_env({}) is None, (thp, glibc, platform)


def test_env_preloads_tcmalloc_where_the_system_has_it_and_respects_the_user(monkeypatch):
    monkeypatch.setattr(hostmem.sys, "platform", "linux")
    monkeypatch.setattr(hostmem, "_thp_mode", lambda: "never")  # the allocator alone
    monkeypatch.setattr(hostmem, "_find_mimalloc", lambda: None)  # tcmalloc's turn
    monkeypatch.setattr(hostmem, "_find_tcmalloc", lambda: TCMALLOC)
    assert hostmem.host_env({"HOME": "/h"}) == {"HOME": "/h", "LD_PRELOAD": TCMALLOC, **QUIET, hostmem.EXECUTED: "1"}
    # another preloaded library stays, first; the user's own report threshold is kept
    env = hostmem.host_env({"LD_PRELOAD": "/x/libfoo.so", "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "7"})
    assert env["LD_PRELOAD"] == f"/x/libfoo.so {TCMALLOC}" and env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "7"
    for user in ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, {"LD_PRELOAD": "libtcmalloc.so.4"},
                 {hostmem.ALLOCATOR_VAR: "glibc"}, {hostmem.EXECUTED: "1"}):
        assert hostmem.host_env(user) is None, user  # the user's allocator, the opt-out, the re-executed process
    monkeypatch.setattr(hostmem.sys, "platform", "darwin")
    assert hostmem.host_env({}) is None
    monkeypatch.setattr(hostmem.sys, "platform", "linux")
    monkeypatch.setattr(hostmem, "_find_tcmalloc", lambda: None)  # not installed: nothing to preload
    assert hostmem.host_env({}) is None
    # both: one re-execution with both settings
    monkeypatch.setattr(hostmem, "_find_tcmalloc", lambda: TCMALLOC)
    monkeypatch.setattr(hostmem, "_thp_mode", lambda: "madvise")
    monkeypatch.setattr(hostmem, "_glibc_version", lambda: (2, 36))
    assert hostmem.host_env({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "LD_PRELOAD": TCMALLOC, **QUIET,
                                    hostmem.EXECUTED: "1"}


def test_env_preloads_mimalloc_first_where_it_loads_cleanly(monkeypatch):
    monkeypatch.setattr(hostmem.sys, "platform", "linux")
    monkeypatch.setattr(hostmem, "_thp_mode", lambda: "never")  # the allocator alone
    monkeypatch.setattr(hostmem, "_find_mimalloc", lambda: MIMALLOC)
    monkeypatch.setattr(hostmem, "_find_tcmalloc", lambda: TCMALLOC)
    tried = []
    monkeypatch.setattr(hostmem, "_preload_problem", lambda lib, settings: tried.append((lib, settings)))
    assert hostmem.host_env({"HOME": "/h"}) == {"HOME": "/h", "LD_PRELOAD": MIMALLOC, **MIMALLOC_ENV,
                                                hostmem.EXECUTED: "1"}
    assert tried == [(MIMALLOC, MIMALLOC_ENV)]  # tried with the settings it will run with
    env = hostmem.host_env({"MIMALLOC_PURGE_DELAY": "100"})  # the user's own setting is kept, and tried
    assert env["MIMALLOC_PURGE_DELAY"] == "100" and tried[-1][1]["MIMALLOC_PURGE_DELAY"] == "100"
    assert hostmem.host_env({"LD_PRELOAD": "/opt/libmimalloc.so.2"}) is None  # the user's own mimalloc
    with pytest.raises(hostmem.HostMemoryError, match="LD_PRELOAD already names an allocator: /opt/libjemalloc"):
        hostmem.host_env({"LD_PRELOAD": "/opt/libjemalloc.so.2", hostmem.ALLOCATOR_VAR: "mimalloc"})
    assert hostmem.host_env({hostmem.ALLOCATOR_VAR: "tcmalloc"})["LD_PRELOAD"] == TCMALLOC
    assert hostmem.host_env({hostmem.ALLOCATOR_VAR: "mimalloc"})["LD_PRELOAD"] == MIMALLOC
    # a GPU or TPU host: auto preloads nothing (never measured there); an explicit choice still holds
    monkeypatch.setattr(hostmem, "ACCELERATOR_MARKERS", (hostmem.MAPS,))  # a path that exists
    assert hostmem.host_env({}) is None
    assert hostmem.host_env({"JAX_PLATFORMS": "cpu"})["LD_PRELOAD"] == MIMALLOC  # a CPU run on a GPU host
    assert hostmem.host_env({hostmem.ALLOCATOR_VAR: "mimalloc"})["LD_PRELOAD"] == MIMALLOC
    monkeypatch.setattr(hostmem, "ACCELERATOR_MARKERS", ())
    assert hostmem.host_env({"JAX_PLATFORMS": "cuda"}) is None
    assert hostmem.host_env({"JAX_PLATFORMS": "tpu,cpu"}) is None
    # a wheel whose library doesn't load cleanly here (no libatomic): tcmalloc, or the reason when asked for
    problem = "ERROR: ld.so: object 'x' from LD_PRELOAD cannot be preloaded: ignored."
    monkeypatch.setattr(hostmem, "_preload_problem", lambda lib, settings: problem)
    assert hostmem.host_env({})["LD_PRELOAD"] == TCMALLOC
    with pytest.raises(hostmem.HostMemoryError, match=f"{MIMALLOC} does not preload here: ERROR: ld.so"):
        hostmem.host_env({hostmem.ALLOCATOR_VAR: "mimalloc"})
    monkeypatch.setattr(hostmem, "_find_mimalloc", lambda: None)
    with pytest.raises(hostmem.HostMemoryError, match="cmeel-mimalloc is not installed"):
        hostmem.host_env({hostmem.ALLOCATOR_VAR: "mimalloc"})
    monkeypatch.setattr(hostmem, "_find_tcmalloc", lambda: None)
    with pytest.raises(hostmem.HostMemoryError, match="the system has no tcmalloc library"):
        hostmem.host_env({hostmem.ALLOCATOR_VAR: "tcmalloc"})
    with pytest.raises(hostmem.HostMemoryError, match="MOEJAX_ALLOCATOR='jemalloc' must be one of auto, mimalloc"):
        hostmem.host_env({hostmem.ALLOCATOR_VAR: "jemalloc"})
    monkeypatch.setattr(hostmem.sys, "platform", "darwin")  # off Linux: checked all the same
    with pytest.raises(hostmem.HostMemoryError, match="MOEJAX_ALLOCATOR='jemalloc' must be one of"):
        hostmem.host_env({hostmem.ALLOCATOR_VAR: "jemalloc"})
    with pytest.raises(hostmem.HostMemoryError, match="preloads an allocator only on Linux"):
        hostmem.host_env({hostmem.ALLOCATOR_VAR: "mimalloc"})
    assert hostmem.host_env({hostmem.ALLOCATOR_VAR: "glibc"}) is None


def _mimalloc_loads_here() -> bool:
    """The pinned wheel is installed (Linux x86_64 / aarch64) and the system has the libatomic its library needs;
    elsewhere the command falls back, as it should."""
    import ctypes.util

    return hostmem._find_mimalloc() is not None and ctypes.util.find_library("atomic") is not None


def test_the_pinned_mimalloc_is_found_and_the_trial_tells_a_library_that_loads_from_one_that_does_not(tmp_path):
    import platform

    lib = hostmem._find_mimalloc()
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        assert lib is None
    else:  # `make` installs cmeel-mimalloc here (requirements.lock)
        assert lib is not None and lib.endswith("cmeel.prefix/lib/libmimalloc.so")
        if _mimalloc_loads_here():
            assert hostmem._preload_problem(lib, hostmem.MIMALLOC_SETTINGS) is None
            # its own diagnostics don't fail the trial
            assert hostmem._preload_problem(lib, {**hostmem.MIMALLOC_SETTINGS, "MIMALLOC_VERBOSE": "1"}) is None
    missing = str(tmp_path / "libnothing.so")
    assert "cannot be preloaded" in hostmem._preload_problem(missing, {})  # ld.so's one line
    spaced = str(tmp_path / "a b" / "libmimalloc.so")
    assert "has a space or a colon, which LD_PRELOAD can't hold" in hostmem._preload_problem(spaced, {})


def test_the_allocator_is_read_from_the_process_maps(monkeypatch, tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("55d0-55d1 r--p 00000000 08:01 1 /usr/bin/python3.11\n"
                    "7f00-7f01 rw-p 00000000 00:00 0 \n"
                    "7f10-7f11 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10\n"
                    "7f12-7f13 r--p 00001000 08:01 2 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10\n"
                    "7f20-7f21 r-xp 00000000 08:01 3 /opt/my libs/libc.so.6\n")
    monkeypatch.setattr(hostmem, "MAPS", maps)
    assert hostmem.allocator() == "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10"
    maps.write_text("55d0-55d1 r--p 00000000 08:01 1 /usr/bin/python3.11\n[heap]\n")
    assert hostmem.allocator() == "glibc"
    monkeypatch.setattr(hostmem, "MAPS", tmp_path / "missing")
    assert hostmem.allocator() == "glibc"


def test_the_allocators_settings_are_read_from_the_environment():
    env = {"MIMALLOC_PURGE_DELAY": "10000", "TCMALLOC_RELEASE_RATE": "0", "HOME": "/h", "MOEJAX_ALLOCATOR": "auto",
           "LD_PRELOAD": "libx.so"}
    assert hostmem.allocator_settings(env) == {"MIMALLOC_PURGE_DELAY": "10000", "TCMALLOC_RELEASE_RATE": "0"}
    assert hostmem.allocator_settings({}) == {}


def test_this_machines_glibc_and_kernel_are_read():
    assert hostmem._thp_mode() in ("always", "madvise", "never", "")
    version = hostmem._glibc_version()
    assert version is None or (len(version) == 2 and version >= (2, 17))


def test_the_process_re_executes_once_and_its_large_buffers_fault_in_huge_pages():
    env = _unset_env()
    env["XLA_FLAGS"] = ""  # one device is enough
    env[hostmem.ALLOCATOR_VAR] = "glibc"  # mimalloc or tcmalloc would reuse the buffers and fault nothing

    def child(**extra):
        p = subprocess.Popen([sys.executable, "-c", CHILD], env={**env, **extra}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        tunables, faults, pid = out.strip().splitlines()[-1].split("|")
        assert int(pid) == p.pid  # executed in place: a launcher's signals still reach the run
        return tunables, float(faults)

    plain_tunables, plain_faults = child(**{hostmem.OPT_OUT: "0"})
    assert plain_tunables == ""
    tunables, faults = child()
    if hostmem.host_env(env) is None:  # this machine can't: the child ran as it was started
        assert tunables == ""
        return
    assert tunables == "glibc.malloc.hugetlb=1"
    # With the tunable the fresh 128 MiB output of every call faults in 2 MiB pages. Without it, in 4 KiB ones
    # where the kernel gives huge pages only to madvised memory (THP "always" gives them to any large mapping).
    assert faults < PAGES_4K / 8, (faults, plain_faults)
    if hostmem._thp_mode() == "madvise":
        assert plain_faults >= PAGES_4K, plain_faults


def test_the_command_and_python_m_moejax_run_the_cli_after_re_executing():
    script = os.path.join(os.path.dirname(sys.executable), "moejax")  # the console script of this venv
    commands = [[sys.executable, "-m", "moejax"]] + ([[script]] if os.path.exists(script) else [])
    for command in commands:
        p = subprocess.run([*command, "count", "tiny"], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "XLA_FLAGS": ""})
        assert p.returncode == 0, (command, p.stderr[-2000:])
        assert p.stdout.startswith("moejax count: preset tiny") and "total parameters" in p.stdout, command


def test_a_closed_stdout_or_a_program_from_stdin_is_left_alone():
    env = _unset_env()
    program = "from moejax.hostmem import exec_with_host_memory; exec_with_host_memory(); print('ran')"
    p = subprocess.run([sys.executable, "-"], input=program, capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and p.stdout == "ran\n", p.stderr  # run once, not re-executed with stdin spent
    # Python's sys.stdout is None where fd 1 was closed at start (`moejax ... >&-`): nothing to flush there.
    closed = "import sys; sys.stdout = None; " + program.replace("print('ran')", "sys.exit(3)")
    p = subprocess.run([sys.executable, "-c", closed], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 3, p.stderr


# A child that re-executes itself, makes one 1.2 GiB allocation (untouched: no memory used), and prints the
# allocator it runs on.
ALLOC_CHILD = """
import json
import numpy as np
from moejax.hostmem import allocator, allocator_settings, exec_with_host_memory
exec_with_host_memory()
big = np.empty(1200 << 20, np.uint8)
print(allocator(), json.dumps(allocator_settings()), sep="|")
"""


def test_the_process_re_executes_onto_the_chosen_allocator_and_stays_quiet():
    env = {**_unset_env(), hostmem.OPT_OUT: "0", "JAX_PLATFORMS": "cpu"}  # the allocator alone, on a CPU run

    def child(**extra):
        p = subprocess.run([sys.executable, "-c", ALLOC_CHILD], env={**env, **extra}, capture_output=True, text=True,
                           timeout=120)
        return p.returncode, p.stdout.strip(), p.stderr

    def quiet(settings=None, **extra):
        rc, out, err = child(**extra)
        assert rc == 0, err[-2000:]
        assert err == ""  # no large-allocation report, no allocator warning: user errors stay one line
        lib, said = out.split("|")
        if settings is not None:  # the settings the allocator started with, as run_info.json records them
            assert json.loads(said) == settings
        return lib

    assert quiet({}, **{hostmem.ALLOCATOR_VAR: "glibc"}) == "glibc"
    mimalloc = hostmem._find_mimalloc()
    if _mimalloc_loads_here():  # the pinned wheel (Linux x86_64 / aarch64): the default
        assert quiet(MIMALLOC_ENV) == mimalloc
        users = {**MIMALLOC_ENV, "MIMALLOC_PURGE_DELAY": "50"}  # the user's own setting is what it starts with
        assert quiet(users, MIMALLOC_PURGE_DELAY="50") == mimalloc
        assert quiet(**{hostmem.ALLOCATOR_VAR: "mimalloc"}) == mimalloc
    if hostmem._find_tcmalloc() is None:  # not installed here: asked for, it is one line and exit 2
        rc, out, err = child(**{hostmem.ALLOCATOR_VAR: "tcmalloc"})
        assert rc == 2 and out == "" and err.count("\n") == 1
        assert err.startswith("moejax: error: MOEJAX_ALLOCATOR=tcmalloc, but the system has no tcmalloc library")
    else:
        assert "libtcmalloc" in quiet(**{hostmem.ALLOCATOR_VAR: "tcmalloc"})
    rc, out, err = child(**{hostmem.ALLOCATOR_VAR: "jemalloc"})
    assert rc == 2
    assert err == "moejax: error: MOEJAX_ALLOCATOR='jemalloc' must be one of auto, mimalloc, tcmalloc, glibc\n"
