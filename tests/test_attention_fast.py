"""The fast attention paths against the dense [S, S] reference (`attend_dense`; attn_q_block = 0 on global
layers and on local layers `attend_band` does not take):
the XLA blockwise/windowed path and the GPU flash kernel (Pallas interpret mode on CPU), values and
gradients; plus a FLOPs guard that local layers skip key blocks outside the window."""

import itertools
import os
from dataclasses import replace
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model import attention as attn
from moejax.model.attention import (Attention, attend_band, attend_dense, attend_query_blocks, attend_window,
                                    attend_xla, attention, attention_impl, band_applies)
from moejax.model.flash_gpu import (FlashBlocks, _key_block_range, _query_block_range, document_bounds,
                                    flash_attention)
from tests.helpers import toy_model

RTOL_FP32 = 1e-5  # blockwise/kernel vs dense: same math, different summation order
ATOL_FP32 = 2e-6
SCALE = 0.45

# 3 documents crossing block boundaries (blocks of 4 / 8), a padded tail (segment 0), one single-document row.
SEG = jnp.asarray([[1] * 7 + [2] * 10 + [3] * 5 + [0] * 2, [4] * 24], jnp.int32)
B, S = SEG.shape


def _qkv(h, g, hd=8, seed=0):
    """q [B, S, H, Hd]; k, v [B, S, G, Hd]."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, S, h, hd)), jax.random.normal(kk, (B, S, g, hd)),
            jax.random.normal(kv, (B, S, g, hd)))


def _per_head(f, h):
    """Wrap an XLA core (K/V per query head) to take G KV heads: query head i reads KV head i // (H/G)."""
    return lambda q, k, v: f(q, *(a[:, :, np.arange(h) // (h // a.shape[2])] for a in (k, v)))


def _vjp_all(f, q, k, v):
    """Output and the gradients of a non-trivial scalar of it wrt q, k, v."""
    w = jax.random.normal(jax.random.key(7), q.shape)
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * w), argnums=(0, 1, 2)))(q, k, v)


def _assert_same(got, want):
    (v_g, g_g), (v_w, g_w) = got, want
    np.testing.assert_allclose(v_g, v_w, rtol=RTOL_FP32)
    for a, b, name in zip(g_g, g_w, "qkv"):
        np.testing.assert_allclose(a, b, rtol=RTOL_FP32, atol=ATOL_FP32, err_msg=f"d{name}")


@pytest.mark.parametrize("window,qb", [(5, 4), (3, 8), (9, 4)])  # windows straddling 1-3 blocks back
def test_window_path_equals_dense(window, qb):
    q, k, v = _qkv(h=4, g=2)
    want = _vjp_all(_per_head(lambda q, k, v: attend_dense(q, k, v, SEG, window, SCALE), 4), q, k, v)
    got = _vjp_all(_per_head(lambda q, k, v: attend_window(q, k, v, SEG, window, SCALE, qb), 4), q, k, v)
    _assert_same(got, want)


def test_query_block_path_equals_dense_global_gqa():
    q, k, v = _qkv(h=4, g=1)  # global layers: fewer KV heads, 4 queries each
    want = _vjp_all(_per_head(lambda q, k, v: attend_dense(q, k, v, SEG, None, SCALE), 4), q, k, v)
    got = _vjp_all(_per_head(lambda q, k, v: attend_query_blocks(q, k, v, SEG, None, SCALE, 8), 4), q, k, v)
    _assert_same(got, want)


# A row that starts with padding (segment 0): the first block's missing previous block (segment id -1) must
# match nothing, not the padding.
SEG_PAD_FIRST = SEG.at[1, :4].set(0)


@pytest.mark.parametrize("window,seg", [(3, SEG), (6, SEG), (3, SEG_PAD_FIRST)], ids=["w3", "w6", "w3-pad-first"])
def test_band_path_equals_dense(window, seg):
    """8 / 4 blocks of the window; documents cross block boundaries. The band takes the G = 2 KV heads
    itself (its grouped core) and, as the other paths, K/V already per query head (G = H)."""
    q, k, v = _qkv(h=4, g=2)
    want = _vjp_all(_per_head(lambda q, k, v: attend_dense(q, k, v, seg, window, SCALE), 4), q, k, v)
    _assert_same(_vjp_all(lambda q, k, v: attend_band(q, k, v, seg, window, SCALE), q, k, v), want)
    _assert_same(_vjp_all(_per_head(lambda q, k, v: attend_band(q, k, v, seg, window, SCALE), 4), q, k, v), want)


def test_whole_sequence_local_layers_take_the_band_where_it_pays():
    """attn_q_block 0: local layers run `attend_band` when S is >= 4 whole windows, else (and on global
    layers) the dense core; each gives the dense core's values from G = 2 KV heads for H = 4."""
    assert [band_applies(24, w) for w in (3, 6, 5, 8, None)] == [True, True, False, False, False]
    q, k, v = _qkv(h=4, g=2)
    for window, banded in ((6, True), (8, False), (None, False)):
        with mock.patch.object(attn, "attend_band", wraps=attend_band) as band:
            got = attend_xla(q, k, v, SEG, window, SCALE, 0)
        assert band.called == banded, window
        want = _per_head(lambda q, k, v: attend_dense(q, k, v, SEG, window, SCALE), 4)(q, k, v)
        np.testing.assert_allclose(got, want, rtol=RTOL_FP32, atol=ATOL_FP32)


def _layer_setup(seq=24, window=5):
    cfg = toy_model(window=window, n_heads=4, n_kv_heads=2, n_kv_heads_global=1)
    p = Attention.init(cfg, jax.random.key(0))
    p = Attention(**{**p.__dict__, "head_gate": 0.3 * jax.random.normal(jax.random.key(9), p.head_gate.shape)})
    x = jax.random.normal(jax.random.key(1), (B, seq, cfg.d_model))
    pos = jnp.asarray([list(range(7)) + list(range(10)) + list(range(5)) + [0, 0], list(range(24))])
    return cfg, p, x, pos


def _layer_grads(cfg, p, x, pos, is_global):
    f = lambda p, x: jnp.sum(jnp.sin(attention(p, x, SEG, pos, is_global, cfg)))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(p, x)


@pytest.mark.parametrize("is_global,window", [(False, 5), (True, 5), (False, 6)])
def test_layer_blockwise_equals_dense_all_weights(is_global, window):
    """The whole layer (projections, RoPE, XSA, gate) with attn_q_block=4 vs 0: values and the gradient of
    every attention weight and of x. Window 6: attn_q_block 0 runs the local layer as `attend_band`, so the
    comparison is band vs window path (each is tied to the dense core above)."""
    cfg, p, x, pos = _layer_setup(window=window)
    v_d, g_d = _layer_grads(cfg, p, x, pos, is_global)
    v_b, g_b = _layer_grads(replace(cfg, attn_q_block=4), p, x, pos, is_global)
    np.testing.assert_allclose(v_b, v_d, rtol=RTOL_FP32)
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g_b), jax.tree.leaves(g_b), jax.tree.leaves(g_d)):
        np.testing.assert_allclose(a, b, rtol=RTOL_FP32, atol=ATOL_FP32, err_msg=jax.tree_util.keystr(path[0]))


def test_traced_layer_flag_takes_the_right_branch():
    """In the layer scan `is_global` is traced; lax.cond must give what the static flag gives."""
    cfg, p, x, pos = _layer_setup()
    cfg = replace(cfg, attn_q_block=4)
    traced = jax.jit(lambda flag: attention(p, x, SEG, pos, flag, cfg))
    for flag in (False, True):
        np.testing.assert_allclose(traced(jnp.asarray(flag)), attention(p, x, SEG, pos, flag, cfg),
                                   rtol=RTOL_FP32, atol=ATOL_FP32)
    assert not np.allclose(traced(jnp.asarray(True)), traced(jnp.asarray(False)), atol=1e-3)


def test_scanned_local_layers_run_the_window_path():
    """With a traced flag the local branch of the cond slices keys (the window path), the global one not."""
    cfg, p, x, pos = _layer_setup()
    cfg = replace(cfg, attn_q_block=4)
    jaxpr = jax.make_jaxpr(lambda flag: attention(p, x, SEG, pos, flag, cfg))(jnp.asarray(False))
    conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == 1
    local, glob = (str(b) for b in conds[0].params["branches"])  # lax.cond: branches = (false, true)
    assert "dynamic_slice" in local and "dynamic_slice" not in glob


def _flops(f, *args) -> float:
    cost = jax.jit(f).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def test_local_layers_skip_key_blocks_outside_the_window():
    """FLOPs guard: the windowed path must cost ~(qb + window - 1) / S of the path that scores every key
    (same query blocks, so XLA's loop accounting treats both alike), fwd and fwd+bwd."""
    seq, window, qb = 512, 32, 32
    q = k = jnp.ones((1, seq, 2, 16))
    seg = jnp.ones((1, seq), jnp.int32)
    win = lambda q, k: attend_window(q, k, k, seg, window, SCALE, qb)
    full = lambda q, k: attend_query_blocks(q, k, k, seg, window, SCALE, qb)
    grad = lambda f: (lambda q, k: jax.grad(lambda q, k: jnp.sum(f(q, k)), argnums=(0, 1))(q, k))
    expected = (qb + window - 1) / seq  # 0.12
    for f_win, f_full in ((win, full), (grad(win), grad(full))):
        ratio = _flops(f_win, q, k) / _flops(f_full, q, k)
        assert ratio < 1.5 * expected, (ratio, expected)


# ---- the GPU kernel, run by the Pallas interpreter on CPU ----------------------------------------------

KERNEL_BLOCKS = FlashBlocks(q=8, k=4, q_bwd=4, k_bwd=8)  # unequal fwd/bwd tiles: every range formula used


def _flash_vs_dense(h, g, window):
    q, k, v = _qkv(h=h, g=g, seed=3)
    want = _vjp_all(_per_head(lambda q, k, v: attend_dense(q, k, v, SEG, window, SCALE), h), q, k, v)
    got = _vjp_all(lambda q, k, v: flash_attention(q, k, v, SEG, SCALE, window, KERNEL_BLOCKS, True), q, k, v)
    _assert_same(got, want)


def test_flash_kernel_global_gqa_equals_dense():
    _flash_vs_dense(h=4, g=1, window=None)


def test_flash_kernel_local_window_equals_dense():
    _flash_vs_dense(h=4, g=2, window=6)  # window straddles key blocks of 4 and query blocks of 8


def _ranges(seg_k, seq: int, bq: int, bk: int, window, off: int):
    """The kernels' loop ranges for one row of per-key segment ids: per query block its key blocks, per key
    block its query blocks (as sets)."""
    first_k, first_q, end_q = (np.asarray(a) for a in document_bounds(jnp.asarray(seg_k)[None], seq, bq, bk))
    keys = [set(range(*(int(b) for b in _key_block_range(jnp.int32(i), bq, bk, window, off, jnp.int32(first_k[i])))))
            for i in range(seq // bq)]
    queries = [set(range(*(int(b) for b in _query_block_range(jnp.int32(j), bq, bk, window, seq // bq, off,
                                                               jnp.int32(first_q[j]), jnp.int32(end_q[j])))))
               for j in range((off + seq) // bk)]
    return keys, queries


def _blocks(pairs, seq: int, bq: int, bk: int, off: int):
    """[query block, key block] of a [S, off + S] pair mask: whether any pair in the block is set."""
    return pairs.reshape(seq // bq, bq, (off + seq) // bk, bk).any(axis=(1, 3))


RANGE_CASES = [(8, 4, 6), (4, 8, 6), (16, 16, 1), (8, 8, 20), (8, 4, None), (4, 4, 13)]  # bq, bk, window


@pytest.mark.parametrize("off", [0, 4, 12, 16, 48], ids=lambda o: f"off{o}")
def test_flash_block_ranges_are_exactly_the_needed_blocks(off):
    """One document from key `start` on (before it: -1, context parallelism's padding of a sequence's first
    chunks): the loop bounds skip a block iff no (q, k) in it is causal, within the window and a real key;
    the queries sit at key positions off + [0, S) (keys extended in front, as context parallelism does)."""
    seq = 64
    cases = [c for c in RANGE_CASES if (off + seq) % c[1] == 0]  # the kernel takes whole key blocks
    assert cases
    for (bq, bk, window), start in itertools.product(cases, sorted({0, off // 2, off})):
        q, k = off + np.arange(seq)[:, None], np.arange(off + seq)[None, :]
        live = (q >= k) & (k >= start) & (True if window is None else q - k < window)
        need = _blocks(live, seq, bq, bk, off)
        keys, queries = _ranges(np.where(np.arange(off + seq) >= start, 1, -1), seq, bq, bk, window, off)
        for i in range(seq // bq):
            assert keys[i] == set(np.flatnonzero(need[i])), (bq, bk, window, start, i)
        for j in range((off + seq) // bk):
            assert queries[j] == set(np.flatnonzero(need[:, j])), (bq, bk, window, start, j)


@pytest.mark.parametrize("off", [0, 16], ids=lambda o: f"off{o}")
def test_flash_block_ranges_skip_other_documents(off):
    """Packed documents (ids in order, -1 before the sequence): the loops take exactly the causal, in-window
    blocks whose id ranges meet, every block holding a live (q, k) pair among them, and fewer blocks than
    causality and the window alone would."""
    seq = 64
    rng = np.random.default_rng(off)
    taken = reachable = 0
    for bq, bk, window in RANGE_CASES:
        lengths = rng.integers(1, 12, size=off + seq)
        seg_k = np.repeat(np.arange(1, lengths.size + 1), lengths)[:off + seq]
        seg_k[:off // 2] = -1
        seg_q = seg_k[off:]
        q, k = off + np.arange(seq)[:, None], np.arange(off + seq)[None, :]
        reach = (q >= k) & (True if window is None else q - k < window)
        need = _blocks(reach & (seg_q[:, None] == seg_k[None, :]), seq, bq, bk, off)
        ids = lambda a, b: (a.reshape(-1, b).min(axis=1), a.reshape(-1, b).max(axis=1))
        (q_min, q_max), (k_min, k_max) = ids(seg_q, bq), ids(seg_k, bk)
        meet = (k_max[None, :] >= q_min[:, None]) & (k_min[None, :] <= q_max[:, None])
        want = _blocks(reach, seq, bq, bk, off) & meet
        keys, queries = _ranges(seg_k, seq, bq, bk, window, off)
        for i in range(seq // bq):
            assert keys[i] == set(np.flatnonzero(want[i])) >= set(np.flatnonzero(need[i])), (bq, bk, window, i)
        for j in range((off + seq) // bk):
            assert queries[j] == set(np.flatnonzero(want[:, j])) >= set(np.flatnonzero(need[:, j])), (bq, bk, j)
        taken += sum(map(len, keys))
        reachable += _blocks(reach, seq, bq, bk, off).sum()
    assert taken < 0.8 * reachable, (taken, reachable)


def test_flash_kernel_on_many_short_documents_equals_dense():
    """Documents of 1-6 keys across blocks of 8 and 4: most key blocks skipped; values and gradients still
    the dense core's, global and local, with earlier keys (-1 then a continued document) in front, and
    with the document skipping off."""
    off, blocks = 8, FlashBlocks(q=8, k=4, q_bwd=4, k_bwd=8)
    rng = np.random.default_rng(7)
    seg_k = np.stack([np.repeat(np.arange(1, 41), rng.integers(1, 7, size=40))[:off + S] for _ in range(B)])
    seg_k[1, :3] = -1
    q, _, _ = _qkv(h=4, g=2, seed=8)
    k, v = (jax.random.normal(key, (B, off + S, 2, 8)) for key in jax.random.split(jax.random.key(9)))
    seg_k, seg_q = jnp.asarray(seg_k, jnp.int32), jnp.asarray(seg_k[:, off:], jnp.int32)
    for window in (None, 5):
        mask = attn.block_mask(seg_q, seg_k, off + jnp.arange(S), jnp.arange(off + S), window)
        want = _vjp_all(_per_head(lambda q, k, v: attn._softmax_av(q, k, v, mask, SCALE), 4), q, k, v)
        for b in (blocks, replace(blocks, skip_documents=False)):  # the skipping changes no value
            got = _vjp_all(lambda q, k, v: flash_attention(q, k, v, seg_k, SCALE, window, b, True), q, k, v)
            _assert_same(got, want)


@pytest.mark.parametrize("off,window", [(4, None), (12, 6), (12, 15), (28, None)])
def test_flash_kernel_with_earlier_keys_equals_dense(off, window):
    """Keys extended in front of the queries (context parallelism: the previous chunks, or a halo; padding
    has segment id -1): row 0's first document continues from the earlier keys, row 1's starts fresh.
    Values and q/k/v gradients against the dense core with explicit positions, GQA 4 on 2."""
    blocks = FlashBlocks(q=8, k=4, q_bwd=4, k_bwd=4)
    q, _, _ = _qkv(h=4, g=2, seed=5)
    kk, kv = jax.random.split(jax.random.key(6))
    k, v = (jax.random.normal(key, (B, off + S, 2, 8)) for key in (kk, kv))
    front = np.full((B, off), -1, np.int32)
    front[0, -3:] = SEG[0, 0]  # the document of row 0's first query began 3 keys earlier
    seg_k = jnp.concatenate([jnp.asarray(front), SEG], axis=1)
    mask = attn.block_mask(SEG, seg_k, off + jnp.arange(S), jnp.arange(off + S), window)
    want = _vjp_all(_per_head(lambda q, k, v: attn._softmax_av(q, k, v, mask, SCALE), 4), q, k, v)
    got = _vjp_all(lambda q, k, v: flash_attention(q, k, v, seg_k, SCALE, window, blocks, True), q, k, v)
    _assert_same(got, want)


# bf16 kernel against the fp32 dense core, norm-wise (max |error| / max |reference|): the project's bf16 tolerance
# (tests/test_expert_parallel.py BF16_RTOL).
BF16_NORMWISE = 2e-2
# Window 1's exact zeros, up to fp32 summation order (dP and delta sum the same products in different orders):
# measured ~2.5e-6; 0.06 when delta read the unrounded dO.
WINDOW_ONE_ATOL = 1e-4


def _bf16_kernel_and_fp32_dense(b, s, h, hd, scale, amp, seg, window, blocks):
    """(kernel's out, dq, dk, dv) on bf16 q/k/v, (the fp32 dense core's) on the same values, one KV head."""
    kq, kk, kv, kc = jax.random.split(jax.random.key(1), 4)
    q = (amp * jax.random.normal(kq, (b, s, h, hd))).astype(jnp.bfloat16)
    k = (amp * jax.random.normal(kk, (b, s, 1, hd))).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, 1, hd)).astype(jnp.bfloat16)
    ct = jax.random.normal(kc, (b, s, h, hd))

    def out_and_grads(f, *args):  # jitted as one program, as a train step runs it
        def run(*args):
            out, pull = jax.vjp(f, *args)
            return out, *pull(ct)
        return [np.asarray(a, np.float64) for a in jax.jit(run)(*args)]

    f32 = lambda a: a.astype(jnp.float32)
    dense = _per_head(lambda q, k, v: attend_dense(q, k, v, seg, window, scale), h)
    want = out_and_grads(lambda q, k, v: dense(f32(q), f32(k), f32(v)), q, k, v)
    got = out_and_grads(lambda q, k, v: flash_attention(q, k, v, seg, scale, window, blocks, True), q, k, v)
    return got, want


def test_flash_kernel_bf16_window_one_has_zero_query_and_key_gradients():
    """Window 1: each query reads only its own key, its softmax is constant, so dQ = dK = 0 exactly. The
    backward's delta = rowsum(O * dO) must read dO rounded to bf16 as the kernels' dP = dO V^T does; from the
    fp32 dO each row of dS kept a residue (dQ/dK ~0.06 here; docs/LOG.md 2026-12-05, thirty-fourth session)."""
    got, want = _bf16_kernel_and_fp32_dense(1, 16, 1, 16, 1.0, 3.0, jnp.ones((1, 16), jnp.int32), 1,
                                            FlashBlocks(q=8, k=8, q_bwd=8, k_bwd=8))
    for name, g in zip(("dq", "dk"), got[1:3]):
        assert np.abs(g).max() <= WINDOW_ONE_ATOL, (name, np.abs(g).max())
    for name, g, w in zip(("out", "dv"), got[::3], want[::3]):
        assert np.abs(g - w).max() <= BF16_NORMWISE * np.abs(w).max(), name


def test_flash_kernel_bf16_gradients_on_a_peaked_softmax():
    """Short documents, a 40-key window, logits up to ~18 (scale 2, q/k x 3): most of each row's weight on a
    few keys, so dQ/dK are small beside dO V^T, and a delta that disagrees with dP shows. bf16 kernel within
    the bf16 tolerance of the fp32 dense core (dQ 5.1e-2, dK 9.7e-2 with the unrounded dO in delta)."""
    rng = np.random.default_rng(0)
    seg = jnp.asarray(np.repeat(np.arange(1, 65), rng.integers(1, 8, size=64))[:64][None], jnp.int32)
    got, want = _bf16_kernel_and_fp32_dense(1, 64, 1, 32, 2.0, 3.0, seg, 40,
                                            FlashBlocks(q=4, k=8, q_bwd=16, k_bwd=32, skip_documents=False))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err <= BF16_NORMWISE, (name, err)


@pytest.mark.parametrize("what", ["v longer", "v fewer heads", "v head dim", "k/v batch"])
def test_flash_kernel_refuses_q_k_v_that_disagree(what):
    """Mismatched V (length, heads, head dim) or a K/V batch other than Q's is an error naming the shapes; the
    interpreter returned finite values from clamped reads before."""
    q, k, v = _qkv(h=2, g=2, seed=1)
    seg = SEG
    if what == "v longer":
        v = jnp.concatenate([v, v[:, :8]], axis=1)
    elif what == "v fewer heads":
        v = v[:, :, :1]
    elif what == "v head dim":
        v = jnp.concatenate([v, v], axis=-1)
    else:
        k, v, seg = (jnp.concatenate([a, a]) for a in (k, v, SEG))
    with pytest.raises(ValueError, match=r"flash attention: q \(.*\), k \(.*\) and v \(.*\) must share"):
        flash_attention(q, k, v, seg, SCALE, None, KERNEL_BLOCKS, True)


def test_attention_impl_choice_and_override():
    assert attention_impl() == ("gpu_kernel" if jax.default_backend() == "gpu" else "xla")
    with mock.patch.dict(os.environ, {"MOEJAX_ATTENTION": "gpu_kernel"}):
        assert attention_impl() == "gpu_kernel"
    with mock.patch.dict(os.environ, {"MOEJAX_ATTENTION": "cudnn"}), pytest.raises(ValueError, match="cudnn"):
        attention_impl()


def test_layer_through_the_kernel_equals_xla(monkeypatch):
    """The layer routed to the kernel (interpret mode) gives the XLA layer's values and weight gradients."""
    cfg, p, x, pos = _layer_setup()
    cfg = replace(cfg, attn_q_block=4)
    want = _layer_grads(cfg, p, x, pos, False)
    interp = lambda q, k, v, seg, scale, window, *_: flash_attention(q, k, v, seg, scale, window, KERNEL_BLOCKS, True)
    monkeypatch.setattr(attn, "flash_attention", interp)
    monkeypatch.setenv("MOEJAX_ATTENTION", "gpu_kernel")
    v_k, g_k = _layer_grads(cfg, p, x, pos, False)
    np.testing.assert_allclose(v_k, want[0], rtol=RTOL_FP32)
    for a, b in zip(jax.tree.leaves(g_k), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, rtol=RTOL_FP32, atol=ATOL_FP32)
