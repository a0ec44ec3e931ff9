"""Reading raw documents for `moejax data prepare`: plain text, JSONL, Parquet and the embedded KJV.

Choices:
  * The format follows the file name: `.txt`/`.text`/`.md` plain text, `.jsonl`/`.ndjson` JSON lines
    (`.gz` of either is read through gzip), `.parquet`. A directory means every such file under it
    (sorted, recursive); `builtin:kjv` is the embedded corpus (one document per chapter).
  * Plain text is one document per file by default (`split="paragraph"`: blank-line separated,
    `"line"`: one per line).
  * Non-UTF-8 bytes are rejected by default, naming the file and the byte offset, because silently
    substituting U+FFFD hides a wrong encoding; `utf8_errors="replace"` opts into substitution.
  * Empty documents are skipped (and counted); an empty or missing file is an error.
Every user-facing problem raises `SourceError` (a ConfigError: the CLI prints it and exits 2), one line
naming the file (and line).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from moejax.config import ConfigError

TEXT_EXT = (".txt", ".text", ".md")
JSONL_EXT = (".jsonl", ".ndjson")
PARQUET_EXT = (".parquet",)
PYARROW_PIN = "pyarrow==26.0.1"


class SourceError(ConfigError):
    """A problem with an input file; the message names the file (and line) and the value."""


@dataclass(frozen=True)
class ReadOptions:
    text_field: str = "text"
    split: str = "file"  # plain text: "file" | "paragraph" | "line"
    utf8_errors: str = "strict"  # "strict" (reject) | "replace"


def file_format(path: str) -> str:
    name = path.lower().removesuffix(".gz")
    for fmt, exts in (("text", TEXT_EXT), ("jsonl", JSONL_EXT), ("parquet", PARQUET_EXT)):
        if name.endswith(exts):
            return fmt
    raise SourceError(f"{path}: unknown file type (expected one of {', '.join(TEXT_EXT + JSONL_EXT + PARQUET_EXT)}"
                      f", optionally .gz)")


def expand_paths(paths: list[str]) -> list[str]:
    """Files named by `paths` (a directory expands to its known files, sorted); errors for missing/empty."""
    out: list[str] = []
    for p in paths:
        if p == "builtin:kjv":
            out.append(p)
        elif os.path.isdir(p):
            found = sorted(str(f) for f in Path(p).rglob("*") if f.is_file() and _known(str(f)))
            if not found:
                raise SourceError(f"{p}: directory has no .txt/.jsonl/.parquet files")
            out.extend(found)
        elif not os.path.exists(p):
            raise SourceError(f"{p}: no such file or directory")
        else:
            file_format(p)
            if os.path.getsize(p) == 0:
                raise SourceError(f"{p}: file is empty")
            out.append(p)
    return out


def _known(path: str) -> bool:
    try:
        file_format(path)
        return True
    except SourceError:
        return False


def input_bytes(path: str) -> int:
    return 4_300_000 if path == "builtin:kjv" else os.path.getsize(path)


def read_documents(path: str, opts: ReadOptions) -> Iterator[str]:
    """Documents of one file, in file order (empty ones included; the writer skips and counts them).
    A corrupt or truncated `.gz`, or a read error, is one SourceError line naming the file."""
    try:
        yield from _documents(path, opts)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise SourceError(f"{path}: corrupt or truncated gzip data ({e})") from None
    except OSError as e:
        raise SourceError(f"{path}: cannot read it ({e.strerror or e})") from None


def _documents(path: str, opts: ReadOptions) -> Iterator[str]:
    if path == "builtin:kjv":
        from moejax.data.corpus import bible_documents

        yield from bible_documents()
        return
    fmt = file_format(path)
    if fmt == "parquet":
        yield from _read_parquet(path, opts.text_field)
    elif fmt == "jsonl":
        yield from _read_jsonl(path, opts)
    else:
        yield from _split_text(_decode(path, _read_bytes(path), opts.utf8_errors), opts.split)


def _read_bytes(path: str) -> bytes:
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
        return f.read()


def _decode(path: str, data: bytes, errors: str, line: int | None = None) -> str:
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        where = f"line {line}, " if line is not None else ""
        raise SourceError(f"{path}: {where}invalid UTF-8 at byte {e.start} ({data[e.start:e.start + 4]!r}); "
                          "fix the encoding or pass --utf8-errors replace") from None


# A blank line (spaces or tabs allowed) in any line-ending convention: a CRLF file was one document. A lone CR
# only where no LF follows, so that one CRLF is one line break, not two.
_NEWLINE = r"(?:\r\n|\n|\r(?!\n))"
PARAGRAPH_BREAK = re.compile(_NEWLINE + r"[ \t]*" + _NEWLINE)


def _split_text(text: str, split: str) -> Iterator[str]:
    if split == "file":
        yield text
    elif split == "line":
        yield from text.splitlines()
    else:
        yield from (p.strip("\r\n") for p in PARAGRAPH_BREAK.split(text))


def _read_jsonl(path: str, opts: ReadOptions) -> Iterator[str]:
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            line = _decode(path, raw, opts.utf8_errors, lineno)
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SourceError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or opts.text_field not in obj:
                raise SourceError(f"{path}: line {lineno} has no {opts.text_field!r} field "
                                  "(choose another with --text-field)")
            text = obj[opts.text_field]
            if not isinstance(text, str):
                raise SourceError(f"{path}: line {lineno}: field {opts.text_field!r} is "
                                  f"{type(text).__name__}, not a string")
            yield text


def _read_parquet(path: str, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SourceError(f"{path}: reading Parquet needs pyarrow, which is not installed "
                          f"(pip install {PYARROW_PIN})") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise SourceError(f"{path}: not a readable Parquet file ({e})") from None
    if text_field not in pf.schema_arrow.names:
        raise SourceError(f"{path}: Parquet file has no column {text_field!r} "
                          f"(columns: {', '.join(pf.schema_arrow.names)}; choose one with --text-field)")
    row = 0
    for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise SourceError(f"{path}: row {row}: column {text_field!r} is {type(text).__name__}, not a string")
            yield text
