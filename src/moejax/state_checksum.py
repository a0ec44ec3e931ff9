"""Checksums of a state's arrays, saved with a checkpoint and checked when it is restored.

Orbax stores no checksum of the array data (zarr3 checks only its shard index), so a bit flipped on disk
restores silently (docs/LOG.md, thirty-fifth session's checkpoint fuzz). Each leaf gets two 32-bit sums of its
bytes read as 32-bit words (2-byte and 1-byte elements widened to one word each):

    plain = sum(w) mod 2^32          mixed = sum((w ^ (w >> 16)) * 0x9E3779B1) mod 2^32

Sums are exact and independent of order, so any sharding, any process count and a host (numpy) or device
(XLA) reduction give the same bits: a checkpoint saved on one mesh checks on another. One flipped bit always
changes `plain`; `mixed` catches changes that cancel in it. Leaves are named by their path ("params/embed").

Device-memory leaves are reduced on device, one jitted call per device set. Leaves in `pinned_host` memory
(the hero's offloaded master weights and optimizer state) are reduced with numpy on each process's own
shards, in chunks on a thread pool, so none is copied to an accelerator; a multi-process job then adds the
processes' sums (a collective). So are a CPU backend's arrays: on this 2-core CPU numpy reduces 1 GiB in
0.3-0.4 s, XLA:CPU in 0.7 s.
"""

from __future__ import annotations

import concurrent.futures
import os

import jax
import jax.numpy as jnp
import numpy as np

MIX = 0x9E3779B1  # an odd constant (2^32 / golden ratio): the product is a bijection on 32-bit words
CHUNK_WORDS = 1 << 24  # 64 MB: numpy's temporaries a thread holds
MASK = (1 << 32) - 1
NUMPY_ON_CPU = True  # the tests turn it off to run the device (XLA) reduction on CPU


def leaf_name(path) -> str:
    """"params/blocks/attn/wq" for the path of any pytree (a dataclass's fields, dicts, lists alike), so a
    partial restore of {"params": …} names its leaves as the whole TrainState did."""
    parts = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def checksums(tree) -> dict[str, str]:
    """{leaf name: "plain:mixed" in hex} for every array leaf with at least one element (a collective in a
    multi-process job: call it on every process)."""
    flat = [(leaf_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if hasattr(x, "dtype") and np.size(x) > 0]
    on_host = [(n, x) for n, x in flat if _host_resident(x)]
    on_device = [(n, x) for n, x in flat if not _host_resident(x)]
    sums = {}
    groups: dict[tuple, list] = {}  # one jitted call per device set (a mesh's arrays, a committed scalar)
    for n, x in on_device:
        groups.setdefault(tuple(sorted(d.id for d in x.sharding.device_set)), []).append((n, x))
    for group in groups.values():
        got = np.asarray(jax.device_get(_device_sums([x for _, x in group])), dtype=np.uint64)
        sums.update({n: (int(a), int(b)) for (n, _), (a, b) in zip(group, got)})
    if on_host:
        local = np.array(_host_sums([x for _, x in on_host]), dtype=np.uint64)  # this process's shards
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            local = np.asarray(multihost_utils.process_allgather(local), dtype=np.uint64).sum(axis=0)
        sums.update({n: (int(a) & MASK, int(b) & MASK) for (n, _), (a, b) in zip(on_host, local)})
    return {n: f"{a:08x}:{b:08x}" for n, (a, b) in sorted(sums.items())}


def mismatches(saved, tree) -> list[str]:
    """The leaves of `tree` whose checksums differ from `saved`'s, a `checksums` entry read back from JSON
    (leaves it lacks are not checked: a zero-size leaf). None (written before checksums) checks nothing; any
    other non-map is damage, not "unchecked": TypeError naming its type."""
    if saved is None:
        return []
    if not isinstance(saved, dict):
        raise TypeError(type(saved).__name__)
    now = checksums(tree)
    return [n for n, c in now.items() if n in saved and saved[n] != c]


def named(bad: list[str]) -> str:
    """"w" or "w and 2 more": the first mismatching leaf, for one error line."""
    return bad[0] + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")


def _host_resident(x) -> bool:
    """Numpy's leaves: host arrays, pinned_host ones, and a CPU backend's (its "device" memory is the host's,
    and numpy's threads reduce it faster than XLA:CPU here)."""
    if isinstance(x, np.ndarray | np.generic):
        return True
    sharding = x.sharding
    on_cpu = NUMPY_ON_CPU and next(iter(sharding.device_set)).platform == "cpu"
    return sharding.memory_kind == "pinned_host" or on_cpu


def _words_np(a: np.ndarray) -> np.ndarray:
    """The array's bytes as 32-bit words, flat (2- and 1-byte elements one word each, 8-byte two)."""
    a = np.ascontiguousarray(a).reshape(-1)
    if a.dtype.itemsize == 4:
        return a.view(np.uint32)
    if a.dtype.itemsize == 8:
        return a.view(np.uint32)  # little-endian word pairs, as XLA's bitcast gives them
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8).astype(np.uint32)


def _sums_np(words: np.ndarray) -> tuple[int, int]:
    """One chunk's sums (numpy releases the GIL here: chunks run on a thread each)."""
    plain = int(words.sum(dtype=np.uint64))
    mixed = int(((words ^ (words >> np.uint32(16))) * np.uint32(MIX)).sum(dtype=np.uint64))
    return plain & MASK, mixed & MASK


def _host_sums(leaves: list) -> list[tuple[int, int]]:
    """This process's share of each leaf's sums: each distinct shard once (replica 0 of it), cut into chunks
    that a thread pool reduces (the hero's offloaded state is ~270 GB a host: one thread would take minutes)."""
    parts = []  # (leaf index, words of one chunk)
    for i, x in enumerate(leaves):
        if isinstance(x, np.ndarray | np.generic):
            shards = [np.asarray(x)] if jax.process_index() == 0 else []
        else:
            shards = [np.asarray(s.data) for s in x.addressable_shards if s.replica_id == 0]
        for words in map(_words_np, shards):
            parts += [(i, words[j:j + CHUNK_WORDS]) for j in range(0, words.size, CHUNK_WORDS)]
    sums = [[0, 0] for _ in leaves]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1)) as pool:
        for (i, _), (a, b) in zip(parts, pool.map(lambda part: _sums_np(part[1]), parts)):
            sums[i][0] += a
            sums[i][1] += b
    return [(a & MASK, b & MASK) for a, b in sums]


def _words_jnp(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
    return jax.lax.bitcast_convert_type(x, jnp.uint16 if size == 2 else jnp.uint8).astype(jnp.uint32)


@jax.jit
def _device_sums(leaves: list[jax.Array]) -> jax.Array:
    """[n, 2] uint32: each leaf's (plain, mixed); uint32 sums wrap mod 2^32, as the definition says."""
    def sums(x):
        w = _words_jnp(x)
        mixed = (w ^ (w >> 16)) * jnp.uint32(MIX)
        return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(mixed, dtype=jnp.uint32)])

    return jnp.stack([sums(x) for x in leaves])
