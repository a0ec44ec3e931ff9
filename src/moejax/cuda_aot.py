"""Compile for NVIDIA GPUs on a machine without one: XLA's own GPU compiler, Triton and ptxas, deviceless.

Why: the fused kernels' Triton compile (PTX, registers, spills) and XLA's memory plan for a GPU were only
seen on a GPU, and most sessions have none. Lowering (`plan --lower`) stops at StableHLO: a Triton module
that XLA then refuses (one did: the flash kernel's global layers, docs/LOG.md 2026-12-01, fourth session)
or a kernel that spills its accumulators passes it. Compiling here catches both.

How: jax's CUDA PJRT plugin makes a device topology from a GPU description alone (`TARGETS`, a
GpuTargetConfigProto: no driver, no device; `jax.experimental.topologies`), and `jit(f).lower(...).compile()`
on its devices runs the whole GPU pipeline, Triton kernels through ptxas included (ptxas from the pinned
nvidia-cuda-nvcc wheel). Nothing runs: the result gives XLA's memory analysis and cost analysis, and
ptxas's register-spill warnings (stderr, `ptxas_warnings`).

The plugin (requirements-cuda-aot.lock) is installed apart, in .venv/cuda-aot (`make cuda-aot`, which
`make test` runs), and only a subprocess puts it on sys.path (`subprocess_env`): importable in the main
interpreter, it would make every jax start try a CUDA backend and print an error on machines without a driver.

Entry points: `moejax plan P --compile` (the whole train step, `ladder.lower`), and
`python -m moejax.cuda_aot kernels` (each GPU kernel's forward and backward at small shapes; tests).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from moejax.config import ConfigError
from moejax.xla_flags import without_forced_host_devices

# What XLA's GPU compiler reads of a device (vendor figures; the per-SM and per-block limits decide
# Triton's shared memory and registers, device_memory_size the scheduler's memory limit).
_SM90 = dict(cc=(9, 0), smem_block_optin=232_448, smem_core=233_472, l2=52_428_800, clock=1.98)
_SM100 = dict(cc=(10, 0), smem_block_optin=232_448, smem_core=233_472, l2=134_217_728, clock=1.965)
TARGETS = {
    "NVIDIA H200": dict(_SM90, cores=132, memory=150_754_820_096, bandwidth=4_800_000_000_000),
    "NVIDIA H100": dict(_SM90, cores=132, memory=85_520_809_984, bandwidth=3_352_320_000_000),
    "NVIDIA GB200": dict(_SM100, cores=148, memory=199_715_979_264, bandwidth=8_000_000_000_000),
}
DEFAULT_GPU = "NVIDIA H200"
RESULT = "CUDA_AOT_RESULT "  # the subprocess's result line prefix
TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call of a Pallas (Triton) kernel
CASE = "CUDA_AOT_CASE "  # on stderr before each case's compile, so ptxas's warnings can be told apart


def target_config(device_kind: str) -> str:
    """The GpuTargetConfigProto (text format) of a GPU in TARGETS."""
    if device_kind not in TARGETS:
        raise ConfigError(f"no CUDA compile target for {device_kind!r} (known: {', '.join(TARGETS)})")
    t = TARGETS[device_kind]
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {t['smem_core']}
  threads_per_core_limit: 2048
  core_count: {t['cores']}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {t['bandwidth']}
  l2_cache_size: {t['l2']}
  clock_rate_ghz: {t['clock']}
  device_memory_size: {t['memory']}
  shared_memory_per_block_optin: {t['smem_block_optin']}
  cuda_compute_capability {{ major: {t['cc'][0]} minor: {t['cc'][1]} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{device_kind}"
"""


def plugin_dir() -> Path:
    """Where the CUDA compile kit is installed: $MOEJAX_CUDA_AOT, else <venv>/cuda-aot."""
    return Path(os.environ.get("MOEJAX_CUDA_AOT") or Path(sys.prefix) / "cuda-aot")


def check_available() -> Path:
    d = plugin_dir()
    if not (d / "jax_plugins").is_dir():
        raise ConfigError(f"compiling for a GPU here needs jax's CUDA plugin in {d} (missing); `make cuda-aot` "
                          f"installs it (requirements-cuda-aot.lock), or set MOEJAX_CUDA_AOT to its directory")
    return d


def subprocess_env() -> dict:
    """Environment of a subprocess that compiles for CUDA: the kit first on sys.path, jax's backend CPU
    (the CUDA plugin is used for its compiler only), no forced host devices, XLA's log on stderr at INFO
    (ptxas's warnings come through it)."""
    kit = check_available()
    path = os.pathsep.join(p for p in (str(kit), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "0",
            "XLA_FLAGS": without_forced_host_devices(os.environ.get("XLA_FLAGS", ""))}


def gpu_devices(device_kind: str, n: int):
    """n devices of a deviceless CUDA topology of `device_kind` GPUs (call inside a `subprocess_env`)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(device_kind),
                                        topology=f"1x1x{n}")
    return list(topo.devices)


_SPILL = re.compile(r"Registers are spilled to local memory in function '(\w+)', (\d+) bytes spill stores, "
                    r"(\d+) bytes spill loads")
_SERIAL = re.compile(r"wgmma\.mma_async instructions are serialized due to (.*?) for the function '(\w+)'")


def ptxas_warnings(stderr: str) -> dict:
    """{function: {"spill_stores": bytes, "spill_loads": bytes, "wgmma_serialized": reason}} from ptxas's
    warnings in XLA's log; the largest spill seen per function."""
    out: dict[str, dict] = {}
    for fn, stores, loads in _SPILL.findall(stderr):
        w = out.setdefault(fn, {})
        w["spill_stores"] = max(w.get("spill_stores", 0), int(stores))
        w["spill_loads"] = max(w.get("spill_loads", 0), int(loads))
    for reason, fn in _SERIAL.findall(stderr):
        out.setdefault(fn, {})["wgmma_serialized"] = reason
    return out


def compiled_numbers(compiled, device_kind: str = DEFAULT_GPU, top: int = 10, by_source: bool = False) -> dict:
    """XLA's memory analysis of a compiled GPU executable (bytes per device), its Triton kernels by name, and
    the roofline estimate of one run on `device_kind` (`moejax.roofline`; XLA's own cost analysis is empty
    without a device), with its `top` largest items (`by_source`: labelled by source line)."""
    from moejax import roofline

    m = compiled.memory_analysis()
    text = compiled.as_text()
    peak = roofline.GPU_PEAKS[device_kind]
    est = roofline.estimate(text, peak, TARGETS[device_kind]["bandwidth"], roofline.GPU_LAUNCH_S,
                            f32_dot_peak=peak * roofline.GPU_F32_DOT_FRACTION, by_source=by_source,
                            f32_fma_peak=roofline.gpu_f32_fma_peak(peak, device_kind))
    est["items"] = est["items"][:top]
    kernels: dict[str, int] = {}
    for line in text.splitlines():
        if f'custom_call_target="{TRITON_CALL}"' in line:
            found = roofline.KERNEL_NAME.search(line)
            name = found.group(1) if found else "unnamed"
            kernels[name] = kernels.get(name, 0) + 1
    return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
            "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
            # XLA's own peak of its buffer assignment. Close to `sum_bytes` (every argument, output and the
            # scratch together), since XLA allocates its scratch as one block of temp bytes; the live set at
            # the heaviest instruction can be smaller (the hero's step: 248.2 GB here, 192.5 GB live at its
            # heaviest point, docs/LOG.md 2026-12-01, fifth session).
            "peak_bytes": getattr(m, "peak_memory_in_bytes", None),
            "sum_bytes": m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes,
            "triton_kernels": sum(kernels.values()), "kernels": kernels, "roofline": est}


def run_compile_subprocess(args: list[str], timeout_s: float, prefix: str = RESULT) -> dict:
    """Run `python -m <args>` in a CUDA-compile subprocess; its result line (`prefix` + JSON) as a dict, plus
    ptxas's warnings and the wall time. A failure is {"ok": False, "error": one line}."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=subprocess_env(),
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"compile did not finish within {timeout_s:.0f} s"}
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith(prefix):
            res = {**json.loads(line[len(prefix):]), "ptxas": ptxas_warnings(proc.stderr), "wall_s": wall}
            by_case = _by_case(proc.stderr)
            for row in res.get("cases", []):
                row["ptxas"] = ptxas_warnings(by_case.get(row["case"], ""))
            return res
    errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error:" in ln]
    tail = (errors or (proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1]
    return {"ok": False, "error": f"exit {proc.returncode}: {tail[:2000]}", "wall_s": wall}


def _by_case(stderr: str) -> dict[str, str]:
    """stderr split at the CASE markers: {case name: what was logged while it compiled}."""
    parts, name = {}, None
    for line in stderr.splitlines(keepends=True):
        if line.startswith(CASE):
            name = line[len(CASE):].strip()
            parts[name] = ""
        elif name is not None:
            parts[name] += line
    return parts


# --- `python -m moejax.cuda_aot kernels`: each fused kernel, forward and backward, compiled for one GPU ----

def _kernel_cases():
    """(name, function, abstract args, Pallas calls expected in the compiled gradient, or in the compiled
    function for the optimizer's Newton-Schulz): small shapes that take every code path of the kernels. Their
    Triton compile mostly doesn't depend on the sizes beyond the tiles, but ptxas's register allocation can:
    `matmul_dx_act` spills 12 B at the step's row counts (81,920 rows and more at width 512, not at 65,536;
    docs/LOG.md 2026-12-04, twenty-first session), which these shapes don't reach. The spill comes with
    128-row blocks (with rows in the kernels too, and in `swiglu_kept_rows`), and not with 64-column dx_act tiles
    (docs/LOG.md 2026-12-05/06, thirty-fifth session)."""
    import jax
    import jax.numpy as jnp

    from moejax.model.flash_gpu import flash_attention
    from moejax.model.kernel_choice import GROUPED_ROWS, chosen
    from moejax.model.moe.grouped import grouped_swiglu, swiglu_kept_rows

    sds = jax.ShapeDtypeStruct

    def flash_grad(window, dtype, kv_heads, earlier=0, b=2, s=512, h=8, hd=128):
        def f(q, k, v, seg):
            loss = lambda q, k, v: flash_attention(q, k, v, seg, hd ** -0.5, window).sum()
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        kv = sds((b, s + earlier, kv_heads, hd), dtype)
        return f, (sds((b, s, h, hd), dtype), kv, kv, sds((b, s + earlier), jnp.int32)), 3  # fwd, dq, dkv

    def grouped_grad(n_exp, dtype, rows=4096, width=256, rows_in_kernels="xla"):
        def f(x, e, wg, wu, wd):
            loss = lambda x, wg, wu, wd: grouped_swiglu(x, e, wg, wu, wd).astype(jnp.float32).sum()
            with chosen(GROUPED_ROWS[0], rows_in_kernels):  # read while jit traces f
                return jax.grad(loss, argnums=(0, 1, 2, 3))(x, wg, wu, wd)
        w = sds((n_exp, width, width), dtype)
        # gate and up as one matmul, then the down projection (its dx with the activation's derivative): 2
        # forward kernels (the down projection's is dead: sum's gradient doesn't read it), 2 dx, 2 dw
        return f, (sds((rows, width), dtype), sds((rows,), jnp.int32), w, w, w), 5

    def kept_rows_grad(n_exp, dtype, rows=1024, width=256):
        # 1,024 rows: blocks of 64 (at 4,096, 128-row blocks: the dx_act spill above, as the local path's)
        def f(x, e, wg, wu, wd):  # ids == n_exp: rows the transport doesn't keep, skipped
            loss = lambda x, wg, wu, wd: swiglu_kept_rows(x, e, wg, wu, wd).astype(jnp.float32).sum()
            return jax.grad(loss, argnums=(0, 1, 2, 3))(x, wg, wu, wd)
        w = sds((n_exp, width, width), dtype)
        return f, (sds((rows, width), dtype), sds((rows,), jnp.int32), w, w, w), 5  # as grouped_grad's

    def newton_schulz_stack(shape):
        from moejax.train.optimizer import newton_schulz

        # 5 steps x (X X^T, c G G + b G, B X + a X): 15 calls of three compiled kernels (alpha, beta are
        # constants)
        return lambda x: newton_schulz(x, kernel={}), (sds(shape, jnp.float32),), 15

    bf16, f32 = jnp.bfloat16, jnp.float32
    return [
        ("flash local bf16 (window 256, GQA 8/2)", *flash_grad(256, bf16, 2)),
        ("flash global bf16 (GQA 8/1)", *flash_grad(None, bf16, 1)),
        ("flash global bf16 with 256 earlier keys (context parallel)", *flash_grad(None, bf16, 2, earlier=256)),
        ("flash local fp32 (window 256, GQA 8/2)", *flash_grad(256, f32, 2)),
        ("grouped SwiGLU bf16 E=64", *grouped_grad(64, bf16)),
        ("grouped SwiGLU bf16 E=384", *grouped_grad(384, bf16)),
        ("grouped SwiGLU fp32 E=64", *grouped_grad(64, f32)),
        ("grouped SwiGLU bf16 E=64, rows read and written in the kernels (MOEJAX_GROUPED_ROWS)",
         *grouped_grad(64, bf16, rows_in_kernels="gpu_kernel")),
        ("kept-rows SwiGLU bf16 E=6, the transport's experts (MOEJAX_EP_GROUPED)", *kept_rows_grad(6, bf16)),
        ("Newton-Schulz bf16 [8, 512, 512] stack", *newton_schulz_stack((8, 512, 512))),
    ]


def compile_kernels(device_kind: str) -> list[dict]:
    """Compile every `_kernel_cases` case for one `device_kind` GPU (inside a `subprocess_env`)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from moejax.model.kernel_choice import targeting_gpu
    from moejax.parallel.mesh import make_mesh
    from moejax.config import ParallelConfig

    mesh = make_mesh(ParallelConfig(data=1), gpu_devices(device_kind, 1))
    on = NamedSharding(mesh, PartitionSpec())
    rows = []
    for name, fn, args, kernels in _kernel_cases():
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on) for a in args]
        print(CASE + name, file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            with targeting_gpu(), jax.set_mesh(mesh):
                compiled = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compile()
            row = {"case": name, "ok": True, **compiled_numbers(compiled, device_kind), "expected_kernels": kernels}
        except Exception as e:  # reported per case; the caller decides
            row = {"case": name, "ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:2000]}
        rows.append({**row, "compile_s": time.perf_counter() - t0})
    return rows


def kernels_in_subprocess(device_kind: str = DEFAULT_GPU, timeout_s: float = 900) -> dict:
    return run_compile_subprocess(["moejax.cuda_aot", "kernels", device_kind], timeout_s)


def _main(argv: list[str]) -> None:
    if argv[:1] == ["kernels"]:
        kind = argv[1] if len(argv) > 1 else DEFAULT_GPU
        rows = compile_kernels(kind)
        print(RESULT + json.dumps({"ok": all(r["ok"] for r in rows), "gpu": kind, "cases": rows}))
        return
    raise SystemExit("usage: python -m moejax.cuda_aot kernels [DEVICE_KIND]")


if __name__ == "__main__":
    _main(sys.argv[1:])
