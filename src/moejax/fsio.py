"""Atomic file writes: the one helper every module uses to publish a file.

A reader sees the old file or the new one, never half of either: write a temp file beside the target
(same filesystem, dot-prefixed so listings skip it), fsync it, rename it over the target, fsync the
directory so the rename survives a crash. A failed write removes its temp file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: str | os.PathLike) -> Path:
    """The temp file `atomic_write*` uses for `path` (`.NAME.tmp-PID`; a killed writer may leave one)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_chunks(path: str | os.PathLike, chunks: Iterable[bytes]) -> None:
    """Replace `path` with the concatenated `chunks` atomically, streaming: memory stays flat for any size."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace `path` with `data` (str is written as UTF-8) atomically."""
    atomic_write_chunks(path, [data.encode() if isinstance(data, str) else data])
