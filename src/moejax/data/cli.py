"""Subcommands of this package (registered into `moejax` by `register`).

  moejax data prepare --source NAME=PATH[,PATH...] ... --tokenizer SPEC --out DIR
  moejax data check [--preset P] [--set data.store=DIR ...] [--verify] [--steps N]
"""

from __future__ import annotations

import json


def register(sub) -> None:
    """Add this package's subparsers to the `moejax` command."""
    d = sub.add_parser("data", help="prepare and check token stores")
    dsub = d.add_subparsers(dest="data_cmd", required=True)

    p = dsub.add_parser("prepare", help="tokenise text/JSONL/Parquet sources into a token store")
    p.add_argument("--source", action="append", required=True, metavar="NAME=PATH[,PATH...]",
                   help="a named source: files, directories, or builtin:kjv (repeatable)")
    p.add_argument("--tokenizer", required=True, metavar="SPEC",
                   help="bpe:VOCAB (trained on the sources), a path to a tokenizer.json, or llama3")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    p.add_argument("--text-split", default="file", choices=["file", "paragraph", "line"],
                   help="plain text: one document per file, per blank-line-separated paragraph, or per line")
    p.add_argument("--utf8-errors", default="strict", choices=["strict", "replace"],
                   help="invalid UTF-8: reject with file and byte offset (default) or substitute U+FFFD")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store at --out")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=_cmd_prepare)

    c = dsub.add_parser("check", help="open the data of a run config and print its plan and a first batch")
    c.add_argument("--preset", default="tiny")
    c.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="config override (repeatable)")
    c.add_argument("--steps", type=int)
    c.add_argument("--verify", action="store_true", help="also check every sha256 and token id range of the store")
    c.set_defaults(fn=_cmd_check)


def _cmd_prepare(args) -> int:
    from moejax.data.prepare import parse_source_args, prepare
    from moejax.data.sources import ReadOptions

    opts = ReadOptions(text_field=args.text_field, split=args.text_split, utf8_errors=args.utf8_errors)
    m = prepare(parse_source_args(args.source), args.tokenizer, args.out, opts, overwrite=args.overwrite,
                progress=not args.no_progress)
    tok = m["tokenizer"]
    print(f"wrote {args.out}: tokenizer {tok['spec']} ({tok['vocab_size']} ids, eos {tok['eos_id']})")
    for name, s in m["sources"].items():
        print(f"  {name}: {s['documents']:,} documents, {s['tokens']:,} tokens, {s['text_bytes']:,} bytes "
              f"({s['text_bytes'] / max(s['tokens'], 1):.2f} bytes/token), {s['skipped_empty']} empty skipped")
    return 0


def _cmd_check(args) -> int:
    from dataclasses import replace

    from moejax.config import apply_overrides
    from moejax.presets import preset
    from moejax.data.pipeline import kjv_store, make_data
    from moejax.data.store import open_store

    cfg = apply_overrides(preset(args.preset), args.set or [])
    if args.steps is not None:
        cfg = replace(cfg, train=replace(cfg.train, steps=args.steps))
    if args.verify:  # the named store, or the embedded corpus's (prepared into the cache on first use)
        path = cfg.data.store or kjv_store(cfg.model.vocab_size).path
        store = open_store(path, verify=True)
        print(f"verified {path}: {store.verified_files} files match their sha256, every token id is below "
              f"{store.vocab_size}")
    with make_data(replace(cfg, data=replace(cfg.data, prefetch=0))) as data:
        b = data.train.batch(0)
        print(json.dumps(data.describe(), indent=2))
        print(f"first batch: {b['tokens'].shape[0]} x {b['tokens'].shape[1]} tokens, "
              f"{int(b['segment_ids'].max(axis=1).sum())} document pieces, "
              f"loss on {float(b['loss_mask'].mean()):.1%} of positions")
    return 0
