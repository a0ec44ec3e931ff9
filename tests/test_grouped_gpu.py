"""The GPU grouped-GEMM kernels (moejax.model.moe.grouped_gpu), run by the Pallas interpreter on CPU, equal
fp32 references and the XLA block path: values and every gradient, unaligned groups, empty experts, E=384."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ConfigError
from moejax.model import kernel_choice
from moejax.model.kernel_choice import ATTENTION, EP_GROUPED, GROUPED, GROUPED_ROWS, chosen, kernel_impl
from moejax.model.moe import grouped, grouped_gpu
from moejax.model.layers import swiglu_act
from moejax.model.moe.experts import routed_local
from moejax.model.moe.grouped import (_swiglu_down, block_matmul, from_blocks, grouped_matmul, grouped_swiglu,
                                      make_layout, row_maps, to_blocks)
from tests.helpers import toy_model
from tests.test_grouped import ATOL_FP32, RTOL_FP32, UNALIGNED, _problem, per_row_reference

# bf16 against fp32, relative Frobenius norm: four bf16 unit roundoffs (2^-8 each), for the chain of
# gate/up matmul, product, down matmul and their backward.
RTOL_BF16_NORM = 4 * 2.0 ** -8
# Tiles smaller than the widths below, so every kernel loops over several contraction chunks and writes
# several column tiles.
SMALL = grouped_gpu.GemmTiles(tn=16, tk=16, tz=16, tf=16)


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setenv("MOEJAX_GROUPED", "gpu_kernel")


def _uses_kernel(fn, *args) -> bool:
    """Whether fn's forward and gradient run every grouped kernel (forward, dx and dw; the down projection's
    with the activation fused: `_act`), none on the einsums."""
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1)))(*args))
    counts = [jaxpr.count(f"name={name}") for name in ("moejax_grouped_fwd", "moejax_grouped_dx", "moejax_grouped_dw")]
    assert len(set(counts)) == 1, f"kernel calls fwd/dx/dw {counts}: part of the path fell back"
    return counts[0] > 0


def _swiglu_vs_reference(x, expert_A, ws, ct, block, rtol, atol):
    swiglu = lambda x, e, *w: grouped_swiglu(x, e, *w, block_size=block)
    assert _uses_kernel(lambda x, w: swiglu(x, expert_A, w, *ws[1:]), x, ws[0]), "the kernel path was not taken"
    y = jax.jit(swiglu)(x, expert_A, *ws)
    np.testing.assert_allclose(np.asarray(y, np.float32), per_row_reference(x, expert_A, *ws), rtol=rtol, atol=atol)
    grads = [jax.jit(jax.grad(lambda x, *w: jnp.sum(f(x, expert_A, *w).astype(jnp.float32) * ct), argnums=(0, 1, 2, 3)))(x, *ws)
             for f in (swiglu, per_row_reference)]
    for name, a, b in zip(["x", "w_gate", "w_up", "w_down"], *grads):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=atol,
                                   err_msg=f"grad {name}")


def test_kernel_swiglu_unaligned_groups_with_empty_experts(kernel):
    _swiglu_vs_reference(*_problem(0, UNALIGNED, Z=32, F=64), 16, RTOL_FP32, ATOL_FP32)


def test_kernel_swiglu_last_expert_empty(kernel):
    """The tail blocks carry expert E-1's id; with E-1 empty none of them may reach its weight gradient."""
    _swiglu_vs_reference(*_problem(0, UNALIGNED + [0], Z=32, F=64), 16, RTOL_FP32, ATOL_FP32)


def test_kernel_swiglu_384_experts(kernel):
    sizes = np.random.default_rng(2).multinomial(700, np.full(384, 1 / 384))
    assert (sizes == 0).any() and sizes.max() > 4
    _swiglu_vs_reference(*_problem(2, sizes, Z=16, F=16), 16, RTOL_FP32, ATOL_FP32)


@pytest.mark.parametrize("rows", ["xla", "gpu_kernel"], ids=["xla_gathers", "rows_in_kernels"])
def test_kernel_bf16_close_to_fp32_reference(kernel, rows, monkeypatch):
    """bf16 operands against the fp32 reference on the same (bf16-rounded) values, in relative Frobenius
    norm: elementwise, bf16 at widths >= 16 (the kernels' minimum) is off by more than test_grouped's
    narrow-width tolerance for the XLA path too; in norm both stay near 0.5% (measured), inside the
    bound of four bf16 roundings. Also with the rows read and written in the kernels."""
    monkeypatch.setenv("MOEJAX_GROUPED_ROWS", rows)
    x, expert_A, ws, ct = _problem(3, UNALIGNED, Z=32, F=32, dtype=jnp.bfloat16)
    swiglu = lambda x, *w: grouped_swiglu(x, expert_A, *w, block_size=16)
    assert _uses_kernel(lambda x, w: swiglu(x, w, *ws[1:]), x, ws[0])
    loss = lambda f: lambda x, *w: jnp.sum(f(x, *w).astype(jnp.float32) * ct)
    ref = lambda x, *w: per_row_reference(x, expert_A, *w)
    got, want = ([jax.jit(f)(x, *ws), *jax.jit(jax.grad(loss(f), argnums=(0, 1, 2, 3)))(x, *ws)] for f in (swiglu, ref))
    for name, a, b in zip(["forward", "grad x", "grad w_gate", "grad w_up", "grad w_down"], got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= RTOL_BF16_NORM * np.linalg.norm(b), name


def test_kernels_equal_xla_block_path_with_several_tiles():
    """Each kernel alone against the XLA einsums on the same blocks: forward, dx and the fp32 dw, with tiles
    smaller than the widths (Z=32: 2 chunks; F=48: 3 column tiles) and the layout's unused tail blocks."""
    x, expert_A, (w, _, _), _ = _problem(4, UNALIGNED, Z=32, F=48)
    layout = make_layout(expert_A, len(UNALIGNED), 16)
    x_BkbZ = to_blocks(x, layout)
    assert layout.n_blocks > int(np.sum(layout.blocks_E)), "the case should have unused tail blocks"
    # Cotangents as the model gives them: zero on padding rows (nothing reads them back).
    dy_BkbF = to_blocks(jax.random.normal(jax.random.key(0), (x.shape[0], 48)), layout)
    e, c = layout.expert_Bk, layout.blocks_E
    y_ref, vjp = jax.vjp(lambda x, w: block_matmul(x, w, e, c), x_BkbZ, w)  # MOEJAX_GROUPED unset on CPU: XLA
    dx_ref, dw_ref = vjp(dy_BkbF)
    run = lambda f, *a: jax.jit(lambda *a: f(*a, tiles=SMALL, interpret=True))(*a)
    np.testing.assert_allclose(run(grouped_gpu.matmul, x_BkbZ, w, e, c), y_ref, rtol=RTOL_FP32, atol=ATOL_FP32)
    np.testing.assert_allclose(run(grouped_gpu.matmul_dx, dy_BkbF, w, e, c), dx_ref, rtol=RTOL_FP32, atol=ATOL_FP32)
    np.testing.assert_allclose(run(grouped_gpu.matmul_dw, x_BkbZ, dy_BkbF, c), dw_ref, rtol=RTOL_FP32, atol=ATOL_FP32)
    # written in bf16 (as for bf16 weights): the fp32 result rounded once, bit for bit
    dw_bf16 = jax.jit(lambda *a: grouped_gpu.matmul_dw(*a, tiles=SMALL, interpret=True, out_dtype=jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(dw_bf16(x_BkbZ, dy_BkbF, c), np.float32),
                                  np.asarray(run(grouped_gpu.matmul_dw, x_BkbZ, dy_BkbF, c).astype(jnp.bfloat16), np.float32))


def test_activation_kernels_equal_the_xla_composition_with_several_tiles():
    """SwiGLU's down projection on the kernels (`grouped._swiglu_down`: the XLA-made activation, the plain
    forward and dw kernels, (d_gate, d_up) from dx's epilogue) against the XLA path's
    block_matmul(swiglu_act(g, u), w) and its VJP, fp32, tiles smaller than the widths, unused tail blocks;
    and the grouped SwiGLU on the kernels runs its two matmuls' kernels."""
    x, expert_A, (_, _, w_down), _ = _problem(5, UNALIGNED, Z=48, F=32)
    layout = make_layout(expert_A, len(UNALIGNED), 16)
    e, c = layout.expert_Bk, layout.blocks_E
    keys = jax.random.split(jax.random.key(6), 3)
    g, u = (to_blocks(jax.random.normal(k, (x.shape[0], 32)), layout) for k in keys[:2])
    gu = jnp.stack([g, u], axis=2)  # [Bk, b, 2, F]: gate and up side by side, as the kernel path has them
    dy = to_blocks(jax.random.normal(keys[2], (x.shape[0], 48)), layout)
    y_ref, vjp = jax.vjp(lambda g, u, w: block_matmul(swiglu_act(g, u), w, e, c), g, u, w_down)  # XLA on CPU
    dg_ref, du_ref, dw_ref = vjp(dy)
    close = functools.partial(np.testing.assert_allclose, rtol=RTOL_FP32, atol=ATOL_FP32)
    dgu = jax.jit(lambda *a: grouped_gpu.matmul_dx_act(*a, tiles=SMALL, interpret=True))(dy, w_down, gu, e, c)
    close(dgu[:, :, 0], dg_ref)
    close(dgu[:, :, 1], du_ref)
    y, vjp = jax.vjp(lambda gu, w: _swiglu_down(gu, w, e, c, True), gu, w_down)  # default tiles: 16 of 48
    dgu, dw = vjp(dy)
    close(y, y_ref)
    close(dgu, jnp.stack([dg_ref, du_ref], axis=2))
    close(dw, dw_ref)
    with chosen(GROUPED[0], "gpu_kernel"):
        x, expert_A, ws, _ = _problem(0, UNALIGNED, Z=32, F=64)
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(grouped_swiglu(x, expert_A, w, *ws[1:])),
                                            argnums=(0, 1)))(x, ws[0]))
    assert jaxpr.count("name=moejax_grouped_dx_act") == 1  # the down projection's dx
    # the forward and dw kernels: one each for gate and up (as one matmul against both weights), one each for
    # the down projection
    assert [jaxpr.count(f"name=moejax_grouped_{k}\n") for k in ("fwd", "dx", "dw")] == [2, 1, 2]


def test_row_mapped_kernels_equal_the_block_kernels_and_xla_gathers():
    """Each kernel reading its rows in place (a row map: gathered loads) and writing them in place (scattered
    stores) against the same kernel on XLA's blocks with XLA's gathers around it: forward, dx, dw with either
    or both operands mapped, and the down projection's dx_act; tiles smaller than the widths, unaligned groups,
    empty experts and the layout's unused tail blocks (whose map entries are all padding)."""
    x, expert_A, (w, _, _), _ = _problem(7, UNALIGNED, Z=32, F=48)
    layout = make_layout(expert_A, len(UNALIGNED), 16)
    assert layout.n_blocks > int(np.sum(layout.blocks_E)), "the case should have unused tail blocks"
    src, dst = row_maps(layout)
    n, e, c = x.shape[0], layout.expert_Bk, layout.blocks_E
    keys = jax.random.split(jax.random.key(8), 2)
    dy = jax.random.normal(keys[0], (n, 48))
    x_b, dy_b = to_blocks(x, layout), to_blocks(dy, layout)
    run = lambda f, *a, **kw: jax.jit(lambda *a: f(*a, tiles=SMALL, interpret=True, **kw))(*a)
    close = functools.partial(np.testing.assert_allclose, rtol=RTOL_FP32, atol=ATOL_FP32)
    y_b = run(grouped_gpu.matmul, x_b, w, e, c)
    close(run(grouped_gpu.matmul, x, w, e, c, rows_in=src), y_b)
    close(run(grouped_gpu.matmul, x_b, w, e, c, rows_out=dst, n_out=n), from_blocks(y_b, layout))
    close(run(grouped_gpu.matmul, x, w, e, c, rows_in=src, rows_out=dst, n_out=n), from_blocks(y_b, layout))
    dx_b = run(grouped_gpu.matmul_dx, dy_b, w, e, c)
    close(run(grouped_gpu.matmul_dx, dy, w, e, c, rows_in=dst, rows_out=dst, n_out=n), from_blocks(dx_b, layout))
    dw_b = run(grouped_gpu.matmul_dw, x_b, dy_b, c)
    close(run(grouped_gpu.matmul_dw, x, dy_b, c, x_rows=src), dw_b)
    close(run(grouped_gpu.matmul_dw, x_b, dy, c, dy_rows=dst), dw_b)
    close(run(grouped_gpu.matmul_dw, x, dy, c, x_rows=src, dy_rows=dst, block=16), dw_b)
    gu = jax.random.normal(keys[1], x_b.shape[:2] + (2, 48))
    w_t = jnp.swapaxes(w, 1, 2)  # [E, F, Z]: the down projection's weights, dy of width Z
    close(run(grouped_gpu.matmul_dx_act, x, w_t, gu, e, c, dy_rows=dst),
          run(grouped_gpu.matmul_dx_act, x_b, w_t, gu, e, c))
    with pytest.raises(ValueError, match="give the block size"):
        grouped_gpu.matmul_dw(x, dy, c, x_rows=src, dy_rows=dst, interpret=True)


@pytest.mark.parametrize("rows", ["xla", "gpu_kernel"], ids=["xla_gathers", "rows_in_kernels"])
def test_routed_local_on_the_kernels_equals_the_xla_path(rows):
    """The MoE layer's dropless path (K = 3 choices a token, masked tokens, empty experts) on the kernels, its
    rows gathered into blocks by XLA or (MOEJAX_GROUPED_ROWS) read and written by the kernels, against the
    XLA path: the output and the gradients of the tokens, combine weights and the three expert weights; the
    row-map kernels are the ones that run when chosen."""
    n_tok, k, n_exp, z, f = 37, 3, 8, 32, 48
    keys = jax.random.split(jax.random.key(9), 7)
    z_TZ = jax.random.normal(keys[0], (n_tok, z))
    expert_TK = jax.random.randint(keys[1], (n_tok, k), 0, n_exp - 2)  # the last two experts get no rows
    weight_TK = jax.random.uniform(keys[2], (n_tok, k))
    mask_T = jnp.arange(n_tok) % 5 != 0
    ws = [jax.random.normal(kk, s) / s[1] ** 0.5 for kk, s in zip(keys[3:6], [(n_exp, z, f)] * 2 + [(n_exp, f, z)])]
    ct = jax.random.normal(keys[6], (n_tok, z))
    loss = lambda z_TZ, w_TK, *ws: jnp.vdot(routed_local(z_TZ, expert_TK, w_TK, mask_T, *ws), ct)

    def value_and_grads(grouped, rows_choice):
        with chosen(GROUPED[0], grouped), chosen(GROUPED_ROWS[0], rows_choice):
            fn = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
            names = str(jax.make_jaxpr(fn)(z_TZ, weight_TK, *ws))
            return jax.jit(fn)(z_TZ, weight_TK, *ws), names

    (want, want_grads), _ = value_and_grads("xla", "xla")
    (got, got_grads), names = value_and_grads("gpu_kernel", rows)
    np.testing.assert_allclose(got, want, rtol=RTOL_FP32, atol=ATOL_FP32)
    for name, a, b in zip(["z", "combine weights", "w_gate", "w_up", "w_down"], got_grads, want_grads):
        np.testing.assert_allclose(a, b, rtol=RTOL_FP32, atol=ATOL_FP32, err_msg=f"grad {name}")
    assert "name=moejax_grouped_dx_act" in names, "the kernel path was not taken"
    mapped = [f"moejax_grouped_{kind}_rows" for kind in ("fwd", "dx", "dw", "dx_act")]
    assert all((m in names) == (rows == "gpu_kernel") for m in mapped), names.count("_rows")


def test_grouped_matmul_with_rows_in_kernels_equals_the_per_row_matmul():
    """One grouped GEMM (`grouped_matmul`, rows unsorted) with every row gather inside its three kernels:
    values and both gradients against x[a] @ w[e_a] per row."""
    x, expert_A, (w, _, _), _ = _problem(10, UNALIGNED, Z=32, F=48)
    ct = jax.random.normal(jax.random.key(11), (x.shape[0], 48))
    per_row = lambda x, w: jnp.einsum("az,azf->af", x, w[expert_A], precision=jax.lax.Precision.HIGHEST)
    with chosen(GROUPED[0], "gpu_kernel"), chosen(GROUPED_ROWS[0], "gpu_kernel"):
        got = jax.jit(jax.value_and_grad(lambda x, w: jnp.vdot(grouped_matmul(x, expert_A, w, 16), ct),
                                         argnums=(0, 1)))(x, w)
    want = jax.value_and_grad(lambda x, w: jnp.vdot(per_row(x, w), ct), argnums=(0, 1))(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=RTOL_FP32, atol=ATOL_FP32)


def test_kept_rows_skip_the_rest_exactly():
    """`swiglu_kept_rows` (the expert-parallel transport's expert compute on the kernels): rows marked E (no
    expert's; here the last group) come out exactly 0 and get exactly 0 input gradient, since the kernels skip
    their blocks, yet store zeros through the row maps; the kept rows and every weight gradient equal the
    per-row reference over the kept rows alone. Only the kept rows' blocks are computed."""
    sizes = [5, 0, 13, 1, 29, 0, 6, 17, 23]  # UNALIGNED's 8 experts, then 23 rows of no expert's
    x, expert_A, ws, ct = _problem(12, sizes, Z=32, F=48)
    n_exp = len(sizes) - 1
    ws = [w[:n_exp] for w in ws]
    kept = np.asarray(expert_A) < n_exp
    layout = grouped.skipping_layout(expert_A, n_exp, 16)
    assert int(layout.blocks_E.sum()) == sum(-(-n // 16) for n in sizes[:n_exp])  # the kept rows' blocks only
    assert layout.n_blocks * 16 >= len(kept)  # every row has a place, the skipped ones in the tail

    def masked_reference(x, *w):
        return jnp.where(kept[:, None], per_row_reference(x, jnp.minimum(expert_A, n_exp - 1), *w), 0.0)

    fn = lambda x, *w: grouped.swiglu_kept_rows(x, expert_A, *w, block_size=16)
    y = jax.jit(fn)(x, *ws)
    assert not np.asarray(y)[~kept].any()
    np.testing.assert_allclose(y, masked_reference(x, *ws), rtol=RTOL_FP32, atol=ATOL_FP32)
    grads = [jax.jit(jax.grad(lambda x, *w: jnp.vdot(f(x, *w), ct), argnums=(0, 1, 2, 3)))(x, *ws)
             for f in (fn, masked_reference)]
    assert not np.asarray(grads[0][0])[~kept].any()
    for name, a, b in zip(["x", "w_gate", "w_up", "w_down"], *grads):
        np.testing.assert_allclose(a, b, rtol=RTOL_FP32, atol=ATOL_FP32, err_msg=f"grad {name}")
    names = str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(fn(x, *ws))))(x))
    assert all(f"moejax_grouped_{kind}_rows" in names for kind in ("fwd", "dx", "dw", "dx_act")), names.count("_rows")


def test_ep_grouped_is_opt_in_even_on_a_gpu(monkeypatch):
    """MOEJAX_EP_GROUPED defaults to the capacity buffers' einsums on a GPU too (not yet timed there); chosen,
    it holds, and a model the kernels can't take is refused before a run."""
    monkeypatch.delenv("MOEJAX_EP_GROUPED", raising=False)
    monkeypatch.setattr(kernel_choice.jax, "default_backend", lambda: "gpu")
    assert kernel_impl(*EP_GROUPED) == "xla"
    monkeypatch.setenv("MOEJAX_EP_GROUPED", "gpu_kernel")
    assert kernel_choice.current()["impl"]["MOEJAX_EP_GROUPED"] == "gpu_kernel"  # a step pins it
    monkeypatch.setenv("MOEJAX_GROUPED", "xla")  # independent of the local path's choice
    model = toy_model(latent_width=24)
    with pytest.raises(ConfigError, match="MOEJAX_EP_GROUPED=gpu_kernel: width 24 has no tile"):
        kernel_choice.check_choices(model)


def test_rows_in_kernels_is_opt_in_even_on_a_gpu(monkeypatch):
    """MOEJAX_GROUPED_ROWS defaults to XLA's gathers on a GPU too (not yet timed there); chosen, it holds."""
    monkeypatch.delenv("MOEJAX_GROUPED_ROWS", raising=False)
    monkeypatch.delenv("MOEJAX_GROUPED", raising=False)
    monkeypatch.setattr(kernel_choice.jax, "default_backend", lambda: "gpu")
    assert kernel_impl(*GROUPED) == "gpu_kernel" and kernel_impl(*GROUPED_ROWS) == "xla"
    monkeypatch.setenv("MOEJAX_GROUPED_ROWS", "gpu_kernel")
    assert kernel_impl(*GROUPED_ROWS) == "gpu_kernel"
    assert kernel_choice.current()["impl"]["MOEJAX_GROUPED_ROWS"] == "gpu_kernel"  # a step pins it


def test_shapes_the_kernels_dont_take_are_an_error(kernel):
    """No silent fall back to the einsums: widths that aren't whole tiles fail with the numbers; small
    inputs get blocks of at least 16 rows, the kernels' minimum (the XLA path would use 8)."""
    assert grouped_gpu.fits(16, 32, 64) and grouped_gpu.fits(128, 512, 512) and grouped_gpu.fits(128, 3072, 1024)
    assert grouped_gpu.fits(128, 192, 48)  # tiles 64 and 16: the largest powers of two dividing the widths
    assert grouped_gpu.tile(128, 3072) == 128 and grouped_gpu.tile(128, 192) == 64 and grouped_gpu.tile(64, 48) == 16
    assert not grouped_gpu.fits(8, 32, 64) and not grouped_gpu.fits(16, 24, 64) and not grouped_gpu.fits(16, 32, 8)
    x, expert_A, ws, _ = _problem(5, UNALIGNED, Z=24, F=64)
    with pytest.raises(ConfigError, match="width 24 has no tile"):
        grouped_swiglu(x, expert_A, *ws)
    x, expert_A, ws, _ = _problem(5, [3, 0, 2, 1], Z=32, F=64)  # 6 rows over 4 experts: default_block -> 8 on XLA
    assert make_layout(expert_A, 4).block == 16
    assert _uses_kernel(lambda x, w: grouped_swiglu(x, expert_A, w, *ws[1:]), x, ws[0])
    with pytest.raises(ValueError, match="float32 and weights bfloat16 differ"):
        layout = make_layout(expert_A, 4)
        grouped_gpu.matmul(to_blocks(x, layout), ws[0].astype(jnp.bfloat16), layout.expert_Bk, layout.blocks_E,
                           interpret=True)


def test_multi_gpu_choice(monkeypatch):
    """On GPUs (any number) both kernels are the default: on a mesh each runs per batch shard under shard_map
    (`parallel.backends`; lowered in test_gpu_lowering, values in test_local_data_parallel)."""
    monkeypatch.delenv("MOEJAX_GROUPED", raising=False)
    monkeypatch.delenv("MOEJAX_ATTENTION", raising=False)
    monkeypatch.setattr(kernel_choice.jax, "default_backend", lambda: "gpu")
    assert kernel_impl(*GROUPED) == kernel_impl(*ATTENTION) == "gpu_kernel"
    monkeypatch.setenv("MOEJAX_ATTENTION", "xla")
    assert kernel_impl(*ATTENTION) == "xla"


def test_grouped_choice_defaults_to_xla_off_gpu_and_chosen_restores(monkeypatch):
    monkeypatch.delenv("MOEJAX_GROUPED", raising=False)
    assert kernel_impl(*GROUPED) == ("gpu_kernel" if jax.default_backend() == "gpu" else "xla")
    with chosen("MOEJAX_GROUPED", "gpu_kernel"):
        assert kernel_impl(*GROUPED) == "gpu_kernel"
    assert "MOEJAX_GROUPED" not in os.environ
    with pytest.raises(ConfigError, match="'triton' is not one of"):
        with chosen("MOEJAX_GROUPED", "triton"):
            pass


def test_a_step_keeps_the_kernel_choice_it_was_built_with(monkeypatch):
    """`make_eval_step` (as `make_train_step`) pins the choices when built: tracing later, under another
    MOEJAX_GROUPED, still gives the built one (jit may trace a step long after it is made)."""
    from moejax.model.transformer import Transformer
    from moejax.train.step import make_eval_step
    from tests.helpers import toy_batch, toy_model

    model = toy_model(n_layers=1)
    params, batch = Transformer.init(model, jax.random.key(0)), toy_batch(model)
    bytes_per_token = jnp.ones((model.vocab_size,), jnp.float32)
    calls = lambda step: str(jax.make_jaxpr(step)(params, batch, bytes_per_token)).count("pallas_call[")
    # the forward's two expert kernels: gate and up as one matmul, the down projection with the activation
    for built, later, kernels in (("gpu_kernel", "xla", 2), ("xla", "gpu_kernel", 0)):
        monkeypatch.setenv("MOEJAX_GROUPED", built)
        step = make_eval_step(model)
        monkeypatch.setenv("MOEJAX_GROUPED", later)
        assert calls(step) == kernels, (built, later)


def test_a_jax_without_pallas_triton_runs_xla_on_a_gpu_and_refuses_a_chosen_kernel(monkeypatch, capsys):
    """Every kernel is written for Pallas's Triton backend, which jax 0.11 deprecates. In a jax without it
    (`pallas_util.plgpu` None) a GPU defaults every op to XLA and says so once before a run; a kernel chosen
    explicitly is one line naming the variable and the jax, not an error mid-trace."""
    from moejax.model import pallas_util

    for var, _ in kernel_choice.KERNEL_OPS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kernel_choice.jax, "default_backend", lambda: "gpu")
    assert set(kernel_choice.current()["impl"].values()) == {"gpu_kernel", "xla"}  # with Triton: the kernels
    monkeypatch.setattr(pallas_util, "plgpu", None)
    assert set(kernel_choice.current()["impl"].values()) == {"xla"}
    kernel_choice.check_choices(toy_model())
    assert "has no Pallas Triton backend, so attention, the grouped GEMM and Newton-Schulz run on their XLA" \
        in capsys.readouterr().err
    monkeypatch.setenv("MOEJAX_ATTENTION", "gpu_kernel")
    with pytest.raises(ConfigError, match=r"MOEJAX_ATTENTION=gpu_kernel: the attention kernel is written for "
                                          r"Pallas's Triton backend, which this jax \(.*\) does not have"):
        kernel_choice.check_choices()


def test_moejax_imports_and_refuses_in_one_line_without_pallas_triton(tmp_path):
    """The import itself: with `jax.experimental.pallas.triton` missing, every kernel module imports (they
    used to import it at the top, so no moejax command ran at all), and `moejax train` with a kernel chosen
    exits 2 with one line, before its run directory exists."""
    import subprocess
    import sys

    run = tmp_path / "run"
    code = ("import sys; sys.modules['jax.experimental.pallas.triton'] = None\n"
            "from moejax.model import flash_gpu, pallas_util\nfrom moejax.train import ns_gpu\n"
            "assert pallas_util.plgpu is None\nfrom moejax.cli import main\n"
            f"sys.exit(main(['train', '--preset', 'tiny', '--no-progress', '--run-dir', {str(run)!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MOEJAX_GROUPED": "gpu_kernel", "WANDB_MODE": "disabled"})
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        f"moejax: error: MOEJAX_GROUPED=gpu_kernel: the grouped GEMM kernel is written for Pallas's Triton backend, "
        f"which this jax ({jax.__version__}) does not have; unset MOEJAX_GROUPED to run the XLA path"]
    assert not run.exists()


def test_run_info_records_which_implementation_each_op_ran(monkeypatch):
    """run_info.json names each op's implementation as the run's steps are built (values and speed differ
    between a kernel and its XLA path), so a log says what ran."""
    from moejax.presets import preset
    from moejax.train.run_dir import run_info

    for var, _ in kernel_choice.KERNEL_OPS:
        monkeypatch.delenv(var, raising=False)
    with chosen("MOEJAX_GROUPED", "gpu_kernel"):
        kernels = run_info(preset("tiny"), 1e11)["kernels"]
    assert kernels == {"MOEJAX_ATTENTION": "xla", "MOEJAX_GROUPED": "gpu_kernel", "MOEJAX_NS": "xla",
                       "MOEJAX_GROUPED_ROWS": "xla", "MOEJAX_EP_GROUPED": "xla"}
