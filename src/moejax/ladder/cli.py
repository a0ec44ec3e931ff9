"""Subcommands of this package (registered into `moejax` by `register`).

  moejax ladder plan [--json]                          rungs d768…d2048 + hero, every number with its formula
  moejax ladder run --scale cpu --out DIR [--widths 32,48] [--steps N]   the CPU micro-ladder (resumable)
  moejax ladder fit DIR [--target-flops X] [--json]    L(C) = E + A*C^-alpha, projection, anomalies, PNG plots
  moejax plan PRESET [--cluster C] [--mfu 0.225] [--json] [--lower | --compile] [--phase SEQ_LEN] [--mesh M]
              [--set K=V ...]
                                                       devices, memory, transport, time, per context phase
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moejax.config import ConfigError

EXIT_DOES_NOT_FIT = 1
MIN_RUNGS = 3  # a power law E + A*C^-alpha has three parameters


def _cmd_ladder_plan(args) -> int:
    from moejax.ladder.rungs import format_ladder_plan, ladder_plan

    p = ladder_plan()
    print(json.dumps(p, indent=2) if args.json else format_ladder_plan(p))
    return 0


def _parse_widths(text: str | None):
    if not text:
        return None
    try:
        widths = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        widths = []
    if not widths:  # "," named no width: not "all of them"
        raise ConfigError(f"--widths {text!r} is not a comma-separated list of integers")
    return widths


def _cmd_ladder_run(args) -> int:
    from moejax.ladder.micro import MICRO_SHAPES, micro_rung, run_micro_ladder

    if args.scale != "cpu":
        raise ConfigError(f"--scale {args.scale!r}: only 'cpu' runs from this command; launch the production "
                          "rungs with `moejax train --preset d768` etc. (docs/LAUNCH.md)")
    widths = _parse_widths(args.widths) or sorted(MICRO_SHAPES)
    for d in widths:
        micro_rung(d)  # validates the width before anything runs
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps ({args.steps}) must be >= 1")
    rows = run_micro_ladder(Path(args.out), widths, args.steps)
    print(f"{len(rows)} rungs in {Path(args.out) / 'results.csv'}; next: moejax ladder fit {args.out}")
    return 0


def _cmd_ladder_fit(args) -> int:
    from moejax.ladder.fit import fit_ladder, format_fit, plot_ladder, usable
    from moejax.ladder.micro import read_results
    from moejax.ladder.rungs import hero_train_flops

    out = Path(args.dir)
    rows = read_results(out)
    if not rows:
        raise ConfigError(f"no results.csv (or no rows) in {out}; run `moejax ladder run --scale cpu --out {out}`")
    good = [r for r in rows if usable(r, args.loss)]
    if len(good) < MIN_RUNGS:
        bad = [r["name"] for r in rows if r not in good]
        raise ConfigError(f"ladder fit needs >= {MIN_RUNGS} usable rungs; {out / 'results.csv'} has {len(good)}"
                          + (f" (unusable: {', '.join(bad)})" if bad else "")
                          + f"; run more with `moejax ladder run --out {out}`")
    target = args.target_flops if args.target_flops is not None else hero_train_flops()
    if not 0 < target < math.inf:
        raise ConfigError(f"--target-flops ({target}) must be positive and finite")
    res = fit_ladder(rows, target, args.loss)
    runs = {r["name"]: out / r["name"] for r in rows}
    res["plots"] = [] if args.no_plots else plot_ladder(rows, res, out, runs)
    print(json.dumps(res, indent=2) if args.json else format_fit(res) +
          "".join(f"\n  plot {p}" for p in res["plots"]))
    return 0


def _cmd_plan(args) -> int:
    from moejax.presets import preset
    from moejax.plan import CLUSTERS, format_plan, plan

    if args.cluster not in CLUSTERS:
        raise ConfigError(f"unknown --cluster {args.cluster!r} (known: {', '.join(CLUSTERS)})")
    cfg = plan_config(preset(args.preset), args.set or [], args.mesh)
    phases = sorted({ph.seq_len for ph in cfg.phases})
    if args.phase is not None and args.phase not in phases:
        raise ConfigError(f"--phase {args.phase}: not a context phase of {cfg.name} ({', '.join(map(str, phases))})")
    if args.phase is not None and not (args.lower or args.compile):
        raise ConfigError(f"--phase {args.phase} needs --lower or --compile (the plan itself covers every phase)")
    cluster = CLUSTERS[args.cluster]
    if args.mesh is None:  # as `train` lays it out on the cluster's devices
        from moejax.parallel.mesh import default_data_parallel

        try:
            cfg = default_data_parallel(cfg, cluster.n_devices)
        except ConfigError as e:  # `plan tiny` on the default cluster (704 GPUs): name the smaller ones too
            smaller = ", ".join(name for name, c in CLUSTERS.items() if c.n_devices < cluster.n_devices)
            raise ConfigError(f"{e}; or plan it for a smaller --cluster ({smaller})" if smaller else str(e)) from None
    r = plan(cfg, cluster, args.mfu)
    if args.compile:
        from moejax.cuda_aot import check_available

        check_available()  # before any work: one line saying what to install
    if args.lower or args.compile:
        from moejax.ladder.lower import lower_in_subprocess

        r["lower"] = lower_in_subprocess(cfg, args.phase, device_kind=cluster.device_kind, cores=cluster.sm_count,
                                         compile=args.compile, timeout_s=args.timeout)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(format_plan(r))
        if "lower" in r:
            from moejax.ladder.lower import format_lower

            print(format_lower(r["lower"], cluster.hbm_bytes))
    if "lower" in r and not r["lower"]["ok"]:
        return 1
    return 0 if r["fits_hbm"] and r["fits_host"] else EXIT_DOES_NOT_FIT


def plan_config(cfg, overrides: list[str], mesh: str | None):
    """The preset with `train`'s `--mesh` (omitted axes = 1) and `--set` applied, validated once."""
    from moejax.parallel.mesh import mesh_overrides
    from moejax.config import apply_overrides

    return apply_overrides(cfg, mesh_overrides(mesh) + overrides)


def register(sub) -> None:
    """Add this package's subparsers to the `moejax` command."""
    from moejax.presets import PRESET_NAMES
    from moejax.plan import DEFAULT_CLUSTER, DEFAULT_MFU

    lad = sub.add_parser("ladder", help="scaling ladder: plan, CPU micro-ladder, fit")
    lsub = lad.add_subparsers(dest="ladder_cmd", required=True)
    p = lsub.add_parser("plan", help="every rung's derived numbers and its share of the hero's compute")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_cmd_ladder_plan)

    r = lsub.add_parser("run", help="train the micro-ladder (resumable; rungs in results.csv are skipped)")
    r.add_argument("--scale", default="cpu", help="'cpu': the micro-ladder of tiny widths")
    r.add_argument("--out", required=True, help="directory for results.csv and one run dir per rung")
    r.add_argument("--widths", help="comma-separated subset of the micro widths (default: all)")
    r.add_argument("--steps", type=int, help="override every rung's step count (smoke tests)")
    r.set_defaults(fn=_cmd_ladder_run)

    f = lsub.add_parser("fit", help="fit L(C) = E + A*C^-alpha, project, flag anomalies, plot")
    f.add_argument("dir")
    f.add_argument("--target-flops", type=float, help="compute to project to (default: the hero's training FLOPs)")
    f.add_argument("--loss", default="eval_loss", choices=["eval_loss", "final_loss"],
                   help="eval_loss (held-out, several batches; default) or final_loss (last train batch)")
    f.add_argument("--json", action="store_true")
    f.add_argument("--no-plots", action="store_true")
    f.set_defaults(fn=_cmd_ladder_fit)

    pl = sub.add_parser("plan", help="devices, mesh, memory, transport and time of a preset on a cluster")
    pl.add_argument("preset", help=f"one of {', '.join(PRESET_NAMES)}")
    pl.add_argument("--cluster", default=DEFAULT_CLUSTER, help="gb200-nvl72x11 | h100x8 | h200x1")
    pl.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                    help="model FLOPs utilisation for the step time, in [0.0001, 1]")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--lower", action="store_true", help="lower (no compile, no run) the train step on the mesh")
    pl.add_argument("--compile", action="store_true",
                    help="lower and compile the train step for the cluster's GPUs with XLA's GPU compiler, here, "
                         "without a GPU (Triton and ptxas included): XLA's memory plan per device, the kernels, "
                         "register spills (needs the CUDA plugin `make cuda-aot` installs in .venv/cuda-aot)")
    pl.add_argument("--phase", type=int, metavar="SEQ_LEN",
                    help="with --lower/--compile: the context phase (its seq_len; default: the longest)")
    pl.add_argument("--timeout", type=float, default=1800, help="seconds for --lower/--compile (default 1800)")
    pl.add_argument("--mesh", help="e.g. replica_dcn=1,data=2,expert=4,model=1 (omitted axes = 1), as for train")
    pl.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="config override (repeatable)")
    pl.set_defaults(fn=_cmd_plan)
