"""Dropless grouped GEMM in plain XLA: rows sorted by expert, padded per expert to whole blocks, then
batched block matmuls. Fast on CPU and GPU alike; no dense emulation.

Dimensions (package legend, `moejax/__init__.py`): A rows (assignments, T*K in the MoE layer), E experts
(groups), Z input width, F output width, b rows per block, Bk blocks (a static bound), Pd = Bk*b padded
rows; for the row gathers N rows read, O rows written, I readers per source row.

Why not `jax.lax.ragged_dot`: on CPU and on GPU (jax 0.10/0.11) it lowers to a dense masked matmul per
group, E x the FLOPs and memory (issue 11: 5.7 TFLOP/s at E=64 on an H200, a 96 GB allocation at E=384).
It stays in the tests as the slow reference only (STYLE rule 14).

How: `make_layout` sorts the rows by expert and gives expert e ceil(n_e/b) whole blocks, so every block
belongs to one expert. Since sum_e ceil(n_e/b) <= (A + E(b-1))/b, Bk = (A + E(b-1)) // b blocks always
suffice (static shapes, nothing dropped). Each matmul is then one batched einsum 'nbz,nzf->nbf' against
the block's expert weights w[expert_Bk]. The layout is built once per MoE layer and reused by the gate,
up and down matmuls: the rows are gathered into blocks once and the outputs gathered back once.

Costs: all Bk blocks are computed, padding or not, so the FLOPs are at most (1 + E(b-1)/A) x the useful
ones; `default_block` halves b until E*b <= MAX_PAD_FRACTION * A. The per-block weights w[expert_Bk] are
Bk*Z*F elements, about F/b x the input blocks: a b much smaller than F makes the weight gather, not the
matmul, the cost. Block size trades the two (measurements: docs/LOG.md 2026-11-30).

Backward, two custom_vjps, so that autodiff's choices don't become the cost:
- `block_matmul`: dx = dy w[expert_Bk]^T, and dw = per-block x^T dy accumulated in fp32, then summed over
  the blocks of each expert (`segment_sum` over blocks sorted by expert). Nothing is E x larger than the
  forward: the largest temporary is the [Bk, Z, F] per-block weight gradient. Plain autodiff would keep
  the gathered weights as a residual and sum bf16 block gradients in bf16.
- `gather_rows`: the row gathers into and out of blocks are each other's transposes, so their backward
  is a gather through the other map, not the scatter-add autodiff would emit.

On GPUs the three block matmuls of `block_matmul` (forward, dx, dw) run as the Pallas kernels of
`grouped_gpu` instead (same layout, same values; no weight gather, no [Bk, Z, F] temporary). There the
expert MLP is two matmuls: gate and up as one, against their weights side by side, then the down projection
of the SwiGLU activation, with the activation's derivative in its dx kernel's epilogue (`_swiglu_down`).
MOEJAX_GROUPED=xla|gpu_kernel chooses explicitly (`kernel_choice`). With the kernels on, blocks
are at least 16 rows; widths that aren't multiples of 16 are a one-line error, not a silent fall back.

Row maps (`row_maps`, MOEJAX_GROUPED_ROWS=gpu_kernel, opt-in): the layout's gathers into blocks and back
done by the kernels themselves. The gate/up kernel reads the tokens' rows through the map (a gathered load)
and the down projection writes the assignment rows (a scattered store); in the backward the dx_act and dw
kernels read dy's rows the same way and gate/up's dx writes one row per assignment, which XLA sums over the
K choices of each token in fp32. No [Pd, Z] block copy of x, y, dy or dx is made: at shape G, 0.8-1.6 GB of
HBM traffic a layer by the compiled step's roofline, and in the bench's single grouped GEMM 2.1 GB, ~0.65 ms
beside ~1.2 ms of kernels on an H200 (docs/LOG.md 2026-12-04). Not yet timed on a GPU, so off by default
(`bench/bench_gpu.py --paths local,local-rows`, `bench/bench_grouped.py`'s "rows in the kernels" rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moejax.config import ConfigError
from moejax.model import kernel_choice
from moejax.model.kernel_choice import EP_GROUPED, GROUPED, GROUPED_ROWS, kernel_impl
from moejax.model.layers import pytree_dataclass, swiglu_act
from moejax.model.moe import grouped_gpu

# Rows per block, the largest the default picks. Measured on 2 CPU cores, fp32, fwd+bwd of one grouped GEMM
# (bench/bench_grouped.py, docs/LOG.md 2026-11-30): at A=16,384, Z=F=256, E=32, b=128 beat 64 by 1.8x and
# 256 by 6%. Two costs pull apart: every one of the Bk static blocks is computed, so padding (up to E*b
# rows) costs FLOPs, while each block costs a Z*F weight gather and a Z*F fp32 weight gradient whatever
# its rows, which on CPU weighs about as much as ~100 rows at Z=F=256. On a GPU the per-block memory
# traffic weighs more against the matmuls, so larger blocks may win there (bench it: --block-sizes).
BLOCK_SIZE = 128
# The default block is halved (down to MIN_BLOCK) until the worst-case padding E*b is at most this fraction
# of the rows, so that small inputs (eval batches, E=384 with few tokens) don't mostly multiply zeros.
# At E=128, A=16,384 (same bench) b=64 (padding <= 50%) ran 1.34x faster than b=32 (<= 25%) and within
# 7% of b=128 (<= 100%).
MAX_PAD_FRACTION = 0.5
MIN_BLOCK = 8


@pytree_dataclass
class BlockLayout:
    """Where each row goes. Pd = Bk*b; the block size b is Pd // Bk (static, from the shapes)."""

    row_Pd: Int[Array, "Pd"]  # source row of each padded row; A (out of range) marks padding
    slot_A: Int[Array, "A"]  # padded row of each source row
    expert_Bk: Int[Array, "Bk"]  # expert of each block, ascending (unused tail blocks repeat E-1)
    blocks_E: Int[Array, "E"]  # blocks holding each expert's rows (they come first; the tail follows)

    @property
    def n_blocks(self) -> int:
        return self.expert_Bk.shape[0]

    @property
    def block(self) -> int:
        return self.row_Pd.shape[0] // self.expert_Bk.shape[0]


def default_block(n_rows: int, n_experts: int, min_block: int = MIN_BLOCK) -> int:
    """BLOCK_SIZE, halved (down to min_block) while the worst-case padding E*b exceeds MAX_PAD_FRACTION of
    the rows."""
    b = BLOCK_SIZE
    while b > min_block and n_experts * b > MAX_PAD_FRACTION * n_rows:
        b //= 2
    return b


def _kernel_chosen() -> bool:
    return kernel_impl(*GROUPED) == "gpu_kernel"


def _rows_in_kernels() -> bool:
    """The GPU kernels read and write the rows in place (MOEJAX_GROUPED_ROWS, opt-in), not in XLA's blocks."""
    return _kernel_chosen() and kernel_impl(*GROUPED_ROWS) == "gpu_kernel"


def make_layout(expert_A: Int[Array, "A"], n_experts: int, block_size: int | None = None,
                presorted: bool = False) -> BlockLayout:
    """Sort rows by expert (stable: source order inside an expert) and pad each expert to whole blocks of
    block_size rows (None: `default_block`, no smaller than the GPU kernels' minimum when they run).
    presorted: the rows already come in ascending expert order (as `jax.lax.ragged_dot` takes them), so the
    sort is skipped; unsorted ids then give a wrong layout, unchecked."""
    (n_rows,) = expert_A.shape
    b = block_size or default_block(n_rows, n_experts, grouped_gpu.MIN_TILE if _kernel_chosen() else MIN_BLOCK)
    n_blocks = max(1, (n_rows + n_experts * (b - 1)) // b)
    # sorted position -> source row
    order_A = jnp.arange(n_rows, dtype=jnp.int32) if presorted else jnp.argsort(expert_A, stable=True)
    expert_sorted_A = expert_A[order_A]
    count_E = jnp.bincount(expert_A, length=n_experts).astype(jnp.int32)
    padded_E = (count_E + b - 1) // b * b
    start_E = jnp.cumsum(count_E) - count_E
    padded_end_E = jnp.cumsum(padded_E)
    padded_start_E = padded_end_E - padded_E
    dst_A = padded_start_E[expert_sorted_A] + jnp.arange(n_rows, dtype=jnp.int32) - start_E[expert_sorted_A]
    slot_A = jnp.zeros((n_rows,), jnp.int32).at[order_A].set(dst_A, unique_indices=True)
    row_Pd = jnp.full((n_blocks * b,), n_rows, jnp.int32).at[dst_A].set(order_A.astype(jnp.int32),
                                                                         unique_indices=True)
    block_start_Bk = jnp.arange(n_blocks, dtype=jnp.int32) * b
    # Unrolled binary search (log2 E steps): the default method is a fori_loop, which on a GPU is a device
    # while loop run twice per layer (forward and remat), each iteration a kernel launch and a host round
    # trip for its predicate (seen in the compiled H200 step, docs/LOG.md 2026-12-03, seventeenth session).
    expert_Bk = jnp.searchsorted(padded_end_E, block_start_Bk, side="right", method="scan_unrolled").astype(jnp.int32)
    return BlockLayout(row_Pd=row_Pd, slot_A=slot_A, expert_Bk=jnp.minimum(expert_Bk, n_experts - 1),
                       blocks_E=padded_E // b)


@jax.custom_vjp
def gather_rows(x_NZ: Float[Array, "N Z"], take_O: Int[Array, "O"], back_NI: Int[Array, "N I"]) -> Float[Array, "O Z"]:
    """y[r] = x[take_O[r]] (0 where out of range). back_NI must list, for each source row s, the K output
    rows that read it (out of range where fewer): then the backward is a gather too, not a scatter-add,
    which XLA runs as a serial loop on CPU and with atomics on GPU."""
    return jnp.take(x_NZ, take_O, axis=0, mode="fill", fill_value=0)


def _gather_rows_fwd(x_NZ, take_O, back_NI):
    return gather_rows(x_NZ, take_O, back_NI), back_NI


def _gather_rows_bwd(back_NI, dy_OZ):
    dx_NIZ = jnp.take(dy_OZ, back_NI, axis=0, mode="fill", fill_value=0)
    return dx_NIZ.sum(axis=1), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def to_blocks(x_NZ: Float[Array, "N Z"], layout: BlockLayout, rows_per_source: int = 1) -> Float[Array, "Bk b Z"]:
    """Gather rows into blocks; padding rows are zero. Source row s feeds rows s*K .. s*K+K-1 (K =
    rows_per_source), so the MoE layer gathers tokens directly, without a [T*K, Z] copy first."""
    back_NI = layout.slot_A.reshape(-1, rows_per_source)
    # Padding rows hold row A, so A // K = S is out of range and reads 0.
    x_PdZ = gather_rows(x_NZ, layout.row_Pd // rows_per_source, back_NI)
    return x_PdZ.reshape(layout.n_blocks, layout.block, x_NZ.shape[-1])


def from_blocks(y_BkbZ: Float[Array, "Bk b Z"], layout: BlockLayout) -> Float[Array, "A Z"]:
    """Gather the outputs back into source row order (padding rows are never read)."""
    return gather_rows(y_BkbZ.reshape(-1, y_BkbZ.shape[-1]), layout.slot_A, layout.row_Pd[:, None])


def _kernel(block: int, w_EZF) -> dict | None:
    """Keyword arguments for the `grouped_gpu` kernels when they run this matmul (MOEJAX_GROUPED, by the
    `kernel_choice` rule) on blocks of `block` rows, else None."""
    return _kernel_args(block, w_EZF, GROUPED[0]) if _kernel_chosen() else None


def _kernel_args(block: int, w_EZF, env_var: str) -> dict:
    """Keyword arguments for the `grouped_gpu` kernels on blocks of `block` rows, chosen by `env_var`. Off GPU they
    run interpreted. A shape they can't take is an error naming `env_var`, not a quiet fall back to the einsums."""
    problem = grouped_gpu.shape_problem(block, *w_EZF.shape[1:])
    if problem:
        raise ConfigError(f"the grouped-GEMM GPU kernel can't take this model: {problem} (latent_width and "
                          f"expert_width must be multiples of {grouped_gpu.MIN_TILE}); set {env_var}=xla")
    return dict(interpret=kernel_choice.run_interpreted())


@jax.custom_vjp
def block_matmul(x_BkbZ: Float[Array, "Bk b Z"], w_EZF: Float[Array, "E Z F"], expert_Bk: Int[Array, "Bk"],
                 blocks_E: Int[Array, "E"]) -> Float[Array, "Bk b F"]:
    """y[n] = x[n] @ w[expert_Bk[n]] for every block n whose rows are real; padding rows and the layout's
    tail blocks must hold zeros (as `to_blocks` and its backward give them): the GPU kernels skip the tail,
    which the einsums compute. blocks_E: the layout's, read by the GPU kernels."""
    kernel = _kernel(x_BkbZ.shape[1], w_EZF)
    if kernel is not None:
        return grouped_gpu.matmul(x_BkbZ, w_EZF, expert_Bk, blocks_E, **kernel)
    return jnp.einsum("nbz,nzf->nbf", x_BkbZ, w_EZF[expert_Bk])


def _block_matmul_fwd(x_BkbZ, w_EZF, expert_Bk, blocks_E):
    # Residuals are the inputs, not the gathered [Bk, Z, F] weights (re-gathered in the backward).
    return block_matmul(x_BkbZ, w_EZF, expert_Bk, blocks_E), (x_BkbZ, w_EZF, expert_Bk, blocks_E)


def _block_matmul_bwd(res, dy_BkbF):
    x_BkbZ, w_EZF, expert_Bk, blocks_E = res
    kernel = _kernel(x_BkbZ.shape[1], w_EZF)
    if kernel is not None:
        dx_BkbZ = grouped_gpu.matmul_dx(dy_BkbF, w_EZF, expert_Bk, blocks_E, **kernel).astype(x_BkbZ.dtype)
        dw_EZF = grouped_gpu.matmul_dw(x_BkbZ, dy_BkbF, blocks_E, **kernel, out_dtype=w_EZF.dtype)
        return dx_BkbZ, dw_EZF, None, None
    dx_BkbZ = jnp.einsum("nbf,nzf->nbz", dy_BkbF, w_EZF[expert_Bk]).astype(x_BkbZ.dtype)  # as the kernels'
    dw_BkZF = jnp.einsum("nbz,nbf->nzf", x_BkbZ, dy_BkbF, preferred_element_type=jnp.float32)
    dw_EZF = jax.ops.segment_sum(dw_BkZF, expert_Bk, num_segments=w_EZF.shape[0], indices_are_sorted=True)
    return dx_BkbZ, dw_EZF.astype(w_EZF.dtype), None, None


block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


def swiglu_blocks(x_BkbZ: Float[Array, "Bk b Z"], layout: BlockLayout, w_gate_EZF: Float[Array, "E Z F"],
                  w_up_EZF: Float[Array, "E Z F"], w_down_EFZ: Float[Array, "E F Z"]) -> Float[Array, "Bk b Z"]:
    """SwiGLU per block with its expert's weights: W2 (silu(x Wg) * (x Wu)). Zero rows stay zero. On the
    GPU kernels the activation's derivative lives inside the down projection's dx kernel (`_swiglu_down`)."""
    mm = lambda x, w: block_matmul(x, w, layout.expert_Bk, layout.blocks_E)
    kernel = _kernel(x_BkbZ.shape[1], w_gate_EZF)  # the down projection has the same two widths
    if kernel is None:
        return mm(swiglu_act(mm(x_BkbZ, w_gate_EZF), mm(x_BkbZ, w_up_EZF)), w_down_EFZ)
    # One matmul against gate and up side by side: x read once, one dx kernel for both (the concatenate's
    # transpose splits the weight gradient back).
    n_blocks, b, _ = x_BkbZ.shape
    gu_Bkb2F = mm(x_BkbZ, jnp.concatenate([w_gate_EZF, w_up_EZF], axis=-1)).reshape(n_blocks, b, 2, -1)
    return _swiglu_down(gu_Bkb2F, w_down_EFZ, layout.expert_Bk, layout.blocks_E, kernel["interpret"])


def _activation(gu_Bkb2F: Float[Array, "Bk b 2 F"]) -> Float[Array, "Bk b F"]:
    """silu(gate) * up from gu's halves, in fp32, rounded once to gu's dtype (one XLA elementwise pass)."""
    g, u = gu_Bkb2F[:, :, 0].astype(jnp.float32), gu_Bkb2F[:, :, 1].astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * u).astype(gu_Bkb2F.dtype)


def _swiglu_down(gu_Bkb2F, w_EFZ, expert_Bk, blocks_E, interpret: bool):
    """block_matmul(swiglu_act(g, u), w), (g, u) the halves of gu, on the kernels (`_swiglu_down_to` blocks)."""
    return _swiglu_down_to(gu_Bkb2F, w_EFZ, expert_Bk, blocks_E, None, 0, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _swiglu_down_to(gu_Bkb2F, w_EFZ, expert_Bk, blocks_E, dst_Pd, n_out: int, interpret: bool):
    """block_matmul(swiglu_act(g, u), w), (g, u) the halves of gu, on the kernels: the activation made by XLA
    for the plain forward and weight-gradient kernels (remade for the latter, not kept: a residual of
    [Bk, b, F] a layer saved), its derivative in dx's epilogue (`grouped_gpu.matmul_dx_act`), so dh is never
    stored. The composition's values up to where bf16 rounds: the activation once from fp32, dh not at all.
    dst_Pd None: the result in blocks; else written straight to the [n_out, Z] rows dst_Pd maps to, and the
    backward reads dy's rows through the same map (the dx and dw kernels' gathered loads)."""
    return grouped_gpu.matmul(_activation(gu_Bkb2F), w_EFZ, expert_Bk, blocks_E, interpret=interpret,
                              rows_out=dst_Pd, n_out=n_out)


def _swiglu_down_to_fwd(gu_Bkb2F, w_EFZ, expert_Bk, blocks_E, dst_Pd, n_out, interpret):
    y = _swiglu_down_to(gu_Bkb2F, w_EFZ, expert_Bk, blocks_E, dst_Pd, n_out, interpret)
    return y, (gu_Bkb2F, w_EFZ, expert_Bk, blocks_E, dst_Pd)


def _swiglu_down_to_bwd(n_out, interpret, res, dy):
    gu_Bkb2F, w_EFZ, expert_Bk, blocks_E, dst_Pd = res
    dgu_Bkb2F = grouped_gpu.matmul_dx_act(dy, w_EFZ, gu_Bkb2F, expert_Bk, blocks_E, interpret=interpret,
                                          dy_rows=dst_Pd)
    dw_EFZ = grouped_gpu.matmul_dw(_activation(gu_Bkb2F), dy, blocks_E, interpret=interpret,
                                   out_dtype=w_EFZ.dtype, dy_rows=dst_Pd)
    return dgu_Bkb2F, dw_EFZ, None, None, None


_swiglu_down_to.defvjp(_swiglu_down_to_fwd, _swiglu_down_to_bwd)


def row_maps(layout: BlockLayout, rows_per_source: int = 1) -> tuple[Int[Array, "Pd"], Int[Array, "Pd"]]:
    """The layout as the kernels' row maps (`grouped_gpu`), -1 on padding rows: (source row each padded row
    reads, as `to_blocks` gathers it: row // rows_per_source; the row each writes, as `from_blocks` reads it)."""
    real_Pd = layout.row_Pd < layout.slot_A.shape[0]
    return (jnp.where(real_Pd, layout.row_Pd // rows_per_source, -1).astype(jnp.int32),
            jnp.where(real_Pd, layout.row_Pd, -1).astype(jnp.int32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _rows_matmul(x_NZ, w_EZF, src_Pd, dst_Pd, expert_Bk, blocks_E, rows_per_source: int, out_rows: bool,
                 interpret: bool):
    """`block_matmul` on the kernels with the row gathers inside them: block rows read x_NZ's rows through
    src_Pd; the result is blocks, or (out_rows) the [A, F] rows dst_Pd maps to, A = N * rows_per_source."""
    n_out = x_NZ.shape[0] * rows_per_source
    return grouped_gpu.matmul(x_NZ, w_EZF, expert_Bk, blocks_E, interpret=interpret, rows_in=src_Pd,
                              rows_out=dst_Pd if out_rows else None, n_out=n_out)


def _rows_matmul_fwd(x_NZ, w_EZF, src_Pd, dst_Pd, expert_Bk, blocks_E, rows_per_source, out_rows, interpret):
    y = _rows_matmul(x_NZ, w_EZF, src_Pd, dst_Pd, expert_Bk, blocks_E, rows_per_source, out_rows, interpret)
    return y, (x_NZ, w_EZF, src_Pd, dst_Pd, expert_Bk, blocks_E)


def _rows_matmul_bwd(rows_per_source, out_rows, interpret, res, dy):
    x_NZ, w_EZF, src_Pd, dst_Pd, expert_Bk, blocks_E = res
    n_src, z = x_NZ.shape
    dy_rows = dst_Pd if out_rows else None  # dy is [A, F] rows, or blocks
    dx_AZ = grouped_gpu.matmul_dx(dy, w_EZF, expert_Bk, blocks_E, interpret=interpret, rows_in=dy_rows,
                                  rows_out=dst_Pd, n_out=n_src * rows_per_source)
    # each source row's K reads summed in fp32 (as its K rows are one token's K expert choices)
    dx_NZ = dx_AZ.astype(jnp.float32).reshape(n_src, rows_per_source, z).sum(axis=1).astype(x_NZ.dtype)
    dw_EZF = grouped_gpu.matmul_dw(x_NZ, dy, blocks_E, interpret=interpret, out_dtype=w_EZF.dtype, x_rows=src_Pd,
                                   dy_rows=dy_rows, block=src_Pd.shape[0] // expert_Bk.shape[0])
    return dx_NZ, dw_EZF, None, None, None, None


_rows_matmul.defvjp(_rows_matmul_fwd, _rows_matmul_bwd)


def swiglu_rows(x_NZ: Float[Array, "N Z"], layout: BlockLayout, w_gate_EZF: Float[Array, "E Z F"],
                w_up_EZF: Float[Array, "E Z F"], w_down_EFZ: Float[Array, "E F Z"],
                rows_per_source: int = 1) -> Float[Array, "A Z"]:
    """The grouped SwiGLU from source rows to assignment rows: row a = s*K + k (K = rows_per_source) is
    expert e_a's SwiGLU of source row s, in `layout`'s order of experts. By XLA's gathers into blocks and back
    around `swiglu_blocks`, or (MOEJAX_GROUPED_ROWS=gpu_kernel, with the GPU kernels) inside the kernels:
    the gate/up kernel reads the source rows in place, the down projection writes the assignment rows, and
    their backward kernels read and write rows the same way, so no [Pd, Z] block copy of x, y or their
    gradients is made."""
    if x_NZ.shape[0] == 0:  # no rows: nothing to gather (a take from an empty axis is an error)
        return jnp.zeros((0, w_down_EFZ.shape[-1]), x_NZ.dtype)
    if not _rows_in_kernels():
        x_BkbZ = to_blocks(x_NZ, layout, rows_per_source)
        return from_blocks(swiglu_blocks(x_BkbZ, layout, w_gate_EZF, w_up_EZF, w_down_EFZ), layout)
    interpret = _kernel(layout.block, w_gate_EZF)["interpret"]
    return _swiglu_in_kernels(x_NZ, layout, w_gate_EZF, w_up_EZF, w_down_EFZ, rows_per_source, interpret)


def _swiglu_in_kernels(x_NZ: Float[Array, "N Z"], layout: BlockLayout, w_gate_EZF, w_up_EZF, w_down_EFZ,
                       rows_per_source: int, interpret: bool) -> Float[Array, "A Z"]:
    """`swiglu_rows` on the GPU kernels with the rows read and written in place (row maps): gate and up as one
    matmul of the source rows, then the down projection of the activation written to the assignment rows."""
    src_Pd, dst_Pd = row_maps(layout, rows_per_source)
    e, c = layout.expert_Bk, layout.blocks_E
    gu_Bkb2F = _rows_matmul(x_NZ, jnp.concatenate([w_gate_EZF, w_up_EZF], axis=-1), src_Pd, dst_Pd, e, c,
                            rows_per_source, False, interpret)
    gu_Bkb2F = gu_Bkb2F.reshape(layout.n_blocks, layout.block, 2, -1)
    return _swiglu_down_to(gu_Bkb2F, w_down_EFZ, e, c, dst_Pd, layout.slot_A.shape[0], interpret)


def skipping_layout(expert_N: Int[Array, "N"], n_experts: int, block_size: int | None = None) -> BlockLayout:
    """`make_layout` for rows of which some are to be skipped: expert_N[n] == n_experts (one past the last)
    marks row n as no expert's. Those rows sort after every expert's blocks, into blocks the layout counts as
    its unused tail (blocks_E covers the real experts only), which the GPU kernels don't compute but still
    store, as zeros, through the row maps: so a skipped row's result (and, in the backward, its input
    gradient) is exactly 0, with no extra pass. For the kernels only: XLA's block einsums compute the tail."""
    b = block_size or default_block(expert_N.shape[0], n_experts + 1, grouped_gpu.MIN_TILE)
    lay = make_layout(expert_N, n_experts + 1, b)
    return BlockLayout(row_Pd=lay.row_Pd, slot_A=lay.slot_A, expert_Bk=jnp.minimum(lay.expert_Bk, n_experts - 1),
                       blocks_E=lay.blocks_E[:n_experts])


def swiglu_kept_rows(x_NZ: Float[Array, "N Z"], expert_N: Int[Array, "N"], w_gate_EZF: Float[Array, "E Z F"],
                     w_up_EZF: Float[Array, "E Z F"], w_down_EFZ: Float[Array, "E F Z"],
                     block_size: int | None = None) -> Float[Array, "N Z"]:
    """Row n's SwiGLU with the weights of expert expert_N[n], or 0 where expert_N[n] == E (no expert's), on the
    GPU kernels (interpreted off GPU) with the rows read and written in place (`skipping_layout`). The
    expert-parallel transport's expert compute (MOEJAX_EP_GROUPED): its received rows straight from the
    all-to-all's buffer, computing only the rows it keeps, where batched einsums over [E, R, Z] capacity
    buffers compute every slot, empty or not (at cf_recv 1.15 about 13% of them on balanced loads), between
    a gather into the buffers and one back."""
    if x_NZ.shape[0] == 0:
        return jnp.zeros((0, w_down_EFZ.shape[-1]), x_NZ.dtype)
    layout = skipping_layout(expert_N, w_gate_EZF.shape[0], block_size)
    interpret = _kernel_args(layout.block, w_gate_EZF, EP_GROUPED[0])["interpret"]
    return _swiglu_in_kernels(x_NZ, layout, w_gate_EZF, w_up_EZF, w_down_EFZ, 1, interpret)


def grouped_matmul(x_AZ: Float[Array, "A Z"], expert_A: Int[Array, "A"], w_EZF: Float[Array, "E Z F"],
                   block_size: int | None = None, presorted: bool = False) -> Float[Array, "A F"]:
    """y[a] = x[a] @ w[expert_A[a]], rows in any order (one grouped GEMM, as `jax.lax.ragged_dot` but unsorted;
    `presorted` as `make_layout`: rows already in expert order skip the sort): layout, gathers into blocks,
    `block_matmul`, gather back; with MOEJAX_GROUPED_ROWS=gpu_kernel the gathers happen inside the kernels."""
    if x_AZ.shape[0] == 0:  # as `swiglu_rows`
        return jnp.zeros((0, w_EZF.shape[-1]), x_AZ.dtype)
    layout = make_layout(expert_A, w_EZF.shape[0], block_size, presorted)
    e, c = layout.expert_Bk, layout.blocks_E
    if not _rows_in_kernels():
        return from_blocks(block_matmul(to_blocks(x_AZ, layout), w_EZF, e, c), layout)
    interpret = _kernel(layout.block, w_EZF)["interpret"]
    src_Pd, dst_Pd = row_maps(layout)
    return _rows_matmul(x_AZ, w_EZF, src_Pd, dst_Pd, e, c, 1, True, interpret)


def grouped_swiglu(x_AZ: Float[Array, "A Z"], expert_A: Int[Array, "A"], w_gate_EZF, w_up_EZF, w_down_EFZ,
                   block_size: int | None = None) -> Float[Array, "A Z"]:
    """SwiGLU of row a with the weights of expert expert_A[a] (rows in any order)."""
    return swiglu_rows(x_AZ, make_layout(expert_A, w_gate_EZF.shape[0], block_size), w_gate_EZF, w_up_EZF,
                       w_down_EFZ)
