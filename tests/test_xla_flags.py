"""The jitted steps' XLA options (`moejax.xla_flags.step_compiler_options`): YNNPACK fusions off on CPU unless
XLA_FLAGS names them, nothing elsewhere, and the same values and gradients as XLA's defaults."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.model.moe.grouped import grouped_swiglu
from moejax.xla_flags import CPU_STEP_OPTIONS, YNN_FUSIONS, step_compiler_options
from tests.test_grouped import ATOL_FP32, RTOL_FP32, UNALIGNED, _problem


def test_options_by_platform_and_xla_flags_win(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert step_compiler_options("cpu") == CPU_STEP_OPTIONS == {YNN_FUSIONS: ""}
    assert step_compiler_options("gpu") == {} and step_compiler_options("tpu") == {}
    monkeypatch.setenv("XLA_FLAGS", f"--{YNN_FUSIONS}=LIBRARY_FUSION_TYPE_DOT")  # the user's choice
    assert step_compiler_options("cpu") == {}


def test_grouped_gemm_without_ynnpack_equals_defaults():
    """The grouped GEMM's forward and backward (batched block dots, gathers, a segment sum) compiled with the
    steps' CPU options: YNNPACK gone from the executable, values and gradients as with XLA's defaults."""
    x, expert_A, ws, ct = _problem(0, UNALIGNED, Z=16, F=32)
    loss = lambda x, *w: jnp.sum(grouped_swiglu(x, expert_A, *w, block_size=8) * ct)
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(x, *ws)
    default, ours = lowered.compile(), lowered.compile(compiler_options=step_compiler_options("cpu"))
    assert "__ynn_fusion" in default.as_text()  # what the option is there to turn off
    assert "__ynn_fusion" not in ours.as_text()
    for a, b in zip(jax.tree.leaves(default(x, *ws)), jax.tree.leaves(ours(x, *ws)), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=RTOL_FP32, atol=ATOL_FP32)
