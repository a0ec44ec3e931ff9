"""Mutation audit of the roofline model, the lowering's bookkeeping and the run report: expected numbers from the
definitions (roofline.py's docstring: each kernel max(FLOPs / peak, bytes / bandwidth) + launch; 2 FLOPs per
multiply-add; a conditional at its costliest branch; in-place ops cost their update), not read back from the code.

The HLO fixtures are hand-written in the compiled text's form and trimmed to the fields the roofline reads (as
test_roofline's CUBLAS_HLO is)."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from moejax import report, roofline
from moejax.cli import main
from moejax.config import ParallelConfig
from moejax.cuda_aot import TRITON_CALL
from moejax.ladder import lower
from moejax.ladder.rungs import format_rung, ladder_plan, rung_plan
from moejax.parallel.mesh import make_mesh
from moejax.presets import HERO
from tests.test_ladder import EXPECTED, tokens_per_step
from tests.test_report import synthetic_rows, write_metrics
from tests.test_roofline import CUBLAS_HLO, LOOP_HLO

PEAK, BW, LAUNCH = 1e12, 1e12, 1e-6

# ---- roofline: compute- vs memory-bound split, launches, top items ----------------------------------------------
# A bf16 dot contracting two dims (K = 8 x 64 = 512: 2 x 256 x 128 x 512 FLOPs, compute-bound at these rates) and a
# large fp32 negate (memory-bound, 128 MB moved, the longer kernel though it has no FLOPs).
MIXED_HLO = """HloModule mixed

ENTRY %main (a: bf16[256,8,64], b: bf16[8,64,128], c: f32[16000000]) -> (bf16[256,128], f32[16000000]) {
  %a = bf16[256,8,64]{2,1,0} parameter(0)
  %b = bf16[8,64,128]{2,1,0} parameter(1)
  %c = f32[16000000]{0} parameter(2)
  %d = bf16[256,128]{1,0} dot(%a, %b), lhs_contracting_dims={1,2}, rhs_contracting_dims={0,1}, metadata={op_name="jit(f)/jvp(dot_general)"}
  %n = f32[16000000]{0} negate(%c), metadata={op_name="jit(f)/neg"}
  ROOT %t = (bf16[256,128]{1,0}, f32[16000000]{0}) tuple(%d, %n)
}
"""
DOT_FLOPS = 2 * 256 * 128 * (8 * 64)
DOT_BYTES = 2 * (256 * 512 + 512 * 128 + 256 * 128)
NEG_BYTES = 2 * 4 * 16_000_000


def test_dot_contracting_several_dims_counts_their_product():
    r = roofline.estimate(MIXED_HLO, PEAK, BW)
    assert r["flops"] == DOT_FLOPS
    assert r["bytes"] == DOT_BYTES + NEG_BYTES


def test_compute_and_memory_bound_time_and_launches_are_split_per_kernel():
    r = roofline.estimate(MIXED_HLO, PEAK, BW, launch_s=LAUNCH)
    assert DOT_FLOPS / PEAK > DOT_BYTES / BW and NEG_BYTES / BW > DOT_FLOPS / PEAK  # the fixture's premise
    assert r["compute_bound_s"] == pytest.approx(DOT_FLOPS / PEAK)
    assert r["memory_bound_s"] == pytest.approx(NEG_BYTES / BW)
    assert r["kernels"] == 2 and r["launch_s"] == pytest.approx(2 * LAUNCH)
    assert r["seconds"] == pytest.approx(r["compute_bound_s"] + r["memory_bound_s"] + r["launch_s"])
    slow = roofline.estimate(MIXED_HLO, PEAK, PEAK / 100)  # now the dot is memory-bound too (73 FLOP/byte)
    assert DOT_BYTES / (PEAK / 100) > DOT_FLOPS / PEAK
    assert slow["compute_bound_s"] == 0.0
    assert slow["memory_bound_s"] == pytest.approx((DOT_BYTES + NEG_BYTES) / (PEAK / 100))


def test_items_are_listed_longest_first_and_the_text_shows_the_top_ones():
    """The negate takes longer than the dot (it has no FLOPs): it leads the list, and `top=1` prints it alone."""
    r = roofline.estimate(MIXED_HLO, PEAK, BW)
    assert [row[0].split()[1] for row in r["items"]] == ["negate", "dot"]
    assert [row[1] for row in r["items"]] == pytest.approx([NEG_BYTES / BW, DOT_FLOPS / PEAK])
    rows = roofline.format_estimate(r, top=1).splitlines()[2:]
    assert len(rows) == 1 and "negate" in rows[0]


def test_format_estimate_units_and_mfu():
    """Milliseconds, TFLOP, GB (1e9), GB/s; MFU = model FLOPs / (seconds x peak), as a percentage."""
    r = {"seconds": 0.25, "compute_bound_s": 0.125, "memory_bound_s": 0.1, "launch_s": 0.025, "flops": 2e14,
         "bytes": 3e11, "kernels": 1234, "peak_flops": 1e15, "bandwidth": 4e12, "items": [], "unknown": [],
         "phases": {"[fwd]": [0.1, 1e14, 1e11, 10.0]}}
    text = roofline.format_estimate(r, model_flops=5e13)
    assert "250.0 ms = compute-bound 125.0 + memory-bound 100.0 + launches 25.0 ms" in text
    assert "200.00 TFLOP, 300.0 GB, 1,234 kernels" in text and "4000 GB/s" in text
    assert "MFU at most 20.0%" in text  # 5e13 / (0.25 s x 1e15 FLOP/s)
    assert "fwd 100.0 ms (100.0 GB)" in text


# ---- roofline: loops, conditionals, standalone in-place ops, Pallas at the bf16 peak --------------------------------
def test_loop_items_count_every_trip_and_an_unknown_count_is_one():
    r = roofline.estimate(LOOP_HLO, PEAK, BW, launch_s=LAUNCH)
    # per label [seconds, FLOPs, bytes, count]: the items add up to the totals, trips included (4 x 3 + 5 kernels)
    assert sum(row[4] for row in r["items"]) == r["kernels"] == 4 * 3 + 5
    assert sum(row[3] for row in r["items"]) == pytest.approx(r["bytes"])
    row = 4 * 1000
    per_trip, compare = (row + 4 + row) + (row + 4 + row) + (4 + 4 + 4), 4 + 4 + 1
    unknown = roofline.estimate(LOOP_HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', ""), PEAK, BW)
    assert unknown["bytes"] == per_trip + 2 * compare  # the body once, the condition once more


COND_HLO = """HloModule cond

%dot_branch (p: bf16[256,512]) -> bf16[256,256] {
  %p = bf16[256,512]{1,0} parameter(0)
  ROOT %d = bf16[256,256]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%copy_branch (q: f32[16000000]) -> f32[16000000] {
  %q = f32[16000000]{0} parameter(0)
  ROOT %n = f32[16000000]{0} negate(%q)
}

ENTRY %main (i: s32[], a: bf16[256,512], c: f32[16000000]) -> f32[16000000] {
  %i = s32[] parameter(0)
  %a = bf16[256,512]{1,0} parameter(1)
  %c = f32[16000000]{0} parameter(2)
  ROOT %r = f32[16000000]{0} conditional(%i, %a, %c), branch_computations={%dot_branch, %copy_branch}
}
"""


def test_conditional_costs_its_longest_branch_not_its_most_flops():
    r = roofline.estimate(COND_HLO, PEAK, BW)
    dot_s = 2 * 256 * 256 * 512 / PEAK
    assert dot_s < NEG_BYTES / BW  # the fixture's premise: the FLOP-less branch is the slower one
    assert (r["seconds"], r["flops"], r["bytes"]) == (pytest.approx(NEG_BYTES / BW), 0.0, NEG_BYTES)


IN_PLACE_HLO = """HloModule in_place

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (buf: f32[64,1000], upd: f32[1,1000], i: s32[], idx: s32[3,1], rows: f32[3,1000]) -> (f32[2,1000], f32[64,1000]) {
  %buf = f32[64,1000]{1,0} parameter(0)
  %upd = f32[1,1000]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %idx = s32[3,1]{1,0} parameter(3)
  %rows = f32[3,1000]{1,0} parameter(4)
  %z = s32[] constant(0)
  %dus = f32[64,1000]{1,0} dynamic-update-slice(%buf, %upd, %i, %z)
  %sl = f32[2,1000]{1,0} slice(%dus), slice={[0:2], [0:1000]}
  %sc = f32[64,1000]{1,0} scatter(%dus, %idx, %rows), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
  ROOT %t = (f32[2,1000]{1,0}, f32[64,1000]{1,0}) tuple(%sl, %sc)
}
"""


def test_standalone_in_place_ops_and_slices_move_only_their_rows():
    """Outside a fusion too: a dynamic-update-slice or scatter reads and writes its update and reads its indices
    (the buffer stays in place); a slice reads and writes what it slices."""
    r = roofline.estimate(IN_PLACE_HLO, PEAK, BW)
    moved = {row[0].split()[1]: row[3] for row in r["items"]}
    assert moved == {"dynamic-update-slice": 2 * 4 * 1000 + 4 + 4, "slice": 2 * 4 * 2 * 1000,
                     "scatter": 2 * 4 * 3 * 1000 + 4 * 3}


PALLAS_HLO = f"""HloModule pallas

ENTRY %main (a: f32[6,64,64], b: f32[6,64,256], c: f32[6,64,256]) -> f32[6,64,256] {{
  %a = f32[6,64,64]{{2,1,0}} parameter(0)
  %b = f32[6,64,256]{{2,1,0}} parameter(1)
  %c = f32[6,64,256]{{2,1,0}} parameter(2)
  ROOT %k = f32[6,64,256]{{2,1,0}} custom-call(%a, %b, %c), custom_call_target="{TRITON_CALL}", metadata={{op_name="jit(step)/moejax_ns_matmul_add/pallas_call"}}
}}
"""


def test_pallas_kernels_run_at_the_peak_and_full_precision_defaults_to_the_fp32_dot_rate():
    """estimate(): 'Pallas kernels are taken at peak_flops'; f32_fma_peak defaults to f32_dot_peak."""
    r = roofline.estimate(PALLAS_HLO, PEAK, 1e15, f32_dot_peak=PEAK / 2, f32_fma_peak=PEAK / 20)
    assert r["seconds"] == pytest.approx(2 * 6 * 64 * 64 * 256 / PEAK)
    gemm = CUBLAS_HLO.replace('"epilogue"', '"precision_config":{"operand_precision":["HIGHEST","HIGHEST"]},"epilogue"')
    r = roofline.estimate(gemm, PEAK, 1e15, f32_dot_peak=PEAK / 2)  # no f32_fma_peak: the fp32 dot rate
    assert r["seconds"] == pytest.approx(2 * 4 * 256 * 1024 * 512 / PEAK + 2 * 512 * 384 * 96 / (PEAK / 2))


def test_flash_flops_causal_half_per_query_head():
    """q [B, S, H, D], k/v [B, Sk, G, D] (G < H KV heads): 2 FLOPs x B x H x S x Sk x D per matmul, forward 2
    matmuls, dq 3, dkv 4, at the causal half."""
    q, kv, o = "bf16[2,512,8,128]{3,2,1,0}", "bf16[2,512,2,128]{3,2,1,0}", "bf16[2,512,8,128]{3,2,1,0}"
    one = 2 * 2 * 8 * 512 * 512 * 128 * 0.5
    for kernel, matmuls in (("moejax_flash_fwd", 2), ("moejax_flash_dq", 3), ("moejax_flash_dkv", 4)):
        assert roofline.pallas_flops(kernel, [q, kv, kv], o) == matmuls * one, kernel


def test_fp32_fma_rate_of_a_gpu_not_in_the_table_is_the_h200s_ratio():
    assert roofline.gpu_f32_fma_peak(1e15, "Some Future GPU") == pytest.approx(1e15 * 67 / 989)
    assert roofline.gpu_f32_fma_peak(989e12, "NVIDIA H100") == pytest.approx(67e12)


# ---- lower: the result's bookkeeping (the step itself stubbed: lowering is test_plan's), format_lower ----------
def _trivial_step(*args, **kwargs):
    return lambda state, batch: (state, None)


def test_lowered_phase_result_names_its_seq_len_and_expected_all_to_alls(monkeypatch):
    """The hero's 262K phase (CP 4: rows of 65,536) without remat: seq_len is the phase's, remat_saves None, and
    each of the 3 waves' all-to-alls counted as the transport without re-forward (4 per wave, scanned once)."""
    monkeypatch.setattr("moejax.train.step.make_train_step", _trivial_step)
    cfg = dataclasses.replace(HERO, train=dataclasses.replace(HERO.train, remat=False))
    r = lower.lower_train_step(cfg, phase=HERO.phases[-1])
    assert (r["seq_len"], r["context"], r["batch"]) == (262_144, 4, [704, 65_536])
    assert r["remat_saves"] is None and r["expected_all_to_all"] == 3 * 4


def test_per_device_bytes_counts_each_devices_shard():
    mesh = make_mesh(ParallelConfig(data=8), jax.devices())
    tree = {"w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=NamedSharding(mesh, PartitionSpec("data"))),
            "b": jax.ShapeDtypeStruct((32,), np.int8, sharding=NamedSharding(mesh, PartitionSpec()))}
    assert lower._per_device_bytes(tree) == 64 // 8 * 32 * 4 + 32


def test_num_partitions_defaults_to_one():
    assert lower._num_partitions("module @jit_f attributes {mhlo.num_partitions = 8 : i32} {}") == 8
    assert lower._num_partitions("module @jit_f {}") == 1


def _lowered_result(**compiled) -> dict:
    return {"ok": True, "preset": "p", "seq_len": 4096, "context": 1, "batch": [8, 4096], "mesh": {"data": 8},
            "devices": 8, "lower_s": 1.0, "abstract_s": 0.5, "wall_s": 3.0, "max_rss_gb": 1.0, "all_to_all": 0,
            "expected_all_to_all": 0, "scan_layers": True, "remat_saves": None, "gpu_kernels": 4,
            "num_partitions": 8, "platform": "cuda", "compile_requested": True, "compile_s": 9.0,
            "opt_state_memory": "pinned_host", "state_fp32_bytes": 2e9,
            "compiled": {"kernels": {}, "argument_bytes": 3e9, "output_bytes": 3e9, "alias_bytes": 2.5e9,
                         "temp_bytes": 1.5e9, "sum_bytes": 5e9, **compiled}}


def test_format_lower_reports_xlas_peak_in_gb_and_the_state_on_the_host():
    text = lower.format_lower(_lowered_result(peak_bytes=4.5e9), hbm_bytes=141e9)
    assert "peak 4.50 GB of 141 GB" in text
    assert "master and optimizer state, 2.00 GB, on the device: 2.50 GB without them" in text
    assert "all summed 5.00 GB = arguments 3.00 + outputs 3.00 - donated 2.50 + temporaries 1.50 GB" in text
    assert "peak 5.00 GB" in lower.format_lower(_lowered_result(peak_bytes=None))  # a jaxlib without XLA's peak


# ---- rungs ----------------------------------------------------------------------------------------------------
def test_rung_tokens_per_active_param_and_the_heros_share_as_printed():
    active, steps = EXPECTED[768]
    assert rung_plan(768)["tokens_per_active_param"] == pytest.approx(steps * tokens_per_step(768) / active)
    row = next(line for line in format_rung(ladder_plan()["hero"]).splitlines() if "share of hero compute" in line)
    assert "100.0000%" in row.split()


# ---- report ---------------------------------------------------------------------------------------------------
def test_series_and_loads_are_placed_at_their_logged_steps():
    """log_every > 1: a row's x is its "step", not its place in the file; booleans and infinities are not curves."""
    rows = [{"step": 10 * (i + 1), "train/loss": v, "train/router/load": [[1.0, 3.0]]}
            for i, v in enumerate([3.0, "inf", float("-inf"), True, 2.0])]
    steps, values = report.series(rows, "train/loss")
    assert steps.tolist() == [10, 50] and values.tolist() == [3.0, 2.0]
    steps, rel_LES = report.load_matrix(rows)
    assert steps.tolist() == [10, 20, 30, 40, 50]
    steps, _ = report.series([{"train/loss": 1.0}, {}, {"train/loss": 2.0}], "train/loss")
    assert steps.tolist() == [0, 2]  # rows without a step: their index


def test_load_matrix_reads_one_layer_and_skips_a_row_of_another_shape():
    rows = [{"step": 0, "train/router/load": [1.0, 3.0, 2.0, 2.0]},  # one layer logged as [E]
            {"step": 1, "train/router/load": [[1.0, 1.0], [1.0, 1.0]]},  # another shape: skipped
            {"step": 2, "train/router/load": [4.0, 0.0, 0.0, 0.0]}]
    steps, rel_LES = report.load_matrix(rows)
    assert steps.tolist() == [0, 2] and rel_LES.shape == (1, 4, 2)
    np.testing.assert_allclose(rel_LES[0, :, 0], [0.5, 1.5, 1.0, 1.0])


@pytest.mark.parametrize("layer", [-1, 2])
def test_a_failed_report_leaves_nothing(tmp_path, capsys, layer):
    """The line plots and the drops-per-layer plot are drawn before the heat map's bad --layer is found: a
    failed report removes them and the report dir it made ("a failed report leaves nothing", write_report).
    Before the fix the drops plot's path was lost when the heat map raised, so it and the dir stayed."""
    run = tmp_path / "run"
    write_metrics(run, synthetic_rows(layers=2))
    assert main(["report", str(run), "--layer", str(layer)]) == 2
    assert f"--layer {layer} is out of range" in capsys.readouterr().err
    assert not (run / "report").exists(), sorted(p.name for p in (run / "report").iterdir())
