"""`moejax plan`: the hero's numbers against hand calculation, too-small clusters, and lowering the step."""

import json
import math
from dataclasses import replace

import pytest

from moejax.cli import main
from moejax.config import ConfigError, ParallelConfig
from moejax.presets import HERO, TINY, ladder_rung
from moejax.plan import CLUSTERS, GB, format_plan, plan

HERO_TOKENS_PER_DEVICE = 11_264 * 4096 // 704  # 65,536


@pytest.fixture(scope="module")
def hero_plan():
    return plan(HERO, CLUSTERS["gb200-nvl72x11"])


def test_hero_transport_by_hand(hero_plan):
    tr = hero_plan["transport"]
    a = HERO_TOKENS_PER_DEVICE * 8
    assert hero_plan["tokens_per_device"] == 65_536 and tr["assignments"] == a
    assert tr["P"] == math.ceil(1.15 * a / (64 * 3)) == 3_141  # SPEC §3
    assert tr["R"] == math.ceil(1.15 * a / (6 * 3)) == 33_497
    assert tr["header_rows"] == math.ceil(3_141 / 3072) == 2
    assert tr["rows_per_wave"] == 64 * (2 + 3_141) == 201_152
    assert tr["bytes_per_wave"] == 201_152 * 3072 * 2 == 1_235_877_888
    # Full width d = 6144 instead of the 3072 latent: 2x the payload, one header row (ceil(3141/6144) = 1).
    assert tr["bytes_per_wave_full_width"] == 64 * (1 + 3_141) * 6144 * 2 == 2_470_969_344
    assert tr["bytes_per_layer_fwd"] == 2 * 3 * 1_235_877_888
    assert tr["bytes_per_step"] == 3 * 48 * 2 * 3 * 1_235_877_888


def test_hero_params_memory_and_time_by_hand(hero_plan):
    r = hero_plan
    assert r["mesh"] == {"replica_dcn": 11, "data": 1, "expert": 64, "model": 1} and r["devices"] == 704
    assert r["exact_params"] == 535_477_106_688  # SPEC §1, from eval_shape
    assert r["params_bf16_total_bytes"] == 2 * 535_477_106_688
    routed_per_device = 48 * (384 // 64) * 3 * 3072 * 3072
    assert r["routed_params_per_device"] == routed_per_device == 8_153_726_976
    other = r["exact_params"] - r["routed_params"]
    assert r["routed_params"] == 48 * 384 * 3 * 3072 * 3072
    # The rest is FSDP over data x expert = 64 (vectors replicated): between other/64 and a little more.
    assert other / 64 <= r["other_params_per_device"] < other / 64 * 1.01
    assert r["weights_bf16_bytes"] == 2 * r["params_per_device"]
    assert r["master_fp32_bytes"] == 4 * r["params_per_device"]
    assert r["host_needed"] == r["master_fp32_bytes"] + r["opt_state_bytes"] and r["fits_host"]
    assert r["block_inputs_bytes"] == 48 * 65_536 * 6144 * 2
    assert r["flops_per_step"] == pytest.approx(3 * 4.989e10 * 46_137_344, rel=1e-3)
    assert r["step_time_s"] == pytest.approx(r["flops_per_step"] / (704 * 2.5e15 * 0.225))
    assert r["days"] == pytest.approx(390_139 * r["step_time_s"] / 86_400)
    assert r["tokens"] == 46_137_344 * 390_139
    assert r["hbm_per_device"] == 186 * GB


def test_kept_transport_results_by_hand(hero_plan):
    """Block remat's kept all-to-all results, every layer: L x (2W | W | 0) waves of S x (M + P) latent rows.
    Kept in full they don't fit a GB200, hence the hero's remat_saves="nothing"."""
    wave = 64 * (2 + 3141) * 3072 * 2
    assert hero_plan["transport"]["bytes_per_wave"] == wave
    assert hero_plan["remat_saves"] == "nothing" and hero_plan["transport_kept_bytes"] == 0 and hero_plan["fits_hbm"]
    for saves, waves in (("transport", 6), ("dispatch", 3)):
        r = plan(replace(HERO, train=replace(HERO.train, remat_saves=saves)), CLUSTERS["gb200-nvl72x11"])
        assert r["transport_kept_bytes"] == 48 * waves * wave
        assert r["hbm_needed"] == hero_plan["hbm_needed"] + 48 * waves * wave and not r["fits_hbm"]


def test_too_small_cluster_errors_with_numbers():
    with pytest.raises(ConfigError, match=r"704 devices, but cluster h100x8 has 8 \(short by 696\)"):
        plan(HERO, CLUSTERS["h100x8"])


def test_cli_exit_codes(capsys):
    assert main(["plan", "hero", "--cluster", "h200x1"]) == 2
    assert "has 1 (short by 703)" in capsys.readouterr().err
    assert main(["plan", "tiny", "--cluster", "h200x1"]) == 0
    assert "fits:" in capsys.readouterr().out
    assert main(["plan", "hero", "--cluster", "nope"]) == 2
    assert main(["plan", "tiny", "--lower", "--phase", "999"]) == 2  # before the plan is printed
    assert capsys.readouterr().err.endswith("--phase 999: not a context phase of tiny (128)\n")
    assert main(["plan", "tiny", "--phase", "128"]) == 2
    assert "needs --lower or --compile" in capsys.readouterr().err


def test_plan_lays_a_one_device_preset_out_as_train_would(capsys):
    """No --mesh: data-parallel on every device of the cluster, as `train` does on a host (a CLI sweep found
    `plan tiny --cluster h100x8` planning one GPU of eight), or the same one-line refusal."""
    assert main(["plan", "tiny", "--cluster", "h100x8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"] == {"replica_dcn": 1, "data": 8, "expert": 1, "model": 1}
    assert main(["plan", "tiny", "--cluster", "gb200-nvl72x11"]) == 2
    err = capsys.readouterr().err  # and which clusters it would fit (a new user's first `plan tiny` stopped here)
    assert "not divisible by 704" in err and "or plan it for a smaller --cluster (h100x8, h200x1)" in err
    assert main(["plan", "tiny", "--cluster", "h100x8", "--mesh", "data=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"]["data"] == 2


def test_lower_hero_on_704_device_abstract_mesh():
    """The whole hero train step, lowered (not compiled) on an AbstractMesh: ~3 s, ~0.3 GB RSS."""
    from moejax.ladder.lower import lower_train_step

    r = lower_train_step(HERO, phase=HERO.phases[0])
    assert r["ok"] and r["devices"] == 704 and r["num_partitions"] == 704
    # The hero's remat keeps nothing of the transport (it would not fit): the re-forward reruns its 2 x W
    assert r["remat_saves"] == "nothing" and r["all_to_all"] == r["expected_all_to_all"] == 3 * 2 * 3
    # Lowered as on GPUs: the flash kernel per batch shard; in the scanned body, each attention kind (lax.cond)
    # forward, remat forward, dq and dkv. The experts run in the EP transport's batched einsums.
    assert r["gpu_kernels"] == 2 * 4


def test_lower_ep_step_on_8_real_devices():
    """The same path on a concrete 8-device mesh of this process (expert=8)."""
    import jax

    from moejax.ladder.lower import lower_train_step
    from moejax.parallel.mesh import make_mesh

    cfg = replace(TINY, parallel=ParallelConfig(expert=8))
    r = lower_train_step(cfg, mesh=make_mesh(cfg.parallel, jax.devices()))
    assert r["ok"] and r["num_partitions"] == 8
    # W=3 waves x (dispatch, return) x (forward, backward) in each of tiny's 4 unrolled layers (no remat)
    assert r["all_to_all"] == r["expected_all_to_all"] == 12 * 4


def test_hero_context_phases(hero_plan):
    """SPEC §5 at fixed tokens per step: the 262K phase has 176 sequences for 704 batch shards, so it runs
    with context-parallel degree 4 (704 rows of 65,536); every phase is reported with its HBM."""
    got = [(p["seq_len"], p["sequences"], p["context"], p["rows"], p["chunk"]) for p in hero_plan["phases"]]
    assert got == [(4096, 11_264, 1, 11_264, 4096), (8192, 5632, 1, 5632, 8192), (65_536, 704, 1, 704, 65_536),
                   (262_144, 176, 4, 704, 65_536)]
    first, last = hero_plan["phases"][0], hero_plan["phases"][-1]
    assert first["hbm_needed"] == hero_plan["hbm_needed"]
    # the 262K phase's global layers read 3 earlier chunks: K and V per query head, 3 x 65,536 x 2 x 6144 x 2 B
    assert last["attention_bytes"] - first["attention_bytes"] > 3 * 65_536 * 2 * 6144 * 2
    assert all(p["fits_hbm"] for p in hero_plan["phases"])
    # the longer phases run at the 4K phase's cf 1.15, which SPEC §6 says does not transfer: flagged
    assert [p["base_cf_at_longer_context"] for p in hero_plan["phases"]] == [False, True, True, True]
    assert "note: seq_len 8,192, 65,536, 262,144 keep the base context's capacity factors" in format_plan(hero_plan)


def test_activations_without_remat_keep_every_layer(capsys):
    """Without remat the backward reads every layer's intermediates, so the estimate holds L blocks' working sets
    where remat holds one (and the transport results it keeps); `fits` follows. On one H200 this estimate came
    within 4-9% of XLA's compiled peak at shape G and the d1024 rung (docs/LOG.md, 2026-12-04)."""
    cfg = ladder_rung(2048)  # remat on: without it the rung would not fit its cluster
    on = plan(cfg, CLUSTERS["gb200-nvl72x11"])
    off = plan(replace(cfg, train=replace(cfg.train, remat=False)), CLUSTERS["gb200-nvl72x11"])
    block = sum(off[k] for k in ("attention_bytes", "moe_bytes", "shared_bytes", "router_bytes"))
    head, inputs, layers = off["lm_head_logits_bytes"], off["block_inputs_bytes"], cfg.model.n_layers
    assert on["activations_bytes"] == inputs + on["transport_kept_bytes"] + block + head
    assert off["activations_bytes"] == inputs + layers * block + head and off["transport_kept_bytes"] == 0
    assert on["fits_hbm"] and not off["fits_hbm"]
    # all-to-all bytes a step: forward + backward, and what a remat re-forward reruns (nothing it keeps)
    nothing = plan(replace(cfg, train=replace(cfg.train, remat_saves="nothing")), CLUSTERS["gb200-nvl72x11"])
    for r, per_wave in ((off, 4), (on, 4), (nothing, 6)):
        tr = r["transport"]
        assert tr["a2a_per_wave"] == per_wave and tr["bytes_per_step"] == per_wave / 2 * layers * tr["bytes_per_layer_fwd"]
    assert main(["plan", "d2048", "--set", "train.remat=false"]) == 1
    out = capsys.readouterr().out
    assert "activations (no remat, estimate)" in out and f"x L = {layers}" in out and "DOES NOT FIT" in out


def test_plan_takes_set_and_mesh(capsys):
    """`plan` takes train's --mesh and --set: a rung on one H200 is planned (and does not fit), not refused."""
    code = main(["plan", "d1024", "--cluster", "h200x1", "--mesh", "expert=1",
                 "--set", "data.context_schedule=0.5:8192:cf=1.5"])
    out = capsys.readouterr().out
    assert code in (0, 1) and "context phases" in out and "1.50/1.50" in out
    assert main(["plan", "tiny", "--set", "parallel.context=3"]) == 2


def test_lower_hero_262k_phase_on_704_device_abstract_mesh():
    """The 262K phase's step (704 rows of 65,536, CP 4) lowered on the abstract 704-device mesh."""
    from moejax.ladder.lower import lower_train_step

    r = lower_train_step(HERO, phase=HERO.phases[-1])
    assert r["ok"] and r["num_partitions"] == 704 and r["context"] == 4 and r["batch"] == [704, 65_536]
    assert r["all_to_all"] == r["expected_all_to_all"]
    assert r["gpu_kernels"] == 2 * 4  # the flash kernel on each chunk's extended keys, as at 4K
