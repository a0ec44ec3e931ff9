"""`moejax data prepare`: read sources, tokenise in parallel, write a token store atomically.

Parallelism comes from the tokenizer's own batch encoder (Rust threads for `tokenizers`, a thread pool for
tiktoken): documents are handed over in batches of ~`batch_bytes`, which keeps every core busy without
pickling text across processes. The BPE for `bpe:VOCAB` is trained on all sources (one extra read pass).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moejax.data.sources import ReadOptions, SourceError, expand_paths, input_bytes, read_documents
from moejax.data.store import SOURCE_NAME, STORE_FILES, NpyAppender, StoreError, StoreWriter, new_manifest, token_dtype
from moejax.data.tokenizer import tokenizer_from_spec


def parse_source_args(items: list[str]) -> dict[str, list[str]]:
    """`NAME=PATH[,PATH...]` strings -> {name: [paths]}."""
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, paths = item.partition("=")
        if not sep or not paths:
            raise SourceError(f"--source {item!r} is not NAME=PATH[,PATH...]")
        if not SOURCE_NAME.match(name):
            raise SourceError(f"--source name {name!r} must be letters, digits, '_', '.', '-' (not starting with one "
                              "of the last three)")
        if name in STORE_FILES:  # its directory would be the store's own file of that name
            raise SourceError(f"--source name {name!r} is one of the store's own files ({', '.join(STORE_FILES)})")
        if name in out:
            raise SourceError(f"--source {name!r} is given twice")
        out[name] = [p for p in paths.split(",") if p]
        if not out[name]:
            raise SourceError(f"--source {item!r} names no file")
    if not out:
        raise SourceError("at least one --source NAME=PATH is required")
    return out


def _refuse_repeated_files(files: dict[str, list[str]]) -> None:
    """A file read twice (named twice, in two sources, or inside a named directory) would put its documents in
    twice, and the held-out split of one copy into the training set of the other."""
    seen: dict[str, str] = {}
    for name, fs in files.items():
        for f in fs:
            key = f if f == "builtin:kjv" else os.path.realpath(f)
            if key in seen:
                where = f"source {name!r}" if seen[key] == name else f"sources {seen[key]!r} and {name!r}"
                raise SourceError(f"{f} is read twice ({where}); name each file once")
            seen[key] = name


def prepare(sources: dict[str, list[str]], tokenizer_spec: str, out: str, opts: ReadOptions = ReadOptions(),
            overwrite: bool = False, progress: bool = True, batch_bytes: int = 1 << 22) -> dict:
    """Build the store at `out`; returns its manifest. Nothing is left at `out` (or beside it) on failure."""
    files = {name: expand_paths(paths) for name, paths in sources.items()}  # fail on missing files first
    _refuse_repeated_files(files)
    try:
        writer = StoreWriter(Path(out), overwrite)
    except OSError as e:  # a read-only or full disk: one line
        raise StoreError(f"cannot create the store {out}: {e.strerror or e} ({e.filename or out})") from None
    try:
        tok = _tokenizer(tokenizer_spec, files, opts)
        manifest = new_manifest(tok, token_dtype(tok.vocab_size))
        total = sum(input_bytes(f) for fs in files.values() for f in fs)
        with tqdm(total=total, unit="B", unit_scale=True, desc="tokenise", disable=not progress) as bar:
            for name, fs in files.items():
                manifest["sources"][name] = _write_source(writer, name, fs, tok, opts, batch_bytes, bar)
        tok.save(writer.tmp / "tokenizer.json")
        np.save(writer.tmp / "bytes_per_token.npy", tok.bytes_per_token().astype(np.int32))
        writer.commit(manifest)
    except OSError as e:  # a full or read-only disk mid-write
        writer.abort()
        raise StoreError(f"cannot write the store {out}: {e.strerror or e} ({e.filename or writer.tmp})") from None
    except BaseException:
        writer.abort()
        raise
    return manifest


def _tokenizer(spec: str, files: dict[str, list[str]], opts: ReadOptions):
    def all_docs():
        for fs in files.values():
            for f in fs:
                yield from read_documents(f, opts)

    try:
        tok = tokenizer_from_spec(spec, all_docs)
    except SourceError:
        raise
    except ValueError as e:
        raise StoreError(str(e)) from None
    return tok


def _write_source(writer: StoreWriter, name: str, files: list[str], tok, opts: ReadOptions, batch_bytes: int,
                  bar) -> dict:
    tok_path, off_path = writer.source_paths(name)
    tokens, offsets = NpyAppender(tok_path, token_dtype(tok.vocab_size)), NpyAppender(off_path, np.int64)
    offsets.append(np.zeros(1, np.int64))
    stats = {"files": files, "documents": 0, "tokens": 0, "text_bytes": 0, "skipped_empty": 0}
    for f in files:
        docs_in_file, pending, pending_bytes = 0, [], 0
        for text in read_documents(f, opts):
            if not text:
                stats["skipped_empty"] += 1
                continue
            pending.append(text)
            pending_bytes += len(text)
            docs_in_file += 1
            if pending_bytes >= batch_bytes:
                _encode_into(pending, tok, tokens, offsets, stats, f)
                bar.update(pending_bytes)
                pending, pending_bytes = [], 0
        _encode_into(pending, tok, tokens, offsets, stats, f)
        bar.update(pending_bytes)
        if docs_in_file == 0:
            raise SourceError(f"{f}: no non-empty documents (source {name!r})")
    if stats["documents"] < 2:  # data check and train will refuse the store: say so now
        print(f"moejax: warning: source {name!r} holds 1 document; training needs >= 2 per source (one is held "
              f"out for eval; a text file is one document unless --text-split paragraph|line)", file=sys.stderr)
    tokens.close(), offsets.close()
    return stats


def _encode_into(texts: list[str], tok, tokens: NpyAppender, offsets: NpyAppender, stats: dict, f: str) -> None:
    if not texts:
        return
    encoded = tok.encode_batch(texts)
    lens = np.array([len(e) + 1 for e in encoded], np.int64)
    flat = np.concatenate([np.append(e, tok.eos_id) for e in encoded])
    if flat.size and (flat.min() < 0 or flat.max() >= tok.vocab_size):  # a tokenizer bug, caught before it lands
        raise StoreError(f"{f}: tokenizer {tok.spec} produced id {int(flat.max())} outside its vocabulary of "
                         f"{tok.vocab_size}")
    tokens.append(flat)
    offsets.append(stats["tokens"] + np.cumsum(lens))
    stats["documents"] += len(texts)
    stats["tokens"] += int(lens.sum())
    stats["text_bytes"] += sum(len(t.encode("utf-8")) for t in texts)
