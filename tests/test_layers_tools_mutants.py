"""Mutation-audit tests for layers (SConv decode step, channel scaling dtypes), kernel_choice's checks,
drop_curve's transport parameters and thresholds, and diffs' traversal. Each pins a behaviour the rest of
the suite left open (a one-line slip there passed every other test)."""

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ConfigError
from moejax.diffs import MISSING, Difference, find_difference, first_difference
from moejax.drop_curve import make_drop_measure, measure_drops, smallest_cf
from moejax.model import kernel_choice
from moejax.model.kernel_choice import (ATTENTION, GROUPED, GROUPED_ROWS, KERNEL_OPS, NEWTON_SCHULZ, check_choices,
                                        kernel_impl)
from moejax.model.layers import Norm, front_extend, matmul_tokens, rms_norm, scale_channels, sconv, sconv_step
from moejax.parallel.expert_parallel import routed_expert_parallel
from moejax.parallel.mesh import batch_sharding
from moejax.presets import TINY
from moejax.train.step import make_eval_step
from tests.test_drop_curve import BIG_CF, SMALL_CF, setup  # noqa: F401  (setup: the module's fixture)
from tests.helpers import all_eqns
from tests.test_layers import FP32_ATOL, FP32_RTOL

# ---------------------------------------------------------------------------------------------- diffs


def test_difference_is_reported_in_the_new_trees_order():
    """Fields are visited in `new`'s order: with two differences, the one `new` lists first is named."""
    old, new = {"a": 1, "b": 1}, {"b": 2, "a": 2}
    assert find_difference(old, new) == Difference("b", 1, 2)


def test_a_field_present_on_one_side_with_value_none_still_differs():
    """One side only compares as MISSING, which is not None: a newly added field defaulting to None counts."""
    assert find_difference({}, {"x": None}) == Difference("x", MISSING, None)
    assert find_difference({"x": None}, {}) == Difference("x", None, MISSING)


def test_deeply_nested_fields_keep_their_whole_dotted_path():
    assert first_difference({"a": {"b": {"c": 1}}}, {"a": {"b": {"c": 2}}}) == "a.b.c: 1 there, 2 now"
    assert first_difference({"a": {"b": {"c": 1}}}, {"a": {"b": {"c": 1}}}, ignore=["a.b.c"]) == ""


# ------------------------------------------------------------------------------------------ drop_curve


def test_smallest_cf_accepts_a_drop_fraction_equal_to_the_target():
    """'drop fraction <= target': exactly at the target counts."""
    assert smallest_cf([1.0, 2.0], [0.25, 0.0], 0.25) == 1.0


def test_measure_uses_the_waves_and_each_capacity_factor_it_is_given(setup):  # noqa: F811
    """Asymmetric capacity factors and one wave: the counts equal the eval step's on the same transport."""
    cfg, mesh, params, batch, _ = setup
    kw = dict(waves=1, cf_send=BIG_CF, cf_recv=SMALL_CF)
    counts, _ = measure_drops(make_drop_measure(cfg, mesh, **kw), params, batch)
    routed = partial(routed_expert_parallel, mesh=mesh, **kw)
    sharded = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in batch.items()}
    metrics = jax.jit(make_eval_step(cfg, routed))(params, sharded, jnp.ones((cfg.vocab_size,), jnp.int32))
    assert counts.fraction("receiver") > 0  # the small receiver capacity is in effect
    assert float(metrics["moe/sender_drop_fraction"]) == pytest.approx(counts.fraction("sender"), abs=1e-7)
    assert float(metrics["moe/receiver_drop_fraction"]) == pytest.approx(counts.fraction("receiver"), abs=1e-7)


# --------------------------------------------------------------------------------------- kernel_choice


@pytest.fixture
def no_kernel_env(monkeypatch):
    for var, _ in KERNEL_OPS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_an_empty_kernel_variable_means_unset(no_kernel_env):
    """MOEJAX_X= (empty) is the default, not an invalid choice, and not an explicit one."""
    no_kernel_env.setenv(ATTENTION[0], "")
    assert kernel_impl(*ATTENTION) == ("gpu_kernel" if jax.default_backend() == "gpu" else "xla")
    assert not kernel_choice.explicitly_chosen(ATTENTION[0])


def test_check_choices_refuses_bad_values_and_rows_without_the_grouped_kernels(no_kernel_env):
    """The checks the CLI runs before a run starts, called directly (a disabled check there starts a run)."""
    no_kernel_env.setenv(GROUPED[0], "cuda")
    with pytest.raises(ConfigError, match=r"MOEJAX_GROUPED='cuda' is not one of"):
        check_choices()
    no_kernel_env.delenv(GROUPED[0])
    no_kernel_env.setenv(GROUPED_ROWS[0], "gpu_kernel")
    with pytest.raises(ConfigError, match="MOEJAX_GROUPED is xla"):
        check_choices()
    no_kernel_env.setenv(GROUPED[0], "gpu_kernel")
    check_choices()


def test_check_choices_passes_shapes_the_kernels_take_and_names_the_first_that_fails(no_kernel_env):
    model = TINY.model
    no_kernel_env.setenv(ATTENTION[0], "gpu_kernel")
    no_kernel_env.setenv(GROUPED[0], "gpu_kernel")
    check_choices(model, seq_len=(128, 256))  # every kernel takes these: no error, nor a 'None' problem
    with pytest.raises(ConfigError, match=r"sequence length \(192\) not divisible by block q") as e:
        check_choices(model, seq_len=(128, 192))  # only the later phase's rows do not fit
    assert "MOEJAX_GROUPED" not in str(e.value)
    no_kernel_env.delenv(ATTENTION[0])  # grouped kernels alone (row gathers left to XLA) still check widths
    with pytest.raises(ConfigError, match="MOEJAX_GROUPED=gpu_kernel: width 24 has no tile"):
        check_choices(replace(model, latent_width=24), seq_len=128)


def test_current_pins_lowering_for_a_gpu_while_targeting_one(no_kernel_env):
    with kernel_choice.targeting_gpu():
        choices = kernel_choice.current()
    assert choices["on_gpu"] and choices["impl"][ATTENTION[0]] == "gpu_kernel"
    with kernel_choice.pinned(choices):
        assert kernel_choice.lowering_for_gpu() and not kernel_choice.run_interpreted()


def test_pinned_choices_decide_lowering_and_explicitness_whatever_holds_later(no_kernel_env):
    """A step built with the Newton-Schulz kernel chosen explicitly, for CPU, keeps both when traced after the
    environment changed or while targeting a GPU."""
    no_kernel_env.setenv(NEWTON_SCHULZ[0], "xla")
    choices = kernel_choice.current()
    no_kernel_env.delenv(NEWTON_SCHULZ[0])
    with kernel_choice.targeting_gpu(), kernel_choice.pinned(choices):
        assert kernel_choice.explicitly_chosen(NEWTON_SCHULZ[0])
        assert not kernel_choice.lowering_for_gpu() and kernel_choice.run_interpreted()


# ---------------------------------------------------------------------------------------------- layers

# Decode steps of these sizes, continued from each other's state, cover the whole row.
STEP_SPLITS = (3, 1, 1, 2, 4)


def test_sconv_step_continued_over_chunks_equals_the_whole_row():
    """`sconv_step` from a zero state, fed the row in pieces (the prompt, then single tokens), gives the
    whole-row conv and carries the last J-1 inputs as the state."""
    rng = np.random.default_rng(7)
    taps = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, sum(STEP_SPLITS), 3)), jnp.float32)
    want = sconv(x, taps, jnp.ones(x.shape[:2], jnp.int32))
    state, outs, start = jnp.zeros((2, 3, 3), jnp.float32), [], 0
    for n in STEP_SPLITS:
        y, state = sconv_step(x[:, start:start + n], taps, state)
        outs.append(y)
        start += n
        np.testing.assert_array_equal(state, x[:, start - 3:start])
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_channel_scaling_keeps_the_activation_dtype_and_weight_gradient_dtypes():
    """bf16 activations with fp32 taps (gains) stay bf16 through SConv (RMSNorm); bf16 weights get bf16
    gradients from both custom VJPs (their fp32 sums are cast back)."""
    x = jax.random.normal(jax.random.key(0), (2, 5, 4), jnp.bfloat16)
    taps = jax.random.normal(jax.random.key(1), (3, 4), jnp.float32)
    assert sconv(x, taps, jnp.ones((2, 5), jnp.int32)).dtype == jnp.bfloat16
    assert rms_norm(x, jnp.ones((4,), jnp.float32), 1e-5).dtype == jnp.bfloat16  # fp32 inside, cast back
    w_c = jnp.ones((4,), jnp.bfloat16)
    assert jax.grad(lambda w: jnp.sum(scale_channels(x, w).astype(jnp.float32)))(w_c).dtype == jnp.bfloat16
    w_m = jnp.ones((4, 6), jnp.bfloat16)
    assert jax.grad(lambda w: jnp.sum(matmul_tokens(x, w).astype(jnp.float32)))(w_m).dtype == jnp.bfloat16


def test_front_extend_refuses_rows_that_are_not_whole_sequences():
    with pytest.raises(ValueError, match=r"rows \(3\) are not whole sequences of context \(2\) chunks"):
        front_extend(jnp.zeros((3, 4)), 2, 2, 0)


def test_gated_norm_gates_in_fp32_for_bf16_activations():
    """GatedNorm on bf16 activations (SPEC §2): the rank-R projections run in bf16 like every matmul, but the
    sigmoid gate and its product with the normalised input are fp32, rounded to bf16 once at the end. Read from
    the jaxpr: under jit on CPU, XLA's excess precision would hide a bf16 gate from a value test."""
    norm = Norm.init(8, 2, 0.5, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 3, 8), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x: norm(x, 1e-5))(x).jaxpr
    sigmoids = [e for e in all_eqns(jaxpr) if e.primitive.name == "logistic"]  # SiLU's, then the gate's
    assert len(sigmoids) == 2 and sigmoids[-1].outvars[0].aval.dtype == jnp.float32
    gate = sigmoids[-1].outvars[0]
    (product,) = [e for e in all_eqns(jaxpr) if gate in e.invars]
    assert product.primitive.name == "mul" and product.outvars[0].aval.dtype == jnp.float32
    assert jaxpr.outvars[0].aval.dtype == jnp.bfloat16
