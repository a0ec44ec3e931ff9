"""Speed-of-light estimate of a compiled XLA program, from its optimized HLO text alone (no device needed).

Why: most sessions have no GPU, yet the question that matters is how fast the train step *could* run on
one. XLA's cost analysis of a deviceless GPU compile is empty (`cuda_aot`), so this reads the compiled
module itself: every kernel the program launches, each costed as max(FLOPs / peak, bytes / bandwidth)
plus a launch overhead, summed in program order as if no two kernels overlapped.
The sum is an estimate of the step time at that roofline: a lower bound where the FLOP and byte counts
are right, and the MFU it implies an upper bound for the program as compiled.

What counts (`estimate`):
- Executed instructions: the entry computation, while bodies times their known trip count (XLA records
  it in backend_config; an unknown count is taken as 1 and reported), conditionals at their costliest
  branch (an upper bound for a scanned body whose branches are the local and global attention layers),
  calls. A fusion is one kernel; bitcasts, tuples, parameters and constants are free.
- Bytes: each kernel's operands and results, except that an operand a fusion only slices
  (dynamic-slice, slice, gather) costs what is sliced, and a dynamic-update-slice or scatter result (a scan
  writing its residuals or outputs in place; a scatter-add) costs its update.
- FLOPs: 2 x output elements x contracted size for every dot (also inside GEMM fusions, and XLA:GPU's
  cuBLAS calls, `LIBRARY_GEMMS`, whose dimension numbers are in their backend_config); Pallas kernels
  by name (`pallas_flops`: moejax's grouped GEMM exactly, flash attention at its causal half, which
  overstates local layers and rows of several documents, whose blocks the kernel skips; names it doesn't
  know cost bytes only and are listed). Elementwise FLOPs are ignored: on these machines they hide under
  the memory traffic of the same kernel.
What it cannot see: a kernel's real efficiency (tiles, occupancy: XLA's autotuner picks GPU GEMM tiles
only on a device, and the Triton kernels are untuned), caches (every kernel reads HBM), and overlap.

Entry points: `estimate(hlo_text, peak_flops, bandwidth)` and `format_estimate`; `moejax plan --compile`
prints it for the cluster's GPU; `bench/roofline.py` for issue 11's shapes and the CPU step (where the
measured step time checks it).
"""

from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
               "s4": 1, "u4": 1, "token": 0}
# Dense bf16 matmul peak (vendor figure, no sparsity) and HBM bandwidth, for `moejax plan --compile`.
GPU_PEAKS = {"NVIDIA H200": 989e12, "NVIDIA H100": 989e12, "NVIDIA GB200": 2.5e15}
# A dot with fp32 operands runs at best on a GPU's TF32 tensor cores (where XLA's default precision allows it),
# at half the bf16 rate: the datasheets' dense TF32 figures.
GPU_F32_DOT_FRACTION = 0.5
# With operand precision HIGHEST (full fp32, as SPEC §2's router logits were computed) XLA keeps to the fp32 FMA
# units, no TF32: the datasheets' dense FP32 rate (H100/H200 67 TFLOP/s, GB200 80) over their bf16 peak. The
# H200 measured the d1024 rung's router GEMMs at ~45 TFLOP/s (docs/LOG.md 2026-12-04, twenty-first session).
GPU_F32_FMA_FRACTION = {"NVIDIA H200": 67 / 989, "NVIDIA H100": 67 / 989, "NVIDIA GB200": 80 / 2500}
_HIGHEST = re.compile(r"operand_precision\W*highest", re.IGNORECASE)  # a fused dot's attribute, a GEMM's config
# `ns_gpu.gram_add`'s square output tile at its default tiles (NsTiles.bm), which the train step uses: the
# roofline counts the kernel's upper tiles with it (this module imports nothing of moejax's; a test ties the two).
NS_GRAM_TILE = 128
GPU_LAUNCH_S = 3e-6  # per kernel; CUDA graphs can hide some of it

_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = (.+?) ([a-z][a-z0-9\-]*)\((.*?)\)(.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(\S+) \(.*\{\s*$")
_NAME = re.compile(r"%([\w.\-]+)")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "iota", "opt-barrier", "copy-done", "all-reduce-done", "all-gather-done",
         "collective-permute-done", "send-done", "recv-done", "async-done", "async-update", "fusion-done"}
# An asynchronous fusion (XLA 0.11 on GPU makes a scan's dynamic slices of its stacks async): the start is the
# kernel, costed as the fusion it calls (its result tuple repeats the operands, which are not moved); the
# done (in _FREE) only waits for it.
_FUSIONS = {"fusion", "fusion-start"}
_SLICERS = {"dynamic-slice", "slice", "gather"}
# Ops that update their first operand in place: the operand number of the update (a scatter's indices are
# read as well).
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}
# A Pallas kernel's name in its op_name: `.../moejax_grouped_fwd/pallas_call`, or wrapped by autodiff, e.g.
# `transpose(jvp(moejax_grouped_dw))/pallas_call` in an unrolled step's backward.
KERNEL_NAME = re.compile(r'op_name="[^"]*?(moejax_\w+)\)*/pallas_call')


def gpu_f32_fma_peak(peak: float, device_kind: str) -> float:
    """The fp32 FMA rate of a GPU whose bf16 peak is `peak` (the H200's ratio for a GPU not in the table)."""
    return peak * GPU_F32_FMA_FRACTION.get(device_kind, GPU_F32_FMA_FRACTION["NVIDIA H200"])


@dataclasses.dataclass
class Instr:
    name: str
    type: str  # result type text: an array, or a tuple of arrays
    op: str
    operands: list[str]
    args: str  # the operand list as written (a parameter's number, a constant's literal)
    attrs: str  # everything after the operand list

    def called(self, key: str) -> list[str]:
        found = re.search(rf"\b{key}=\{{([^}}]*)\}}", self.attrs) or re.search(rf"\b{key}=%([\w.\-]+)", self.attrs)
        if not found:
            return []
        return _NAME.findall(found.group(1)) if "{" in found.group(0) else [found.group(1)]


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a result type (one for an array, several for a tuple)."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(type_text)
            if dt in DTYPE_BYTES]


def nbytes(type_text: str) -> int:
    return sum(DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in arrays(type_text))


def parse(hlo_text: str) -> tuple[dict[str, list[Instr]], str]:
    """Computations by name (their instructions in order) and the entry computation's name."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = comps.setdefault(header.group(1), [])
            entry = header.group(1) if line.startswith("ENTRY") else entry
            continue
        m = _LINE.match(line)
        if m and current is not None:
            name, type_text, op, operands, attrs = m.groups()
            current.append(Instr(name, type_text, op, _NAME.findall(operands), operands, attrs))
    if not entry:
        raise ValueError("no ENTRY computation in this HLO text")
    return comps, entry


def _dot_flops(ins: Instr, shapes: dict[str, str]) -> float:
    out = arrays(ins.type)
    lhs = arrays(shapes.get(ins.operands[0], ""))
    dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
    if not out or not lhs or not dims:
        return 0.0
    contracted = math.prod(lhs[0][1][int(d)] for d in dims.group(1).split(",") if d)
    return 2.0 * math.prod(out[0][1]) * contracted


# XLA:GPU's library GEMMs (cuBLAS, cuBLASLt; hipBLASLt answers to the same names): XLA emits a dense dot as
# one of these where its autotuner prefers the library to a Triton GEMM fusion (jax 0.11 on an H200 did so
# for most of the step's dots). The dot's dimension numbers are in the call's backend_config; the result is
# a tuple (the product, a workspace) or the product alone.
LIBRARY_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def library_gemm(ins: Instr) -> bool:
    target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    return bool(target) and target.group(1).startswith(LIBRARY_GEMMS)


def _library_gemm_cost(ins: Instr, operand_types: list[str]) -> tuple[float, float]:
    """FLOPs and bytes of a library GEMM call: 2 x product elements x contracted size; its operands (lhs,
    rhs, and a bias if fused) and the product, not the workspace."""
    out, lhs = arrays(ins.type), arrays(operand_types[0]) if operand_types else []
    dims = _GEMM_CONTRACTING.search(ins.attrs)
    if not out or not lhs or not dims:
        return 0.0, nbytes(ins.type) + sum(map(nbytes, operand_types))
    contracted = math.prod(lhs[0][1][int(d)] for d in re.findall(r"\d+", dims.group(1)))
    product = DTYPE_BYTES[out[0][0]] * math.prod(out[0][1])
    return 2.0 * math.prod(out[0][1]) * contracted, product + sum(map(nbytes, operand_types))


def pallas_flops(kernel: str, operand_types: list[str], result_type: str) -> float | None:
    """FLOPs of one of moejax's Pallas kernels from its operands, or None for a kernel it doesn't know."""
    ops = [arrays(t)[0][1] if arrays(t) else () for t in operand_types]
    res = arrays(result_type)
    grouped = kernel.removesuffix("_rows")
    if grouped in ("moejax_grouped_fwd", "moejax_grouped_dx", "moejax_grouped_dx_act", "moejax_grouped_dw"):
        # Operands: two index arrays (expert, used / first, count), then the row maps of the `_rows` variants
        # ([Pd] each, `grouped_gpu`), then the matmul's own (x, w / dy, w, gu / x, dy). Pd = Bk * b rows are
        # computed: a map's length, or the blocks of the first operand [Bk, b, K].
        mapped = kernel != grouped
        rows = ops[2][0] if mapped else ops[2][0] * ops[2][1]
        if grouped == "moejax_grouped_dw":  # (..., x [., Z], dy [., F])
            return 2.0 * rows * ops[-2][-1] * ops[-1][-1]
        first = 2 + sum(len(o) == 1 for o in ops[2:]) if mapped else 2  # the first non-map operand: x or dy
        return 2.0 * rows * ops[first][-1] * res[0][1][-1]  # out [., N] (dx_act: [Bk, b, 2, N])
    if kernel == "moejax_ns_matmul_add":  # (a [N,M,K], b [N,K,P], c [N,M,P])
        n, m, k = ops[0]
        return 2.0 * n * m * k * ops[1][-1]
    if kernel == "moejax_ns_gram":  # (a [N,M,K], c [N,M,M]?): the T(T+1)/2 upper tiles of T x T (`ns_gpu`)
        n, m, k = ops[0]
        bt = math.gcd(NS_GRAM_TILE, m)  # the largest power of two up to the tile that divides M, as ns_gpu's
        t = m // bt
        return 2.0 * n * (t * (t + 1) // 2) * bt ** 2 * k
    matmuls = {"moejax_flash_fwd": 2, "moejax_flash_dq": 3, "moejax_flash_dkv": 4}.get(kernel)
    if matmuls:  # q [B, S, H, D] is the first 4-d operand, k [B, Sk, G, D] the next; causal half
        q, k = [s for s in ops if len(s) == 4][:2]
        return matmuls * 2.0 * q[0] * q[2] * q[1] * k[1] * q[3] * 0.5
    return None


@dataclasses.dataclass
class Cost:
    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    kernels: float = 0.0
    compute_s: float = 0.0  # time of the kernels bound by FLOPs
    memory_s: float = 0.0  # time of the kernels bound by bytes
    items: dict = dataclasses.field(default_factory=dict)  # label -> [seconds, flops, bytes, count]
    unknown: set = dataclasses.field(default_factory=set)

    def add(self, label: str, flops: float, nbytes_: float, peak: float, bw: float, launch: float):
        """One kernel: its time is max(FLOPs / peak, bytes / bw) + launch."""
        t_c, t_m = flops / peak, nbytes_ / bw
        s = max(t_c, t_m) + launch
        self.seconds += s
        self.flops += flops
        self.bytes += nbytes_
        self.kernels += 1
        self.compute_s += t_c if t_c >= t_m else 0.0
        self.memory_s += t_m if t_m > t_c else 0.0
        row = self.items.setdefault(label, [0.0, 0.0, 0.0, 0.0])
        for i, v in enumerate((s, flops, nbytes_, 1.0)):
            row[i] += v

    def merge(self, other: "Cost", times: float = 1.0) -> None:
        for f in ("seconds", "flops", "bytes", "kernels", "compute_s", "memory_s"):
            setattr(self, f, getattr(self, f) + getattr(other, f) * times)
        for label, row in other.items.items():
            mine = self.items.setdefault(label, [0.0, 0.0, 0.0, 0.0])
            for i in range(4):
                mine[i] += row[i] * times
        self.unknown |= other.unknown


class _Walker:
    def __init__(self, comps: dict[str, list[Instr]], peak: float, bw: float, launch: float, count_trips: bool,
                 f32_peak: float | None = None, frames: dict[str, list[str]] | None = None,
                 f32_fma_peak: float | None = None):
        self.comps, self.peak, self.bw, self.launch, self.count_trips = comps, peak, bw, launch, count_trips
        self.frames = frames  # by_source: each instruction's source frames
        self.f32_peak = f32_peak or peak
        self.f32_fma_peak = f32_fma_peak or self.f32_peak
        self.shapes = {i.name: i.type for c in comps.values() for i in c}

    def computation(self, name: str) -> Cost:
        cost = Cost()
        for ins in self.comps[name]:
            self.instruction(ins, cost)
        return cost

    def instruction(self, ins: Instr, cost: Cost) -> None:
        if ins.op in _FREE:
            return
        if ins.op == "while":
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
            if not trips:
                cost.unknown.add(f"while {ins.name}: unknown trip count, taken as 1")
            n = int(trips.group(1)) if trips and self.count_trips else 1
            cost.merge(self.computation(ins.called("body")[0]), n)
            cost.merge(self.computation(ins.called("condition")[0]), n + 1 if self.count_trips else 1)
            return
        if ins.op == "conditional":
            branches = ins.called("branch_computations") or ins.called("true_computation") + ins.called(
                "false_computation")
            cost.merge(max((self.computation(b) for b in branches), key=lambda c: c.seconds))
            return
        if ins.op == "call":
            cost.merge(self.computation(ins.called("to_apply")[0]))
            return
        flops, moved = self.kernel(ins, cost)
        cost.add(self.label(ins), flops, moved, self._dot_peak(ins), self.bw, self.launch)

    def _dot_peak(self, ins: Instr) -> float:
        """The rate of this kernel's dot (or of its fused body's): fp32 operands at full precision at the FMA
        rate, other fp32 ones at the TF32 rate, the rest (and kernels without a dot) at the peak."""
        if ins.op == "dot" or (ins.op == "custom-call" and library_gemm(ins)):
            dots = [ins]
        elif ins.op in _FUSIONS:
            dots = [i for i in self.comps[ins.called("calls")[0]] if i.op == "dot"]
        else:
            return self.peak
        f32 = [d for d in dots if self.shapes.get(d.operands[0], "").startswith("f32[")]
        if not f32:
            return self.peak
        return self.f32_fma_peak if any(_HIGHEST.search(d.attrs) for d in f32) else self.f32_peak

    def kernel(self, ins: Instr, cost: Cost) -> tuple[float, float]:
        operand_types = [self.shapes.get(o, "") for o in ins.operands]
        if ins.op in _FUSIONS:
            return self.fusion(ins, operand_types)
        if ins.op == "dot":
            return _dot_flops(ins, self.shapes), nbytes(ins.type) + sum(map(nbytes, operand_types))
        if ins.op in _IN_PLACE:  # reads and writes the update, reads the indices; the buffer stays in place
            u = _IN_PLACE[ins.op]
            return 0.0, 2.0 * nbytes(operand_types[u]) + sum(nbytes(t) for i, t in enumerate(operand_types)
                                                             if i not in (0, u))
        if ins.op in _SLICERS:
            return 0.0, 2.0 * nbytes(ins.type)
        if ins.op == "custom-call" and library_gemm(ins):
            return _library_gemm_cost(ins, operand_types)
        if ins.op == "custom-call":
            kernel = KERNEL_NAME.search(ins.attrs)
            flops = pallas_flops(kernel.group(1), operand_types, ins.type) if kernel else None
            if flops is None:
                target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
                cost.unknown.add(f"custom-call {kernel.group(1) if kernel else target and target.group(1)}: bytes only")
            return flops or 0.0, nbytes(ins.type) + sum(map(nbytes, operand_types))
        return 0.0, nbytes(ins.type) + sum(map(nbytes, operand_types))

    def fusion(self, ins: Instr, operand_types: list[str]) -> tuple[float, float]:
        body = self.comps[ins.called("calls")[0]]
        by_name = {i.name: i for i in body}
        users: dict[str, list[Instr]] = {}
        for i in body:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        flops = sum(_dot_flops(i, self.shapes) for i in body if i.op == "dot")
        moved = 0.0
        for p, t in zip(sorted((i for i in body if i.op == "parameter"), key=lambda i: int(i.args)), operand_types):
            uses = users.get(p.name, [])
            # a buffer only sliced, or updated in place, costs the slices read (the updates are the output's)
            if uses and all((u.op in _SLICERS or u.op in _IN_PLACE) and u.operands[0] == p.name for u in uses):
                moved += sum(nbytes(u.type) for u in uses if u.op in _SLICERS)
            else:
                moved += nbytes(t)
        root = body[-1] if body else None
        outs = [by_name.get(o) for o in root.operands] if root is not None and root.op == "tuple" else [root]
        for out in outs:
            if out is not None and out.op in _IN_PLACE:
                moved += nbytes(self.shapes.get(out.operands[_IN_PLACE[out.op]], ""))
            elif out is not None:
                moved += nbytes(out.type)
        return flops, moved

    def label(self, ins: Instr) -> str:
        kernel = KERNEL_NAME.search(ins.attrs)
        op_name = re.search(r'op_name="([^"]*)"', ins.attrs)
        if kernel:
            return f"{_phase(op_name.group(1) if op_name else '')} {kernel.group(1)}"
        where = _short_op_name(op_name.group(1)) if op_name else ""
        if self.frames is not None:  # the innermost source line, and the kind of op
            where = f"{(self.frames.get(ins.name) or ['(no frame)'])[0]} ({where.rsplit('/', 1)[-1]})"
        kind = re.search(r"kind=(k\w+)", ins.attrs)
        what = ins.op if ins.op != "fusion" else f"fusion:{kind.group(1) if kind else ''}"
        return f"{_phase(op_name.group(1) if op_name else '')} {what} {where}".strip()


def _phase(op_name: str) -> str:
    """Which part of a jax train step an op came from, by its op_name path: the forward, the remat's
    recomputed forward, the backward, or the rest (optimizer, metrics; no autodiff transform in the path)."""
    if "rematted_computation" in op_name:
        return "[remat]"
    if "transpose(jvp" in op_name:
        return "[bwd]"
    return "[fwd]" if "jvp(" in op_name else "[rest]"


def _short_op_name(op_name: str) -> str:
    """The last three meaningful parts of a jax op_name path (`.../blocks/attention/dot_general` ->
    `blocks/attention/dot_general`)."""
    parts = [p for p in op_name.split("/") if p and not p.startswith(("jit(", "jvp(", "transpose(", "vmap("))
             and p not in ("while", "body", "closed_call", "checkpoint", "rematted_computation", "cond")]
    return "/".join(parts[-3:])


def _section(lines: list[str], name: str) -> dict[int, str]:
    """The numbered lines under a section header of the HLO text ("1 {...}" up to the first other line)."""
    out, start = {}, lines.index(name) + 1
    for line in lines[start:]:
        m = re.match(r"(\d+) (.*)", line)
        if not m:
            break
        out[int(m.group(1))] = m.group(2)
    return out


def source_frames(hlo: str, skip_files: tuple[str, ...] = ()) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Per HLO instruction of a compiled module's text: its source frames, innermost first ("function:line";
    [] without metadata; frames in files named in `skip_files` left out), and its op_name ("" without)."""
    lines = hlo.split("\n")
    if "StackFrames" not in lines:
        return {}, {}
    files = {k: v.strip('"').rsplit("/", 1)[-1] for k, v in _section(lines, "FileNames").items()}
    funcs = {k: v.strip('"') for k, v in _section(lines, "FunctionNames").items()}
    locs = {}
    for k, v in _section(lines, "FileLocations").items():
        m = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", v)
        locs[k] = (files[int(m.group(1))], f"{funcs[int(m.group(2))]}:{m.group(3)}")
    parents = {}
    for k, v in _section(lines, "StackFrames").items():
        m = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", v)
        parents[k] = (int(m.group(1)), int(m.group(2)))

    def chain(frame: int) -> list[str]:
        out = []
        while frame in parents:
            loc, parent = parents[frame]
            if locs[loc][0] not in skip_files:
                out.append(locs[loc][1])
            if parent == frame:
                break
            frame = parent
        return out

    frames, ops = {}, {}
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = ", line)
        if m:
            # other fields (scheduling_name, deduplicated_name: GPU compiles) may sit between the two
            meta = re.search(r"metadata=\{([^}]*)\}", line)
            op = re.search(r'op_name="([^"]*)"', meta.group(1)) if meta else None
            frame = re.search(r"stack_frame_id=(\d+)", meta.group(1)) if op else None
            frames[m.group(1)] = chain(int(frame.group(1))) if frame else []
            ops[m.group(1)] = op.group(1) if op else ""
    return frames, ops


def estimate(hlo_text: str, peak_flops: float, bandwidth: float, launch_s: float = 0.0,
             count_trips: bool = True, f32_dot_peak: float | None = None, by_source: bool = False,
             f32_fma_peak: float | None = None) -> dict:
    """The roofline estimate of one run of the compiled program `hlo_text` (its `as_text()`) on a device of
    `peak_flops` FLOP/s and `bandwidth` bytes/s, `launch_s` seconds per kernel: seconds, FLOPs, bytes,
    kernels, the time of compute-bound and memory-bound kernels, per part of a train step and per label
    (kernel name, or op kind and the jax op it came from) [seconds, FLOPs, bytes, count], largest first.
    `count_trips` False: every loop body once, as XLA's own cost analysis counts (to compare with it).
    `f32_dot_peak`: the rate of dots with fp32 operands, if not `peak_flops` (a GPU's TF32 rate beside its bf16
    peak: `GPU_F32_DOT_FRACTION`); `f32_fma_peak`: that of fp32 dots at operand precision HIGHEST, if not
    `f32_dot_peak` (a GPU's fp32 FMA rate: `GPU_F32_FMA_FRACTION`); Pallas kernels are taken at `peak_flops`.
    `by_source`: label the other kernels by the innermost Python source line that emitted them
    (`source_frames`), not by jax op."""
    comps, entry = parse(hlo_text)
    frames = source_frames(hlo_text)[0] if by_source else None
    cost = _Walker(comps, peak_flops, bandwidth, launch_s, count_trips, f32_dot_peak, frames,
                   f32_fma_peak).computation(entry)
    top = sorted(cost.items.items(), key=lambda kv: -kv[1][0])
    phases: dict[str, list[float]] = {}
    for label, row in top:
        mine = phases.setdefault(label.split()[0], [0.0, 0.0, 0.0, 0.0])
        for i in range(4):
            mine[i] += row[i]
    return {"seconds": cost.seconds, "flops": cost.flops, "bytes": cost.bytes, "kernels": cost.kernels,
            "compute_bound_s": cost.compute_s, "memory_bound_s": cost.memory_s,
            "launch_s": cost.kernels * launch_s, "peak_flops": peak_flops, "bandwidth": bandwidth,
            "items": [[label, *row] for label, row in top], "phases": phases, "unknown": sorted(cost.unknown)}


def format_estimate(r: dict, model_flops: float | None = None, top: int = 12) -> str:
    """A few lines: the estimate, the MFU it caps (with the model's FLOPs per run), the largest items."""
    text = (f"roofline (no overlap, every kernel at its bound): {1e3 * r['seconds']:.1f} ms = compute-bound "
            f"{1e3 * r['compute_bound_s']:.1f} + memory-bound {1e3 * r['memory_bound_s']:.1f} + launches "
            f"{1e3 * r['launch_s']:.1f} ms; {r['flops'] / 1e12:.2f} TFLOP, {r['bytes'] / 1e9:.1f} GB, "
            f"{r['kernels']:,.0f} kernels (peak {r['peak_flops'] / 1e12:.3g} TFLOP/s, {r['bandwidth'] / 1e9:.0f} GB/s)")
    if model_flops:
        text += (f"; model FLOPs {model_flops / 1e12:.2f} TFLOP -> MFU at most "
                 f"{100 * model_flops / r['seconds'] / r['peak_flops']:.1f}%")
    text += "\n  by part: " + ", ".join(f"{p[1:-1]} {1e3 * row[0]:.1f} ms ({row[2] / 1e9:.1f} GB)"
                                       for p, row in r["phases"].items())
    rows = [f"  {1e3 * s:9.2f} ms {f / 1e9:10.1f} GFLOP {b / 1e9:8.2f} GB {n:6.0f}x  {label}"
            for label, s, f, b, n in r["items"][:top]]
    notes = [f"  (not costed: {u})" for u in r["unknown"]]
    return "\n".join([text, *rows, *notes])
