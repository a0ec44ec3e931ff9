"""The `moejax` command's host memory: glibc's malloc asked for transparent huge pages by re-executing once."""

import os
import subprocess
import sys

from moejax import hostmem

# A child that re-executes itself, then prints the tunables it runs with and the minor page faults of three
# calls that each produce a fresh 128 MiB output (32,768 pages of 4 KiB each).
CHILD = """
import os, resource, sys
from moejax.hostmem import exec_with_huge_pages
exec_with_huge_pages()
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


def test_env_adds_the_tunable_to_existing_ones_once_and_respects_the_opt_out():
    env = hostmem.huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    if env is None:  # not glibc >= 2.35 on Linux with THP on: nothing to add, whatever the environment
        assert hostmem.huge_page_env({}) is None
        return
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.trim_threshold=1:glibc.malloc.hugetlb=1"
    assert hostmem.huge_page_env({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert hostmem.huge_page_env(env) is None  # set already (by the user or by the first execution)
    assert hostmem.huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None  # the user's choice
    assert hostmem.huge_page_env({hostmem.OPT_OUT: "0"}) is None


def test_the_process_re_executes_once_and_its_large_buffers_fault_in_huge_pages():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hostmem.OPT_OUT)}
    env["XLA_FLAGS"] = ""  # one device is enough

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
    if hostmem.huge_page_env(env) is None:  # this machine can't: the child ran as it was started
        assert tunables == "" and faults > PAGES_4K / 2
        return
    assert tunables == "glibc.malloc.hugetlb=1"
    # Without the tunable every call faults the fresh 128 MiB output in 4 KiB pages; with it, in 2 MiB ones.
    assert plain_faults >= PAGES_4K, plain_faults
    assert faults < PAGES_4K / 8, (faults, plain_faults)


def test_the_console_script_runs_the_cli_after_re_executing(tmp_path):
    code = "import sys; from moejax.entry import main; sys.argv[1:] = ['count', 'tiny']; sys.exit(main())"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "XLA_FLAGS": ""})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("moejax count: preset tiny") and "total parameters" in p.stdout
