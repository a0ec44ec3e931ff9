"""moejax's train step beside a plain PyTorch MoE stack of the same shape, in one run (not a test).

Issue 11's targets compare against "a mainstream PyTorch MoE": 49% MFU on the 2-core CPU shape, ~30,000
tokens/s at shape G on one H200. Those figures were measured once, elsewhere; this script measures the
baseline on the machine at hand, step for step beside moejax's own jitted step, so the ratio is one run's.

The PyTorch stack is written here, the way such stacks are (Qwen2-MoE / Mixtral style), at the moejax config's
sizes: token embedding; per layer RMSNorm -> GQA attention with RoPE through `F.scaled_dot_product_attention`
(causal over the whole sequence, `n_kv_heads` KV heads) -> RMSNorm -> MoE (softmax router, top-k, weights
renormalised; routed SwiGLU experts d_model -> expert_width -> d_model; one shared SwiGLU expert of width
n_shared x shared_width behind a sigmoid gate); final RMSNorm, untied LM head, cross-entropy; AdamW (fused on
CUDA, foreach on CPU). The routed experts run one of two ways (`--experts`):
  loop        HF-style: one gather, three matmuls and an `index_add_` per expert that received tokens;
  grouped_mm  rows sorted by expert, `torch._grouped_mm` for the three GEMMs (bf16 on Hopper; torch >= 2.8).
What it leaves out of moejax's recipe: the latent transport, GatedNorm, SConv, QK-norm, local/global layers,
QB balancing, the z-loss, the hero optimizer. So its FLOPs differ; each side's MFU counts its own model FLOPs
by the same rules (`accounting.fwd_flops_per_token`'s: 2 x MACs of the matmuls, full-sequence scores and
values, 3 FLOPs a score for the softmax; training = 3 x forward) against the same peak.

Peak: on CPU the fp32 1024^3 matmul measured through jax before the steps and after each round, the highest
reading (as bench_train_step.py); on GPU the bf16 8192^3 one (`perf.job_peak`). torch's own matmul peak is
printed beside it. Each stack runs in a worker process of its own (in one process their thread pools and
allocators slowed each other: docs/LOG.md, fortieth session), and the two alternate step by step (which one goes
first swaps each step), so a busy shared machine slows both alike; `--sequential` runs one stack's steps, then
the other's, with one worker alive at a time (the GPU session's part: both at G don't fit together). Each worker
runs with the `moejax` command's CPU allocator (`moejax.hostmem` re-executes it).

Shapes: `--shape cpu` (issue 11's CPU shape: d256, 4 layers, 4 heads x 64, 32 experts top-4, expert width 128,
vocab 8,192, seq 256, batch 16, fp32; moejax in its bench_train_step.py config) or `--shape G` (d1024, 12
layers, 8 heads x 128, 64 experts top-8, expert width 512, vocab 32,768, seq 4096, batch 8; bf16 autocast for
PyTorch, moejax as bench_gpu.py's fast layout: unrolled, no remat).
moejax's optimizer is plain Adam (`--moejax-optimizer hero` for the preset's): like for like with AdamW.

Needs torch (`pip install -e '.[bench-torch]'`, torch 2.13.0; its CPU build from PyTorch's index, see
pyproject.toml; the GPU machine has its own). `--check` compares the two expert paths with a per-token dense
reference (values and gradients in fp32; on CUDA also values in bf16) and exits non-zero on a mismatch.

Usage: python bench/bench_torch_moe.py [--shape cpu|G] [--steps 10] [--warmup 2] [--experts auto|loop|grouped_mm]
                                        [--only both|torch|moejax] [--moejax-optimizer adam|hero] [--check]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Workers and this process each hold the GPU at once: jax must not take 75% of its memory at start; PyTorch's
# allocator grows its segments instead of fragmenting them (the eager stack at G holds ~65-80 GB).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError:  # one line, no traceback: the bench needs an optional package
    sys.exit("bench_torch_moe.py needs PyTorch: pip install torch==2.13.0 (the CPU build: "
             "--index-url https://download.pytorch.org/whl/cpu)")

CHECK_RTOL = 1e-5  # fp32: the expert paths differ only in summation order
CHECK_BF16_NORM = 2e-2  # bf16 GEMMs (8 bits of mantissa) against the same ops' dense reference under autocast
# SDPA takes fewer KV heads itself from torch 2.5; before, KV heads are repeated first (as HF's sdpa path does)
SDPA_GQA = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


@dataclasses.dataclass(frozen=True)
class Dims:
    """The PyTorch stack's sizes, taken from a moejax ModelConfig and the batch shape."""
    vocab: int
    d: int
    layers: int
    heads: int
    head_dim: int
    kv_heads: int
    experts: int
    top_k: int
    expert_width: int
    shared_width: int  # one shared expert this wide (moejax: n_shared experts of shared_width each)
    seq: int
    batch: int

    @classmethod
    def of(cls, cfg) -> "Dims":
        m, t = cfg.model, cfg.train
        return cls(vocab=m.vocab_size, d=m.d_model, layers=m.n_layers, heads=m.n_heads, head_dim=m.head_dim,
                   kv_heads=m.n_kv_heads, experts=m.n_experts, top_k=m.top_k, expert_width=m.expert_width,
                   shared_width=m.n_shared * m.shared_width, seq=t.seq_len, batch=t.batch_size)


def fwd_flops_per_token(x: Dims) -> float:
    """The PyTorch stack's forward FLOPs a token, by `moejax.accounting.fwd_flops_per_token`'s rules."""
    q, kv = x.heads * x.head_dim, x.kv_heads * x.head_dim
    per_layer = (2 * (x.d * q + 2 * x.d * kv + q * x.d)  # QKV + O projections
                 + 2 * 2 * x.heads * x.head_dim * x.seq  # scores + weighted values, the whole sequence
                 + 3 * x.heads * x.seq  # softmax (accounting.SOFTMAX_FLOPS_PER_SCORE)
                 + 2 * x.d * x.experts  # router
                 + 2 * x.top_k * 3 * x.d * x.expert_width  # routed experts
                 + 2 * 3 * x.d * x.shared_width + 2 * x.d)  # shared expert and its gate
    return x.layers * per_layer + 2 * x.d * x.vocab  # LM head


# ---- the PyTorch stack -------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x, cos, sin):
    """Rotary embedding of [B, H, S, hd] by [S, hd/2] angle tables (rotate-half form)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, x: Dims):
        super().__init__()
        self.h, self.kv, self.hd = x.heads, x.kv_heads, x.head_dim
        self.q = nn.Linear(x.d, x.heads * x.head_dim, bias=False)
        self.k = nn.Linear(x.d, x.kv_heads * x.head_dim, bias=False)
        self.v = nn.Linear(x.d, x.kv_heads * x.head_dim, bias=False)
        self.o = nn.Linear(x.heads * x.head_dim, x.d, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.hd).transpose(1, 2)  # [B, H, S, hd]
        k = self.k(x).view(b, s, self.kv, self.hd).transpose(1, 2)  # [B, KV, S, hd]
        v = self.v(x).view(b, s, self.kv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if SDPA_GQA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
        else:
            k, v = (t.repeat_interleave(self.h // self.kv, dim=1) for t in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, self.h * self.hd))


class SwiGLU(nn.Module):
    def __init__(self, d: int, width: int):
        super().__init__()
        self.gate, self.up = nn.Linear(d, width, bias=False), nn.Linear(d, width, bias=False)
        self.down = nn.Linear(width, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Routed experts' weights stacked ([E, d, w], [E, w, d]) so both expert paths read the same tensors."""

    def __init__(self, x: Dims, experts: str):
        super().__init__()
        self.e, self.k, self.path = x.experts, x.top_k, experts
        self.router = nn.Linear(x.d, x.experts, bias=False)
        init = lambda *shape, fan_in: nn.Parameter(torch.randn(*shape) / math.sqrt(fan_in))
        self.w_gate = init(x.experts, x.d, x.expert_width, fan_in=x.d)
        self.w_up = init(x.experts, x.d, x.expert_width, fan_in=x.d)
        self.w_down = init(x.experts, x.expert_width, x.d, fan_in=x.expert_width)
        self.shared = SwiGLU(x.d, x.shared_width) if x.shared_width else None
        self.shared_gate = nn.Linear(x.d, 1, bias=False)

    def route(self, x):
        """[T, K] expert ids and their renormalised softmax weights."""
        probs = self.router(x).float().softmax(dim=-1)
        w, sel = probs.topk(self.k, dim=-1)
        return sel, (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        sel, w = self.route(x)
        out = (self.grouped if self.path == "grouped_mm" else self.loop)(x, sel, w)
        if self.shared is not None:
            out = out + self.shared(x) * torch.sigmoid(self.shared_gate(x))
        return out.view(shape)

    def _expert(self, e, rows):
        return (F.silu(rows @ self.w_gate[e]) * (rows @ self.w_up[e])) @ self.w_down[e]

    def loop(self, x, sel, w):
        out = torch.zeros_like(x)
        # as HF's code does: the experts hit (a host sync), then a `where` (another) and three GEMMs each
        for e in torch.bincount(sel.flatten(), minlength=self.e).nonzero().flatten().tolist():
            tok, slot = torch.where(sel == e)
            out.index_add_(0, tok, (self._expert(e, x[tok]) * w[tok, slot, None]).to(x.dtype))
        return out

    def grouped(self, x, sel, w):
        flat = sel.flatten()  # [T*K], token-major
        order = flat.argsort(stable=True)
        tok = order // self.k
        offs = torch.bincount(flat, minlength=self.e).cumsum(0).to(torch.int32)  # each expert's end row
        dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        rows = x.to(dt)[tok]  # cast, then gather: a T*K-row gather of fp32 would be twice the bytes
        gate = torch._grouped_mm(rows, self.w_gate.to(dt), offs=offs)
        up = torch._grouped_mm(rows, self.w_up.to(dt), offs=offs)
        y = torch._grouped_mm(F.silu(gate) * up, self.w_down.to(dt), offs=offs)
        return torch.zeros_like(x).index_add_(0, tok, (y * w.flatten()[order, None]).to(x.dtype))

    def dense_reference(self, x):
        """Every expert on every token, weighted by a dense [T, E] matrix with zeros off the top-k (the slow
        reference `--check` compares both paths with)."""
        sel, w = self.route(x)
        dense_w = torch.zeros(x.shape[0], self.e, dtype=w.dtype, device=x.device).scatter(1, sel, w)
        ys = torch.stack([self._expert(e, x) for e in range(self.e)], dim=1)  # [T, E, d]
        return (ys * dense_w[..., None]).sum(dim=1)


class Block(nn.Module):
    def __init__(self, x: Dims, experts: str):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(x.d), Attention(x)
        self.moe_norm, self.moe = RMSNorm(x.d), MoE(x, experts)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.moe(self.moe_norm(x))


class TorchMoE(nn.Module):
    def __init__(self, x: Dims, experts: str):
        super().__init__()
        self.dims = x
        self.embed = nn.Embedding(x.vocab, x.d)
        self.blocks = nn.ModuleList(Block(x, experts) for _ in range(x.layers))
        self.norm, self.lm_head = RMSNorm(x.d), nn.Linear(x.d, x.vocab, bias=False)
        inv = 1.0 / 10_000.0 ** (torch.arange(0, x.head_dim, 2).float() / x.head_dim)
        angles = torch.outer(torch.arange(x.seq).float(), inv)  # [S, hd/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, self.dims.vocab), targets.reshape(-1))


def torch_train_step(model, device: torch.device, autocast: torch.dtype | None):
    """The stack's training step: (tokens, targets) -> loss, one AdamW update, finished when it returns."""
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=fused, foreach=not fused)

    def step(tokens, targets) -> float:
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)  # .item(): waits for the step on a GPU

    return step


def check_expert_paths() -> None:
    """Loop and grouped_mm against the dense reference: values and the gradients of x and every expert weight,
    fp32, random sizes with experts left empty. Exits 1 naming the first mismatch."""
    torch.manual_seed(0)
    x_dims = Dims(vocab=64, d=32, layers=1, heads=2, head_dim=16, kv_heads=1, experts=7, top_k=3, expert_width=24,
                  shared_width=0, seq=8, batch=2)
    for tokens in (1, 5, 37):
        moe = MoE(x_dims, "loop")
        x = torch.randn(tokens, x_dims.d, requires_grad=True)
        grads = {}
        for path in ("dense", "loop", "grouped_mm"):
            x.grad = None
            moe.zero_grad()
            y = moe.dense_reference(x) if path == "dense" else (moe.loop if path == "loop" else moe.grouped)(
                x, *moe.route(x))
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            grads[path] = [y.detach(), x.grad] + [p.grad for p in (moe.w_gate, moe.w_up, moe.w_down, moe.router.weight)]
        for path in ("loop", "grouped_mm"):
            for name, a, b in zip(("y", "dx", "dw_gate", "dw_up", "dw_down", "drouter"), grads[path], grads["dense"]):
                if not torch.allclose(a, b, rtol=CHECK_RTOL, atol=CHECK_RTOL * b.abs().max().item()):
                    sys.exit(f"check: {path} {name} at {tokens} tokens differs from the dense reference by "
                             f"{(a - b).abs().max().item():.3g} (largest {b.abs().max().item():.3g})")
    print(f"check: loop and grouped_mm equal the dense reference (values and 5 gradients, rtol {CHECK_RTOL}, "
          "1 / 5 / 37 tokens, 7 experts top-3)")
    if torch.cuda.is_available() and hasattr(torch, "_grouped_mm"):  # what the GPU run takes: bf16 autocast
        moe = MoE(dataclasses.replace(x_dims, d=256, expert_width=128, experts=64, top_k=8), "loop").cuda()
        x = torch.randn(1000, 256, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref = moe.dense_reference(x).float()
            ys = {path: fn(x, *moe.route(x)).float() for path, fn in (("loop", moe.loop), ("grouped_mm", moe.grouped))}
        for path, y in ys.items():
            err = ((y - ref).norm() / ref.norm()).item()
            if not err < CHECK_BF16_NORM:
                sys.exit(f"check: {path} on CUDA in bf16 differs from the dense reference by {err:.3g} norm-wise")
        print(f"check: on CUDA in bf16 (1,000 tokens, 64 experts top-8) loop and grouped_mm are within "
              f"{CHECK_BF16_NORM} of the dense reference, norm-wise")


# ---- the comparison ----------------------------------------------------------------------------------------
def configs(args):
    """(moejax RunConfig as its own bench times it, the PyTorch stack's autocast dtype on a GPU)."""
    if args.shape == "cpu":
        from bench_train_step import bench_config
        cfg, autocast = bench_config(True, args.moejax_optimizer), None
    else:
        from bench_gpu import shape_g, smoke
        cfg = smoke(shape_g()) if args.smoke else shape_g()
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, scan_layers=False))
        autocast = torch.bfloat16
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, optimizer=args.moejax_optimizer,
                                                              remat=args.moejax_remat)), autocast


def batches(cfg, shape: str, n: int) -> list[dict]:
    """The same n batches in every worker: the corpus's on CPU, bench_gpu.py's synthetic ones at shape G."""
    if shape == "cpu":
        from moejax.data.pipeline import make_data
        with make_data(cfg) as data:
            return [data.train.batch(i) for i in range(n)]
    from bench_gpu import synthetic_batch
    return [synthetic_batch(cfg, seed=i) for i in range(n)]


def torch_stack(cfg, autocast, experts: str, data: list[dict]):
    """(step on batch i -> loss, what ran, the first step's loss) for the PyTorch stack on this machine's device,
    its first step done. `auto` takes grouped_mm on CUDA and falls back to the loop if this torch can't run it."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if experts == "auto":
        if device.type == "cuda" and hasattr(torch, "_grouped_mm"):
            try:
                return torch_stack(cfg, autocast, "grouped_mm", data)
            except RuntimeError as e:  # a torch whose grouped GEMM wants another GPU, dtype or alignment
                print(f"bench_torch_moe.py: grouped_mm failed ({str(e).splitlines()[0]}); timing the loop instead",
                      file=sys.stderr)
            torch.cuda.empty_cache()  # the failed stack's memory, now that nothing holds it
        experts = "loop"
    torch.manual_seed(0)
    step = torch_train_step(TorchMoE(Dims.of(cfg), experts).to(device), device,
                            autocast if device.type == "cuda" else None)
    tb = [(torch.as_tensor(b["tokens"], dtype=torch.long, device=device),
           torch.as_tensor(b["targets"], dtype=torch.long, device=device)) for b in data]
    loss = step(*tb[0])
    about = f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads, experts {experts}"
    return (lambda i: step(*tb[i])), about, loss


def moejax_stack(cfg, data: list[dict]):
    """(step on batch i -> loss, what ran, the first step's loss) for moejax's jitted train step
    (bench_train_step.py's), compiled and its first step done."""
    import jax
    from bench_train_step import compiled_step
    placed = [jax.device_put(b) for b in data]
    fn, state, _ = compiled_step(cfg, placed[0])  # its first step, on batch 0
    holder = {"state": state}

    def step(i: int) -> float:
        holder["state"], metrics = jax.block_until_ready(fn(holder["state"], placed[i]))
        return float(metrics["train/loss"])

    return step, f"jax {jax.__version__} on {jax.devices()[0].platform}", float("nan")


def serve(args) -> None:
    """A worker: one stack, set up with its first step (compile) on batch 0, then one step per `i` read from
    stdin, each answered with its own wall seconds and loss. Alone in its process: the two stacks' thread pools
    and allocators never meet (in one process, alternating slowed moejax's CPU step by 1.2-1.3x and PyTorch's
    by 1.1-1.5x against each alone)."""
    from moejax import hostmem
    hostmem.exec_with_host_memory()  # the allocator the `moejax` command runs with (may re-execute)
    cfg, autocast = configs(args)
    data = batches(cfg, args.shape, args.warmup + args.steps)
    t0 = time.perf_counter()
    step, about, _ = torch_stack(cfg, autocast, args.experts, data) if args.worker == "PyTorch" else \
        moejax_stack(cfg, data)
    print(f"ready {time.perf_counter() - t0:.3f} {about}", flush=True)
    for line in sys.stdin:
        i = int(line)
        t0 = time.perf_counter()
        loss = step(i)
        print(f"{time.perf_counter() - t0:.6f} {loss:.6f}", flush=True)


def start_worker(name: str, args) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", name, "--shape", args.shape, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--experts", args.experts, "--moejax-optimizer", args.moejax_optimizer,
           *(["--moejax-remat"] if args.moejax_remat else []), *(["--smoke"] if args.smoke else [])]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)


def ask(proc: subprocess.Popen, name: str) -> list[str]:
    line = proc.stdout.readline()
    if not line:
        sys.exit(f"bench_torch_moe.py: the {name} worker exited ({proc.wait()}); its error is above")
    return line.split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("cpu", "G"), default="cpu")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per stack")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (moejax's first compiles)")
    ap.add_argument("--experts", choices=("auto", "loop", "grouped_mm"), default="auto",
                    help="the PyTorch stack's routed experts (auto: grouped_mm on CUDA when torch has it, else loop)")
    ap.add_argument("--only", choices=("both", "PyTorch", "moejax"), default="both")
    ap.add_argument("--moejax-optimizer", choices=("adam", "hero"), default="adam")
    ap.add_argument("--moejax-remat", action="store_true", help="moejax's step with remat")
    ap.add_argument("--sequential", action="store_true",
                    help="one stack's steps, then the other's, one worker alive at a time (shape G's two stacks take "
                         "~115 GB together: on a GPU under 100 GB)")
    ap.add_argument("--smoke", action="store_true", help="shape G at CPU size: checks the script, not the machine")
    ap.add_argument("--check", action="store_true", help="check the PyTorch expert paths, then exit")
    ap.add_argument("--worker", choices=("PyTorch", "moejax"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.check:
        check_expert_paths()
        return
    if args.warmup < 1 or args.steps < 1:
        ap.error(f"--warmup ({args.warmup}) and --steps ({args.steps}) must be >= 1: the first step compiles")
    if args.worker:
        serve(args)
        return

    import jax
    from moejax import accounting
    from moejax.perf import job_peak, measure_matmul_peak

    cfg, _ = configs(args)
    on_gpu = jax.default_backend() == "gpu"
    names = ["PyTorch", "moejax"] if args.only == "both" else [args.only]
    peak_of = (lambda: measure_matmul_peak(repeats=3)) if not on_gpu else \
        (lambda: job_peak()["peak_flops_per_unit"])
    peaks = [peak_of()]
    first, about, times, losses = {}, {}, {k: [] for k in names}, {}
    for group in ([[name] for name in names] if args.sequential else [names]):
        workers = {}
        try:
            for name in group:  # one at a time: the compiles don't share the machine either
                workers[name] = start_worker(name, args)
                ready = ask(workers[name], name)
                first[name], about[name] = float(ready[1]), " ".join(ready[2:])
            for i in range(1, args.warmup + args.steps):
                for name in (group if i % 2 else group[::-1]):
                    print(i, file=workers[name].stdin, flush=True)
                    seconds, losses[name] = map(float, ask(workers[name], name))
                    times[name].append(seconds)
                if not on_gpu:  # between the steps, while the workers wait
                    peaks.append(peak_of())
        finally:
            for proc in workers.values():
                proc.stdin.close()
                proc.wait()
    peak = max(peaks)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch_peak = _torch_matmul_peak(device)

    dims = Dims.of(cfg)
    tokens = dims.batch * dims.seq
    flops = {"PyTorch": 3 * fwd_flops_per_token(dims) * tokens,
             "moejax": accounting.train_flops(cfg.model, cfg.train.seq_len, tokens)}
    print(f"device: {jax.devices()[0].device_kind}; " + "; ".join(f"{k}: {v}" for k, v in about.items()))
    print(f"shape {args.shape}: d_model {dims.d}, {dims.layers} layers, {dims.heads} heads x {dims.head_dim} "
          f"({dims.kv_heads} KV), {dims.experts} experts top-{dims.top_k}, expert width {dims.expert_width}, vocab "
          f"{dims.vocab:,}, batch {dims.batch} x seq {dims.seq} = {tokens:,} tokens/step; PyTorch "
          f"{'bf16 autocast' if on_gpu else 'fp32'}, AdamW; moejax {cfg.model.compute_dtype}, "
          f"optimizer {cfg.train.optimizer}, remat {cfg.train.remat}, scan_layers {cfg.train.scan_layers}")
    what = "fp32 1024^3" if not on_gpu else "bf16 8192^3"
    print(f"peak ({what} matmul through jax): {peak / 1e12:.3f} TFLOP/s, the highest of {len(peaks)} readings "
          f"(lowest {min(peaks) / 1e12:.3f}); torch's own {what} matmul: {torch_peak / 1e12:.3f} TFLOP/s")
    how = "one stack after the other" if args.sequential else "the two alternating step by step"
    print(f"timed: median of {args.steps} steps after {args.warmup} warm-up steps, each stack in its own process, "
          f"{how}\n")
    print("| stack | setup + 1st step (s) | step (ms, median) | min / max (ms) | tokens/s | model FLOPs/step | MFU "
          "| mean step (ms) | last loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    med = {}
    for name in names:
        ts = times[name][args.warmup - 1:]
        med[name] = float(np.median(ts))
        print(f"| {name} | {first[name]:.1f} | {1e3 * med[name]:.1f} | {1e3 * min(ts):.1f} / {1e3 * max(ts):.1f} | "
              f"{tokens / med[name]:,.0f} | {flops[name]:.4g} | {100 * flops[name] / med[name] / peak:.2f}% | "
              f"{1e3 * float(np.mean(ts)):.1f} | {losses[name]:.3f} |")
    if len(med) == 2:
        print(f"\nmoejax / PyTorch: tokens/s {med['PyTorch'] / med['moejax']:.2f}x, "
              f"MFU {flops['moejax'] / med['moejax'] / (flops['PyTorch'] / med['PyTorch']):.2f}x")


def _torch_matmul_peak(device: torch.device) -> float:
    """FLOP/s of torch's fastest of 5 matmuls (fp32 1024^3 on CPU, bf16 8192^3 on CUDA)."""
    from moejax.perf import _fastest
    n, dtype = (1024, torch.float32) if device.type == "cpu" else (8192, torch.bfloat16)
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    (a @ b), sync()
    return 2.0 * n**3 / _fastest(lambda: ((a @ b), sync()), 5)


if __name__ == "__main__":
    main()
