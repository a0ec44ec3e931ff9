"""XLA's own GPU compiler — Triton and ptxas included — compiles the fused kernels and a whole train step for
NVIDIA GPUs on this machine without one (`moejax.cuda_aot`: a deviceless CUDA topology). Lowering alone
(test_gpu_lowering) stops before Triton's compile, which once refused the flash kernel's global layers
(a loop bound typed i1) and would have let its dK/dV kernel spill 12 KB of registers per thread.

Each test runs the compile in a subprocess with the CUDA plugin on its path (`make` installs it in
.venv/cuda-aot). Nothing is run: the kernels' numerics are tested through the interpreter elsewhere.
"""

import json
import os
import subprocess
import sys

from moejax.cuda_aot import kernels_in_subprocess
from tests.helpers import subprocess_xla_flags

ENV = {**os.environ, "WANDB_MODE": "disabled", "XLA_FLAGS": subprocess_xla_flags()}
KERNELS = {"moejax_flash_fwd", "moejax_flash_dq", "moejax_flash_dkv", "moejax_grouped_fwd", "moejax_grouped_dx",
           "moejax_grouped_dw", "moejax_grouped_dx_act"}


def _our_spills(ptxas: dict) -> dict:
    return {fn: w for fn, w in ptxas.items() if fn.startswith("moejax_") and w.get("spill_stores")}


def _check_kernels(gpu: str) -> None:
    r = kernels_in_subprocess(gpu)
    assert r.get("cases"), r.get("error")
    failed = {c["case"]: c["error"] for c in r["cases"] if not c["ok"]}
    assert not failed, failed
    for c in r["cases"]:
        # every Pallas call of the gradient is a compiled Triton kernel, none fell back or was dropped
        assert c["triton_kernels"] == c["expected_kernels"], c
        if "bf16" in c["case"]:  # the training dtype on GPUs; fp32 operands need twice the registers
            assert not _our_spills(c["ptxas"]), (c["case"], c["ptxas"])


def test_every_gpu_kernel_compiles_for_an_h200_without_register_spills():
    _check_kernels("NVIDIA H200")


def test_every_gpu_kernel_compiles_for_a_gb200():
    _check_kernels("NVIDIA GB200")  # the hero's GPU (sm_100)


def test_plan_compiles_a_data_parallel_step_for_eight_gpus(tmp_path):
    # two of tiny's layers: one local, one global, so both attention kinds (and half the compile time)
    proc = subprocess.run([sys.executable, "-m", "moejax.cli", "plan", "tiny", "--cluster", "h100x8", "--mesh",
                           "data=8", "--set", "model.n_layers=2", "--compile", "--json"],
                          capture_output=True, text=True, env=ENV, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)["lower"]
    assert r["ok"] and r["devices"] == 8 and r["num_partitions"] == 8, r
    c = r["compiled"]
    assert set(c["kernels"]) == KERNELS, c["kernels"]  # both kernels, forward and backward, per batch shard
    assert c["alias_bytes"] > 0.9 * c["argument_bytes"] > 0  # the state is donated, as the loop does
    assert 0 < c["peak_bytes"] <= c["sum_bytes"] < 80e9  # XLA's live-range peak, at most everything summed
    assert 0 < r["state_fp32_bytes"] < c["argument_bytes"]
    assert not _our_spills(r["ptxas"]), r["ptxas"]
    # the roofline of one device's step: every kernel costed (ours by name), more FLOPs than the model's
    # (the optimizer's and the recomputed ones come on top)
    roof = c["roofline"]
    assert roof["seconds"] > 0 and roof["kernels"] > 0 and not roof["unknown"], roof["unknown"]
    assert 0 < r["model_flops_per_device"] < roof["flops"]
    assert {"[fwd]", "[bwd]", "[rest]"} <= set(roof["phases"])


def test_plan_compile_without_the_cuda_plugin_is_one_line(tmp_path):
    env = {**ENV, "MOEJAX_CUDA_AOT": str(tmp_path / "missing")}
    proc = subprocess.run([sys.executable, "-m", "moejax.cli", "plan", "tiny", "--cluster", "h200x1", "--mesh",
                           "data=1", "--compile"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "CUDA plugin" in proc.stderr and "missing" in proc.stderr
    assert proc.stdout == ""


# The EP transport's backward compiled for 4 H200s: the integer index maps (header decode, ranks, chains of
# integer gathers) must reach the [rows, Z] row gathers as arrays, not fused into them. Fused, each element
# recomputed the chain: 3.1 ms a layer on an H200 in the capacity path's backward (docs/LOG.md, 2026-12-04,
# twenty-first session). Without `expert_parallel.materialized` this compile has 10 such fusions.
_EP_FUSION_SCRIPT = """
import json, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from moejax.cuda_aot import gpu_devices
from moejax.parallel.expert_parallel import routed_expert_parallel
from moejax.parallel.mesh import BATCH_AXES, MESH_AXES
mesh = Mesh(np.array(gpu_devices("NVIDIA H200", 4)).reshape(1, 1, 4, 1), MESH_AXES, axis_types=(AxisType.Auto,) * 4)
T, Z, F, E, K = 4096, 128, 128, 16, 4
tok, exp = NamedSharding(mesh, PartitionSpec(BATCH_AXES)), NamedSharding(mesh, PartitionSpec("expert"))
S = jax.ShapeDtypeStruct
args = [S((T, Z), jnp.bfloat16, sharding=tok), S((T, K), jnp.int32, sharding=tok),
        S((T, K), jnp.float32, sharding=tok), S((T,), jnp.bool_, sharding=tok)]
args += [S(s, jnp.bfloat16, sharding=exp) for s in ((E, Z, F), (E, Z, F), (E, F, Z))]
def loss(*a):
    return jnp.sum(routed_expert_parallel(*a, mesh=mesh)[0].astype(jnp.float32) ** 2)
text = jax.jit(jax.grad(loss, argnums=(0, 2, 4, 5, 6))).trace(*args).lower(lowering_platforms=("cuda",)).compile().as_text()
computations = re.split(r"\\n(?=\\S)", text)
fused = [c.split("(")[0].strip() for c in computations if re.search(r"= [su]32\\[[^\\]]*\\]\\{[^}]*\\} gather\\(", c)
         and re.search(r"= (?:f32|bf16)\\[[^\\]]*,\\d+\\]\\{[^}]*\\} gather\\(", c)]
row_gathers = len(re.findall(r"= (?:f32|bf16)\\[[^\\]]*,128\\]\\{[^}]*\\} gather\\(", text))
print("RESULT " + json.dumps({"fused": fused, "row_gathers": row_gathers}))
"""


def test_ep_transport_index_maps_are_not_fused_into_its_row_gathers():
    from moejax.cuda_aot import subprocess_env

    proc = subprocess.run([sys.executable, "-c", _EP_FUSION_SCRIPT], capture_output=True, text=True,
                          env=subprocess_env(), timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["row_gathers"] > 0, r  # the transport's [rows, Z] gathers are there to look at
    assert r["fused"] == [], r


# The router's bf16 logits at the hero's per-device shape ([65,536, 6,144] x [6,144, 384]), forward and
# gradients, compiled for a GB200: with the concatenate of dlogits' parts fused into the GEMM, XLA's deviceless
# compile chose a Triton tiling over the GPU's shared memory (295,152 of 232,448 bytes) and failed the hero's
# step. No dot may keep full fp32 precision (the FMA units), in either way XLA writes it.
_ROUTER_SCRIPT = """
import json
import jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from moejax.cuda_aot import gpu_devices
from moejax.model.moe.router import logits_bf16_matmul
from moejax.roofline import _HIGHEST
one = SingleDeviceSharding(gpu_devices("NVIDIA GB200", 1)[0])
m = jax.ShapeDtypeStruct((65536, 6144), jnp.bfloat16, sharding=one)
w = jax.ShapeDtypeStruct((6144, 384), jnp.float32, sharding=one)
loss = lambda m, w: jnp.sum(logits_bf16_matmul(m, w) ** 2)
text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(m, w).lower(lowering_platforms=("cuda",)).compile().as_text()
print("RESULT " + json.dumps({"f32_dots": len(_HIGHEST.findall(text))}))
"""


def test_router_logits_compile_for_a_gb200_at_the_hero_shape():
    from moejax.cuda_aot import subprocess_env

    proc = subprocess.run([sys.executable, "-c", _ROUTER_SCRIPT], capture_output=True, text=True,
                          env=subprocess_env(), timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    assert json.loads(lines[-1][len("RESULT "):]) == {"f32_dots": 0}  # every router GEMM on the tensor cores
