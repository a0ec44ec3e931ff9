"""Ladder rung numbers against SPEC §5 and hand calculation; the micro-ladder rule."""

import pytest

from moejax.config import ConfigError
from moejax.presets import LADDER_SHAPES
from moejax.ladder.micro import MICRO_SHAPES, MICRO_TOKENS_PER_ACTIVE_PARAM, micro_rung
from moejax.ladder.rungs import LADDER_WIDTHS, format_ladder_plan, ladder_plan, rung_plan
from moejax.train.heuristic import optimizer_heuristic

RACKS = {768: 1, 1024: 2, 1536: 6, 2048: 11}  # SPEC §5: batch = 1024 sequences x racks, 4096 tokens each


def tokens_per_step(d):
    return 1024 * RACKS[d] * 4096


def hand_active(d, layers, heads, experts=384, k=8):
    """SPEC §1 formula with the ladder rule: head dim 128, KV heads H/4, expert = latent = shared = d/2."""
    q, kv, half = heads * 128, max(1, heads // 4) * 128, d // 2
    attn = d * q + 2 * d * kv + q * d
    per_layer = attn + d * experts + 2 * d * half + 2 * 3 * d * half + k * 3 * half * half
    return layers * per_layer


def hand_fwd_flops(d, layers, heads, seq=4096, window=2048, vocab=128_256):
    half, flops = d // 2, 0
    for i in range(layers):
        glob = (i + 1) % 4 == 0 or i == layers - 1
        kv = max(1, heads // 8) if glob else max(1, heads // 4)
        ctx = seq if glob else min(seq, window)
        flops += 2 * (2 * d * heads * 128 + 2 * d * kv * 128) + 4 * heads * 128 * ctx + 3 * heads * ctx  # + softmax
        flops += 2 * d * 384 + 4 * d * half + 2 * 8 * 3 * half * half + 2 * 2 * 3 * d * half
    return flops + 2 * d * vocab


# Hand-computed from the formula above (d768: 8 x 7,569,408); steps as SPEC §5 states them.
EXPECTED = {768: (60_555_264, 11_420), 1024: (162_004_992, 15_276), 1536: (481_296_384, 15_128),
            2048: (1_170_735_104, 20_072)}
# The heuristic at those batches (SPEC §4): beta2 = 0.999^32 on one rack, clipped to 0.95 from two racks up.
EXPECTED_LR = {768: (3.0163e-3, 1.3071e-2, 0.96849), 1024: (2.7697e-3, 1.2002e-2, 0.95),
               1536: (2.9362e-3, 1.2724e-2, 0.95), 2048: (2.6803e-3, 1.1614e-2, 0.95)}
QUOTED_RTOL = 1e-4  # EXPECTED_LR is quoted to 5 significant digits


@pytest.mark.parametrize("d", sorted(EXPECTED))
def test_rung_numbers(d):
    r = rung_plan(d)
    layers, heads = LADDER_SHAPES[d]
    assert (r["n_layers"], r["n_heads"], r["n_kv_heads"], r["n_kv_heads_global"]) == \
        (layers, heads, heads // 4, max(1, heads // 8))
    assert r["expert_width"] == r["latent_width"] == r["shared_width"] == d // 2
    active, steps = EXPECTED[d]
    batch = tokens_per_step(d)
    assert r["active_params"] == hand_active(d, layers, heads) == active
    assert r["total_params"] == active + layers * 376 * 3 * (d // 2) ** 2 + 2 * 128_256 * d
    assert (r["batch_size"], r["racks"], r["tokens_per_step"]) == (1024 * RACKS[d], RACKS[d], batch)
    assert r["steps"] == round(791 * active / batch) == steps
    assert r["tokens"] == steps * batch
    assert r["fwd_flops_per_token"] == hand_fwd_flops(d, layers, heads)
    assert r["train_flops"] == pytest.approx(3 * hand_fwd_flops(d, layers, heads) * steps * batch)
    hp = optimizer_heuristic(total_tokens=r["tokens"], width=d, batch_tokens=batch)
    assert (r["adam_lr"], r["muonh_lr"], r["beta2"], r["eps"]) == (hp.adam_lr, hp.muonh_lr, hp.beta2, hp.eps)
    adam, muonh, beta2 = EXPECTED_LR[d]
    assert (r["adam_lr"], r["muonh_lr"], r["beta2"]) == (pytest.approx(adam, rel=QUOTED_RTOL),
                                                         pytest.approx(muonh, rel=QUOTED_RTOL),
                                                         pytest.approx(beta2, rel=QUOTED_RTOL))
    assert (r["eval_every"], r["eval_batch_size"]) == (round(0.05 * steps), 64 * RACKS[d])  # SPEC §5 eval


def test_ladder_plan_shares_and_hero():
    p = ladder_plan()
    assert [r["d_model"] for r in p["rungs"]] == list(LADDER_WIDTHS) == [768, 1024, 1536, 2048]
    hero = p["hero"]
    assert hero["active_params"] == 22_762_487_808 and hero["total_params"] == 535_305_388_032
    assert hero["steps"] == 390_139 and hero["share_of_hero"] == 1.0
    assert hero["train_flops"] == pytest.approx(2.695e24, rel=1e-4)  # SPEC §1 (without the softmax: 2.694e24)
    assert hero["fwd_flops_per_token"] == hand_fwd_flops(6144, 48, 48)
    assert p["ladder_share_of_hero"] == pytest.approx(0.00423, abs=0.00005)  # the rungs: ~0.42% of the hero
    assert sum(r["train_flops"] for r in p["rungs"]) / hero["train_flops"] == pytest.approx(p["ladder_share_of_hero"])
    text = format_ladder_plan(p)
    assert "0.423%" in text and "round(791*N/4,194,304)" in text


def test_unknown_rung_is_a_config_error():
    with pytest.raises(ConfigError, match="no ladder rung at width 999"):
        rung_plan(999)
    with pytest.raises(ConfigError, match="no micro-ladder rung at width 100"):
        micro_rung(100)


@pytest.mark.parametrize("d", sorted(MICRO_SHAPES))
def test_micro_rung_rule(d):
    from moejax import accounting

    cfg = micro_rung(d)
    m, t = cfg.model, cfg.train
    assert (m.n_layers, m.n_heads) == MICRO_SHAPES[d] and m.head_dim == 16 and m.n_heads * 16 == d
    assert m.expert_width == m.latent_width == m.shared_width == d // 2
    assert (m.n_experts, m.top_k, m.vocab_size, t.seq_len, t.batch_size) == (16, 2, 2048, 128, 16)
    assert t.optimizer == "hero" and m.qb
    assert t.steps == max(20, round(MICRO_TOKENS_PER_ACTIVE_PARAM * accounting.active_params(m) / 2048))


def test_micro_ladder_budget():
    """~1,500 steps in all: about 15 minutes on 2 CPU cores."""
    steps = [micro_rung(d).train.steps for d in sorted(MICRO_SHAPES)]
    assert steps == sorted(steps) and 1000 < sum(steps) < 2000
