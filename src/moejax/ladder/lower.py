"""Lower a preset's whole train step on its mesh, never run it: `moejax plan P --lower` (and `--compile`,
which also compiles it for the cluster's GPUs on a deviceless CUDA topology: `moejax.cuda_aot`).

The state is abstract: `jax.ShapeDtypeStruct`s carrying the real shardings (`param_shardings` for the
parameters, `mirror_shardings` for the optimizer state), built from `jax.eval_shape` — the 535B hero is
never allocated. The mesh is a `jax.sharding.AbstractMesh` of the preset's shape, so no devices are
needed at all, and the hero's 704-device step lowers on a laptop (time and RAM: docs/LOG.md and
`format_lower`). `jax.jit(step, in_shardings, out_shardings).lower(state, batch)` runs
the full tracing + sharding propagation + StableHLO emission, including the pooled-wave transport's
`shard_map` over `expert`; the all_to_all count in the lowered text checks that every MoE layer emits
its W waves x 2 directions (the layer scan holds one copy of the body, the backward another; unrolled,
every layer has its own; block remat adds the collectives `train.remat_saves` doesn't keep: none, W or 2W).
The step is built as the run would build it: cfg.train.remat and cfg.train.scan_layers.

`lower_in_subprocess` runs it in a fresh interpreter so the caller's jax state (forced host devices,
x64, caches) cannot leak in, and so a failure cannot take the CLI down with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from moejax.cuda_aot import TRITON_CALL  # how a Pallas (Triton) kernel appears in the lowered text
from moejax.roofline import format_estimate


def abstract_train_inputs(cfg, mesh, phase=None):
    """(abstract state, abstract batch, state shardings, batch sharding, optimizer, lr_fn); the batch of
    `phase` (a ContextPhase: rows x chunk) or of train.seq_len."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from moejax.parallel.mesh import BATCH_SPEC, REPLICATED
    from moejax.plan import abstract_state_parts
    from moejax.train.state import TrainState, compute_copy

    params, params_sh, opt, opt_sh, optimizer, lr_fn = abstract_state_parts(cfg, mesh)
    rep = NamedSharding(mesh, REPLICATED)
    sds = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    key_data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    m, t = cfg.model, cfg.train
    state = TrainState(step=sds(jax.ShapeDtypeStruct((), jnp.int32), rep),
                       params=jax.tree.map(sds, params, params_sh),
                       compute=jax.tree.map(sds, jax.eval_shape(lambda p: compute_copy(p, jnp.dtype(m.compute_dtype)),
                                                                params), params_sh),
                       opt_state=jax.tree.map(sds, opt, opt_sh),
                       rng=sds(key_data, rep))
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    bsh = NamedSharding(mesh, BATCH_SPEC)
    shape = (phase.rows, phase.chunk) if phase is not None else (t.batch_size, t.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=bsh)
             for k in ("tokens", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=bsh)
    return state, batch, state_sh, bsh, optimizer, lr_fn


def lower_train_step(cfg, remat: bool | None = None, platform: str = "cuda", mesh=None, phase=None,
                     device_kind: str = "NVIDIA H200", cores: int = 132, compile: bool = False,
                     top: int = 10, by_source: bool = False) -> dict:
    """Lower cfg's train step on an AbstractMesh of cfg.parallel's shape (or on `mesh`, a concrete Mesh
    of this process's devices, lowered for them); returns timing and counts. `phase` (a ContextPhase of
    cfg.phases): that phase's batch layout, context-parallel degree and capacity factors. `device_kind`,
    `cores`: the GPU the abstract mesh stands for (the kernels' Triton target). `compile`: lower on a
    deviceless CUDA topology of that GPU instead and compile with XLA's GPU compiler (`moejax.cuda_aot`; run
    in its subprocess environment), adding XLA's memory and cost analysis. `remat` None: as cfg.train.remat;
    the layers are scanned or unrolled as cfg.train.scan_layers says. `top`, `by_source`: the roofline's
    largest items listed, labelled by source line (`cuda_aot.compiled_numbers`)."""
    import contextlib
    import dataclasses

    import jax
    from jax.sharding import AbstractDevice, use_abstract_mesh

    from moejax.config import ALL_TO_ALLS_PER_WAVE
    from moejax.model.kernel_choice import targeting_gpu
    from moejax.parallel.mesh import abstract_mesh, make_mesh
    from moejax.parallel.backends import attention_kernel, layer_weights, moe_backend
    from moejax.train.step import make_train_step

    t0 = time.perf_counter()
    remat = cfg.train.remat if remat is None else remat
    saves = cfg.train.remat_saves
    concrete = mesh is not None
    gpu = AbstractDevice(device_kind=device_kind, num_cores=cores, platform="gpu") if platform == "cuda" else None
    if compile:
        from moejax.cuda_aot import gpu_devices

        mesh = make_mesh(cfg.parallel, gpu_devices(device_kind, cfg.parallel.n_devices))
    mesh = mesh if concrete or compile else abstract_mesh(cfg.parallel, gpu)
    state, batch, state_sh, bsh, optimizer, lr_fn = abstract_train_inputs(cfg, mesh, phase)
    par = cfg.parallel if phase is None else dataclasses.replace(cfg.parallel, cf_send=phase.cf_send,
                                                                  cf_recv=phase.cf_recv)
    # An AbstractMesh has no devices, so the target platform is named (the hero runs on GPUs), and the step
    # is built and traced as a GPU would run it: with the fused kernels, unless MOEJAX_* chooses xla.
    on_gpu = not concrete and platform == "cuda"
    with contextlib.ExitStack() as as_on_gpu:
        if on_gpu:
            as_on_gpu.enter_context(jax.set_mesh(mesh) if compile else use_abstract_mesh(mesh))
            as_on_gpu.enter_context(targeting_gpu())
        step = make_train_step(cfg.model, optimizer, lr_fn, moe_backend(par, mesh), remat=remat and saves,
                               context=1 if phase is None else phase.context, scan_layers=cfg.train.scan_layers,
                               attention_kernel=attention_kernel(mesh),
                               layer_weights=layer_weights(mesh))
        # the state donated, as the train loop does (so the compiled memory analysis is the real one)
        fn = jax.jit(step, in_shardings=(state_sh, bsh), out_shardings=(state_sh, None), donate_argnums=0)
        t1 = time.perf_counter()
        lowered = fn.lower(state, batch) if concrete else fn.trace(state, batch).lower(lowering_platforms=(platform,))
    t2 = time.perf_counter()
    compiled = {}
    if compile:
        from moejax.cuda_aot import compiled_numbers

        from moejax.accounting import train_flops

        rows, seq = batch["tokens"].shape
        compiled = {"compiled": compiled_numbers(lowered.compile(), device_kind, top, by_source),
                    "compile_s": time.perf_counter() - t2,
                    "state_fp32_bytes": _per_device_bytes((state.params, state.opt_state)),
                    # the model FLOPs of one step per device (a context-parallel row is a chunk of a sequence)
                    "model_flops_per_device": train_flops(cfg.model, seq * (1 if phase is None else phase.context),
                                                          rows * seq) / mesh.size}
    text = lowered.as_text()
    target = "local devices" if concrete else f"{platform} ({device_kind})" if on_gpu else platform
    return {"ok": True, "preset": cfg.name, "platform": target, "mesh": dict(mesh.shape), "devices": mesh.size,
            **compiled,
            "abstract_s": t1 - t0, "lower_s": t2 - t1, "hlo_chars": len(text),
            "num_partitions": _num_partitions(text), "all_to_all": text.count("stablehlo.all_to_all"),
            "gpu_kernels": text.count(f"stablehlo.custom_call @{TRITON_CALL}"),
            "seq_len": cfg.train.seq_len if phase is None else phase.seq_len,
            "context": 1 if phase is None else phase.context,
            "batch": list(batch["tokens"].shape),
            "remat_saves": saves if remat else None, "opt_state_memory": cfg.train.opt_state_memory,
            # W waves x (dispatch, return) x (forward, backward transposes, + what the remat re-forward reruns),
            # once in a scanned layer body, in every layer unrolled
            "scan_layers": cfg.train.scan_layers,
            "expected_all_to_all": (cfg.parallel.waves * ALL_TO_ALLS_PER_WAVE[saves if remat else "transport"]
                                    * (1 if cfg.train.scan_layers else cfg.model.n_layers)
                                    if cfg.parallel.use_ep else 0)}


def _per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs."""
    import jax

    from moejax.plan import _shard_elems

    return sum(n * size for _, _, n, size in _shard_elems(tree, jax.tree.map(lambda x: x.sharding, tree)))
RESULT = "LOWER_RESULT "  # the subprocess's result line


def _num_partitions(text: str) -> int:
    import re

    found = re.search(r"mhlo\.num_partitions = (\d+)", text)
    return int(found.group(1)) if found else 1


def _main(argv: list[str]) -> None:
    from moejax.config import RunConfig

    cfg = RunConfig.from_dict(json.loads(argv[0]))
    seq_len = int(argv[1]) if len(argv) > 1 else 0
    gpu = dict(device_kind=argv[2], cores=int(argv[3])) if len(argv) > 3 else {}
    try:
        phases = {ph.seq_len: ph for ph in cfg.phases}
        if seq_len and seq_len not in phases:
            raise ValueError(f"--phase {seq_len} is not a context phase of {cfg.name} ({', '.join(map(str, phases))})")
        res = lower_train_step(cfg, phase=phases[seq_len or max(phases)], compile=argv[4:5] == ["compile"], **gpu)
    except Exception as e:  # reported to the parent, which prints it as one line
        res = {"ok": False, "preset": cfg.name, "error": f"{type(e).__name__}: {e}"[:2000]}
    import resource

    res["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(RESULT + json.dumps(res))


def lower_in_subprocess(cfg, seq_len: int | None = None, timeout_s: float = 900, device_kind: str = "NVIDIA H200",
                        cores: int = 132, compile: bool = False) -> dict:
    """Lower `cfg`'s step at the context phase of `seq_len` (default: the longest) in a fresh interpreter,
    for GPUs of `device_kind` with `cores` SMs; `compile`: and compile it for them (`moejax.cuda_aot`)."""
    args = ["moejax.ladder.lower", cfg.to_json(), str(seq_len or 0), device_kind, str(cores)]
    if compile:
        from moejax.cuda_aot import run_compile_subprocess

        return {"preset": cfg.name, "compile_requested": True,
                **run_compile_subprocess([*args, "compile"], timeout_s, prefix=RESULT)}
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=timeout_s)
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return {**json.loads(line[len(RESULT):]), "wall_s": wall}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"ok": False, "preset": cfg.name, "error": f"exit {proc.returncode}: {tail[0]}", "wall_s": wall}


def format_lower(r: dict, hbm_bytes: float | None = None) -> str:
    """One paragraph for `moejax plan --lower` / `--compile`; `hbm_bytes`: the device's, for the compiled peak."""
    what = "compile" if r.get("compile_requested") else "lower"
    if not r["ok"]:
        return f"{what}: FAILED for {r['preset']}: {r['error']}"
    mesh = ", ".join(f"{k}={v}" for k, v in r["mesh"].items())
    text = (f"lower: whole train step of {r['preset']} at seq_len {r['seq_len']:,} (context-parallel degree "
            f"{r['context']}, batch {r['batch'][0]:,} x {r['batch'][1]:,}) "
            f"lowered on {'a deviceless CUDA topology' if 'compiled' in r else 'an abstract mesh'} ({mesh}) = "
            f"{r['devices']} devices in {r['lower_s']:.1f} s (+{r['abstract_s']:.1f} s abstract state; "
            f"{r['wall_s']:.1f} s wall incl. interpreter start; peak RSS {r['max_rss_gb']:.2f} GB); "
            f"{r['all_to_all']} all_to_all in the lowered text ({r['expected_all_to_all']} expected "
            f"{'in the scanned layer' if r['scan_layers'] else 'over the unrolled layers'}: W waves x "
            f"dispatch/return x forward/backward, + what the remat re-forward reruns with "
            f"train.remat_saves={r['remat_saves']}); "
            f"{r['gpu_kernels']} fused GPU kernel calls (each per batch shard); "
            f"num_partitions {r['num_partitions']}; platform {r['platform']}")
    if "compiled" not in r:
        return text + "; nothing compiled or allocated"
    c, gb = r["compiled"], 1e9
    of = f" of {hbm_bytes / gb:.0f} GB" if hbm_bytes else ""
    spills = {fn: w for fn, w in r.get("ptxas", {}).items() if w.get("spill_stores")}
    kernels = ", ".join(f"{n} {k}" for k, n in sorted(c["kernels"].items())) or "none"
    peak = c["sum_bytes"] if c["peak_bytes"] is None else c["peak_bytes"]  # (a jaxlib without XLA's peak)
    state = r["state_fp32_bytes"]
    host = (f" (train.opt_state_memory=pinned_host: a deviceless compile has no host memory, so it counts the fp32 "
            f"master and optimizer state, {state / gb:.2f} GB, on the device: {(peak - state) / gb:.2f} GB without "
            f"them)" if r.get("opt_state_memory") == "pinned_host" else "")
    return (text + f"\ncompile: XLA's GPU compiler (Triton, ptxas) in {r['compile_s']:.1f} s, nothing run; "
            f"per device: peak {peak / gb:.2f} GB{of} (XLA's buffer assignment){host}; all summed "
            f"{c['sum_bytes'] / gb:.2f} GB = arguments {c['argument_bytes'] / gb:.2f} + "
            f"outputs {c['output_bytes'] / gb:.2f} - donated {c['alias_bytes'] / gb:.2f} + temporaries "
            f"{c['temp_bytes'] / gb:.2f} GB; Triton kernels: {kernels}; register spills (ptxas): "
            + (", ".join(f"{fn} {w['spill_stores']} B" for fn, w in sorted(spills.items())) or "none")
            + ("\n" + format_estimate(c["roofline"], r.get("model_flops_per_device"), top=6) if "roofline" in c else ""))


if __name__ == "__main__":
    _main(sys.argv[1:])
