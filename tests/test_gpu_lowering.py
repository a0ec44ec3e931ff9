"""The Pallas GPU kernels lower to Triton for an H200 on this CPU-only machine (jax.export for 'cuda' under
an abstract H200 device): Pallas's Triton lowering rules accept every op, ref index and loop bound they
use, at the shapes of issue 11's shape G. What this cannot check is Triton's own compile to PTX, which
runs inside XLA on a GPU (`bench/bench_gpu.py` does that)."""

import contextlib
import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from moejax.model import flash_gpu, kernel_choice
from moejax.model.flash_gpu import flash_attention
from moejax.model.moe import grouped_gpu
from moejax.model.moe.grouped import default_block
from moejax.config import ParallelConfig
from moejax.ladder.lower import TRITON_CALL, abstract_train_inputs
from moejax.parallel.backends import attention_kernel, moe_backend
from moejax.parallel.expert_parallel import transport_sizes
from moejax.parallel.mesh import MESH_AXES
from moejax.presets import TINY, ladder_rung
from moejax.train import ns_gpu
from moejax.train.optimizer import make_optimizer, param_group
from moejax.train.state import init_state
from moejax.train.step import make_train_step
from tests.helpers import toy_batch, toy_model

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def _as_gpu():
    """Trace as a GPU would: on an abstract H200, Triton kernels chosen (not the interpreter)."""
    stack = contextlib.ExitStack()
    stack.enter_context(use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H200)))
    stack.enter_context(kernel_choice.targeting_gpu())
    return stack


def _triton_calls(fn, *args) -> int:
    """Lower `fn` for CUDA as a GPU would trace it and count its Triton kernel calls."""
    with _as_gpu():
        exported = export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
    return exported.mlir_module().count(f"stablehlo.custom_call @{TRITON_CALL}")


def _loops(fn, *args) -> list[tuple[str, int | None]]:
    """The loops of `fn` traced as a GPU would trace it (`_jaxpr_loops`)."""
    with _as_gpu():
        return _jaxpr_loops(jax.jit(fn).trace(*args).jaxpr)


def _jaxpr_loops(closed) -> list[tuple[str, int | None]]:
    """(primitive, trip count) of every scan (not fully unrolled) and while loop in a jaxpr, sub-jaxprs (cond,
    custom VJPs, remat, shard_map, nested jits) included, but not inside Pallas kernels, whose loops run
    within the kernel. Each is a device while loop on a GPU: a launch and a host round trip for its predicate
    per trip. jnp.searchsorted's default method was one (a fori_loop, i.e. a scan) in every layer's block
    layout and EP ranking."""
    loops, todo = [], [closed.jaxpr]
    while todo:
        for eqn in todo.pop().eqns:
            if eqn.primitive.name == "pallas_call":
                continue
            unrolled = eqn.primitive.name == "scan" and eqn.params["unroll"] >= eqn.params["length"]
            if eqn.primitive.name in ("scan", "while") and not unrolled:
                loops.append((eqn.primitive.name, eqn.params.get("length")))
            for v in eqn.params.values():
                for sub in v if isinstance(v, (list, tuple)) else [v]:
                    if isinstance(sub, ClosedJaxpr):
                        todo.append(sub.jaxpr)
                    elif isinstance(sub, Jaxpr):
                        todo.append(sub)
    return loops


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("n_experts", [64, 384])
def test_grouped_gemm_kernels_lower_to_triton(n_experts):
    """Shape G's expert matmul (Z = F = 512, b = 128, bf16) and the d1024 rung's 384 experts."""
    e, z, f, b, n_blocks = n_experts, 512, 512, 128, 3 * n_experts
    x, dy, w = _spec((n_blocks, b, z)), _spec((n_blocks, b, f)), _spec((e, z, f))
    expert_Bk, blocks_E = _spec((n_blocks,), jnp.int32), _spec((e,), jnp.int32)
    assert grouped_gpu.fits(b, z, f)
    assert _triton_calls(grouped_gpu.matmul, x, w, expert_Bk, blocks_E) == 1
    assert _triton_calls(grouped_gpu.matmul_dx, dy, w, expert_Bk, blocks_E) == 1
    assert _triton_calls(grouped_gpu.matmul_dw, x, dy, blocks_E) == 1


@pytest.mark.parametrize("window", [None, 2048], ids=["global", "local"])
def test_flash_attention_lowers_to_triton(window):
    """Forward and backward (fwd, dq, dkv kernels) at head_dim 128, 8 query heads on 2 KV heads."""
    q, kv, seg = _spec((1, 4096, 8, 128)), _spec((1, 4096, 2, 128)), _spec((1, 4096), jnp.int32)
    grads = lambda q, k, v, s: jax.grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, s, 0.1, window)),
                                        argnums=(0, 1, 2))(q, k, v)
    assert _triton_calls(grads, q, kv, kv, seg) == 3


@pytest.mark.parametrize("seq", [32, 48])
def test_flash_attention_shorter_than_a_block_lowers_or_is_refused_first(seq):
    """A sequence shorter than the blocks is its own tile: 32 rows lower; 48 (not a power of two, which
    Triton's tiles must be) is refused by `shape_problem`, which `kernel_choice.check_choices` asks before a
    run starts, instead of failing inside Pallas's lowering mid-trace (it passed the check before)."""
    q, kv, seg = _spec((1, seq, 2, 64)), _spec((1, seq, 1, 64)), _spec((1, seq), jnp.int32)
    grads = lambda q, k, v, s: jax.grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, s, 0.1, None)),
                                        argnums=(0, 1, 2))(q, k, v)
    problem = flash_gpu.shape_problem(seq, 2, 1, 64)
    if seq == 32:
        assert problem is None and _triton_calls(grads, q, kv, kv, seg) == 3
    else:
        assert problem == "sequence length (48) makes block q a tile of 48 rows: not a power of two >= 16 (Triton)"
        with pytest.raises(ValueError, match="tile of 48 rows"):
            _triton_calls(grads, q, kv, kv, seg)
        assert flash_gpu.shape_problem(seq, 2, 1, 64, interpret=True) is None  # the interpreter takes any tile


@pytest.mark.parametrize("remat", [False, True], ids=["no_remat", "remat"])
def test_train_step_lowers_with_both_kernels(remat, monkeypatch):
    """The whole train step (hero optimizer, bf16, unrolled layers) lowered for CUDA with both kernels
    chosen runs every layer's attention and expert matmuls through Triton: per layer, attention forward +
    dq + dkv and the two expert matmuls' forward + dx + dw (gate and up as one; the down projection with
    SwiGLU's activation fused); remat reruns the three forwards."""
    monkeypatch.setenv("MOEJAX_ATTENTION", "gpu_kernel")
    monkeypatch.setenv("MOEJAX_GROUPED", "gpu_kernel")
    monkeypatch.setenv("MOEJAX_NS", "xla")  # the optimizer's kernel: test_newton_schulz_kernel_in_one_device_steps
    step, state, batch, model = _toy_gpu_step(remat)
    per_layer = (1 + 2) + 2 * (1 + 2) + (3 if remat else 0)
    assert _triton_calls(step, state, batch) == model.n_layers * per_layer
    assert _loops(step, state, batch) == []  # unrolled layers: nothing loops on the device


def _toy_gpu_step(remat: bool, parallel: ParallelConfig = ParallelConfig()):
    model = toy_model(d_model=64, head_dim=16, window=32, rope_dim=8, expert_width=32, latent_width=32,
                      shared_width=32, vocab_size=256, n_layers=2, compute_dtype="bfloat16")
    cfg = replace(TINY, model=model, train=replace(TINY.train, batch_size=2, seq_len=64), parallel=parallel)
    optimizer, lr_fn = make_optimizer(cfg)
    state = jax.eval_shape(lambda: init_state(cfg, optimizer, jax.random.key(0)))
    batch = jax.eval_shape(lambda: toy_batch(model, batch=2, seq=64, doc_lens=((20, 44), (64,))))
    with kernel_choice.targeting_gpu():  # the step fixes its kernel choices when built
        step = make_train_step(model, optimizer, lr_fn, remat=remat, scan_layers=False)
    return step, state, batch, model


def test_newton_schulz_kernel_in_one_device_steps(monkeypatch):
    """On one GPU the hero optimizer's Newton-Schulz runs through its kernels: 5 steps x 3 calls (X X^T,
    c G G + b G, B X + a X) for every MuonH matrix stack; on a multi-device mesh it stays XLA by default (GSPMD would run a
    custom call replicated over the sharded stacks)."""
    for var in ("MOEJAX_ATTENTION", "MOEJAX_GROUPED", "MOEJAX_NS"):
        monkeypatch.delenv(var, raising=False)
    step, state, batch, model = _toy_gpu_step(False)
    model_calls = model.n_layers * ((1 + 2) + 2 * (1 + 2))
    muonh = [p.shape[-2:] for path, p in jax.tree_util.tree_flatten_with_path(state.params)[0]
             if param_group(path) == "muonh"]
    # the toy's GatedNorm rank is 4: no power-of-two tile >= 16, so those matrices keep XLA
    fit = [s for s in muonh if ns_gpu.shape_problem(min(s), min(s), max(s)) is None]
    assert 0 < len(fit) < len(muonh)
    assert _triton_calls(step, state, batch) == model_calls + 15 * len(fit)
    step, state, batch, _ = _toy_gpu_step(False, ParallelConfig(data=2))
    assert _triton_calls(step, state, batch) == model_calls


@pytest.mark.parametrize("rows", ["xla", "gpu_kernel"], ids=["xla_gathers", "rows_in_kernels"])
def test_d1024_rung_step_lowers_with_both_kernels(rows, monkeypatch):
    """The real d1024 rung (384 experts, scanned layers, remat, memory settings) at issue 11's 8 x 4096
    tokens: both kernels take its shapes (abstract shapes: nothing is allocated), with the grouped GEMM's
    rows gathered by XLA or (MOEJAX_GROUPED_ROWS) inside its kernels."""
    monkeypatch.setenv("MOEJAX_ATTENTION", "gpu_kernel")
    monkeypatch.setenv("MOEJAX_GROUPED", "gpu_kernel")
    monkeypatch.setenv("MOEJAX_GROUPED_ROWS", rows)
    monkeypatch.setenv("MOEJAX_NS", "xla")  # counted in test_newton_schulz_kernel_in_one_device_steps
    cfg = ladder_rung(1024)
    cfg = replace(cfg, train=replace(cfg.train, batch_size=8, remat=True, scan_layers=True), parallel=ParallelConfig())
    optimizer, lr_fn = make_optimizer(cfg)
    state = jax.eval_shape(lambda: init_state(cfg, optimizer, jax.random.key(0)))
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    batch = {k: _spec(shape, jnp.int32) for k in ("tokens", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = _spec(shape, jnp.bool_)
    with kernel_choice.targeting_gpu():
        step = make_train_step(cfg.model, optimizer, lr_fn, remat=True, scan_layers=cfg.train.scan_layers)
    # One scanned body: both attention kinds under the lax.cond (forward + remat forward each), two expert
    # matmuls (gate and up as one, the down projection with the activation; forward + remat forward, dx, dw).
    assert cfg.model.n_experts == 384 and cfg.train.scan_layers
    assert _triton_calls(step, state, batch) == 2 * (2 + 1 + 1) + 2 * (2 + 1 + 1)
    # the layer scan and the loss streamed over vocab blocks, forward and backward; nothing loops inside them
    vocab_blocks = -(-cfg.model.vocab_size // cfg.model.loss_vocab_block)
    loops = _loops(step, state, batch)
    assert loops and set(loops) <= {("scan", cfg.model.n_layers), ("scan", vocab_blocks)}, loops


@pytest.mark.parametrize("axes", [dict(data=8), dict(data=2, expert=4)], ids=["local_data8", "ep_data2_expert4"])
def test_mesh_step_runs_each_kernel_per_batch_shard(axes, monkeypatch):
    _lower_mesh_step(axes, "xla", monkeypatch)


def test_mesh_step_with_rows_in_the_grouped_kernels(monkeypatch):
    """As above with MOEJAX_GROUPED_ROWS=gpu_kernel: the grouped kernels read a shard's 64 tokens in place
    ([64, Z] operands, no [Bk, b, Z] copy) and write its 64 x top-2 assignment rows, under shard_map (the
    whole-array outputs of the scattered stores need their varying axes too)."""
    _lower_mesh_step(dict(data=8), "gpu_kernel", monkeypatch)


def test_mesh_step_with_the_transports_experts_on_the_grouped_kernels(monkeypatch):
    """MOEJAX_EP_GROUPED=gpu_kernel on data 2 x expert 4: every wave's expert MLPs run on the grouped kernels
    inside the transport's shard_map, reading the received block's rows in place ([X*P, Z], no [E_loc, R, Z]
    buffer) and writing the returned rows."""
    _lower_mesh_step(dict(data=2, expert=4), "xla", monkeypatch, ep_grouped="gpu_kernel")


def _lower_mesh_step(axes: dict, rows_in_kernels: str, monkeypatch, ep_grouped: str = "xla"):
    """On 8 abstract H200s, the train step's kernels are called inside the batch shards' shard_map with one
    device's rows (batch 8 over 8 shards: 1 row each): attention on both MoE backends, the grouped GEMM on
    the local one (the EP backend's experts are batched einsums on its fixed buffers). Under shard_map
    Pallas must be told its outputs' varying axes (`pallas_util.out_like`); without that this raised."""
    monkeypatch.setenv("MOEJAX_ATTENTION", "gpu_kernel")
    monkeypatch.setenv("MOEJAX_GROUPED", "gpu_kernel")
    monkeypatch.setenv("MOEJAX_GROUPED_ROWS", rows_in_kernels)
    monkeypatch.setenv("MOEJAX_EP_GROUPED", ep_grouped)
    model = toy_model(d_model=64, head_dim=16, window=32, rope_dim=8, expert_width=32, latent_width=32,
                      shared_width=32, vocab_size=256, n_layers=2, compute_dtype="bfloat16")
    par = ParallelConfig(**axes)
    cfg = replace(TINY, model=model, train=replace(TINY.train, batch_size=8, seq_len=64), parallel=par)
    mesh = AbstractMesh(par.mesh_shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                        abstract_device=H200)
    state, batch, state_sh, batch_sh, optimizer, lr_fn = abstract_train_inputs(cfg, mesh)
    with use_abstract_mesh(mesh), kernel_choice.targeting_gpu():
        step = make_train_step(model, optimizer, lr_fn, moe_backend(par, mesh), remat=False, scan_layers=False,
                               attention_kernel=attention_kernel(mesh))
        traced = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None)).trace(state, batch)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    operands = re.findall(rf"stablehlo.custom_call @{re.escape(TRITON_CALL)}\(.*?\).*?: \((.*?)\) ->", text)
    attention = [o for o in operands if "tensor<1x64x4x16xbf16>" in o]  # q of one row
    assert len(attention) == model.n_layers * 3  # forward, dq, dkv
    assert not any("tensor<8x64" in o for o in operands), "attention saw the global batch"
    # The grouped GEMM's blocks are one shard's 64 tokens x top-2, not the batch's 512 x 2.
    rows = 64 * model.top_k
    b = default_block(rows, model.n_experts, grouped_gpu.MIN_TILE)
    shard_blocks = f"tensor<{(rows + model.n_experts * (b - 1)) // b}x{b}x"  # [Bk, b, ...] of one shard's rows
    grouped = [o for o in operands if o not in attention]
    if par.resolved_backend == "ep":
        # Per layer and wave: gate/up's forward twice (the expert compute's checkpoint reruns it for the
        # backward; the down projection's forward is not rerun: its output isn't needed), the down projection's
        # forward, and dx and dw of each. Five of the seven read the received block's [X*P, Z] rows in place
        # (gate/up's forwards and dw, the down projection's dx_act and dw, through its return rows).
        calls = model.n_layers * par.waves
        assert len(grouped) == (calls * 7 if ep_grouped == "gpu_kernel" else 0)
        sizes = transport_sizes(64, model.top_k, par.expert, model.n_experts // par.expert, par.waves,
                                par.cf_send, par.cf_recv, model.latent_width, 2)  # one row of 64 tokens a device
        received = f"tensor<{par.expert * sizes.send_pool}x{model.latent_width}xbf16>"
        assert sum(received in o for o in grouped) == (calls * 5 if ep_grouped == "gpu_kernel" else 0), grouped[:1]
        return
    assert len(grouped) == model.n_layers * 2 * 3
    if rows_in_kernels == "xla":
        assert all(shard_blocks in o for o in grouped), (shard_blocks, grouped[:1])
    else:  # gate/up's forward and dw read the shard's tokens; the down projection's dx_act and dw its rows
        reads = lambda shape: sum(f"tensor<{shape}xbf16>" in o for o in grouped)
        assert reads(f"64x{model.latent_width}") == model.n_layers * 2, grouped[:2]
        assert reads(f"{rows}x{model.latent_width}") == model.n_layers * 2, grouped[:2]
    assert _jaxpr_loops(traced.jaxpr) == []  # nor in the EP transport's ranking
