"""Context parallelism (issue 14) on the 8 forced CPU devices: the same batch laid out as 1, 2 or 4 chunks per
sequence, each chunk on its own device, gives the same loss and gradients. The batch has documents that
cross chunk boundaries, local windows that straddle them (and one wider than a chunk: a two-hop halo), a
global layer reading every earlier chunk, SConv taps across the boundary and next-token targets across it.
"""

import json
import shutil
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from moejax.cli import main
from moejax.config import ConfigError, ParallelConfig, apply_overrides
from moejax.data.loader import chunk_rows
from moejax.model.attention import flash_kernel
from moejax.model.kernel_choice import ATTENTION, chosen
from moejax.model.layers import front_extend
from moejax.model.transformer import Transformer, model_loss
from moejax.parallel.backends import attention_kernel, moe_backend
from moejax.parallel.mesh import REPLICATED, batch_sharding, make_mesh, param_shardings
from moejax.presets import preset
from moejax.train.loop import RunOptions, train
from tests.helpers import toy_batch, toy_model

# CP vs no CP in fp32: the same math over the same tokens; only the order of reductions differs (the
# per-device partial sums of weight gradients, the loss mean). Measured: loss 1e-7, grads < 1e-6 relative.
CP_RTOL_FP32 = 2e-5
CP_ATOL_FP32 = 2e-6
OPTS = RunOptions(wandb="disabled", progress=False, peak_flops=1e11)
NO_DROP_CF = 16.0  # P and R above any possible load at these shapes: EP drops nothing, so it equals dropless
SEQ, N_SEQS = 32, 2
# documents crossing the chunk boundaries 8/16/24 (c=4) and 16 (c=2); row 1 ends in padding
DOC_LENS = ((5, 11, 10, 6), (13, 12))


def _placed(cfg, batch, context: int):
    """(mesh, params, chunked batch, routed experts) with one chunk per device on an EP mesh."""
    par = ParallelConfig(expert=N_SEQS * context, cf_send=NO_DROP_CF, cf_recv=NO_DROP_CF)
    mesh = make_mesh(par)
    params = Transformer.init(cfg, jax.random.key(0))
    params = jax.device_put(params, param_shardings(params, mesh))
    return mesh, params, jax.device_put(chunk_rows(batch, context), batch_sharding(mesh)), moe_backend(par, mesh)


def _run(cfg, batch, context: int, kernel: bool = False):
    """Loss, grads and drop count with `context` chunks per sequence, one chunk per device (EP mesh);
    `kernel`: attention through the flash kernel per batch shard (interpreted here), not XLA."""
    mesh, params, chunks, routed = _placed(cfg, batch, context)
    attend = attention_kernel(mesh) if kernel else flash_kernel

    def f(p, b):
        with chosen(ATTENTION[0], "gpu_kernel" if kernel else "xla"):
            (loss, aux), grads = jax.value_and_grad(
                lambda p: model_loss(p, b, cfg, routed, remat=False, context=context, attention_kernel=attend),
                has_aux=True)(p)
        dropped = jnp.sum(aux["layers"]["sender_dropped"] + aux["layers"]["receiver_dropped"])
        return loss, grads, dropped, aux["tokens"]

    if kernel:  # every layer's attention forward, dq and dkv really are kernel calls
        assert str(jax.make_jaxpr(f)(params, chunks)).count("pallas_call[") == 3 * cfg.n_layers
    loss, grads, dropped, tokens = jax.jit(f, out_shardings=NamedSharding(mesh, REPLICATED))(params, chunks)
    return float(loss), jax.device_get(grads), int(dropped), float(tokens)


@pytest.fixture(scope="module")
def without_cp():
    """(model, batch, the context-1 run's loss, grads, drops, tokens), shared by the tests below. Window 12: its
    11-key halo is one hop at c=2 (chunks of 16) and two hops at c=4 (chunks of 8)."""
    cfg = toy_model(window=12, n_layers=2)  # layer 0 local, layer 1 (the last) global
    batch = {k: np.asarray(v) for k, v in toy_batch(cfg, N_SEQS, SEQ, seed=3, doc_lens=DOC_LENS).items()}
    return cfg, batch, *_run(cfg, batch, 1)


def test_context_parallel_loss_and_grads_equal(without_cp):
    cfg, batch, want_loss, want_grads, dropped, tokens = without_cp
    assert dropped == 0 and tokens == batch["loss_mask"].sum()
    for context in (2, 4):
        loss, grads, dropped, _ = _run(cfg, batch, context)
        assert dropped == 0
        np.testing.assert_allclose(loss, want_loss, rtol=CP_RTOL_FP32, err_msg=f"loss, context {context}")
        for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(g, w, rtol=CP_RTOL_FP32, atol=CP_ATOL_FP32,
                                       err_msg=f"d{jax.tree_util.keystr(path)}, context {context}")


def test_context_parallel_through_the_flash_kernel_equals_xla(without_cp):
    """The kernel path under CP: each chunk's kernel call gets its extended keys (halo two hops back on the
    local layer, 3 earlier chunks on the global one, padded to whole key blocks); loss and gradients equal
    the XLA path without CP."""
    cfg, batch, want_loss, want_grads, _, _ = without_cp
    loss, grads, dropped, _ = _run(cfg, batch, 4, kernel=True)
    assert dropped == 0
    np.testing.assert_allclose(loss, want_loss, rtol=CP_RTOL_FP32)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=CP_RTOL_FP32, atol=CP_ATOL_FP32, err_msg=f"d{jax.tree_util.keystr(path)}")


def test_front_extend_reads_only_its_own_sequence():
    a = jnp.arange(4 * 3).reshape(4, 3)  # 2 sequences x 2 chunks of 3
    got = np.asarray(front_extend(a, 4, 2, -1))
    np.testing.assert_array_equal(got, [[-1, -1, -1, -1, 0, 1, 2], [-1, 0, 1, 2, 3, 4, 5],
                                        [-1, -1, -1, -1, 6, 7, 8], [-1, 6, 7, 8, 9, 10, 11]])
    np.testing.assert_array_equal(front_extend(a, 2, 1, 0), np.pad(np.asarray(a), ((0, 0), (2, 0))))


def test_halo_is_a_collective_permute_not_a_gather():
    """Under jit on a sharded row axis, the roll of a chunk's tail lowers to a collective-permute."""
    mesh = make_mesh(ParallelConfig(expert=8))
    x = jax.device_put(jnp.zeros((8, 16, 4)), batch_sharding(mesh))
    hlo = jax.jit(lambda x: front_extend(x, 3, 4, 0.0)).lower(x).compile().as_text()
    assert "collective-permute" in hlo and "all-gather" not in hlo


def _cp_gradient_hlo(cfg, batch, context: int, remat) -> str:
    """The compiled CP gradient of `model_loss` (one chunk per device, layers unrolled) under this remat."""
    _, params, chunks, routed = _placed(cfg, batch, context)
    loss = lambda p, b: model_loss(p, b, cfg, routed, remat=remat, context=context, scan_layers=False)[0]
    return jax.jit(jax.grad(loss)).lower(params, chunks).compile().as_text()


def test_remat_keeps_the_halo_instead_of_exchanging_it_again():
    """Every remat policy saves the context-parallel halo (`layers.SAVE_HALO`), so the backward's re-forward
    does not exchange it again: as many collective-permutes as without remat (at 262K, recomputed inside
    the global layers' branch, the exchange was an all-gather of K and V to every device: docs/LOG.md
    2026-12-04)."""
    cfg = toy_model(window=12, n_layers=2)
    batch = {k: np.asarray(v) for k, v in toy_batch(cfg, N_SEQS, SEQ, seed=3, doc_lens=DOC_LENS).items()}
    count = lambda remat: _cp_gradient_hlo(cfg, batch, 4, remat).count("collective-permute(")
    plain = count(False)
    assert plain > 0
    for remat in ("nothing", True):  # the hero's policy, and the default ("transport")
        assert count(remat) == plain, remat


# ---- the micro context schedule: train through every phase change, CP up to 4, exact resume -------------
MICRO_SCHEDULE = "0.375:512:cf=2.0,0.75:1024"  # 128 -> 512 (2 sequences, CP 2) -> 1024 (1 sequence, CP 4)


def micro_cfg(**parallel):
    """1024 tokens per step over 4 batch shards: 8 x 128 (steps 0-2), 2 x 512 (CP 2, cf 2; steps 3-5),
    1 x 1024 (CP 4, chunks of 256; steps 6-7). Three phases, because each costs a compile (the suite's time
    budget): both CP changes and a cf change. Adam and 2 layers keep each compile short; a permanent checkpoint
    at step 5 is the resume point."""
    cfg = apply_overrides(preset("tiny"), ["model.n_layers=2", "model.attn_q_block=128", "train.batch_size=8",
                                           "train.seq_len=128", "train.steps=8", "train.eval_every=0",
                                           "train.eval_batches=1", "train.eval_batch_size=4", "train.optimizer=adam",
                                           "train.checkpoint_every=5", f"data.context_schedule={MICRO_SCHEDULE}",
                                           "data.prefetch=0"])
    return replace(cfg, parallel=ParallelConfig(expert=4, **parallel))


def test_micro_schedule_trains_through_every_phase_and_resumes_exactly(tmp_path):
    cfg = micro_cfg()
    assert [(ph.seq_len, ph.sequences, ph.context, ph.cf_send) for ph in cfg.phases] == [
        (128, 8, 1, 1.15), (512, 2, 2, 2.0), (1024, 1, 4, 1.15)]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(cfg, straight, OPTS)
    rows = lambda d: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    a = rows(straight)
    assert [r["data/seq_len"] for r in a] == [128] * 3 + [512] * 3 + [1024] * 2
    assert [r["data/context_parallel"] for r in a] == [1] * 3 + [2] * 3 + [4] * 2
    assert all(np.isfinite(r["train/loss"]) for r in a) and a[-1]["train/loss"] < a[0]["train/loss"]
    # Resume from the step-5 checkpoint (inside the CP-2, cf=2 phase) and cross into the CP-4 phase: the
    # same rows, bit for bit; the resumed phase keeps its capacity factors.
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000008")
    train(cfg, resumed, OPTS)
    b = rows(resumed)
    assert [r["moe/cf_send"] for r in b] == [1.15] * 3 + [2.0] * 3 + [1.15] * 2
    for key in ("train/loss", "train/grad_norm", "train/param_norm", "moe/drop_fraction", "eval/loss"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key


# One phase per capacity override (cf sets both, cf_send and cf_recv one each) and the base phase without any;
# seq_lens as in MICRO_SCHEDULE, so every phase is a valid layout of micro_cfg. Config only: nothing trains.
CF_SCHEDULE = "0.25:256:cf=2.0,0.5:512:cf_send=2.5,0.75:1024:cf_recv=3"


def test_each_phase_takes_only_the_capacity_factors_it_sets():
    cfg = apply_overrides(micro_cfg(), [f"data.context_schedule={CF_SCHEDULE}"])
    base = (cfg.parallel.cf_send, cfg.parallel.cf_recv)
    assert base == (1.15, 1.15)  # the hero's, different from every override below
    assert [(ph.start, ph.seq_len, ph.cf_send, ph.cf_recv) for ph in cfg.phases] == [
        (0, 128, *base), (2, 256, 2.0, 2.0), (4, 512, 2.5, base[1]), (6, 1024, base[0], 3.0)]


# ---- bad input: one line naming the values, ConfigError (exit 2), nothing written --------------------------
@pytest.mark.parametrize("overrides,message", [
    (["parallel.context=3"], "context-parallel degree 3 does not divide the sequence length 128"),
    (["parallel.context=8"], "context-parallel degree 8 does not divide the batch shards (replica_dcn*data*expert = 4)"),
    (["data.context_schedule=0.75:1024:cp=2"],
     "seq_len 1024 (from step 6): 1 sequences x context-parallel degree 2 = 2 rows is not divisible by the batch shards"),
    (["data.context_schedule=0.5:256:cf=0"], "cf (0.0) must be > 0"),
    (["data.context_schedule=0.5:256:cf=1:cf_send=2"], "cf_send is given twice"),
    (["data.context_schedule=0.5:256:ep=2"], "'ep=2' is not one of cf=, cf_send=, cf_recv=, cp="),
    (["train.batch_size=24", "data.context_schedule=0.75:768:cp=4"],
     "seq_len 768 / context-parallel degree 4 = chunk 192 is not divisible by model.attn_q_block (128)"),
])
def test_bad_context_layouts_fail_with_numbers(overrides, message):
    with pytest.raises(ConfigError) as e:
        apply_overrides(micro_cfg(), overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cli_refuses_bad_cp_before_writing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["train", "--run-dir", str(run_dir), "--preset", "tiny", "--mesh", "expert=4", "--no-progress",
            "--set", "data.context_schedule=0.5:2048:cp=2"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "= 2 rows is not divisible by the batch shards" in err[0]
    assert not run_dir.exists()
