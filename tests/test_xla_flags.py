"""The train steps' XLA options (`moejax.xla_flags.step_compiler_options`): YNNPACK fusions off on CPU unless
XLA_FLAGS names them, nothing elsewhere, the same values and gradients as XLA's defaults, and the loop's train
step (not its eval steps) compiled with them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import xla_flags
from moejax.config import ParallelConfig
from moejax.model.moe.grouped import grouped_swiglu
from moejax.xla_flags import CPU_STEP_OPTIONS, XLA_DEFAULTS, YNN_FUSIONS, step_compiler_options
from tests.helpers import loop_steps, toy_model
from tests.test_grouped import ATOL_FP32, RTOL_FP32, UNALIGNED, _problem

YNN = "__ynn_fusion"  # a YNNPACK fusion in compiled CPU HLO


def test_options_by_platform_and_the_users_choice_wins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 --{YNN_FUSIONS}_not_this_one=1")
    assert step_compiler_options("cpu") == CPU_STEP_OPTIONS == {YNN_FUSIONS: ""}
    assert step_compiler_options("gpu") == {} and step_compiler_options("tpu") == {}
    monkeypatch.setenv(XLA_DEFAULTS, "1")
    assert step_compiler_options("cpu") == {}
    monkeypatch.delenv(XLA_DEFAULTS)
    monkeypatch.setenv("XLA_FLAGS", f"--{YNN_FUSIONS}=LIBRARY_FUSION_TYPE_DOT")
    assert step_compiler_options("cpu") == {}


def test_an_option_this_jaxlib_lacks_warns_and_falls_back(monkeypatch):
    monkeypatch.setitem(CPU_STEP_OPTIONS, "xla_cpu_no_such_option", "")
    xla_flags._cpu_options_known.cache_clear()
    try:
        with pytest.warns(UserWarning, match="does not take .*xla_cpu_no_such_option.*XLA's defaults"):
            assert step_compiler_options("cpu") == {}
    finally:
        monkeypatch.undo()
        xla_flags._cpu_options_known.cache_clear()
    assert step_compiler_options("cpu") == CPU_STEP_OPTIONS


def test_the_loops_train_step_compiles_without_ynnpack_and_eval_with_defaults():
    model = toy_model(n_layers=1, window=12)
    cfg, state, batch, step_fn, eval_fns = loop_steps(model, ParallelConfig(data=1), batch_size=2, seq_len=16)
    assert YNN not in step_fn(cfg.phases[0]).lower(state, batch).compile().as_text()
    bytes_per_token = jnp.ones((model.vocab_size,), jnp.float32)
    assert YNN in eval_fns["eval/"].lower(state.compute, batch, bytes_per_token).compile().as_text()


def test_grouped_gemm_without_ynnpack_equals_defaults():
    """The grouped GEMM's forward and backward (batched block dots, gathers, a segment sum) compiled with the
    steps' CPU options: YNNPACK gone from the executable, values and gradients as with XLA's defaults."""
    x, expert_A, ws, ct = _problem(0, UNALIGNED, Z=16, F=32)
    loss = lambda x, *w: jnp.sum(grouped_swiglu(x, expert_A, *w, block_size=8) * ct)
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(x, *ws)
    default, ours = lowered.compile(), lowered.compile(compiler_options=step_compiler_options("cpu"))
    assert YNN in default.as_text()  # what the option is there to turn off
    assert YNN not in ours.as_text()
    for a, b in zip(jax.tree.leaves(default(x, *ws)), jax.tree.leaves(ours(x, *ws)), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=RTOL_FP32, atol=ATOL_FP32)
