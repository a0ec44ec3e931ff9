"""The train steps' XLA options (`moejax.xla_flags.step_compiler_options`): YNNPACK for reductions only on CPU
(no YNNPACK dots) unless XLA_FLAGS names the option, nothing elsewhere, the same values and gradients as XLA's
defaults, and the loop's train step (not its eval steps) compiled with them. The parameter initialiser's
(`init_compiler_options`): LLVM -O1 on CPU, the same bits as XLA's default -O2."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import xla_flags
from moejax.config import ParallelConfig
from moejax.model.moe.grouped import grouped_swiglu
from moejax.model.transformer import Transformer
from moejax.xla_flags import (CPU_INIT_OPTIONS, CPU_STEP_OPTIONS, OPT_LEVEL, XLA_DEFAULTS, YNN_FUSIONS,
                              init_compiler_options, step_compiler_options)
from tests.helpers import loop_steps, toy_model
from tests.test_grouped import ATOL_FP32, RTOL_FP32, UNALIGNED, _problem

YNN_FUSION = re.compile(r"%ynn_fusion[.\d]* = .*?op_name=\"[^\"]*/(\w+)\"")  # a YNNPACK fusion and its root op


def ynn_ops(compiled) -> set[str]:
    """The root ops (dot_general, reduce_sum, ...) of the YNNPACK fusions in a compiled CPU executable."""
    return set(YNN_FUSION.findall(compiled.as_text()))


def test_options_by_platform_and_the_users_choice_wins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 --{YNN_FUSIONS}_not_this_one=1")
    assert step_compiler_options("cpu") == CPU_STEP_OPTIONS == {YNN_FUSIONS: "LIBRARY_FUSION_TYPE_REDUCE"}
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


def test_the_loops_train_step_compiles_without_ynnpack_dots_and_eval_with_defaults():
    model = toy_model(n_layers=1, window=12)
    cfg, state, batch, step_fn, eval_fns = loop_steps(model, ParallelConfig(data=1), batch_size=2, seq_len=16)
    assert "dot_general" not in ynn_ops(step_fn(cfg.phases[0]).lower(state, batch).compile())
    bytes_per_token = jnp.ones((model.vocab_size,), jnp.float32)
    assert "dot_general" in ynn_ops(eval_fns["eval/"].lower(state.compute, batch, bytes_per_token).compile())


def test_the_cpu_options_leave_reductions_to_ynnpack():
    """A norm's sum of squares (the step's norm metrics; YNNPACK takes sums of >= 4,096 elements) stays a
    YNNPACK reduction; the matmul beside it does not."""
    x = jnp.ones((256, 256), jnp.float32)
    lowered = jax.jit(lambda x: (jnp.sum(x * x), x @ x)).lower(x)
    assert ynn_ops(lowered.compile(compiler_options=step_compiler_options("cpu"))) == {"reduce_sum"}
    assert ynn_ops(lowered.compile()) == {"reduce_sum", "dot_general"}


def test_grouped_gemm_without_ynnpack_equals_defaults():
    """The grouped GEMM's forward and backward (batched block dots, gathers, a segment sum) compiled with the
    steps' CPU options: no YNNPACK dots in the executable, values and gradients as with XLA's defaults."""
    x, expert_A, ws, ct = _problem(0, UNALIGNED, Z=16, F=32)
    loss = lambda x, *w: jnp.sum(grouped_swiglu(x, expert_A, *w, block_size=8) * ct)
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(x, *ws)
    default, ours = lowered.compile(), lowered.compile(compiler_options=step_compiler_options("cpu"))
    assert "dot_general" in ynn_ops(default)  # what the option is there to turn off
    assert "dot_general" not in ynn_ops(ours)
    for a, b in zip(jax.tree.leaves(default(x, *ws)), jax.tree.leaves(ours(x, *ws)), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=RTOL_FP32, atol=ATOL_FP32)


def test_initialiser_options_by_platform_and_the_users_choice_wins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert init_compiler_options("cpu") == CPU_INIT_OPTIONS == {OPT_LEVEL: 1}
    assert init_compiler_options("gpu") == {} and init_compiler_options("tpu") == {}
    monkeypatch.setenv(XLA_DEFAULTS, "1")
    assert init_compiler_options("cpu") == {}
    monkeypatch.delenv(XLA_DEFAULTS)
    monkeypatch.setenv("XLA_FLAGS", f"--{OPT_LEVEL}=0")  # the suite's own setting
    assert init_compiler_options("cpu") == {}


def test_initialiser_at_o1_gives_the_bits_of_xlas_default_o2():
    """The parameters `init_state` compiles at CPU_INIT_OPTIONS are those of XLA's default level, bit for bit:
    -O1 only compiles sooner (the random bits are integer hashes; the float transforms round the same)."""
    init = jax.jit(functools.partial(Transformer.init, toy_model(n_layers=1)))
    lowered = init.lower(jax.random.key(7))
    default, ours = (lowered.compile(compiler_options=o) for o in ({OPT_LEVEL: 2}, CPU_INIT_OPTIONS))
    for a, b in zip(jax.tree.leaves(default(jax.random.key(7))), jax.tree.leaves(ours(jax.random.key(7))), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
