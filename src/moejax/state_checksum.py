"""Checksums of a state's arrays, saved with a checkpoint and checked when it is restored.

Orbax stores no checksum of the array data (zarr3 checks only its shard index), so a bit flipped on disk
restores silently (docs/LOG.md, thirty-fifth session's checkpoint fuzz). Each leaf gets three 32-bit sums of its
bytes read as 32-bit words w (2-byte and 1-byte elements widened to one word each, 8-byte ones two words, a
last axis of 2):

    plain = sum(w) mod 2^32          mixed = sum((w ^ (w >> 16)) * 0x9E3779B1) mod 2^32
    placed = sum(w * prod_k h_k(i_k)) mod 2^32,   h_k(i) = fmix32(i + k * 0x9E3779B9) | 1

where (i_0, i_1, ...) is the word's index in the whole (global) array and fmix32 is MurmurHash3's finalizer.
Sums are exact and independent of the order they are taken in, so any sharding, any process count and a host
(numpy) or device (XLA) reduction give the same bits: a checkpoint saved on one mesh checks on another. One
flipped bit always changes `plain` (and `placed`: its weights are odd); `mixed` catches changes that cancel in
`plain`; `placed` catches values in the wrong place — two shards, rows or words that trade places, a transpose —
which the other two cannot see. Leaves are named by their path ("params/embed"). Entries written before
`placed` existed hold two sums and are checked on those two.

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
AXIS_STEP = 0x9E3779B9  # h_k's offset per axis, so a square array's transpose changes `placed`
CHUNK_WORDS = 1 << 21  # 8 MB blocks: their temporaries stay in the allocator's reuse (64 MB ones were 1.7x slower)
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
    """{leaf name: "plain:mixed:placed" in hex} for every array leaf with at least one element (a collective in a
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
        sums.update({n: tuple(int(v) for v in row) for (n, _), row in zip(group, got)})
    if on_host:
        local = np.array(_host_sums([x for _, x in on_host]), dtype=np.uint64)  # this process's shards
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            local = np.asarray(multihost_utils.process_allgather(local), dtype=np.uint64).sum(axis=0)
        sums.update({n: tuple(int(v) & MASK for v in row) for (n, _), row in zip(on_host, local)})
    return {n: ":".join(f"{v:08x}" for v in row) for n, row in sorted(sums.items())}


def mismatches(saved, tree) -> list[str]:
    """The leaves of `tree` whose checksums differ from `saved`'s, a `checksums` entry read back from JSON
    (leaves it lacks are not checked: a zero-size leaf). None (written before checksums) checks nothing; any
    other non-map is damage, not "unchecked": TypeError naming its type."""
    if saved is None:
        return []
    if not isinstance(saved, dict):
        raise TypeError(type(saved).__name__)
    now = checksums(tree)
    return [n for n, c in now.items() if n in saved and not _agrees(saved[n], c)]


def _agrees(saved, now: str) -> bool:
    """An entry of two sums (saved before `placed` existed) is checked on those two; anything else that is not
    two or three of them is damage."""
    fields = saved.split(":") if isinstance(saved, str) else []
    return len(fields) in (2, 3) and fields == now.split(":")[:len(fields)]


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
    """The array's bytes as 32-bit words, in its shape (2- and 1-byte elements one word each; 8-byte ones two,
    a last axis of 2: little-endian word pairs, as XLA's bitcast gives them)."""
    a = np.ascontiguousarray(a)
    if a.dtype.itemsize == 4:
        return a.view(np.uint32)
    if a.dtype.itemsize == 8:
        return a.reshape(a.shape + (1,)).view(np.uint32)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8).astype(np.uint32)


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer on uint32 arrays (numpy's or jax's: the same wrapping arithmetic)."""
    u32 = h.dtype.type
    h = h ^ (h >> u32(16))
    h = h * u32(0x85EBCA6B)
    h = h ^ (h >> u32(13))
    h = h * u32(0xC2B2AE35)
    return h ^ (h >> u32(16))


def _axis_weights_np(axis: int, start: int, size: int) -> np.ndarray:
    """h_axis(i) for the global indices start … start + size - 1, uint32."""
    i = np.arange(start, start + size, dtype=np.uint64) + np.uint64(axis * AXIS_STEP)
    return _fmix32((i & np.uint64(MASK)).astype(np.uint32)) | np.uint32(1)


def _sums_np(words: np.ndarray, start: tuple[int, ...]) -> tuple[int, int, int]:
    """One block's sums; `start` is its first word's global index (numpy releases the GIL here: blocks run on a
    thread each). `placed` is taken as sum_r lead_r * (sum_c w[r, c] * h_last(c)) over the block as rows of its last
    axis, lead_r the product of the other axes' weights: two passes over the words, no weight array."""
    plain = int(words.sum(dtype=np.uint64))
    mixed = int(((words ^ (words >> np.uint32(16))) * np.uint32(MIX)).sum(dtype=np.uint64))
    if words.ndim == 0:
        return plain & MASK, mixed & MASK, plain & MASK  # one word, weight 1
    lead = np.ones((), np.uint32)
    for k, (o, n) in enumerate(zip(start[:-1], words.shape[:-1])):  # [rows]: prod_k h_k(i_k), wrapping
        lead = np.multiply.outer(lead, _axis_weights_np(k, o, n))
    last = _axis_weights_np(words.ndim - 1, start[-1], words.shape[-1])
    rows = (words.reshape(-1, words.shape[-1]) * last).sum(axis=1, dtype=np.uint64)  # < 2^64: row < 2^32 words
    rows = (rows & np.uint64(MASK)) * lead.reshape(-1).astype(np.uint64)  # each < 2^64
    placed = int((rows & np.uint64(MASK)).sum(dtype=np.uint64))
    return plain & MASK, mixed & MASK, placed & MASK


def _blocks(shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Index tuples (a slice per axis, so a block keeps every axis and its slices' starts are its first word's
    index) cutting an array of `shape` into C-contiguous blocks of at most CHUNK_WORDS words (or one row of the
    last axis, if that is longer): whole trailing axes, a range of the axis before them, one index of each axis
    before that."""
    if not shape:
        return [()]
    axis = next(a for a in range(len(shape)) if a == len(shape) - 1 or int(np.prod(shape[a + 1:])) <= CHUNK_WORDS)
    rows = max(1, CHUNK_WORDS // int(np.prod(shape[axis + 1:])))
    whole = tuple(slice(0, n) for n in shape[axis + 1:])
    return [tuple(slice(i, i + 1) for i in lead) + (slice(j, min(j + rows, shape[axis])),) + whole
            for lead in np.ndindex(*shape[:axis]) for j in range(0, shape[axis], rows)]


def _host_sums(leaves: list) -> list[tuple[int, int, int]]:
    """This process's share of each leaf's sums: each distinct shard once (replica 0 of it), cut into blocks
    that a thread pool reduces (the hero's offloaded state is ~270 GB a host: one thread would take minutes)."""
    parts = []  # (leaf index, words of one block, its first word's global index)
    for i, x in enumerate(leaves):
        if isinstance(x, np.ndarray | np.generic):
            shards = [(np.asarray(x), (0,) * np.ndim(x))] if jax.process_index() == 0 else []
        else:
            shards = [(np.asarray(s.data), tuple(sl.start or 0 for sl in s.index))
                      for s in x.addressable_shards if s.replica_id == 0]
        for data, offset in shards:
            words = _words_np(data)
            offset = offset + (0,) * (words.ndim - len(offset))  # an 8-byte leaf's word axis
            parts += [(i, words[index], tuple(o + ix.start for o, ix in zip(offset, index)))
                      for index in _blocks(words.shape)]
    sums = [[0, 0, 0] for _ in leaves]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1)) as pool:
        for (i, _, _), got in zip(parts, pool.map(lambda part: _sums_np(part[1], part[2]), parts)):
            sums[i] = [a + b for a, b in zip(sums[i], got)]
    return [tuple(v & MASK for v in row) for row in sums]


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
    """[n, 3] uint32: each leaf's (plain, mixed, placed); uint32 sums wrap mod 2^32, as the definition says. The
    iotas are global indices whatever the sharding (XLA offsets each shard's)."""
    def sums(x):
        w = _words_jnp(x)
        mixed = (w ^ (w >> 16)) * jnp.uint32(MIX)
        weight = jnp.ones(w.shape, jnp.uint32)
        for k in range(w.ndim):
            i = jax.lax.broadcasted_iota(jnp.uint32, w.shape, k) + jnp.uint32((k * AXIS_STEP) & MASK)
            weight = weight * (_fmix32(i) | jnp.uint32(1))
        return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(mixed, dtype=jnp.uint32),
                          jnp.sum(w * weight, dtype=jnp.uint32)])

    return jnp.stack([sums(x) for x in leaves])
