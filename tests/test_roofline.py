"""`moejax.roofline` reads compiled HLO text: its FLOP and byte counts against XLA's own cost analysis on CPU
(where XLA has one), and against hand counts where XLA's analysis says less (loops, in-place slices)."""

import math

import jax
import jax.numpy as jnp
import pytest

from moejax import roofline
from moejax.train import ns_gpu
from moejax.train.optimizer import make_optimizer
from moejax.train.state import init_state
from moejax.train.step import make_train_step
from tests.helpers import toy_batch, toy_model

# XLA's cost analysis also counts elementwise FLOPs, which the roofline leaves out (they hide under the same
# kernel's memory traffic): a train step's are ~2% of its dot FLOPs. Bytes are counted the same way.
STEP_FLOPS_RTOL = 0.05
STEP_BYTES_RTOL = 0.03


def _compiled(f, *args):
    return jax.jit(f).lower(*args).compile()


def test_dot_flops_exact_and_bytes_as_xla():
    a, b = jnp.ones((64, 128)), jnp.ones((128, 32))
    compiled = _compiled(lambda a, b: jnp.tanh(a @ b) + 1, a, b)
    r = roofline.estimate(compiled.as_text(), peak_flops=1e11, bandwidth=1e10)
    assert r["flops"] == 2 * 64 * 128 * 32
    assert r["bytes"] == pytest.approx(compiled.cost_analysis()["bytes accessed"], rel=1e-6)
    assert r["seconds"] == pytest.approx(sum(row[1] for row in r["items"]))
    assert r["unknown"] == []


def test_scan_counts_every_trip():
    """XLA's cost analysis counts a while body once; the roofline multiplies by the known trip count."""
    xs, w = jnp.ones((6, 64, 128)), jnp.ones((128, 128))

    def scan(xs, w):
        return jax.lax.scan(lambda c, x: (jnp.tanh(x @ w) + c, None), jnp.zeros((64, 128)), xs)[0]

    r = roofline.estimate(_compiled(scan, xs, w).as_text(), peak_flops=1e11, bandwidth=1e10)
    assert r["flops"] == 6 * 2 * 64 * 128 * 128
    assert r["unknown"] == []


# A loop of 4 trips that reads one row of a [4, 1000] stack and writes one row of another in place: what a
# scan over layers does with its weights and residuals. Hand-written in the compiled text's form.
LOOP_HLO = """HloModule loop

%fused_slice (p0: f32[4,1000], p1: s32[]) -> f32[1,1000] {
  %p0 = f32[4,1000]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  ROOT %ds = f32[1,1000]{1,0} dynamic-slice(%p0, %p1, %c0), dynamic_slice_sizes={1,1000}
}

%fused_update (p0: f32[4,1000], p1: f32[1,1000], p2: s32[]) -> f32[4,1000] {
  %p0 = f32[4,1000]{1,0} parameter(0)
  %p1 = f32[1,1000]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %c0 = s32[] constant(0)
  %neg = f32[1,1000]{1,0} negate(%p1)
  ROOT %dus = f32[4,1000]{1,0} dynamic-update-slice(%p0, %neg, %p2, %c0)
}

%body (t: (s32[], f32[4,1000], f32[4,1000])) -> (s32[], f32[4,1000], f32[4,1000]) {
  %t = (s32[], f32[4,1000]{1,0}, f32[4,1000]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %xs = f32[4,1000]{1,0} get-tuple-element(%t), index=1
  %ys = f32[4,1000]{1,0} get-tuple-element(%t), index=2
  %x = f32[1,1000]{1,0} fusion(%xs, %i), kind=kLoop, calls=%fused_slice
  %y = f32[4,1000]{1,0} fusion(%ys, %x, %i), kind=kLoop, calls=%fused_update
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[4,1000]{1,0}, f32[4,1000]{1,0}) tuple(%next, %xs, %y)
}

%cond (t: (s32[], f32[4,1000], f32[4,1000])) -> pred[] {
  %t = (s32[], f32[4,1000]{1,0}, f32[4,1000]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[4,1000]) -> f32[4,1000] {
  %a = f32[4,1000]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[4,1000]{1,0}, f32[4,1000]{1,0}) tuple(%z, %a, %a)
  %w = (s32[], f32[4,1000]{1,0}, f32[4,1000]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %r = f32[4,1000]{1,0} get-tuple-element(%w), index=2
}
"""


def test_loop_slices_and_in_place_updates_cost_only_their_rows():
    r = roofline.estimate(LOOP_HLO, peak_flops=1e12, bandwidth=1e9, launch_s=1e-6)
    row = 4 * 1000
    per_trip = (row + 4 + row) + (row + 4 + row) + (4 + 4 + 4)  # slice fusion, update fusion, the index add
    assert r["bytes"] == 4 * per_trip + 5 * (4 + 4 + 1)  # + the condition's 5 compares
    assert r["kernels"] == 4 * 3 + 5
    assert r["seconds"] == pytest.approx(r["bytes"] / 1e9 + r["kernels"] * 1e-6)


def test_async_fusion_costs_what_its_synchronous_form_costs():
    """XLA 0.11 on GPU runs a scan's dynamic slices as fusion-start / fusion-done pairs, whose start's result
    tuple repeats the whole stack: costed as the fusion it calls, the done free (on an H200 the capacity
    path's step had been priced at 220 GB for them)."""
    async_hlo = LOOP_HLO.replace(
        "%x = f32[1,1000]{1,0} fusion(%xs, %i), kind=kLoop, calls=%fused_slice",
        "%xs0 = ((f32[4,1000]{1,0}, s32[]), f32[1,1000]{1,0}, u32[]) fusion-start(%xs, %i), kind=kLoop, "
        "calls=%fused_slice\n  %x = f32[1,1000]{1,0} fusion-done(%xs0)")
    assert "fusion-start" in async_hlo
    sync, asyn = (roofline.estimate(h, peak_flops=1e12, bandwidth=1e9, launch_s=1e-6) for h in (LOOP_HLO, async_hlo))
    assert (asyn["bytes"], asyn["kernels"], asyn["seconds"]) == (sync["bytes"], sync["kernels"], sync["seconds"])


def test_unknown_trip_count_is_reported():
    r = roofline.estimate(LOOP_HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', ""), 1e12, 1e9)
    assert any("unknown trip count" in u for u in r["unknown"])


def test_train_step_counts_match_xla_cost_analysis():
    """A whole toy train step, unrolled layers."""
    # wide enough that dots dominate the FLOPs, as in any real step (at d 32 elementwise ops are ~25%)
    model = toy_model(n_layers=2, d_model=128, head_dim=32, expert_width=128, latent_width=128, shared_width=128,
                      vocab_size=1024, gated_norm_rank=16)
    from dataclasses import replace

    from moejax.presets import TINY

    cfg = replace(TINY, model=model, train=replace(TINY.train, batch_size=8, seq_len=128, optimizer="adam"))
    optimizer, lr_fn = make_optimizer(cfg)
    state = init_state(cfg, optimizer, jax.random.key(0))
    batch = toy_batch(model, batch=8, seq=128, doc_lens=((50, 78),) + ((128,),) * 7)
    step = make_train_step(model, optimizer, lr_fn, remat=False, scan_layers=False)
    compiled = jax.jit(step).lower(state, batch).compile()
    xla = compiled.cost_analysis()
    # XLA's analysis counts a loop body once (the suite's -O0 CPU flags turn scatters into loops)
    r = roofline.estimate(compiled.as_text(), peak_flops=1e11, bandwidth=1e10, count_trips=False)
    assert r["flops"] == pytest.approx(xla["flops"], rel=STEP_FLOPS_RTOL)
    assert r["flops"] <= xla["flops"]
    assert r["bytes"] == pytest.approx(xla["bytes accessed"], rel=STEP_BYTES_RTOL)
    assert {"[fwd]", "[bwd]", "[rest]"} <= set(r["phases"])
    text = roofline.format_estimate(r, model_flops=r["flops"] / 2)
    assert "MFU at most" in text and "by part:" in text


def test_pallas_grouped_gemm_flops():
    x, w, e = "bf16[10,128,512]{2,1,0}", "bf16[4,512,256]{2,1,0}", "s32[10]{0}"
    assert roofline.pallas_flops("moejax_grouped_fwd", [e, e, x, w], "bf16[10,128,256]{2,1,0}") == 2 * 10 * 128 * 512 * 256
    dy = "bf16[10,128,256]{2,1,0}"
    assert roofline.pallas_flops("moejax_grouped_dw", ["s32[4]", "s32[4]", x, dy], "f32[4,512,256]") == \
        2 * 10 * 128 * 512 * 256
    gu = "bf16[10,128,2,256]{3,2,1,0}"  # the down projection's dx with the activation's derivative: width 256
    assert roofline.pallas_flops("moejax_grouped_dx_act", [e, e, x, "bf16[4,256,512]", gu], gu) == \
        2 * 10 * 128 * 512 * 256
    # with row maps: Pd = 10 x 128 rows computed, whatever the rows' arrays hold (here 300 tokens, 900 rows)
    m, tok, rows = "s32[1280]{0}", "bf16[300,512]{1,0}", "bf16[900,256]{1,0}"
    assert roofline.pallas_flops("moejax_grouped_fwd_rows", [e, e, m, m, tok, w], rows) == 2 * 1280 * 512 * 256
    assert roofline.pallas_flops("moejax_grouped_dx_rows", [e, e, m, rows, w], "bf16[900,512]") == \
        2 * 1280 * 256 * 512
    assert roofline.pallas_flops("moejax_grouped_dw_rows", ["s32[4]", "s32[4]", m, tok, dy], "f32[4,512,256]") == \
        2 * 1280 * 512 * 256
    assert roofline.pallas_flops("moejax_grouped_dx_act_rows", [e, e, m, "bf16[900,512]", "bf16[4,256,512]", gu],
                                 gu) == 2 * 1280 * 512 * 256
    a, b = "bf16[6,64,64]{2,1,0}", "bf16[6,64,256]{2,1,0}"
    assert roofline.pallas_flops("moejax_ns_matmul_add", [a, b, b], b) == 2 * 6 * 64 * 64 * 256
    # the symmetric Gram: 10 of the 4 x 4 tiles of a [512, 512] result (128-row tiles), each over K = 1024
    x, g = "bf16[6,512,1024]{2,1,0}", "bf16[6,512,512]{2,1,0}"
    assert roofline.pallas_flops("moejax_ns_gram", [x], g) == 2 * 6 * 10 * 128 * 128 * 1024
    assert roofline.pallas_flops("moejax_ns_gram", [g, g], g) == 2 * 6 * 10 * 128 * 128 * 512
    assert roofline.pallas_flops("moejax_ns_gram", ["bf16[2,48,64]"], "bf16[2,48,48]") == 2 * 2 * 6 * 16 * 16 * 64
    assert all(math.gcd(roofline.NS_GRAM_TILE, m) == ns_gpu.gram_tile(m) for m in (16, 48, 96, 512, 1024, 3072))
    assert roofline.pallas_flops("some_other_kernel", [x], x) is None


def test_kernel_name_found_through_autodiff_wrappers():
    """A Pallas kernel is costed by its name, however many transforms wrap it in the op_name (an unrolled,
    un-rematted step's backward has `transpose(jvp(name))`; the old pattern missed it and left those kernels
    without FLOPs)."""
    names = {'op_name="jit(train_step)/jvp(moejax_grouped_fwd)/pallas_call"': "moejax_grouped_fwd",
             'op_name="jit(train_step)/transpose(jvp(moejax_grouped_dw))/pallas_call"': "moejax_grouped_dw",
             'op_name="jit(step)/while/body/closed_call/moejax_flash_dq/pallas_call"': "moejax_flash_dq"}
    for attrs, name in names.items():
        assert roofline.KERNEL_NAME.search(attrs).group(1) == name
    assert roofline.KERNEL_NAME.search('op_name="jit(step)/custom_kernel/pallas_call"') is None


def test_fp32_dots_at_their_own_rate():
    """On a GPU a dot of fp32 operands runs at the TF32 rate, half the bf16 peak: a compute-bound fp32 dot
    takes twice as long; a bf16 one (fp32 out) is unchanged."""
    a, b = jnp.ones((256, 256)), jnp.ones((256, 256))
    f32 = _compiled(lambda a, b: a @ b, a, b).as_text()
    bf16 = _compiled(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32),
                     a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)).as_text()
    slow_bytes = dict(peak_flops=1e9, bandwidth=1e15)  # compute-bound
    for text, factor in ((f32, 2.0), (bf16, 1.0)):
        base = roofline.estimate(text, **slow_bytes)["seconds"]
        assert roofline.estimate(text, **slow_bytes, f32_dot_peak=0.5e9)["seconds"] == pytest.approx(factor * base)


def test_full_precision_fp32_dots_at_the_fma_rate():
    """A dot at operand precision HIGHEST keeps a GPU to its fp32 FMA units (no TF32): costed at
    `f32_fma_peak`; the default-precision fp32 dot beside it stays at the TF32 rate."""
    a, b = jnp.ones((256, 256)), jnp.ones((256, 256))
    highest = _compiled(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST), a, b).as_text()
    default = _compiled(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.DEFAULT), a, b).as_text()
    rates = dict(peak_flops=1e9, bandwidth=1e15, f32_dot_peak=0.5e9)  # compute-bound
    for text, seconds in ((highest, 2 * 256 ** 3 / 0.05e9), (default, 2 * 256 ** 3 / 0.5e9)):
        assert roofline.estimate(text, **rates, f32_fma_peak=0.05e9)["seconds"] == pytest.approx(seconds, rel=0.01)
    gemm = CUBLAS_HLO.replace('"epilogue"', '"precision_config":{"operand_precision":["HIGHEST","HIGHEST"]},"epilogue"')
    r = roofline.estimate(gemm, peak_flops=1e12, bandwidth=1e14, f32_dot_peak=0.5e12, f32_fma_peak=0.05e12)
    assert r["seconds"] == pytest.approx(2 * 4 * 256 * 1024 * 512 / 1e12 + 2 * 512 * 384 * 96 / 0.05e12)


# XLA:GPU's library GEMMs as jax 0.11 compiles them for an H200 (`--xla_gpu_enable_triton_gemm=false` on a
# deviceless compile gives the same text): the dot's dimension numbers sit in the call's backend_config, and
# the result is (product, 4 MiB workspace). Trimmed to the fields the roofline reads.
_GEMM_CONFIG = ('backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,'
                '"dot_dimension_numbers":{"lhs_contracting_dimensions":[%s],"rhs_contracting_dimensions":[%s],'
                '"lhs_batch_dimensions":[%s],"rhs_batch_dimensions":[%s]},"epilogue":"DEFAULT"}}')
CUBLAS_HLO = f"""HloModule gemms

ENTRY %main (a: bf16[4,256,512], b: bf16[4,1024,512], c: f32[512,384], d: f32[384,96]) -> f32[512,96] {{
  %a = bf16[4,256,512]{{2,1,0}} parameter(0)
  %b = bf16[4,1024,512]{{2,1,0}} parameter(1)
  %c = f32[512,384]{{1,0}} parameter(2)
  %d = f32[384,96]{{1,0}} parameter(3)
  %g1 = (bf16[4,256,1024]{{2,1,0}}, s8[4194304]{{0}}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", {_GEMM_CONFIG % ('"2"', '"2"', '"0"', '"0"')}
  %g2 = (f32[512,96]{{1,0}}, s8[4194304]{{0}}) custom-call(%c, %d), custom_call_target="__cublas$gemm", {_GEMM_CONFIG % ('"1"', '"0"', "", "")}
  ROOT %r = f32[512,96]{{1,0}} get-tuple-element(%g2), index=0
}}
"""


def test_library_gemm_calls_cost_their_flops_at_the_operands_rate():
    """A cuBLAS call is a dot: its FLOPs from the backend_config's contracting dims, its bytes the operands
    and product (not the workspace), an fp32 one at the fp32 dot rate."""
    r = roofline.estimate(CUBLAS_HLO, peak_flops=1e12, bandwidth=1e14, f32_dot_peak=0.5e12)  # compute-bound
    batched, f32 = 2 * 4 * 256 * 1024 * 512, 2 * 512 * 384 * 96
    assert r["flops"] == batched + f32 and r["unknown"] == []
    bf16_bytes, f32_bytes = 2 * (4 * 256 * 512 + 4 * 1024 * 512 + 4 * 256 * 1024), 4 * (512 * 384 + 384 * 96 + 512 * 96)
    assert r["bytes"] == bf16_bytes + f32_bytes
    assert r["seconds"] == pytest.approx(batched / 1e12 + f32 / 0.5e12)


def _two_lines(a, b):
    h = jnp.tanh(a @ b)
    return (h @ b.T).sum()


def test_by_source_labels_kernels_with_the_line_that_emitted_them():
    a, b = jnp.ones((64, 128)), jnp.ones((128, 32))
    r = roofline.estimate(_compiled(_two_lines, a, b).as_text(), peak_flops=1e11, bandwidth=1e10, by_source=True)
    first = _two_lines.__code__.co_firstlineno
    by_line = {label: flops for label, _, flops, _, _ in r["items"]}
    for line, flops in ((first + 1, 2 * 64 * 128 * 32), (first + 2, 2 * 64 * 32 * 128)):
        mine = [f for label, f in by_line.items() if f"_two_lines:{line} " in label]
        assert sum(mine) == flops, (line, by_line)
