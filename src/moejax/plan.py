"""`moejax plan PRESET --cluster C`: devices, memory, transport, time — before anything is allocated.

Every number is derived from the preset and the cluster table below, with its formula printed:
- mesh = the preset's (replica_dcn, data, expert, model); the cluster must hold that many devices and
  the expert axis must fit in one NVLink domain (rack/node), since the all-to-all runs over it;
- per-device bytes of every parameter leaf from the real sharding rules (`parallel.mesh.param_shardings`
  on an `AbstractMesh`; shard shapes, no devices, no allocation): routed experts over `expert`, the rest
  FSDP over (data, expert) inside a rack; bf16 compute copy = 2 bytes/param, fp32 grads 4 bytes/param;
- pinned host: fp32 master (4 bytes/param) + the optimizer state leaves from `jax.eval_shape` of the
  real optimizer's init, sharded like their parameters (`mirror_shardings`);
- activations with per-block remat (an estimate, stated term by term): the L block inputs kept for the
  backward + one block's working set while it is recomputed (attention as implemented: dense fp32
  scores [B, H, S, S] per device; MoE transport buffers; expert hidden) + the LM-head logits; without
  remat (train.remat=false) the backward reads every layer's intermediates, so L blocks' working sets;
- per context phase (`RunConfig.phases`): sequences per step, context-parallel degree, the phase's
  capacity factors, and the attention / activation / HBM numbers above at that phase's layout (a global
  layer's keys are the whole sequence; with CP the earlier chunks' K/V per query head are counted);
- transport sizes from `expert_parallel.transport_sizes` (P, R, header rows, bytes per wave);
- step time = 3 x fwd FLOPs/token x tokens/step / (devices x peak x MFU); the default MFU 0.225 is
  the run's reported ~22.5%.

Cluster numbers (documented vendor specs; dense bf16 peaks, no sparsity):
- gb200-nvl72x11: 11 GB200 NVL72 racks, 64 GPUs used per rack (16 nodes x 4), ~186 GB HBM3e usable per
  B200, 2.5 PFLOP/s bf16; host 480 GB LPDDR5X per Grace shared by 2 GPUs = 240 GB per GPU.
- h100x8: one 8 x H100 SXM node, 80 GB HBM3, 989 TFLOP/s bf16; 2 TB host per node (DGX H100) = 256 GB/GPU.
- h200x1: one H200, 141 GB HBM3e, 989 TFLOP/s bf16; 256 GB host assumed (DGX H200 share).
GB = 1e9 bytes throughout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moejax import accounting
from moejax.config import ALL_TO_ALLS_PER_WAVE, ConfigError, RunConfig
from moejax.parallel.mesh import BATCH_AXES, MESH_AXES, abstract_mesh

GB = 1e9
DEFAULT_MFU = 0.225
MIN_MFU = 1e-4  # `plan --mfu`: 0.01%
STREAM_BLOCK = 16_384  # vocab block assumed for the "lean" estimate (model.loss_vocab_block)


@dataclass(frozen=True)
class Cluster:
    name: str
    racks: int  # data-centre-network domains (replica_dcn goes across them)
    devices_per_rack: int  # devices in one NVLink domain that the run uses
    hbm_bytes: float
    host_bytes_per_device: float
    peak_flops: float  # dense bf16 FLOP/s per device
    device: str
    device_kind: str  # as jax names it: `plan --lower` lowers the GPU kernels for it
    sm_count: int

    @property
    def n_devices(self) -> int:
        return self.racks * self.devices_per_rack


CLUSTERS = {
    "gb200-nvl72x11": Cluster("gb200-nvl72x11", 11, 64, 186 * GB, 240 * GB, 2.5e15, "GB200 (B200)", "NVIDIA GB200",
                              148),
    "h100x8": Cluster("h100x8", 1, 8, 80 * GB, 256 * GB, 989e12, "H100 SXM", "NVIDIA H100", 132),
    "h200x1": Cluster("h200x1", 1, 1, 141 * GB, 256 * GB, 989e12, "H200", "NVIDIA H200", 132),
}
DEFAULT_CLUSTER = "gb200-nvl72x11"


def check_cluster(cfg: RunConfig, cluster: Cluster) -> None:
    p = cfg.parallel
    mesh = "(" + ", ".join(map(str, p.mesh_shape)) + ")"
    if p.n_devices > cluster.n_devices:
        raise ConfigError(f"preset {cfg.name} needs mesh {mesh} = {p.n_devices} devices, but cluster {cluster.name} "
                          f"has {cluster.n_devices} (short by {p.n_devices - cluster.n_devices})")
    if p.expert * p.model > cluster.devices_per_rack:
        raise ConfigError(f"preset {cfg.name}: expert axis ({p.expert}) x model ({p.model}) exceeds the "
                          f"{cluster.devices_per_rack} devices of one NVLink domain of {cluster.name}")


def abstract_state_parts(cfg: RunConfig, mesh):
    """(params, param shardings, optimizer state, its shardings) — shapes only, via jax.eval_shape."""
    import jax

    from moejax.model.transformer import Transformer
    from moejax.parallel.mesh import mirror_shardings, param_shardings
    from moejax.train.optimizer import make_optimizer

    params = jax.eval_shape(lambda k: Transformer.init(cfg.model, k), jax.random.key(0))
    params_sh = param_shardings(params, mesh)
    optimizer, lr_fn = make_optimizer(cfg)
    opt = jax.eval_shape(optimizer.init, params)
    return params, params_sh, opt, mirror_shardings(opt, params, params_sh, mesh), optimizer, lr_fn


def _shard_elems(tree, shardings) -> list[tuple[str, int, int, int]]:
    """(path, global elements, per-device elements, itemsize) per leaf."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(path), math.prod(x.shape), math.prod(sh.shard_shape(x.shape)), x.dtype.itemsize)
            for (path, x), sh in zip(leaves, jax.tree.leaves(shardings))]


def memory_numbers(cfg: RunConfig) -> dict:
    mesh = abstract_mesh(cfg.parallel)
    params, params_sh, opt, opt_sh, _, _ = abstract_state_parts(cfg, mesh)
    p_leaves = _shard_elems(params, params_sh)
    routed = [x for x in p_leaves if x[0].split(".")[-1] in ("w_gate", "w_up", "w_down") and ".moe." in x[0]]
    exact = sum(x[1] for x in p_leaves)
    per_dev = sum(x[2] for x in p_leaves)
    routed_dev = sum(x[2] for x in routed)
    opt_dev = sum(x[2] * x[3] for x in _shard_elems(opt, opt_sh))
    opt_total = sum(x[1] * x[3] for x in _shard_elems(opt, opt_sh))
    return {"exact_params": exact, "routed_params": sum(x[1] for x in routed), "params_per_device": per_dev,
            "routed_params_per_device": routed_dev, "other_params_per_device": per_dev - routed_dev,
            "weights_bf16_bytes": 2 * per_dev, "grads_fp32_bytes": 4 * per_dev,
            "master_fp32_bytes": 4 * per_dev, "opt_state_bytes": opt_dev, "opt_state_total_bytes": opt_total,
            "params_bf16_total_bytes": 2 * exact}


def transport_numbers(cfg: RunConfig, tokens_per_device: int) -> dict | None:
    from moejax.parallel.expert_parallel import transport_sizes

    m, p = cfg.model, cfg.parallel
    if not p.use_ep:
        return None
    e_loc, dt = m.n_experts // p.expert, 2 if m.compute_dtype == "bfloat16" else 4
    args = (tokens_per_device, m.top_k, p.expert, e_loc, p.waves, p.cf_send, p.cf_recv)
    lat, full = transport_sizes(*args, m.latent_width, dt), transport_sizes(*args, m.d_model, dt)
    per_layer = 2 * p.waves * lat.bytes_per_wave  # dispatch + return, every wave (forward)
    a2a = ALL_TO_ALLS_PER_WAVE[cfg.train.remat_saves] if cfg.train.remat else ALL_TO_ALLS_PER_WAVE["transport"]
    return {"local_experts": e_loc, "assignments": lat.assignments, "P": lat.send_pool, "R": lat.recv_capacity,
            "header_rows": lat.header_rows, "header_digits": lat.header_digits, "rows_per_wave": lat.rows_per_wave,
            "bytes_per_wave": lat.bytes_per_wave, "bytes_per_wave_full_width": full.bytes_per_wave,
            "bytes_per_layer_fwd": per_layer,
            # forward + backward (the transposed all_to_alls) + what a block-remat re-forward reruns: per wave
            # ALL_TO_ALLS_PER_WAVE[remat_saves] of them with remat, 4 without; per_layer counts the forward's 2
            "a2a_per_wave": a2a, "bytes_per_step": a2a / 2 * m.n_layers * per_layer,
            "expert_rows_per_wave": lat.expert_rows_per_wave,
            "waves": p.waves}


def activation_numbers(cfg: RunConfig, tokens_per_device: int, tr: dict | None, seq_len: int | None = None,
                       context: int = 1) -> dict:
    """Per-device activations at one context phase (default: train.seq_len without context parallelism)."""
    m, t = cfg.model, cfg.train
    seq = seq_len or t.seq_len
    T, d, dt = tokens_per_device, m.d_model, (2 if m.compute_dtype == "bfloat16" else 4)
    chunk = seq // context
    rows = max(1, T // chunk)  # rows (chunks of a sequence with context parallelism) per device
    kept = m.n_layers * T * d * dt  # block inputs saved for the backward (per-block remat)
    qkvo = T * (2 * m.q_dim + 2 * m.kv_dim) * dt
    q_rows = m.attn_q_block if m.attn_q_block and m.attn_q_block < chunk else chunk
    # A global layer reads every earlier position of the sequence: the chunk's own S/c keys plus, with CP,
    # the (c-1) earlier chunks moved in (front_extend), K and V per query head.
    kv_ext = rows * (seq - chunk) * 2 * m.q_dim * dt
    attn = rows * m.n_heads * q_rows * seq * (4 + dt) + qkvo + kv_ext  # live scores + probs of one query block
    if tr:
        moe = (2 * tr["waves"] * tr["bytes_per_wave"]  # dispatched rows (kept) + received rows
               + tr["expert_rows_per_wave"] * (m.latent_width + 3 * m.expert_width) * dt  # one wave's expert MLP
               + T * m.latent_width * (dt + 4))  # latent z + fp32 combine
    else:
        moe = T * m.top_k * (m.latent_width + 3 * m.expert_width) * dt + T * m.latent_width * (dt + 4)
    # What block remat keeps of every layer's transport for the backward (train.remat_saves): both all-to-all
    # results of each wave, the dispatch ones, or none. XLA's own plan of the hero showed these as six
    # [L, 64, P, latent] stacks; the working set above is one layer's. Without remat they are in the L working
    # sets below.
    kept_waves = {"transport": 2, "dispatch": 1, "nothing": 0}[t.remat_saves] * tr["waves"] if tr and t.remat else 0
    transport_kept = m.n_layers * kept_waves * tr["bytes_per_wave"] if kept_waves else 0
    shared = T * m.n_shared * 3 * m.shared_width * dt
    router = 2 * T * m.n_experts * 4  # fp32 logits + margins
    vocab = m.loss_vocab_block or m.vocab_size
    head = T * vocab * 4
    # With remat one block's working set is live at a time (its recompute). Without it the backward reads every
    # layer's intermediates, kept from the forward: L working sets (their transport results among them). Checked
    # against XLA's compiled peak on one H200 (docs/LOG.md 2026-12-04, twenty-fourth session).
    blocks_live = 1 if t.remat else m.n_layers
    block = attn + moe + shared + router  # one layer's working set
    return {"tokens_per_device": T, "lm_head_vocab": vocab, "lm_head_streamed": bool(m.loss_vocab_block),
            "block_inputs_bytes": kept, "attention_bytes": attn, "attention_qkvo_bytes": qkvo,
            "attention_kv_context_bytes": kv_ext, "moe_bytes": moe, "transport_kept_bytes": transport_kept,
            "remat": bool(t.remat), "remat_saves": t.remat_saves, "blocks_live": blocks_live,
            "scan_layers": t.scan_layers,
            "shared_bytes": shared, "router_bytes": router, "block_bytes": block, "lm_head_logits_bytes": head,
            "activations_bytes": kept + transport_kept + blocks_live * block + head}


def phase_numbers(cfg: RunConfig, cluster: Cluster, fixed_hbm: float, tokens_per_device: int) -> list[dict]:
    """Per context phase (SPEC §5): sequences per step, context-parallel degree, rows and chunk length, the
    phase's capacity factors, attention and activation HBM per device, and whether it fits. `fixed_hbm`:
    weights + grads (+ optimizer state when on device), the same in every phase."""
    from dataclasses import replace

    out = []
    base = cfg.phases[0]
    for ph in cfg.phases:
        pc = replace(cfg, parallel=replace(cfg.parallel, cf_send=ph.cf_send, cf_recv=ph.cf_recv))
        act = activation_numbers(cfg, tokens_per_device, transport_numbers(pc, tokens_per_device), ph.seq_len,
                                 ph.context)
        hbm = fixed_hbm + act["activations_bytes"]
        out.append({"from_step": ph.start, "seq_len": ph.seq_len, "sequences": ph.sequences, "context": ph.context,
                    "rows": ph.rows, "chunk": ph.chunk, "cf_send": ph.cf_send, "cf_recv": ph.cf_recv,
                    "attention_bytes": act["attention_bytes"], "activations_bytes": act["activations_bytes"],
                    "hbm_needed": hbm, "fits_hbm": hbm <= cluster.hbm_bytes,
                    # SPEC §6: capacity tuned at the base context does not transfer to longer ones
                    "base_cf_at_longer_context": ph.seq_len > base.seq_len and (ph.cf_send, ph.cf_recv) == (
                        base.cf_send, base.cf_recv)})
    return out


def plan(cfg: RunConfig, cluster: Cluster, mfu: float = DEFAULT_MFU) -> dict:
    check_cluster(cfg, cluster)
    if not MIN_MFU <= mfu <= 1:  # below MIN_MFU the times are no plan (1e-308 printed 10^300 days)
        raise ConfigError(f"--mfu ({mfu}) must be in [{MIN_MFU}, 1]")
    m, t, p = cfg.model, cfg.train, cfg.parallel
    T = t.tokens_per_step // p.batch_shards
    mem = memory_numbers(cfg)
    tr = transport_numbers(cfg, T)
    act = activation_numbers(cfg, T, tr)
    hbm = mem["weights_bf16_bytes"] + mem["grads_fp32_bytes"] + act["activations_bytes"]
    host = mem["master_fp32_bytes"] + mem["opt_state_bytes"]
    if t.opt_state_memory == "device":
        hbm += host
    # What a blockwise (flash) attention kernel and a vocab-streamed loss would leave: q/k/v/o only, and
    # [T, STREAM_BLOCK] fp32 logits.
    lean = (hbm - act["blocks_live"] * (act["attention_bytes"] - act["attention_qkvo_bytes"])
            - act["lm_head_logits_bytes"] + T * min(STREAM_BLOCK, m.vocab_size) * 4)
    phases = phase_numbers(cfg, cluster, hbm - act["activations_bytes"], T)
    fwd = accounting.fwd_flops_per_token(m, t.seq_len)
    step_flops = accounting.train_flops(m, t.seq_len, t.tokens_per_step)
    step_time = step_flops / (p.n_devices * cluster.peak_flops * mfu)
    return {"preset": cfg.name, "cluster": cluster.name, "device": cluster.device,
            "mesh": dict(zip(MESH_AXES, p.mesh_shape)), "devices": p.n_devices,
            "cluster_devices": cluster.n_devices, "hbm_per_device": cluster.hbm_bytes,
            "host_per_device": cluster.host_bytes_per_device, "opt_state_memory": t.opt_state_memory,
            **mem, **act, "transport": tr, "phases": phases, "hbm_needed": hbm, "hbm_needed_lean": lean, "host_needed": host,
            "fits_hbm": hbm <= cluster.hbm_bytes, "fits_host": host <= cluster.host_bytes_per_device,
            "total_params": accounting.total_params(m), "active_params": accounting.active_params(m),
            "fwd_flops_per_token": fwd, "flops_per_step": step_flops, "mfu": mfu, "step_time_s": step_time,
            "steps": t.steps, "days": t.steps * step_time / 86400, "tokens": t.total_tokens,
            "tokens_per_step": t.tokens_per_step, "train_flops": step_flops * t.steps}


def verdict(r: dict) -> str:
    if r["fits_hbm"] and r["fits_host"]:
        return (f"fits: {r['hbm_needed'] / GB:.1f} of {r['hbm_per_device'] / GB:.0f} GB HBM and "
                f"{r['host_needed'] / GB:.1f} of {r['host_per_device'] / GB:.0f} GB host per device")
    parts = []
    if not r["fits_hbm"]:
        parts.append(f"needs {r['hbm_needed'] / GB:.1f} GB HBM per device, {r['device']} has "
                     f"{r['hbm_per_device'] / GB:.0f} GB (over by {(r['hbm_needed'] - r['hbm_per_device']) / GB:.1f} GB)")
    if not r["fits_host"]:
        parts.append(f"needs {r['host_needed'] / GB:.1f} GB pinned host per device, has "
                     f"{r['host_per_device'] / GB:.0f} GB (over by {(r['host_needed'] - r['host_per_device']) / GB:.1f} GB)")
    return f"DOES NOT FIT on {r['cluster']}: " + "; ".join(parts)


def format_plan(r: dict) -> str:
    g = lambda b: f"{b / GB:,.2f} GB"
    mesh = ", ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [f"moejax plan: {r['preset']} on {r['cluster']} ({r['device']})",
             f"  mesh ({mesh}) = {r['devices']} devices of {r['cluster_devices']}; batch over "
             f"{'x'.join(BATCH_AXES)}; {r['tokens_per_device']:,} tokens per device",
             f"  params: total {r['total_params']:,} (formula), exact pytree {r['exact_params']:,}; "
             f"active {r['active_params']:,}",
             f"  bf16 copy of all params {g(r['params_bf16_total_bytes'])} (2 B x exact params)",
             "per-device HBM",
             f"  {'bf16 compute weights':<40}{g(r['weights_bf16_bytes']):>14}  2 B x {r['params_per_device']:,} params "
             f"(routed {r['routed_params_per_device']:,} over expert + {r['other_params_per_device']:,} FSDP)",
             f"  {'fp32 gradients':<40}{g(r['grads_fp32_bytes']):>14}  4 B x params per device, sharded like them",
             f"  {'activations (' + ('per-block remat' if r['remat'] else 'no remat') + ', estimate)':<40}"
             f"{g(r['activations_bytes']):>14}",
             f"    {'block inputs kept':<38}{g(r['block_inputs_bytes']):>14}  L x T x d x 2 B",
             *([] if r["remat"] else [f"    {'each layer keeps (no remat)':<38}{g(r['block_bytes']):>14}  x L = "
                                      f"{r['blocks_live']}: the four working sets below"]),
             *([f"    {'':<38}{'':>14}  not counted: with the layers scanned (train.scan_layers) XLA also "
                "copies them into per-layer stacks (shape G on an H200: 76 GB scanned, 49 unrolled; --compile "
                "shows XLA's plan)"] if r["scan_layers"] and not r["remat"] else []),
             *([f"    {'transport results kept':<38}{g(r['transport_kept_bytes']):>14}  L x "
                f"{'2W' if r['remat_saves'] == 'transport' else 'W'} x bytes/wave (train.remat_saves="
                f"{r['remat_saves']})"] if r["transport_kept_bytes"] else []),
             f"    {'attention working set':<38}{g(r['attention_bytes']):>14}  B x H x q_block x S x (4+2) B "
             f"scores of one query block (model.attn_q_block; S if 0) + q/k/v/o",
             f"    {'MoE working set':<38}{g(r['moe_bytes']):>14}  2 x W x bytes/wave + one wave's expert MLP + z",
             f"    {'shared experts':<38}{g(r['shared_bytes']):>14}  T x 2 x 3 x width x 2 B",
             f"    {'router':<38}{g(r['router_bytes']):>14}  T x E x 4 B x 2",
             f"    {'LM-head logits (fp32)':<38}{g(r['lm_head_logits_bytes']):>14}  T x "
             f"{r['lm_head_vocab']:,} x 4 B" + (" (vocab block)" if r["lm_head_streamed"] else " (set model.loss_vocab_block to stream it)"),
             f"  {'total HBM':<40}{g(r['hbm_needed']):>14}  of {g(r['hbm_per_device'])}",
             f"  {'(with flash attn + streamed loss)':<40}{g(r['hbm_needed_lean']):>14}  blockwise attention, "
             f"loss_vocab_block={STREAM_BLOCK:,}: a fused kernel's floor"]
    tr = r["transport"]
    if tr:
        lines += ["transport (pooled waves, per device, per MoE layer)",
                  f"  A = {r['tokens_per_device']:,} x K = {tr['assignments']:,} assignments; E_loc = "
                  f"{tr['local_experts']}; W = {tr['waves']}",
                  f"  P = ceil(cf_send*A/(X*W)) = {tr['P']:,} rows; R = ceil(cf_recv*A/(E_loc*W)) = {tr['R']:,} rows; "
                  f"header M = ceil(Md*P/latent) = {tr['header_rows']} (Md = {tr['header_digits']} base-256 digits "
                  f"per expert id)",
                  f"  rows per wave S*(M+P) = {tr['rows_per_wave']:,}; bytes per wave {g(tr['bytes_per_wave'])} at "
                  f"latent width ({g(tr['bytes_per_wave_full_width'])} at full width d)",
                  f"  per layer fwd 2 x W x wave = {g(tr['bytes_per_layer_fwd'])}; per step {tr['a2a_per_wave']} "
                  f"all-to-alls a wave (fwd + bwd{' + remat' if tr['a2a_per_wave'] > 4 else ''}): "
                  f"{tr['a2a_per_wave']}/2 x L x layer = {g(tr['bytes_per_step'])}"]
    lines += ["context phases (tokens per step fixed; per device: attention working set, all activations, HBM)",
              f"  {'from step':>10} {'seq_len':>8} {'seqs':>6} {'CP':>3} {'rows':>6} {'chunk':>7} {'cf s/r':>10} "
              f"{'attention':>11} {'activations':>12} {'HBM':>10}  fits"]
    for ph in r["phases"]:
        lines.append(f"  {ph['from_step']:>10,} {ph['seq_len']:>8,} {ph['sequences']:>6,} {ph['context']:>3} "
                     f"{ph['rows']:>6,} {ph['chunk']:>7,} {ph['cf_send']:>4.2f}/{ph['cf_recv']:<4.2f} "
                     f"{g(ph['attention_bytes']):>11} {g(ph['activations_bytes']):>12} {g(ph['hbm_needed']):>10}  "
                     f"{'yes' if ph['fits_hbm'] else 'NO'}")
    lines += ["  CP = context-parallel degree: each sequence is CP consecutive rows (chunks) on consecutive batch "
              "shards; global layers read the (CP-1) earlier chunks, local layers a window-1 halo"]
    reused = [f"{ph['seq_len']:,}" for ph in r["phases"] if ph["base_cf_at_longer_context"]]
    if tr and reused:
        lines += [f"  note: seq_len {', '.join(reused)} keep the base context's capacity factors, and capacity tuned "
                  f"at a short context does not transfer to long ones (SPEC §6; fewer documents per shard drop more):",
                  "    measure each length's drops (bench/bench_drops_context.py) and set :cf=X on its phase; in "
                  "training the `drop` alarm (alarms.drop_max) watches moe/drop_fraction"]
    lines += ["pinned host (fp32 master + optimizer state)" if r["opt_state_memory"] == "pinned_host"
              else "fp32 master + optimizer state (device memory: counted in HBM above)",
              f"  {'fp32 master':<40}{g(r['master_fp32_bytes']):>14}  4 B x params per device",
              f"  {'optimizer state':<40}{g(r['opt_state_bytes']):>14}  eval_shape(optimizer.init), sharded like "
              f"params ({g(r['opt_state_total_bytes'])} in all)",
              f"  {'total':<40}{g(r['host_needed']):>14}  of {g(r['host_per_device'])}",
              "compute",
              f"  FLOPs per step 3 x {r['fwd_flops_per_token']:.4g} x {r['tokens_per_step']:,} = {r['flops_per_step']:.4g}",
              f"  step time at {100 * r['mfu']:.3g}% MFU: {r['step_time_s']:.2f} s; {r['steps']:,} steps = "
              f"{r['days']:.1f} days ({24 * r['days']:,.1f} h); {r['tokens']:.4g} tokens; {r['train_flops']:.4g} FLOPs",
              verdict(r)]
    return "\n".join(lines)
