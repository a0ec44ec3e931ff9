"""Atomic file writes: the one helper every module uses to publish a file.

A reader sees the old file or the new one, never half of either: write a temp file beside the target
(same filesystem, dot-prefixed so listings skip it), fsync it, rename it over the target, fsync the
directory so the rename survives a crash. A failed write removes its temp file.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace `path` with `data` (str is written as UTF-8) atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    payload = data.encode() if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
