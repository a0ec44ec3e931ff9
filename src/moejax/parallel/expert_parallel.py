"""The pooled-wave fixed-capacity expert-parallel transport (SPEC §3) — the launch EP backend.

Dimensions (the package legend, `moejax/__init__.py`): T tokens (local to a shard inside `shard_map`),
K choices, A = T*K assignments, Z latent width, F expert width, E experts, X shards on the `expert` axis,
E_loc = E/X local experts, W waves, P sender pool rows per destination per wave, Md header digits per slot,
M = ceil(Md*P/Z) header rows, Y = M + P rows of one destination's block, R receiver capacity per local expert per wave,
ER = E_loc*R expert slots, N = W*X*P send rows (X*P per wave).

Per shard (one `shard_map` over the whole mesh; all_to_all over `expert` only, so every (replica_dcn,
data) group runs its own exchange):
1. Sender: rank each valid assignment among those bound for the same destination shard, token-major then
   choice order; wave = rank % W, slot = rank // W (round-robin striping); slot >= P is a sender drop.
   Send rows are *gathered* from the tokens through the plan (no scatter).
2. Each destination's block is [M + P, Z]: M header rows carry slot -> local expert + 1 (0 = empty) in the
   activation dtype, so ids ride in the same all_to_all as the payload (no metadata collective). Each id is
   Md base-256 digits, every one an integer bf16 holds exactly (`header_digits`: Md = 1 up to 255 local
   experts, as on the hero's 6; Md = 2 beyond, e.g. the d1024 rung's 384 experts on one GPU).
3. Receiver: decode ids, rank rows per local expert in interleaved order (slot p of every source before
   slot p+1 of any) so overflow is spread evenly over senders; inside a slot the source order starts at
   (slot + wave + receiving shard) % X, so ties at the cut-off do not always go against the same
   sender (SPEC §6). Rank >= R is a receiver drop. Compact to
   [E_loc, R, Z], run the expert MLPs (rematerialised per wave), expand back (or, MOEJAX_EP_GROUPED, run them
   on the grouped kernels straight from the received rows, kept rows only). The return block again has
   M header rows, carrying the receiver's kept flag per slot: the sender learns exactly which rows were
   dropped (for the per-assignment keep mask); dropped rows come back as zeros.
4. Combine: y[t] = sum_k w[t,k] * returned[row(t,k)] in fp32; each assignment lives in one wave, so the
   single combine over all waves' rows is the sum over waves.

Notable choices:
- Backward has no scatter: every movement is a gather with a known inverse (`transport_ops`).
- P is capped at ceil(A/W) and R at X*P (more rows than can ever arrive); the caps change no result, only
  buffer sizes, and never bind at production capacity factors (hero: P = 3,141, R = 33,497).
- SPEC §3 asks to refuse a header bf16 can't hold exactly, or to encode it safely: digits encode it safely,
  so no expert count is refused. The return block's header carries its kept flags with the same Md digits, so
  both directions move blocks of one shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Bool, Float, Int

from moejax.model.kernel_choice import EP_GROUPED, kernel_impl, vma_checked
from moejax.model.moe.experts import expert_mlp_batched
from moejax.model.moe.grouped import swiglu_kept_rows
from moejax.model.moe.layer import SAVE_DISPATCH, SAVE_RETURN, DropStats
from moejax.parallel.mesh import BATCH_AXES, BATCH_SPEC, EXPERT_AXIS, EXPERTS_SPEC, REPLICATED, batch_shards
from moejax.parallel.transport_ops import combine_rows, gather_rows, rank_in_groups

# Per-assignment transport outcome (debug output `status_TK`).
PADDING, KEPT, SENDER_DROPPED, RECEIVER_DROPPED = 0, 1, 2, 3


def _ceil(x: float) -> int:
    return math.ceil(round(x, 6))  # 1.15 * A / 192 must not become n + 1e-12 when it is exactly n


@dataclass(frozen=True)
class TransportSizes:
    """Static buffer sizes of one MoE layer's transport on one shard (SPEC §3.1)."""

    assignments: int  # A = tokens per shard * K
    send_pool: int  # P, rows per destination per wave
    recv_capacity: int  # R, rows per local expert per wave
    header_rows: int  # M = ceil(Md * P / Z)
    header_digits: int  # Md, base-HEADER_BASE digits per header value (`header_digits`)
    rows_per_wave: int  # X * (M + P) = X * Y, rows one shard sends (and receives) per wave and direction
    bytes_per_wave: int  # rows_per_wave * Z * dtype bytes, one direction
    expert_rows_per_wave: int  # E_loc * R, rows through the expert MLPs per wave


# Header values are written in digits of this base: every integer up to 256 is exact in bf16 (8 significand
# bits), the narrowest activation dtype, and wider ones hold more; digits are 0 .. 255.
HEADER_BASE = 256


def header_digits(local_experts: int) -> int:
    """Md, the base-256 digits a header value needs: values run to E_loc (local expert + 1; 0 = empty)."""
    digits = 1
    while HEADER_BASE ** digits <= local_experts:
        digits += 1
    return digits


def transport_sizes(tokens_per_device: int, top_k: int, n_shards: int, local_experts: int, waves: int,
                    cf_send: float, cf_recv: float, latent_width: int, dtype_bytes: int) -> TransportSizes:
    """P = ceil(cf_send*A/(X*W)), R = ceil(cf_recv*A/(E_loc*W)), capped where larger buffers cannot fill, and
    at least one row each (a tiny capacity factor rounded them to 0 buffers, an error deep in the transport)."""
    a = tokens_per_device * top_k
    p = max(1, min(_ceil(cf_send * a / (n_shards * waves)), -(-a // waves)))
    r = max(1, min(_ceil(cf_recv * a / (local_experts * waves)), n_shards * p))
    digits = header_digits(local_experts)
    m = -(-digits * p // latent_width)
    rows = n_shards * (m + p)
    return TransportSizes(a, p, r, m, digits, rows, rows * latent_width * dtype_bytes, local_experts * r)


# ---- header rows -----------------------------------------------------------------------------------
def _encode_header(values_XP: Int[Array, "X P"], sizes: TransportSizes, width: int, dtype) -> Array:
    """[X, M, Z] header rows: each value as Md base-256 digits, least significant first, then zero padding."""
    n_src, m = values_XP.shape[0], sizes.header_rows
    digits_XPMd = jnp.stack([values_XP // HEADER_BASE ** i % HEADER_BASE for i in range(sizes.header_digits)], -1)
    flat = digits_XPMd.reshape(n_src, -1)
    return jnp.pad(flat, ((0, 0), (0, m * width - flat.shape[1]))).astype(dtype).reshape(n_src, m, width)


def _decode_header(header_XMZ: Array, sizes: TransportSizes) -> Int[Array, "X P"]:
    pool, n_digits = sizes.send_pool, sizes.header_digits
    flat = header_XMZ.reshape(header_XMZ.shape[0], -1)[:, :pool * n_digits]
    digits_XPMd = jnp.round(flat.astype(jnp.float32)).astype(jnp.int32).reshape(-1, pool, n_digits)
    return sum(digits_XPMd[..., i] * HEADER_BASE ** i for i in range(n_digits))


# ---- plans (integer bookkeeping, no gradients) -----------------------------------------------------
def materialized(plan):
    """The plan's index maps as arrays in memory. Without the barrier XLA fuses their arithmetic (header
    decode, ranks, chains of integer gathers) into every [rows, Z] gather that reads them and recomputes it
    per element: on an H200 the capacity path's fused backward of the three waves' returns took 3.1 ms a
    layer (37 ms of a 316 ms step at issue 11's shape G) for ~0.6 GB of traffic."""
    return jax.lax.optimization_barrier(plan)


class SenderPlan(NamedTuple):
    row_token_N: Int[Array, "N"]  # token feeding send row n = (wave, dest, slot)
    row_assign_N: Int[Array, "N"]  # its assignment t*K + k
    row_valid_N: Bool[Array, "N"]
    ids_WXP: Int[Array, "W X P"]  # header values: local expert + 1, 0 = empty
    assign_row_TK: Int[Array, "T K"]  # send row of each assignment
    assign_sent_TK: Bool[Array, "T K"]
    sender_dropped_TK: Bool[Array, "T K"]


def _sender_plan(expert_TK, mask_T, n_shards: int, local_experts: int, waves: int, pool: int) -> SenderPlan:
    n_tok, k = expert_TK.shape
    expert_A = expert_TK.reshape(-1).astype(jnp.int32)
    valid_A = jnp.repeat(mask_T, k)
    dest_A, local_A = expert_A // local_experts, expert_A % local_experts
    groups = rank_in_groups(jnp.where(valid_A, dest_A, n_shards), n_shards)  # flat order = token-major
    wave_A, slot_A = groups.rank_N % waves, groups.rank_N // waves
    sent_A = valid_A & (slot_A < pool)
    assign_row_A = jnp.where(sent_A, (wave_A * n_shards + dest_A) * pool + slot_A, 0)
    # Inverse map: send row (w, s, p) holds the (p*W + w)-th assignment bound for shard s.
    w_WXP, s_WXP, p_WXP = jnp.meshgrid(jnp.arange(waves), jnp.arange(n_shards), jnp.arange(pool), indexing="ij")
    assign_WXP, valid_WXP = groups.member(s_WXP, p_WXP * waves + w_WXP)
    ids_WXP = jnp.where(valid_WXP, jnp.take(local_A, assign_WXP) + 1, 0)
    assign_N = assign_WXP.reshape(-1)
    return SenderPlan(assign_N // k, assign_N, valid_WXP.reshape(-1), ids_WXP,
                      assign_row_A.reshape(n_tok, k), sent_A.reshape(n_tok, k),
                      (valid_A & ~sent_A).reshape(n_tok, k))


class ReceiverPlan(NamedTuple):
    slot_row_ER: Int[Array, "ER"]  # received row (s*P + p) feeding expert slot c = e*R + r
    slot_valid_ER: Bool[Array, "ER"]
    row_slot_N: Int[Array, "N"]  # expert slot of received row n = s*P + p
    row_kept_N: Bool[Array, "N"]
    dropped: Int[Array, ""]


def _receiver_plan(ids_XP: Int[Array, "X P"], local_experts: int, capacity: int, rotation) -> ReceiverPlan:
    """Rank received rows per local expert in interleaved order j = p*X + i: slot p of every source before
    slot p+1 of any. Inside slot p the i-th source is (i + p + rotation) % X, so the sources that lose a
    tie at the capacity cut-off change with the slot, the wave and the receiving shard."""
    n_src, pool = ids_XP.shape
    slot_N, i_N = jnp.divmod(jnp.arange(pool * n_src), n_src)
    src_at_pos_N = (i_N + slot_N + rotation) % n_src
    row_at_pos_N = src_at_pos_N * pool + slot_N  # received row (s*P + p) at interleaved position j
    ids_at_pos_N = jnp.take(ids_XP.reshape(-1), row_at_pos_N)
    groups = rank_in_groups(jnp.where(ids_at_pos_N > 0, ids_at_pos_N - 1, local_experts), local_experts)
    kept_at_pos_N = (ids_at_pos_N > 0) & (groups.rank_N < capacity)
    e_ER, r_ER = jnp.divmod(jnp.arange(local_experts * capacity), capacity)
    pos_ER, slot_valid_ER = groups.member(e_ER, r_ER)
    slot_row_ER = jnp.take(row_at_pos_N, pos_ER)
    # Back to received-row order through the inverse of the (static) interleaving permutation.
    pos_of_row_N = jnp.argsort(row_at_pos_N)
    kept_N = jnp.take(kept_at_pos_N, pos_of_row_N)
    row_slot_N = jnp.where(kept_N, jnp.take((ids_at_pos_N - 1) * capacity + groups.rank_N, pos_of_row_N), 0)
    dropped = jnp.sum((ids_at_pos_N > 0) & ~kept_at_pos_N, dtype=jnp.int32)
    return ReceiverPlan(slot_row_ER, slot_valid_ER, row_slot_N, kept_N, dropped)


# ---- one wave: exchange, expert compute, return ----------------------------------------------------
def _unvarying(x, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes among `axes` over which x does not vary (inside a checked shard_map)."""
    return tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)


def _expert_compute(payload_NZ: Float[Array, "N Z"], plan: ReceiverPlan, w_gate_EZF, w_up_EZF, w_down_EFZ,
                    cap: int) -> Float[Array, "N Z"]:
    """Each kept received row's SwiGLU with its local expert's weights, in received-row order; 0 for the rows
    not kept (empty or dropped). Rematerialised in the backward pass from what is kept per wave.
    - Default: gather the kept rows into [E_loc, R, Z] capacity buffers, batched einsums over every slot (empty
      ones too), gather back. Only the buffers (and the weights) are kept.
    - MOEJAX_EP_GROUPED=gpu_kernel (opt-in until a GPU has timed it): the grouped GEMM kernels read the received
      rows in place and compute only the kept ones (`grouped.swiglu_kept_rows`); only the received block
      (kept anyway) and the rows' expert ids are kept, the row layout is rebuilt in the backward. Same values up
      to the summation order."""
    local_experts = w_gate_EZF.shape[0]
    if kernel_impl(*EP_GROUPED) == "gpu_kernel":
        expert_N = jnp.where(plan.row_kept_N, plan.row_slot_N // cap, local_experts).astype(jnp.int32)
        ws = (w_gate_EZF, w_up_EZF, w_down_EFZ)
        if vma_checked(EP_GROUPED):
            # The kernels' weight gradients vary over the batch axes, as the rows do; the cast's transpose sums
            # them over the shards that share these experts (the einsums' autodiff does that by itself).
            ws = [jax.lax.pcast(w, _unvarying(w, BATCH_AXES), to="varying") for w in ws]
        return jax.checkpoint(swiglu_kept_rows)(payload_NZ, expert_N, *ws)
    x_ERZ = gather_rows(payload_NZ, plan.slot_row_ER, plan.slot_valid_ER, plan.row_slot_N[:, None],
                        plan.row_kept_N[:, None])
    y_ERZ = jax.checkpoint(expert_mlp_batched)(x_ERZ.reshape(local_experts, cap, -1), w_gate_EZF, w_up_EZF,
                                               w_down_EFZ)
    return gather_rows(y_ERZ.reshape(local_experts * cap, -1), plan.row_slot_N, plan.row_kept_N,
                       plan.slot_row_ER[:, None], plan.slot_valid_ER[:, None])


def _wave(send_XPZ, ids_XP, w_gate_EZF, w_up_EZF, w_down_EFZ, sizes: TransportSizes, wave: int):
    n_shards, pool, width = send_XPZ.shape
    local_experts, m, cap = w_gate_EZF.shape[0], sizes.header_rows, sizes.recv_capacity
    dtype = send_XPZ.dtype
    block_XYZ = jnp.concatenate([_encode_header(ids_XP, sizes, width, dtype), send_XPZ], axis=1)
    # Before: block s is bound for shard s (sharded by source). After: block s came from shard s.
    recv_XYZ = checkpoint_name(jax.lax.all_to_all(block_XYZ, EXPERT_AXIS, 0, 0, tiled=True), SAVE_DISPATCH)
    rotation = (jax.lax.axis_index(EXPERT_AXIS) + wave) % n_shards
    plan = materialized(_receiver_plan(_decode_header(recv_XYZ[:, :m], sizes), local_experts, cap, rotation))
    payload_NZ = recv_XYZ[:, m:].reshape(n_shards * pool, width)
    ret_NZ = _expert_compute(payload_NZ, plan, w_gate_EZF, w_up_EZF, w_down_EFZ, cap).astype(dtype)
    kept_XP = plan.row_kept_N.reshape(n_shards, pool).astype(jnp.int32)
    back_XYZ = jnp.concatenate([_encode_header(kept_XP, sizes, width, dtype), ret_NZ.reshape(n_shards, pool, width)],
                               axis=1)
    # Before: block s holds rows that came from shard s. After: block s holds my rows processed by shard s.
    back_XYZ = checkpoint_name(jax.lax.all_to_all(back_XYZ, EXPERT_AXIS, 0, 0, tiled=True), SAVE_RETURN)
    return back_XYZ[:, m:], _decode_header(back_XYZ[:, :m], sizes) > 0, plan.dropped


def _shard_body(z_TZ, expert_TK, weight_TK, mask_T, w_gate_EZF, w_up_EZF, w_down_EFZ, *, sizes: TransportSizes,
                waves: int, n_shards: int):
    width, pool = z_TZ.shape[1], sizes.send_pool
    plan = materialized(_sender_plan(expert_TK, mask_T, n_shards, w_gate_EZF.shape[0], waves, pool))
    # The dispatch result is kept for the backward pass; its cotangent is a gather-sum over each token's K rows.
    send_NZ = gather_rows(z_TZ, plan.row_token_N, plan.row_valid_N, plan.assign_row_TK, plan.assign_sent_TK)
    send_WXPZ = send_NZ.reshape(waves, n_shards, pool, width)
    rets, flags, recv_dropped = zip(*[_wave(send_WXPZ[w], plan.ids_WXP[w], w_gate_EZF, w_up_EZF, w_down_EFZ, sizes, w)
                                      for w in range(waves)])
    ret_NZ = jnp.stack(rets).reshape(-1, width)
    kept_row_N = plan.row_valid_N & jnp.stack(flags).reshape(-1)
    kept_row_N, kept_TK = materialized((kept_row_N, plan.assign_sent_TK & jnp.take(kept_row_N, plan.assign_row_TK)))
    y_TZ = combine_rows(ret_NZ, weight_TK, plan.assign_row_TK, kept_TK, plan.row_assign_N, kept_row_N)

    valid_TK = jnp.broadcast_to(mask_T[:, None], expert_TK.shape)
    status_TK = jnp.select([kept_TK, plan.sender_dropped_TK, valid_TK], [KEPT, SENDER_DROPPED, RECEIVER_DROPPED],
                           PADDING).astype(jnp.int8)
    count = lambda x: jax.lax.psum(jnp.sum(x, dtype=jnp.int32), BATCH_AXES)
    stats = DropStats(valid=count(valid_TK), kept=count(kept_TK), sender_dropped=count(plan.sender_dropped_TK),
                      receiver_dropped=jax.lax.psum(sum(recv_dropped), BATCH_AXES),  # counted where it happens
                      padding_skipped=count(~valid_TK))
    return y_TZ, stats, status_TK


def _layout(mesh: jax.sharding.Mesh, z_TZ, expert_TK, w_gate_EZF) -> tuple[int, int, int]:
    """(tokens per shard, expert shards X, local experts E_loc), validated."""
    n_batch = batch_shards(mesh)
    n_shards, n_experts = mesh.shape[EXPERT_AXIS], w_gate_EZF.shape[0]
    if z_TZ.shape[0] % n_batch:
        raise ValueError(f"tokens ({z_TZ.shape[0]}) are not divisible by the batch shards ({n_batch})")
    if n_experts % n_shards:
        raise ValueError(f"experts ({n_experts}) are not divisible by the expert axis ({n_shards})")
    if expert_TK.shape[0] != z_TZ.shape[0]:
        raise ValueError(f"expert_TK has {expert_TK.shape[0]} tokens, z_TZ has {z_TZ.shape[0]}")
    return z_TZ.shape[0] // n_batch, n_shards, n_experts // n_shards


def routed_expert_parallel_debug(z_TZ, expert_TK, weight_TK, mask_T, w_gate_EZF, w_up_EZF, w_down_EFZ, *,
                                 mesh: jax.sharding.Mesh, waves: int = 3, cf_send: float = 1.15,
                                 cf_recv: float = 1.15):
    """`routed_expert_parallel` plus status_TK int8 [T, K]: PADDING / KEPT / SENDER_DROPPED / RECEIVER_DROPPED."""
    tokens, n_shards, local_experts = _layout(mesh, z_TZ, expert_TK, w_gate_EZF)
    sizes = transport_sizes(tokens, expert_TK.shape[1], n_shards, local_experts, waves, cf_send, cf_recv,
                            z_TZ.shape[1], jnp.dtype(z_TZ.dtype).itemsize)
    body = partial(_shard_body, sizes=sizes, waves=waves, n_shards=n_shards)
    tok, exp = BATCH_SPEC, EXPERTS_SPEC
    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, tok, exp, exp, exp),
                       out_specs=(tok, REPLICATED, tok), check_vma=vma_checked(EP_GROUPED))
    return fn(z_TZ, expert_TK, weight_TK, mask_T, w_gate_EZF, w_up_EZF, w_down_EFZ)


def routed_expert_parallel(z_TZ: Float[Array, "T Z"], expert_TK: Int[Array, "T K"], weight_TK: Float[Array, "T K"],
                           mask_T: Bool[Array, "T"], w_gate_EZF: Float[Array, "E Z F"],
                           w_up_EZF: Float[Array, "E Z F"], w_down_EFZ: Float[Array, "E F Z"], *,
                           mesh: jax.sharding.Mesh, waves: int = 3, cf_send: float = 1.15, cf_recv: float = 1.15
                           ) -> tuple[jax.Array, DropStats]:
    """Routed experts over the `expert` mesh axis with the pooled-wave transport (SPEC §3).

    Global (SPMD) arrays in, tokens sharded over BATCH_AXES, expert weights over `expert`. Returns y_TZ fp32
    (sum over kept assignments, sharded like the tokens) and the global DropStats counts.
    """
    y_TZ, stats, _ = routed_expert_parallel_debug(z_TZ, expert_TK, weight_TK, mask_T, w_gate_EZF, w_up_EZF,
                                                  w_down_EFZ, mesh=mesh, waves=waves, cf_send=cf_send,
                                                  cf_recv=cf_recv)
    return y_TZ, stats
