"""Benchmark the routed-expert paths on 8 forced CPU host devices (not a test; numbers go to docs/LOG.md).

1. Forward+backward wall time of the dropless local path on one device vs the pooled-wave transport on
   an EP=8 mesh at equal global tokens, measured in the same run.
2. Drop fraction (sender / receiver split) vs capacity factor for a random router (distinct top-k).

On CPU the 8 host devices share the same cores, so EP gains no compute. The local path runs the blocked
grouped GEMM (`moejax.model.moe.grouped`); before 2026-11-30 it used `jax.lax.ragged_dot`, a dense masked
matmul per expert group on CPU (the 2026-11-30 transport entry in docs/LOG.md was measured with that).
Usage: python bench/bench_moe_transport.py [--tokens 4096] [--experts 64] [--top-k 4] [--latent 256] ...
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

from moejax.parallel.mesh import BATCH_AXES, MESH_AXES  # noqa: E402
from moejax.model.moe.experts import routed_local  # noqa: E402
from moejax.parallel.expert_parallel import routed_expert_parallel, transport_sizes  # noqa: E402


def make_inputs(key, tokens, experts, top_k, latent, width):
    ks = jax.random.split(key, 6)
    z = jax.random.normal(ks[0], (tokens, latent))
    expert = jax.vmap(lambda k: jax.random.permutation(k, experts)[:top_k])(jax.random.split(ks[1], tokens))
    weight = jax.nn.softmax(jax.random.normal(ks[2], (tokens, top_k)), axis=-1) * 2.5
    mask = jnp.ones((tokens,), bool)
    wg, wu = (jax.random.normal(k, (experts, latent, width)) / math.sqrt(latent) for k in ks[3:5])
    wd = jax.random.normal(ks[5], (experts, width, latent)) / math.sqrt(width)
    return [z, expert.astype(jnp.int32), weight, mask, wg, wu, wd]


def fwd_bwd(fn):
    """jit of d(sum y^2)/d(z, weight, w_gate, w_up, w_down)."""
    def loss(*args):
        y = fn(*args)
        y = y[0] if isinstance(y, tuple) else y
        return jnp.sum(jnp.square(y))
    return jax.jit(jax.grad(loss, argnums=(0, 2, 4, 5, 6)))


def time_it(f, args, reps):
    jax.block_until_ready(f(*args))  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--latent", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--local-reps", type=int, default=2, help="the local path is slow on CPU, see below")
    a = ap.parse_args()

    args = make_inputs(jax.random.key(0), a.tokens, a.experts, a.top_k, a.latent, a.width)
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(1, 1, 8, 1), MESH_AXES,
                             axis_types=(AxisType.Auto,) * 4)
    tok, exp = NamedSharding(mesh, PartitionSpec(BATCH_AXES)), NamedSharding(mesh, PartitionSpec("expert"))
    ep_args = [jax.device_put(x, tok if i < 4 else exp) for i, x in enumerate(args)]
    local_args = [jax.device_put(x, devices[0]) for x in args]

    print(f"# routed experts fwd+bwd: T={a.tokens} global tokens, E={a.experts}, K={a.top_k}, "
          f"Z={a.latent}, F={a.width}, fp32, {len(devices)} CPU host devices, waves={a.waves}")
    t_local = time_it(fwd_bwd(routed_local), local_args, a.local_reps)
    ep = lambda cf: fwd_bwd(lambda *x: routed_expert_parallel(*x, mesh=mesh, waves=a.waves, cf_send=cf, cf_recv=cf))
    t_ep = time_it(ep(1.15), ep_args, a.reps)
    print("| path | devices | fwd+bwd ms |\n|---|---|---|")
    print(f"| routed_local (dropless) | 1 | {t_local * 1e3:.1f} |")
    print(f"| pooled-wave EP, cf 1.15 | 8 | {t_ep * 1e3:.1f} |")
    print(f"EP8 / local time ratio: {t_ep / t_local:.2f}  (median of {a.reps} / {a.local_reps} runs)")

    print(f"\n# drop fraction vs capacity factor (cf_send = cf_recv), random router, EP=8, waves={a.waves}")
    print("| cf | P | R | dropped | sender | receiver |\n|---|---|---|---|---|---|")
    for cf in (1.0, 1.15, 1.5):
        _, stats = jax.jit(lambda *x: routed_expert_parallel(*x, mesh=mesh, waves=a.waves, cf_send=cf,
                                                             cf_recv=cf))(*ep_args)
        s = {k: int(v) for k, v in stats._asdict().items()}
        assert s["kept"] + s["sender_dropped"] + s["receiver_dropped"] == s["valid"], s
        sz = transport_sizes(a.tokens // 8, a.top_k, 8, a.experts // 8, a.waves, cf, cf, a.latent, 4)
        v = s["valid"]
        print(f"| {cf:.2f} | {sz.send_pool} | {sz.recv_capacity} | {(s['sender_dropped'] + s['receiver_dropped']) / s['valid']:.4f} | "
              f"{s['sender_dropped'] / v:.4f} | {s['receiver_dropped'] / v:.4f} |")


if __name__ == "__main__":
    main()
