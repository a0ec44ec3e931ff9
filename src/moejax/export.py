"""`moejax export`: a run's weights as safetensors, with the resolved model config and the tokenizer.

  moejax export RUN_DIR --out DIR [--dtype bf16|fp32] [--checkpoint STEP]

DIR holds (tensor names, shapes and conventions: docs/EXPORT.md):
  model-00001-of-0000N.safetensors  the tensors, a new file whenever one would pass SHARD_BYTES
  model.safetensors.index.json      Hugging Face style: {"metadata": {"total_size": ...}, "weight_map": {name: file}}
  config.json                       {"format": "moejax-export/1", "model": {...}, "derived": {...}, "dtype", "step",
                                     "tokenizer": {...}, "run_config": {...}, "source": {...}}
  tokenizer.json                    the run's Hugging Face tokenizer (absent for llama3: Meta's file, by name)

Notable choices:
- Names unstack the scanned L axis (`layers.{i}.moe.w_gate`), so each tensor is one layer's, as other
  frameworks expect; matrices stay `[fan_in, fan_out]` (y = x @ W), not PyTorch's [out, in].
- Values come from the fp32 master weights cast to --dtype (bf16 equals the run's bf16 compute copy); the
  router bias is the train state's fp32 QB bias and stays fp32 at any --dtype (routing ties are decided
  by it).
- Written under a temporary sibling directory and renamed into place; an existing --out is replaced only
  when it is empty or an earlier export holding nothing an export doesn't write (else: one-line error,
  nothing touched).
- `load_export` / `init_params_from_export` read it back (`train --init-from EXPORT_DIR` starts a new run
  from it); `tests/test_export.py` checks an export reproduces the checkpoint's logits exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

import jax
import numpy as np

from moejax import state_checksum
from moejax.config import ConfigError, ModelConfig, first_line
from moejax.model.transformer import Transformer

FORMAT = "moejax-export/1"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
SHARD_BYTES = 2 << 30
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
FP32_ALWAYS = ("router_bias",)  # leaf names exported in fp32 whatever --dtype says


class ExportError(ConfigError):
    """An unusable --out, export directory or tensor set; one line (exit 2)."""


# ---- names ------------------------------------------------------------------------------------------
def _leaf_name(path) -> str:
    return ".".join(k.name for k in path)  # Transformer and its parts are dataclasses: GetAttrKey entries


def to_tensors(params: Transformer, router_bias_fp32: bool = True) -> dict[str, np.ndarray]:
    """{name: numpy array} in export order: top-level tensors, then layers.0.*, layers.1.*, ..."""
    top, per_layer = {}, []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name, arr = _leaf_name(path), np.asarray(leaf)
        if name.startswith("blocks."):
            per_layer.append((name[len("blocks."):], arr))
        else:
            top[name] = arr
    out = {k: top[k] for k in ("embed", *[n for n in top if n.startswith("embed_norm.")])}
    n_layers = per_layer[0][1].shape[0]
    for i in range(n_layers):
        out.update({f"layers.{i}.{name}": np.ascontiguousarray(arr[i]) for name, arr in per_layer})
    out.update({k: v for k, v in top.items() if k not in out})
    return out


def from_tensors(tensors: dict, cfg: ModelConfig) -> Transformer:
    """Inverse of `to_tensors`: host numpy arrays in their stored dtypes; names and shapes are checked
    against cfg."""
    abstract = jax.eval_shape(lambda k: Transformer.init(cfg, k), jax.random.key(0))
    expected = set()

    def leaf(path, x):
        name = _leaf_name(path)
        stacked = name.startswith("blocks.")
        names = [f"layers.{i}.{name[len('blocks.'):]}" for i in range(cfg.n_layers)] if stacked else [name]
        shape = tuple(x.shape[1:] if stacked else x.shape)
        expected.update(names)
        for n in names:
            if n not in tensors:
                raise ExportError(f"export has no tensor {n!r}")
            if tuple(tensors[n].shape) != shape:
                raise ExportError(f"tensor {n!r} has shape {tuple(tensors[n].shape)} in the export, {shape} "
                                  "from its config")
        return np.stack([np.asarray(tensors[n]) for n in names]) if stacked else np.asarray(tensors[name])

    params = jax.tree_util.tree_map_with_path(leaf, abstract)
    extra = sorted(set(tensors) - expected)
    if extra:
        raise ExportError(f"export has tensors its config does not explain: {', '.join(extra[:3])}")
    return params


def shard_plan(tensors: dict[str, np.ndarray], shard_bytes: int) -> list[list[str]]:
    """Names grouped in order into files of at most shard_bytes (a larger tensor gets a file of its own)."""
    shards, size = [[]], 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += arr.nbytes
    return shards


# ---- writing ----------------------------------------------------------------------------------------
def is_export(path: Path) -> bool:
    try:
        return (path / INDEX).is_file() and json.loads((path / CONFIG).read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _written_by_export(name: str) -> bool:
    return name in (INDEX, CONFIG, TOKENIZER) or SHARD_NAME.fullmatch(name) is not None


def check_out(out: Path) -> None:
    """--out must be new, an empty directory, or an earlier export holding nothing else (which is then replaced
    whole: a file a user added there, or a run copied into it, would go with it)."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not is_export(out):
            raise ExportError(f"--out {out} is a non-empty directory that is not an earlier export; "
                              "choose another directory")
        others = sorted(p.name for p in out.iterdir() if not _written_by_export(p.name))
        if others:
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            raise ExportError(f"--out {out} is an earlier export that also holds what no export writes ({shown}); "
                              "move that away or choose another directory")


def derived(cfg: ModelConfig) -> dict:
    """Numbers another framework would otherwise re-derive from the config's rules."""
    heads = np.arange(cfg.n_heads)
    return {"global_layers": list(cfg.global_layers), "q_dim": cfg.q_dim, "kv_dim": cfg.kv_dim,
            "kv_head_of_query_head_local": (heads // (cfg.n_heads // cfg.n_kv_heads)).tolist(),
            "kv_head_of_query_head_global": (heads // (cfg.n_heads // cfg.n_kv_heads_global)).tolist()}


def write_export(tmp: Path, tensors: dict[str, np.ndarray], config: dict, tokenizer, shard_bytes: int) -> None:
    from safetensors.numpy import save_file

    shards = shard_plan(tensors, shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, tmp / fname, metadata={"format": FORMAT})
        os.chmod(tmp / fname, 0o644)  # safetensors creates 0600; the other files follow the umask
        weight_map.update({n: fname for n in names})
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values())), "format": FORMAT},
             "weight_map": weight_map}
    (tmp / INDEX).write_text(json.dumps(index, indent=2))
    has_file = tokenizer is not None and hasattr(tokenizer, "tok")  # HFTokenizer; llama3 is Meta's file
    if has_file:
        tokenizer.save(tmp / TOKENIZER)
    if tokenizer is not None:
        config["tokenizer"] = {"file": TOKENIZER if has_file else None, "spec": tokenizer.spec,
                               "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
                               "eos_token": tokenizer.eos_token,
                               # not saved in tokenizer.json: text quoting a special token stays text
                               "encode_special_tokens": bool(has_file and tokenizer.tok.encode_special_tokens)}
    (tmp / CONFIG).write_text(json.dumps(config, indent=2))


def _remove_dead_writers(out: Path) -> None:
    """The half-written dirs that exports to `out` killed on this host left (kill -9, an OOM kill): a writer's
    dir names its host and PID, so only this host's, of processes that are gone, are removed; another host's
    export (a shared filesystem) or a live one here is left alone."""
    mine = re.compile(rf"^\.{re.escape(out.name)}\.tmp-{re.escape(socket.gethostname())}-(\d+)-[0-9a-f]{{8}}$")
    for p in out.parent.iterdir():
        if (m := mine.match(p.name)) and p.is_dir() and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def _swap_into_place(tmp: Path, out: Path) -> None:
    if out.exists():  # empty, or an earlier export: move it aside, rename, then delete it
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def export_run(run_dir: str | Path, out: str | Path, dtype: str = "bf16", step: int | None = None,
               shard_bytes: int = SHARD_BYTES) -> dict:
    """Write the export; returns {"out", "step", "files", "tensors", "bytes"}."""
    from moejax.data.pipeline import run_tokenizer
    from moejax.weights import load_run

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    out = Path(out)
    check_out(out)
    loaded = load_run(run_dir, step, "params")
    cfg = loaded.cfg
    cast = lambda path, x: x if _leaf_name(path).endswith(FP32_ALWAYS) else x.astype(DTYPES[dtype])
    tensors = to_tensors(jax.tree_util.tree_map_with_path(cast, loaded.params))
    config = {"format": FORMAT, "model": dataclasses.asdict(cfg.model), "derived": derived(cfg.model),
              "dtype": DTYPES[dtype], "fp32_always": list(FP32_ALWAYS), "step": loaded.step,
              "source": {"run_dir": str(Path(run_dir).absolute()), "checkpoint": str(loaded.path)},
              "run_config": cfg.to_dict(), "checksums": state_checksum.checksums(tensors)}
    tmp = out.parent / f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_writers(out)
        tmp.mkdir()
        write_export(tmp, tensors, config, run_tokenizer(cfg), shard_bytes)
        _swap_into_place(tmp, out)
    except OSError as e:  # a full disk, a read-only place, a file where a directory should be
        raise ExportError(f"cannot write the export to {out}: {e.strerror or e}; nothing was replaced") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    return {"out": str(out), "step": loaded.step, "files": files, "tensors": len(tensors),
            "bytes": sum(a.nbytes for a in tensors.values())}


# ---- reading ----------------------------------------------------------------------------------------
def load_export(path: str | Path) -> tuple[ModelConfig, Transformer, dict]:
    """(model config, weights as host numpy arrays in their stored dtypes, config.json)."""
    from safetensors import safe_open

    path = Path(path)
    if not is_export(path):
        raise ExportError(f"{path} is not a moejax export (no {INDEX} and {CONFIG} of format {FORMAT})")
    config = json.loads((path / CONFIG).read_text())
    index = json.loads((path / INDEX).read_text())
    try:
        cfg = ModelConfig(**config["model"])
    except (TypeError, ValueError) as e:
        raise ExportError(f"{path / CONFIG}: model config is not valid ({e})") from None
    tensors = {}
    for fname in sorted(set(index["weight_map"].values())):
        if not (path / fname).is_file():
            raise ExportError(f"{path / fname} is missing (named in {INDEX})")
        with safe_open(path / fname, framework="flax") as f:  # the numpy reader lacks bfloat16
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    _check_checksums(path, config, tensors)
    return cfg, from_tensors(tensors, cfg), config


def _check_checksums(path: Path, config: dict, tensors: dict) -> None:
    """The tensors are what was exported (`state_checksum`, as checkpoints have it); exports made before
    checksums load unchecked."""
    try:
        bad = state_checksum.mismatches(config.get("checksums"), tensors)
    except TypeError as e:
        raise ExportError(f"{path / CONFIG}'s checksums are {e}, not a map of tensor to checksum") from None
    if bad:
        raise ExportError(f"{path} is damaged: tensor {state_checksum.named(bad)} changed on disk since it was "
                          f"exported (its checksum differs from {CONFIG}'s)")


def check_export(path: str | Path, model_config: dict) -> None:
    """What `init_params_from_export` would refuse, read cheaply (config.json, the index, each shard's header)
    before a run starts: `train --init-from` checks it before the new run dir is written."""
    from safetensors import safe_open

    from moejax.checkpoint import CheckpointError, check_compatible

    path = Path(path)
    try:
        check_compatible(json.loads((path / CONFIG).read_text())["model"], model_config)
        files = set(json.loads((path / INDEX).read_text())["weight_map"].values())
        for fname in sorted(files):
            with safe_open(path / fname, framework="flax") as f:
                f.keys()
    except CheckpointError:  # another model's weights: its own line
        raise
    except Exception as e:  # a malformed index, a missing or truncated shard (safetensors' errors are its own)
        raise ExportError(f"{path} is damaged ({type(e).__name__}: {first_line(e)})") from None


def init_params_from_export(path: str | Path, like: Transformer, model_config: dict) -> Transformer:
    """fp32 weights (the [L, E] router bias included) of an export, placed like `like` (for --init-from)."""
    from moejax.checkpoint import check_compatible

    try:
        cfg, params, _ = load_export(path)
    except ExportError:
        raise
    except Exception as e:  # a shard truncated past its header: one line, not safetensors' traceback
        raise ExportError(f"{path} is damaged ({first_line(e)})") from None
    check_compatible(dataclasses.asdict(cfg), model_config)
    return jax.tree.map(lambda a, x: jax.device_put(a.astype(np.float32), x.sharding), params, like)


def _cmd_export(args) -> int:
    s = export_run(args.run_dir, args.out, args.dtype, args.checkpoint)
    print(f"exported step {s['step']}: {s['tensors']} tensors, {s['bytes'] / 2**20:.1f} MiB in "
          f"{len(s['files'])} file(s) -> {s['out']}")
    return 0


def register(sub) -> None:
    """Add the `export` subparser to the `moejax` command."""
    e = sub.add_parser("export", help="a run's weights as safetensors + config.json + tokenizer.json")
    e.add_argument("run_dir")
    e.add_argument("--out", required=True, help="new, empty, or an earlier export (replaced)")
    e.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    e.add_argument("--checkpoint", type=int, metavar="STEP", help="export this step (default: newest)")
    e.set_defaults(fn=_cmd_export)
