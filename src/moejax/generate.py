"""`moejax generate`: continue a prompt with a trained run's weights, streaming text as tokens come.

  moejax generate RUN_DIR [--checkpoint STEP] --prompt TEXT [--max-new-tokens N] [--temperature T]
                  [--top-p P] [--seed S]

The newest complete checkpoint (or STEP's) gives the compute-dtype weights and the QB router bias
(`weights.load_run`); the run's tokenizer comes from its data config (`data.pipeline.run_tokenizer`);
`model.decode.generate_tokens` decodes with a KV cache. The prompt is one document from position 0;
generation stops at `--max-new-tokens` or at the end-of-document token. stdout gets only the
continuation; a timing line goes to stderr. XLA compilations are cached on disk
(`$MOEJAX_CACHE/jax`, default ~/.cache/moejax/jax), so a second call on the same model starts faster.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from moejax.config import ConfigError


class TextStream:
    """Incremental detokenisation: text of all ids so far, minus what was already printed. A byte-level
    BPE token can end inside a UTF-8 character; such text ends in U+FFFD and waits for the next token."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.done = tokenizer, [], 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.done = text[self.done:], len(text)
        return new

    def flush(self) -> str:
        text = self.tok.decode(self.ids)
        new, self.done = text[self.done:], len(text)
        return new


# The global layers' KV cache is allocated for the prompt plus every new token at once: 10^12 new tokens filled the
# host's memory until the kernel killed the process. A million is far past any sensible continuation.
MAX_NEW_TOKENS = 1 << 20
SEED_RANGE = (-(1 << 63), 1 << 63)  # jax.random.key takes a 64-bit integer


def check_options(max_new_tokens: int, temperature: float, top_p: float, seed: int = 0) -> None:
    if not 0 < max_new_tokens <= MAX_NEW_TOKENS:
        raise ConfigError(f"--max-new-tokens ({max_new_tokens}) must be from 1 to {MAX_NEW_TOKENS:,}")
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ConfigError(f"--seed ({seed}) must fit in 64 bits (from -2**63 to 2**63 - 1)")
    if not 0 <= temperature < float("inf"):
        raise ConfigError(f"--temperature ({temperature}) must be a finite number >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top-p ({top_p}) must be in (0, 1]")


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes the shell couldn't decode (surrogate escapes): the tokenizer's TypeError
        raise ConfigError(f"--prompt is not valid UTF-8 text (at character {e.start})") from None
    ids = [int(i) for i in tokenizer.encode_batch([prompt])[0]]
    if not ids:
        raise ConfigError(f"--prompt {prompt!r} has no tokens")
    return ids


def generate(run_dir: str | Path, prompt: str, *, step: int | None = None, max_new_tokens: int = 64,
             temperature: float = 0.8, top_p: float = 0.95, seed: int = 0, out: TextIO | None = None) -> dict:
    """Stream the continuation to `out` (default stdout); returns token counts and timings (seconds)."""
    from moejax.compile_cache import enable_compile_cache
    from moejax.data.pipeline import run_tokenizer
    from moejax.model.decode import generate_tokens
    from moejax.weights import choose_checkpoints, load_run, run_config

    check_options(max_new_tokens, temperature, top_p, seed)
    out = out or sys.stdout
    t0 = time.perf_counter()
    cfg = run_config(Path(run_dir))
    choose_checkpoints(Path(run_dir), step)  # no checkpoint: fail before building the tokenizer
    tokenizer = run_tokenizer(cfg)
    ids = encode_prompt(tokenizer, prompt)
    enable_compile_cache()
    loaded = load_run(run_dir, step, "compute")
    t_loaded = time.perf_counter()
    stream, n_new, t_first = TextStream(tokenizer), 0, None
    for tok, _ in generate_tokens(loaded.params, cfg.model, ids, max_new_tokens, temperature=temperature,
                                  top_p=top_p, seed=seed, eos_id=tokenizer.eos_id, n_valid=tokenizer.vocab_size):
        t_first = t_first or time.perf_counter()
        if tok == tokenizer.eos_id:
            break
        n_new += 1
        out.write(stream.push(tok))
        out.flush()
    out.write(stream.flush() + "\n")
    out.flush()
    t_end = time.perf_counter()
    rate = (n_new - 1) / (t_end - t_first) if n_new > 1 else 0.0
    return {"step": loaded.step, "prompt_tokens": len(ids), "new_tokens": n_new, "load_s": t_loaded - t0,
            "first_token_s": t_first - t_loaded, "tokens_per_s": rate}


def _cmd_generate(args) -> int:
    s = generate(args.run_dir, args.prompt, step=args.checkpoint, max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    print(f"moejax: step {s['step']} weights; {s['prompt_tokens']} prompt + {s['new_tokens']} new tokens; "
          f"load {s['load_s']:.2f} s, first token {s['first_token_s']:.2f} s, "
          f"{s['tokens_per_s']:.1f} tokens/s after it", file=sys.stderr)
    return 0


def register(sub) -> None:
    """Add the `generate` subparser to the `moejax` command."""
    g = sub.add_parser("generate", help="continue a prompt with a run's newest (or a named) checkpoint")
    g.add_argument("run_dir")
    g.add_argument("--checkpoint", type=int, metavar="STEP", help="use this step's checkpoint (default: newest)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (1 = off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same text)")
    g.set_defaults(fn=_cmd_generate)
