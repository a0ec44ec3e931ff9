"""Shared building blocks: parameter containers, init, RMSNorm + GatedNorm, SConv.

Dimensions: B batch, S sequence, D width, Q GatedNorm rank, C channels, J conv taps.
Notable choices (SPEC §2):
- Every matrix is stored `[..., fan_in, fan_out]` and drawn from sigma * truncated_normal(-3, 3),
  sigma = 0.5 / sqrt(d_model); the optimizer relies on the last two dims being the matrix.
- Norm internals run in fp32 and cast back to the input dtype.
- GatedNorm: y = x * sigmoid(W_up silu(W_down x)), applied after RMSNorm at every norm site.
- SConv is a causal depthwise conv whose taps never read across a packed-document boundary; tap 0 is the
  current token and is initialised to 1 (identity at init).
- Context parallelism (docs/ARCHITECTURE.md): a sequence may arrive as `context` consecutive rows
  ("chunks"). `front_extend` prefixes each row with the end of the rows before it in the same sequence
  (the halo); SConv and attention read their history through it, so nothing else knows about chunks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from moejax.model import kernel_choice

# The rolled tails of `front_extend` (the context-parallel halo), named so that every block remat policy keeps
# them (`transformer.REMAT_POLICIES`) instead of exchanging them again in the backward.
SAVE_HALO = "cp_halo"


def pytree_dataclass(cls):
    """A frozen dataclass registered as a pytree (all fields are children)."""
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


def trunc_normal(key, shape, std: float) -> jax.Array:
    return std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)


def rms_normalize(x: Float[Array, "... D"], eps: float) -> Float[Array, "... D"]:
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_norm(x: Float[Array, "... D"], gain: Float[Array, "D"], eps: float) -> Float[Array, "... D"]:
    return scale_channels(rms_normalize(x, eps), gain.astype(jnp.float32)).astype(x.dtype)


@jax.custom_vjp
def scale_channels(x: Float[Array, "... C"], w: Float[Array, "C"]) -> Float[Array, "... C"]:
    """x * w, one weight per channel (norm gains, SConv taps), with the weight gradient sum_tokens g * x in
    fp32, also for bf16 activations (autodiff would sum bf16 products in bf16). Off GPU that column sum is
    a [1, N] @ [N, C] product with ones: XLA CPU runs the sum over the token axes as a two-stage
    reduce-window at ~1/4 the speed of an elementwise pass, the dot costs about one pass. On 2 CPU cores,
    fp32, [16, 256, 256]: SConv fwd+bwd 5.1 -> 2.3 ms, RMSNorm 2.4 -> 1.3 ms; the train step 1.011-1.019x
    (docs/LOG.md, 2026-12-03). On GPUs (`kernel_choice.lowering_for_gpu`) a plain sum, which XLA fuses
    with the product into one kernel; the dot would write and re-read the [N, C] products."""
    return x * w.astype(x.dtype)


def _scale_channels_fwd(x, w):
    return scale_channels(x, w), (x, w)


def _scale_channels_bwd(res, g):
    x, w = res
    gx_NC = (g.astype(jnp.float32) * x.astype(jnp.float32)).reshape(-1, x.shape[-1])
    if kernel_choice.lowering_for_gpu():
        dw_C = jnp.sum(gx_NC, axis=0)
    else:
        ones_1N = jnp.ones((1, gx_NC.shape[0]), jnp.float32)
        dw_C = jnp.dot(ones_1N, gx_NC, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)[0]
    return g * w.astype(g.dtype), dw_C.astype(w.dtype)


scale_channels.defvjp(_scale_channels_fwd, _scale_channels_bwd)


@jax.custom_vjp
def matmul_tokens(x: Float[Array, "... D"], w: Float[Array, "D F"]) -> Float[Array, "... F"]:
    """x @ w for every token-major projection, with the weight gradient taken as (g^T x)^T: the activation
    x is read in its own layout and only the small [F, D] result is transposed. Left to itself, XLA CPU
    lays out x^T for dW = x^T g by recomputing x in a strided loop fusion (18 ms per GatedNorm at T=4096,
    D=256; the GatedNorm backward alone ran 3.4x faster). Same dtypes as `@`; on GPU the GEMM library
    takes either orientation, so nothing changes there."""
    return x @ w


def _matmul_tokens_fwd(x, w):
    return x @ w, (x, w)


def _matmul_tokens_bwd(res, g):
    x, w = res
    g_TF, x_TD = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    dw = jnp.einsum("tf,td->fd", g_TF, x_TD, preferred_element_type=jnp.float32).T
    return g @ w.T, dw.astype(w.dtype)


matmul_tokens.defvjp(_matmul_tokens_fwd, _matmul_tokens_bwd)


@pytree_dataclass
class Norm:
    """RMSNorm (learned gain) followed by a rank-R GatedNorm."""

    gain: Float[Array, "D"]
    down: Float[Array, "D Q"]
    up: Float[Array, "Q D"]

    @staticmethod
    def init(d: int, rank: int, std: float, key) -> "Norm":
        k1, k2 = jax.random.split(key)
        return Norm(gain=jnp.ones((d,), jnp.float32), down=trunc_normal(k1, (d, rank), std),
                    up=trunc_normal(k2, (rank, d), std))

    def __call__(self, x: Float[Array, "B S D"], eps: float) -> Float[Array, "B S D"]:
        h = rms_norm(x, self.gain, eps)
        low = jax.nn.silu(matmul_tokens(h, self.down.astype(h.dtype)))
        gate = jax.nn.sigmoid(matmul_tokens(low, self.up.astype(h.dtype)).astype(jnp.float32))
        return (h.astype(jnp.float32) * gate).astype(x.dtype)


def init_conv(taps: int, channels: int) -> Float[Array, "J C"]:
    return jnp.zeros((taps, channels), jnp.float32).at[0].set(1.0)


def front_extend(a: Array, n: int, context: int, fill) -> Array:
    """a [B, S, ...] -> [B, n + S, ...]: each row prefixed with the n positions before it in its sequence.

    With context parallelism a sequence is `context` consecutive rows (chunks of S positions), so the n
    positions before row r are the tails of rows r-1, r-2, ... of the same sequence (chunk index r % context
    >= that distance); anything before the sequence start is `fill` (segment ids use -1, which matches no
    document). context == 1 is a plain front pad. Communication: each hop is `jnp.roll` of only the needed
    tail along the row axis, which GSPMD partitions into a collective-permute over the batch shards
    (before: the tail of this device's rows; after: the tail of the previous device's last row)."""
    rows, seq = a.shape[0], a.shape[1]
    if rows % context:
        raise ValueError(f"rows ({rows}) are not whole sequences of context ({context}) chunks")
    chunk_idx = (jnp.arange(rows) % context).reshape(-1, *[1] * (a.ndim - 1))
    parts = [a]
    for hop in range(1, -(-n // seq) + 1):
        take = min(seq, n - (hop - 1) * seq)
        empty = jnp.full((rows, take, *a.shape[2:]), fill, a.dtype)
        if hop < context:
            tail = checkpoint_name(jnp.roll(a[:, seq - take:], hop, axis=0), SAVE_HALO)  # row r reads row r - hop
            empty = jnp.where(chunk_idx >= hop, tail, empty)
        parts.insert(0, empty)
    return jnp.concatenate(parts, axis=1) if n else a


def sconv(x: Float[Array, "B S C"], taps_JC: Float[Array, "J C"], segment_ids: Int[Array, "B S"],
          context: int = 1) -> Float[Array, "B S C"]:
    """Causal depthwise conv, y[t] = sum_j taps[j] * x[t-j], with x[t-j] zeroed across documents; with
    `context` > 1 the first J-1 taps of a chunk read the previous chunk (front_extend)."""
    n = taps_JC.shape[0] - 1
    seq = x.shape[1]
    x_ext, seg_ext = front_extend(x, n, context, 0), front_extend(segment_ids, n, context, -1)
    y = scale_channels(x, taps_JC[0])
    for j in range(1, n + 1):
        x_shift, seg_shift = x_ext[:, n - j:n - j + seq], seg_ext[:, n - j:n - j + seq]
        same_doc = (seg_shift == segment_ids)[..., None]
        y = y + scale_channels(jnp.where(same_doc, x_shift, 0), taps_JC[j])
    return y


def sconv_step(x: Float[Array, "B T C"], taps_JC: Float[Array, "J C"],
               state: Float[Array, "B J-1 C"]) -> tuple[Float[Array, "B T C"], Float[Array, "B J-1 C"]]:
    """`sconv` continued from `state`, the previous J-1 inputs of the same document (zeros before its first
    token, which is what the document mask gives). Returns the T outputs and the new state (decoding)."""
    hist = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    y = sconv(hist, taps_JC, jnp.ones(hist.shape[:2], jnp.int32))
    return y[:, state.shape[1]:], hist[:, hist.shape[1] - state.shape[1]:]


@jax.custom_vjp
def swiglu_act(gate: Float[Array, "... F"], up: Float[Array, "... F"]) -> Float[Array, "... F"]:
    """silu(gate) * up, the SwiGLU activation, keeping only (gate, up) for the backward, which recomputes
    the sigmoid in fp32 inside one elementwise pass. Autodiff keeps sigmoid(gate) as a third residual and
    spends more passes over the [rows, F] arrays: on 2 CPU cores, fp32, the [159, 128, 128] expert blocks'
    SwiGLU fwd+bwd 91.5 -> 84.0 ms, and the CPU-shape step's compiled temporaries 1,138 -> 1,090 MiB without
    remat (docs/LOG.md, 2026-12-03). Used by every expert MLP."""
    return jax.nn.silu(gate) * up


def _swiglu_act_fwd(gate, up):
    return swiglu_act(gate, up), (gate, up)


def _swiglu_act_bwd(res, dh):
    gate, up = res
    g32, u32, dh32 = gate.astype(jnp.float32), up.astype(jnp.float32), dh.astype(jnp.float32)
    sig = jax.nn.sigmoid(g32)
    d_up = dh32 * g32 * sig  # d(silu(g) u)/du = silu(g)
    d_gate = dh32 * u32 * sig * (1.0 + g32 * (1.0 - sig))  # silu'(g) = s (1 + g (1 - s))
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


swiglu_act.defvjp(_swiglu_act_fwd, _swiglu_act_bwd)


def swiglu(x: Float[Array, "... D"], w_gate: Float[Array, "D F"], w_up: Float[Array, "D F"],
           w_down: Float[Array, "F D"]) -> Float[Array, "... D"]:
    return matmul_tokens(swiglu_act(matmul_tokens(x, w_gate), matmul_tokens(x, w_up)), w_down)


def shared_swiglu(x: Float[Array, "... D"], w_gate_UDF: Float[Array, "U D F"], w_up_UDF: Float[Array, "U D F"],
                  w_down_UFD: Float[Array, "U F D"]) -> Float[Array, "... D"]:
    """The sum of U SwiGLU experts as one SwiGLU U*F wide: the gates side by side form a D x U*F gate, and
    sum_u h_u W_u = [h_1 .. h_U] [W_1; ..; W_U]. Two D-by-U*F dots and one U*F-by-D dot instead of 3U
    narrow ones: at issue 11's CPU shape the whole train step ran 1.011x faster (docs/LOG.md, 2026-12-03).
    The parameters keep their [U, ...] shape: MuonH orthogonalises each expert's matrices on their own.
    (Laying the U gates side by side moves no data between devices unless Fs itself is sharded.)"""
    n_exp, d, f = w_gate_UDF.shape
    side_by_side = lambda w_UDF: jnp.moveaxis(w_UDF, 0, 1).reshape(d, n_exp * f)
    return swiglu(x, side_by_side(w_gate_UDF), side_by_side(w_up_UDF), w_down_UFD.reshape(n_exp * f, d))
