"""Token drops vs context length and capacity factor on real packed documents (not a test; numbers go to
docs/LOG.md). Issue 14 part 5; SPEC §5 (context extension) and §6 (capacity tuned at 4K does not transfer).

1. Train the tiny preset with QB through the real loop (`moejax.train.loop.train`) on an EP mesh of 8
   forced CPU host devices (expert=8, the pooled-wave transport at cf 1.15) at the base context
   (`--train-seq-len`, default 256), on the embedded KJV with `--heldout` of it held out. An existing run
   directory (`--run-dir`) that already finished is reused as it is: `train` resumes, finds nothing to do.
2. With those weights frozen, for each context length (`--contexts`) take `--batches` held-out batches from
   the data pipeline at a fixed `--tokens` per batch (sequences = tokens / context, as the context schedule
   keeps tokens per step fixed) and run one forward pass per capacity factor (`--cfs`, cf_send = cf_recv)
   through the transport on the same mesh; read sender / receiver / total dropped fractions from its
   DropStats (`moejax.drop_curve`), plus documents per shard from the packed segment ids.
3. `--qb-refresh`: also measure batch i+1 with the QB bias that batch i implies at the same context and cf
   (what the running QB would route the next step with), to separate "the router bias was set at the base
   context" from "fewer documents per shard" (needs --batches >= 2).

Prints a table, the smallest tested cf with total drops <= `--target` per context, and writes
`drops_context.json` and `drops_context.png` to `--out`.

The model is trained only at the base context: at longer contexts its (one) global attention layer sees
far more positions than it ever did in training, so router inputs are out of distribution there. That
is part of what is measured, not hidden: the JSON carries the cross-entropy of every forward.

Usage: python bench/bench_drops_context.py [--steps 300] [--contexts 256,512,2048,8192]
       [--cfs 1.0,1.15,1.25,1.5,2.0] [--tokens 65536] [--batches 1] [--qb-refresh] [--run-dir DIR] [--out DIR]
       python bench/bench_drops_context.py --replot runs/drops_context/drops_context.json --out DIR
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moejax.config import RunConfig  # noqa: E402
from moejax.data.pipeline import make_data  # noqa: E402
from moejax.drop_curve import (documents_per_shard, make_drop_measure, measure_drops,  # noqa: E402
                               replicate, set_router_bias, smallest_cf)
from moejax.parallel.expert_parallel import transport_sizes  # noqa: E402
from moejax.parallel.mesh import batch_shards, make_mesh  # noqa: E402
from moejax.presets import TINY  # noqa: E402
from moejax.train.loop import RunOptions, train  # noqa: E402
from moejax.weights import load_run  # noqa: E402

TRAIN_CF = 1.15  # the hero's cf_send = cf_recv, used while training
ATTN_Q_BLOCK = 512  # query blocks at long context: no [S, S] scores at once (changes no value)


def train_config(args) -> RunConfig:
    r = dataclasses.replace
    return r(TINY, name="tiny-ep8-drops",
             train=r(TINY.train, seq_len=args.train_seq_len, batch_size=args.train_batch, steps=args.steps,
                     eval_every=0, eval_batches=1, checkpoint_every=10 * args.steps, temp_checkpoint_minutes=1e6),
             parallel=r(TINY.parallel, expert=8, cf_send=TRAIN_CF, cf_recv=TRAIN_CF),
             data=r(TINY.data, heldout_fraction=args.heldout, prefetch=0))


def heldout_batches(cfg: RunConfig, seq_len: int, tokens: int, n: int) -> list[dict]:
    """The pipeline's held-out batches 0..n-1 at `seq_len`, tokens / seq_len sequences each."""
    rows = tokens // seq_len
    r = dataclasses.replace
    at = r(cfg, model=r(cfg.model, attn_q_block=min(seq_len, ATTN_Q_BLOCK)),
           train=r(cfg.train, seq_len=seq_len, batch_size=rows, eval_batch_size=rows))
    with make_data(at) as data:
        return [data.eval.batch(i) for i in range(n)]


def measure_context(args, cfg: RunConfig, params, mesh, seq_len: int) -> dict:
    batches = heldout_batches(cfg, seq_len, args.tokens, args.batches)
    shards = batch_shards(mesh)
    docs = np.stack([documents_per_shard(b["segment_ids"], shards) for b in batches])
    model = dataclasses.replace(cfg.model, attn_q_block=min(seq_len, ATTN_Q_BLOCK))
    local_experts = cfg.model.n_experts // mesh.shape["expert"]
    out = {"seq_len": seq_len, "sequences": args.tokens // seq_len, "docs_per_shard_mean": float(docs.mean()),
           "docs_per_shard_min": int(docs.min()), "docs_per_shard_max": int(docs.max()), "cf": {}}
    for cf in args.cfs:
        t0 = time.perf_counter()
        fn = make_drop_measure(model, mesh, cf_send=cf, cf_recv=cf, waves=cfg.parallel.waves)
        sizes = transport_sizes(args.tokens // shards, cfg.model.top_k, mesh.shape["expert"], local_experts,
                                cfg.parallel.waves, cf, cf, cfg.model.latent_width, 4)
        frozen, biases = [], []
        for b in batches:
            counts, bias = measure_drops(fn, params, b)
            frozen.append(counts)
            biases.append(bias)
        refreshed = [measure_drops(fn, set_router_bias(params, bias), b)[0]
                     for bias, b in zip(biases, batches[1:])] if args.qb_refresh else []
        out["cf"][str(cf)] = {"P": sizes.send_pool, "R": sizes.recv_capacity, "frozen": summarise(frozen),
                              **({"qb_refreshed": summarise(refreshed)} if refreshed else {}),
                              "wall_s": time.perf_counter() - t0}
        f = out["cf"][str(cf)]["frozen"]
        print(f"  seq {seq_len:5d} cf {cf:4.2f}: total {100 * f['total']:6.2f}%  sender {100 * f['sender']:6.2f}%  "
              f"receiver {100 * f['receiver']:6.2f}%  ce {f['cross_entropy']:.3f}  "
              f"({out['cf'][str(cf)]['wall_s']:.0f} s)", flush=True)
    return out


def summarise(counts: list) -> dict:
    """Fractions pooled over the batches (and layers), plus each batch's total and the per-layer totals."""
    pooled = lambda f: float(np.mean([f(c) for c in counts]))  # batches have equal valid counts
    return {"total": pooled(lambda c: c.fraction("total")), "sender": pooled(lambda c: c.fraction("sender")),
            "receiver": pooled(lambda c: c.fraction("receiver")),
            "per_batch_total": [c.fraction("total") for c in counts],
            "per_layer_total": np.mean([c.layer_fractions() for c in counts], axis=0).tolist(),
            "cross_entropy": pooled(lambda c: c.cross_entropy), "valid": sum(sum(c.valid) for c in counts)}


def print_table(res: dict, cfs: list[float], variant: str) -> None:
    print(f"\n{variant}: total (sender / receiver) dropped, % of valid assignments")
    print("| seq_len | sequences | docs/shard | " + " | ".join(f"cf {cf}" for cf in cfs) + " | cf for <= target |")
    print("|---|---|---|" + "---|" * len(cfs) + "---|")
    for c in res["contexts"]:
        cells = []
        for cf in cfs:
            f = c["cf"][str(cf)][variant]
            cells.append(f"{100 * f['total']:.2f} ({100 * f['sender']:.2f} / {100 * f['receiver']:.2f})")
        need = c["smallest_cf"][variant]
        print(f"| {c['seq_len']} | {c['sequences']} | {c['docs_per_shard_mean']:.1f} | " + " | ".join(cells)
              + f" | {need if need is not None else '> ' + str(max(cfs))} |")


def plot(res: dict, cfs: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = [c["seq_len"] for c in res["contexts"]]
    labels = [f"{c['seq_len']}\n({c['docs_per_shard_mean']:.0f} docs)" for c in res["contexts"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    for ax, part in zip(axes, ("total", "sender", "receiver")):
        for cf in cfs:
            y = [100 * c["cf"][str(cf)]["frozen"][part] for c in res["contexts"]]
            line, = ax.plot(ctx, y, marker="o", label=f"cf {cf}")
            if res["qb_refresh"]:
                y = [100 * c["cf"][str(cf)]["qb_refreshed"][part] for c in res["contexts"]]
                ax.plot(ctx, y, marker="x", ls="--", color=line.get_color())
        ax.axhline(100 * res["target"], color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=0.1, linscale=0.5)  # 0.02% vs 0.2% matters as much as 2% vs 6%
        ax.set_xticks(ctx, labels, fontsize=8)
        ax.set_title(f"{part} dropped")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("% of valid assignments (linear below 0.1)")
    axes[1].set_xlabel("context length (mean documents per shard)")
    axes[0].legend(title="cf_send = cf_recv" + ("\n(dashed: QB refreshed)" if res["qb_refresh"] else ""), fontsize=8)
    fig.suptitle(f"tiny MoE (trained at seq {res['train']['seq_len']}), EP=8 pooled-wave transport, "
                 f"{res['tokens']:,} tokens per batch, held-out KJV", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps at the base context")
    ap.add_argument("--train-seq-len", type=int, default=256)
    ap.add_argument("--train-batch", type=int, default=16, help="sequences per training step")
    ap.add_argument("--heldout", type=float, default=0.2, help="data.heldout_fraction (never trained on)")
    ap.add_argument("--contexts", default="256,512,2048,8192")
    ap.add_argument("--cfs", default="1.0,1.15,1.25,1.5,2.0")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per measured batch, at every context")
    ap.add_argument("--batches", type=int, default=1, help="held-out batches per context")
    ap.add_argument("--qb-refresh", action="store_true")
    ap.add_argument("--target", type=float, default=0.03, help="drop fraction the 'cf needed' column aims at")
    ap.add_argument("--run-dir", help="train here, or reuse the finished run there (default: a temp dir)")
    ap.add_argument("--out", default="runs/drops_context", help="where the JSON and PNG go (runs/ is git-ignored)")
    ap.add_argument("--replot", help="only redraw the PNG of an existing drops_context.json (into --out)")
    args = ap.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.cfs = [float(x) for x in args.cfs.split(",")]
    if args.qb_refresh and args.batches < 2:
        ap.error("--qb-refresh needs --batches >= 2 (batch i's QB bias routes batch i + 1)")
    return args


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        res = json.loads(Path(args.replot).read_text())
        plot(res, [float(cf) for cf in res["contexts"][0]["cf"]], out / "drops_context.png")
        return
    with tempfile.TemporaryDirectory(prefix="bench_drops_") as tmp:
        run_dir = Path(args.run_dir or tmp) / "tiny-ep8-drops"
        cfg = train_config(args)
        t0 = time.perf_counter()
        summary = train(cfg, run_dir, RunOptions(wandb="disabled", progress=False, peak_flops=1e11))
        train_s = time.perf_counter() - t0
        loaded = load_run(run_dir)
    cfg, mesh = loaded.cfg, make_mesh(loaded.cfg.parallel)
    # The train step's forward: the fp32 upcast of the bf16 compute copy (router bias fp32 throughout).
    params = replicate(jax.tree.map(lambda x: x.astype(jnp.float32), loaded.params), mesh)
    print(f"trained {loaded.step} steps at seq {cfg.train.seq_len} x {cfg.train.batch_size} in {train_s:.0f} s: "
          f"train loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}, eval loss "
          f"{summary.get('eval/loss', float('nan')):.3f}, last step's drops {100 * summary['drop_fraction']:.2f}%",
          flush=True)
    res = {"train": {"steps": loaded.step, "seq_len": cfg.train.seq_len, "batch_size": cfg.train.batch_size,
                     "cf": TRAIN_CF, "wall_s": train_s, "summary": summary},
           "mesh": dict(mesh.shape), "tokens": args.tokens, "target": args.target, "qb_refresh": args.qb_refresh,
           "batches": args.batches, "contexts": []}
    t1 = time.perf_counter()
    for seq_len in args.contexts:
        c = measure_context(args, cfg, params, mesh, seq_len)
        variants = ("frozen", "qb_refreshed") if args.qb_refresh else ("frozen",)
        c["smallest_cf"] = {v: smallest_cf(args.cfs, [c["cf"][str(cf)][v]["total"] for cf in args.cfs], args.target)
                            for v in variants}
        res["contexts"].append(c)
    res["measure_wall_s"] = time.perf_counter() - t1
    (out / "drops_context.json").write_text(json.dumps(res, indent=1, default=float))
    plot(res, args.cfs, out / "drops_context.png")
    m = cfg.model
    print(f"\ndevices {jax.device_count()} x {jax.devices()[0].device_kind}; mesh {dict(mesh.shape)}; tiny model "
          f"{m.n_layers} layers, {m.n_experts} experts top-{m.top_k}; {args.tokens:,} tokens per batch "
          f"({args.tokens // batch_shards(mesh):,} per shard), {args.batches} held-out batch(es) per context; "
          f"measuring took {res['measure_wall_s']:.0f} s")
    for v in variants:
        print_table(res, args.cfs, v)
    print(f"\nwrote {out / 'drops_context.json'} and {out / 'drops_context.png'}")


if __name__ == "__main__":
    main()
