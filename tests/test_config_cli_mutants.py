"""Config validation, overrides, presets and the non-train CLI, mutation audit: each test here fails on one
realistic bug that the rest of the suite let through, and passes on the real code. Nothing here trains.

Config (README: every config validates itself; a bad value is one line naming the field and the values, exit 2,
nothing written): every check of ModelConfig / TrainConfig / ParallelConfig / DataConfig / AlarmConfig /
RunConfig refuses its bad value with its own message, and the boundary values the messages call valid are
accepted. Overrides: bools, ints and floats are parsed strictly; config.json round-trips a whole run.
Presets: the hero's SPEC §5 layout. CLI: the launcher's variables (docs/LAUNCH.md), process checks, the forced
host-device count per process, and what `moejax summary` prints."""

import argparse
import json

import pytest

from moejax import cli
from moejax.cli import _distributed_from_env, _ensure_host_devices, _validate_processes, build_parser, main
from moejax.config import ConfigError, ParallelConfig, RunConfig, apply_overrides
from moejax.plan import CLUSTERS, plan
from moejax.presets import HERO, preset
from moejax.xla_flags import FORCED_HOST_DEVICES

# ---------------------------------------------------------------------------------------------- refused values
# tiny: n_heads 8, n_kv_heads 2 (global 1), head_dim 16, 16 experts, seq_len 128, batch 16 (2048 tokens a step),
# 300 steps, the hero optimizer; one device.


@pytest.mark.parametrize("overrides, words", [
    (["model.vocab_size=0"], "vocab_size (0) must be positive"),
    (["model.window=0"], "window (0) must be positive"),
    (["model.top_k=0"], "top_k (0) must be positive"),
    (["model.qb_bins=0"], "qb_bins (0) must be positive"),
    (["model.n_kv_heads_global=4"], "n_kv_heads_global (4) exceeds n_kv_heads (2)"),
    (["model.n_kv_heads=8", "model.n_kv_heads_global=3"], "n_heads (8) is not divisible by n_kv_heads_global (3)"),
    (["model.rope_dim=0"], "rope_dim (0) must be even and in (0, head_dim=16]"),
    (["model.head_dim=15", "model.rope_dim=8"], "head_dim (15) must be even"),
    (["model.compute_dtype=float16"], "compute_dtype ('float16') must be 'bfloat16' or 'float32'"),
    (["model.loss_vocab_block=-1"], "loss_vocab_block (-1) must be >= 0"),
    (["model.attn_q_block=-1"], "attn_q_block (-1) must be >= 0"),
    (["model.attn_q_block=96"], "seq_len (128) is not divisible by model.attn_q_block (96)"),
    (["train.seed=9223372036854775808"], "seed (9223372036854775808) must be in [0, 2**32)"),
    (["train.warmup_fraction=1"], "warmup_fraction (1.0) must be in [0, 1)"),
    (["train.min_lr_fraction=-0.1"], "min_lr_fraction (-0.1) must be in [0, 1]"),
    (["train.optimizer=sgd"], "optimizer ('sgd') must be 'adam' or 'hero'"),
    (["train.eval_every=-1"], "eval_every (-1) must be >= 0"),
    (["train.opt_state_memory=host"], "opt_state_memory ('host') must be 'device' or 'pinned_host'"),
    (["train.remat_saves=all"], "remat_saves ('all') must be one of transport, dispatch, nothing"),
    (["train.temp_checkpoint_minutes=0"], "temp_checkpoint_minutes (0.0) must be positive"),
    (["train.log_every=0"], "log_every (0) must be positive"),
    (["train.checkpoint_every=0"], "checkpoint_every (0) must be positive"),
    (["train.batch_size=0"], "batch_size (0) must be positive"),
    (["train.optimizer=adam", "train.learning_rate=0"], "learning_rate (0.0) must be positive"),
    (["parallel.context=-1"], "parallel.context (-1) must be >= 0 (0 = automatic)"),
    (["parallel.model=2"], "model axis (2) > 1 is not supported yet"),
    (["parallel.waves=0"], "waves (0) must be positive"),
    (["parallel.cf_recv=0"], "cf_recv (0.0) must be positive"),
    (["parallel.data=2", "parallel.expert=5"], "n_experts (16) is not divisible by the expert axis (5)"),
    (["data.prefetch=-1"], "data.prefetch (-1) must be in [0, 64]"),
    (["data.weights=a=0"], "data.weights: 'a' has 0.0; every value must be a number > 0 and <= 1e+15"),
    (["data.weights=a=inf"], "data.weights: 'a' has inf; every value must be a number > 0 and <= 1e+15"),
    (["data.weights=a=1e303"], "data.weights: 'a' has 1e+303; every value must be a number > 0 and <= 1e+15"),
    (["data.context_schedule=1:256"], "need 0 < fraction < 1 and seq_len > 0"),
    (["data.context_schedule=0.5:256:cp=0"], "cp (0) must be > 0"),
    (["data.context_schedule=0.5:256:cp=2.5"], "cp='2.5' is not a number"),
    (["data.context_schedule=0.5:100"],
     "tokens per step (2048 = 128 x 16) is not divisible by seq_len 100 (from step 150)"),
    (["alarms.patience=0"], "patience (0) must be positive"),
    (["alarms.drop_max=1.5"], "alarms.drop_max (1.5) must be <= 1"),
    (["train.b1=0.8"], "train.b1 would have no effect: train.optimizer=hero"),  # SPEC §4: hero's betas are fitted
    (["model.n_layers=1.5"], "override model.n_layers='1.5' is not a valid int"),
    (["model.qb=2"], "override model.qb='2' is not a valid bool"),
    (["data.store"], "override 'data.store' is not of the form section.field=value"),  # no "=": never store=""
    # found by this audit, accepted before (NaN or a dead model at step 0, after the run dir was written;
    # an infinite alarm threshold switched its alarm off)
    (["model.norm_eps=-1"], "norm_eps (-1.0) must be positive"),
    (["model.qk_norm_eps=0"], "qk_norm_eps (0.0) must be positive"),
    (["model.rope_theta=0"], "rope_theta (0.0) must be positive"),
    (["model.init_scale=0"], "init_scale (0.0) must be positive"),
    (["model.qk_mult=0"], "qk_mult (0.0) must be positive"),
    (["model.combine_scale=-2.5"], "combine_scale (-2.5) must be positive"),
    (["model.z_loss_weight=-1"], "z_loss_weight (-1.0) must be >= 0"),
    (["train.optimizer=adam", "train.b1=1.5"], "b1 (1.5) must be in [0, 1)"),
    (["train.optimizer=adam", "train.b2=1"], "b2 (1.0) must be in [0, 1)"),
    (["train.optimizer=adam", "train.eps=-1"], "eps (-1.0) must be positive"),
    (["alarms.collapse_ratio=inf"], "collapse_ratio (inf) must be a finite number"),
    (["alarms.grad_spike=nan"], "grad_spike (nan) must be a finite number"),
    # found by the thirty-sixth session's CLI fuzz: each passed and then crashed or hung mid-run, after the run
    # dir was written (a deque's maxlen overflow, a 10^30-batch prefetch queue, jax's int32 step, a seed jax cut
    # to 32 bits)
    (["alarms.window=" + str(10**30)], f"alarms.window ({10**30}) must be below 2**31"),
    (["train.steps=" + str(10**30)], f"train.steps ({10**30}) must be below 2**31"),
    (["model.n_experts=" + str(10**30)], f"model.n_experts ({10**30}) must be below 2**31"),
    (["train.seed=4294967296"], "seed (4294967296) must be in [0, 2**32)"),  # jax kept its low 32 bits: seed 0
    (["data.prefetch=1000"], "data.prefetch (1000) must be in [0, 64]"),
    (["model.window=x"], "override model.window='x' is not a valid int"),  # the section named: alarms has one too
])
def test_each_bad_value_is_refused_naming_it(overrides, words):
    with pytest.raises(ConfigError) as e:
        apply_overrides(preset("tiny"), overrides)
    assert words in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- accepted values


@pytest.mark.parametrize("override, field, value", [
    ("model.n_shared=0", ("model", "n_shared"), 0),  # ">= 0": no shared experts is a valid model
    ("model.rope_dim=16", ("model", "rope_dim"), 16),  # "(0, head_dim=16]": the whole head may rotate
    ("train.warmup_fraction=0", ("train", "warmup_fraction"), 0.0),  # "[0, 1)"
    ("train.min_lr_fraction=1", ("train", "min_lr_fraction"), 1.0),  # "[0, 1]": a constant learning rate
    ("train.seed=4294967295", ("train", "seed"), 2**32 - 1),  # "[0, 2**32)"
    ("model.z_loss_weight=0", ("model", "z_loss_weight"), 0.0),  # ">= 0": no z-loss
    ("alarms.window=3", ("alarms", "window"), 3),  # ">= 3 (a trend needs three points)"
    ("alarms.dead_load=0", ("alarms", "dead_load"), 0.0),  # "[0, 1)"
    ("model.qb=false", ("model", "qb"), False),
    ("model.qb=0", ("model", "qb"), False),
    ("train.remat=1", ("train", "remat"), True),
    ("train.remat=TRUE", ("train", "remat"), True),
])
def test_boundary_values_the_messages_allow_are_accepted(override, field, value):
    got = getattr(getattr(apply_overrides(preset("tiny"), [override]), field[0]), field[1])
    assert got == value and type(got) is type(value)


def test_a_float_field_given_a_whole_number_stays_a_float():
    cfg = apply_overrides(preset("tiny"), ["parallel.cf_send=2", "alarms.collapse_ratio=3"])
    assert type(cfg.parallel.cf_send) is float and type(cfg.alarms.collapse_ratio) is float
    assert json.loads(cfg.to_json())["parallel"]["cf_send"] == 2.0


def test_only_the_expert_axis_turns_on_the_ep_transport():
    """parallel.moe_backend=auto: the pooled-wave transport when expert > 1, else the dropless local path."""
    assert ParallelConfig().resolved_backend == "local" and not ParallelConfig(data=8).use_ep
    assert ParallelConfig(expert=2).resolved_backend == "ep" and ParallelConfig(expert=2).use_ep


# ---------------------------------------------------------------------------------------------- config.json


@pytest.mark.parametrize("cfg", [
    HERO,
    apply_overrides(preset("tiny"), ["data.weights=a=0.7,b=0.3", "data.context_schedule=0.5:256",
                                     "alarms.enabled=false", "train.remat=true"]),
], ids=["hero", "tiny-overridden"])
def test_config_json_round_trips_every_section_and_the_name(cfg):
    """`RunConfig.from_dict(json.loads(cfg.to_json()))` is the config a resumed run compares and trains with."""
    back = RunConfig.from_dict(json.loads(cfg.to_json()))
    assert back == cfg and back.name == cfg.name and back.data == cfg.data


# ---------------------------------------------------------------------------------------------- context phases


def test_a_phases_cp_wins_over_parallel_context():
    """ParallelConfig: "A phase's `cp=` in data.context_schedule wins" over parallel.context."""
    cfg = apply_overrides(preset("tiny"), ["parallel.expert=4", "parallel.context=2",
                                           "data.context_schedule=0.5:512:cp=4"])
    assert [(ph.seq_len, ph.context) for ph in cfg.phases] == [(128, 2), (512, 4)]


def test_a_phase_keeps_the_base_receive_factor_when_it_sets_only_the_send_one():
    cfg = apply_overrides(preset("tiny"), ["parallel.cf_send=1.3", "parallel.cf_recv=1.6",
                                           "data.context_schedule=0.5:256:cf_send=2"])
    assert [(ph.cf_send, ph.cf_recv) for ph in cfg.phases] == [(1.3, 1.6), (2.0, 1.6)]


def test_a_later_phase_on_the_same_step_wins():
    """0.5 and 0.501 of 300 steps both round to step 150: the later entry is the one that runs."""
    cfg = apply_overrides(preset("tiny"), ["data.context_schedule=0.5:256,0.501:512"])
    assert [(ph.start, ph.seq_len) for ph in cfg.phases] == [(0, 128), (150, 512)]


# ---------------------------------------------------------------------------------------------- presets


def test_hero_context_extension_starts_at_the_seeds_marks():
    """SPEC §5 / the seed: 4K -> 8K at the 50% mark, 8K -> 65K at 95%, the 262K phase after that, near the end."""
    steps = HERO.train.steps
    got = [(ph.start, ph.seq_len) for ph in HERO.phases]
    assert got[:3] == [(0, 4096), (round(0.5 * steps), 8192), (round(0.95 * steps), 65_536)]
    assert got[3][1] == 262_144 and round(0.95 * steps) < got[3][0] < steps


def test_hero_memory_layout():
    """The hero (moejax plan hero): 48 layers on 704 devices scanned, the fp32 master and optimizer state in
    pinned host memory, the LM head streamed over 16K-wide vocab blocks and attention over 512-query blocks."""
    t, m = HERO.train, HERO.model
    assert (t.scan_layers, t.opt_state_memory, t.remat) == (True, "pinned_host", True)
    assert (m.loss_vocab_block, m.attn_q_block) == (16_384, 512)
    for name in ("d768", "d1024", "d1536", "d2048"):
        assert (preset(name).model.loss_vocab_block, preset(name).model.attn_q_block) == (16_384, 512)


@pytest.mark.parametrize("name", ["d768", "d1024", "d1536"])
def test_rungs_that_fit_without_remat_take_the_remat_free_step(name):
    """LADDER_REMAT: block remat only on the rungs that need it to fit their cluster (d2048, the hero); the
    narrower rungs fit without it (`moejax plan`) and take the faster remat-free step."""
    cfg = preset(name)
    assert not cfg.train.remat and plan(cfg, CLUSTERS["gb200-nvl72x11"])["fits_hbm"]


# ---------------------------------------------------------------------------------------------- launcher env

LAUNCH_VARS = ("JAX_COORDINATOR_ADDRESS", "MASTER_ADDR", "MASTER_PORT", "JAX_NUM_PROCESSES", "SLURM_NTASKS",
               "WORLD_SIZE", "JAX_PROCESS_ID", "SLURM_PROCID", "RANK")


@pytest.fixture
def launch_env(monkeypatch):
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)

    def resolve(**env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        args = build_parser().parse_args(["train", "--run-dir", "x"])
        _distributed_from_env(args)
        return args.coordinator, args.num_processes, args.process_id
    return resolve


def test_the_jax_variables_win_over_the_launchers(launch_env):
    """docs/LAUNCH.md: JAX_COORDINATOR_ADDRESS (or MASTER_ADDR:MASTER_PORT), JAX_NUM_PROCESSES (SLURM_NTASKS,
    WORLD_SIZE), JAX_PROCESS_ID (SLURM_PROCID, RANK): the first named is used when several are set."""
    assert launch_env(JAX_COORDINATOR_ADDRESS="a:1", MASTER_ADDR="b", MASTER_PORT="2", JAX_NUM_PROCESSES="4",
                      SLURM_NTASKS="8", WORLD_SIZE="16", JAX_PROCESS_ID="1", SLURM_PROCID="2", RANK="3") == ("a:1", 4, 1)


def test_master_addr_without_a_port_names_no_coordinator(launch_env):
    assert launch_env(MASTER_ADDR="node0", WORLD_SIZE="2", RANK="1") == (None, None, None)


def test_an_empty_launcher_variable_counts_as_unset(launch_env):
    """An exported-but-empty JAX_NUM_PROCESSES / JAX_PROCESS_ID falls through to the launcher's variable."""
    assert launch_env(JAX_COORDINATOR_ADDRESS="a:1", JAX_NUM_PROCESSES="", SLURM_NTASKS="4", JAX_PROCESS_ID="",
                      SLURM_PROCID="2") == ("a:1", 4, 2)


@pytest.mark.parametrize("n, i, timeout, coordinator, words", [
    (2, -1, 300, "a:1", "--process-id (-1) must be in [0, --num-processes=2)"),
    (None, -1, 300, "a:1", "--process-id (-1) must be >= 0"),
    (2, 1, 0, "a:1", "--dist-timeout (0) must be positive"),
    (2, 1, 300, None, "--num-processes 2 --process-id 1 need --coordinator HOST:PORT (process 0's address) or "
                      "--distributed"),
    (None, 1, 300, None, "--process-id 1 needs --coordinator HOST:PORT (process 0's address) or --distributed"),
    (2, None, 300, None, "--num-processes 2 needs --coordinator HOST:PORT (process 0's address) or --distributed"),
    (2, 0, 300, "localhost", "--coordinator 'localhost' is not HOST:PORT (e.g. node0:8476)"),
    (2, 0, 300, "node0:http", "--coordinator 'node0:http' is not HOST:PORT (e.g. node0:8476)"),
    (2, 0, 300, ":8476", "--coordinator ':8476' is not HOST:PORT (e.g. node0:8476)"),
    (2, 0, 300, "node0:70000", "--coordinator 'node0:70000' is not HOST:PORT (e.g. node0:8476)"),
])
def test_bad_process_flags_are_refused_naming_them(n, i, timeout, coordinator, words):
    """Checked on every process before any waiting: without a coordinator a `--process-id 1` trained alone; a
    coordinator without a port failed inside jax on process 0 (`list index out of range`)."""
    with pytest.raises(ConfigError) as e:
        _validate_processes(argparse.Namespace(num_processes=n, process_id=i, dist_timeout=timeout,
                                               coordinator=coordinator, distributed=False))
    assert str(e.value) == words


@pytest.mark.parametrize("n, i, coordinator, distributed", [
    (None, None, None, False), (1, 0, None, False), (2, 1, "node0:8476", False), (None, None, None, True),
    (2, 0, "[::1]:8476", False)])
def test_good_process_flags_pass(n, i, coordinator, distributed):
    _validate_processes(argparse.Namespace(num_processes=n, process_id=i, dist_timeout=300,
                                           coordinator=coordinator, distributed=distributed))


def test_each_process_forces_its_share_of_the_mesh_as_host_devices(monkeypatch):
    """On CPU, `--mesh data=8` over 2 processes is 4 devices per process (the mesh spans the job)."""
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(cli, "_backends_started", lambda: False)
    _ensure_host_devices(argparse.Namespace(mesh="data=8", num_processes=2))
    assert f"{FORCED_HOST_DEVICES}=4" in cli.os.environ["XLA_FLAGS"].split()


def test_a_bad_mesh_read_before_jax_starts_is_one_line(tmp_path, monkeypatch, capsys):
    """Outside this suite XLA_FLAGS forces no host devices, so `--mesh` is parsed before jax starts (to force them):
    a bad one there must be the same one line and exit 2, not a traceback."""
    monkeypatch.setenv("XLA_FLAGS", "")
    assert main(["train", "--run-dir", str(tmp_path / "r"), "--mesh", "data=0"]) == 2
    err = capsys.readouterr().err
    assert err == "moejax: error: --mesh item 'data=0' is not AXIS=N with AXIS one of replica_dcn, data, expert, model " \
                  "and N >= 1\n"
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------------------------------------- summary


def test_summary_prints_percentages_the_eval_row_and_each_alarms_first_and_last(tmp_path, capsys):
    summary = {"preset": "tiny", "steps": 10, "first_loss": 7.7, "last_loss": 5.5, "tokens_per_second": 1234.0,
               "mfu": 0.123, "wall_seconds": 9.0, "drop_fraction": 0.0312, "eval/loss": 5.6, "eval/bpb": 1.2,
               "eval_step": 7,
               "alarms": {"collapse": {"count": 1, "first": "c1", "last": "c1"},
                          "high_drop": {"count": 3, "first": "d1", "last": "d3"}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "MFU 12.3% of measured matmul peak" in out and "MoE drops   3.12%" in out
    (tmp_path / "run_info.json").write_text(json.dumps({"peak_source": "--peak-flops", "peak_flops": 1e11}))
    assert main(["summary", str(tmp_path)]) == 0  # a run told its peak: not "measured"
    assert "MFU 12.3% of the peak given by --peak-flops" in capsys.readouterr().out
    (tmp_path / "run_info.json").unlink()
    assert "(step 7's row; later steps were not evaluated)" in out
    assert "collapse: raised 1x; first: c1" in out and "high_drop: raised 3x; first: d1" in out
    assert out.count("last:") == 1 and "last:  d3" in out
    del summary["eval_step"]  # an older summary: every run evaluated at its last step
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "eval loss   5.600" in out and "not evaluated" not in out
    summary["eval_step"] = 9  # the last step's row
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "alarms": {}}))
    assert main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "not evaluated" not in out and "alarms      none" in out


@pytest.mark.parametrize("argv, words", [
    # argparse's own errors printed its usage block and "moejax train: error: ..."
    (["train", "--run-dir", "x", "--steps", "1.5"], "argument --steps: invalid int value: '1.5'"),
    (["train", "--run-dir", "x", "--wandb", "bogus"], "argument --wandb: invalid choice: 'bogus'"),
    (["train", "--run-dir", "x", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["export", "run", "--out", "o", "--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    (["bogus"], "argument cmd: invalid choice: 'bogus'"),
    (["train", "--run-dir", "x", "--num-processes", "abc"], "argument --num-processes: invalid int value: 'abc'"),
    # accepted before, found by the thirty-sixth session's CLI fuzz
    (["train", "--run-dir", "x", "--mesh", "data=²"], "--mesh item 'data=²' is not AXIS=N"),  # was a traceback
    (["train", "--run-dir", "x", "--peak-flops", "nan"], "--peak-flops (nan) must be a finite FLOP/s >= 0"),
    (["train", "--run-dir", "x", "--peak-flops", "-5"], "--peak-flops (-5.0) must be a finite FLOP/s >= 0"),
    (["ladder", "run", "--out", "x", "--widths", ","], "--widths ',' is not a comma-separated list of integers"),
    # an empty --mesh ("$MESH" unset) trained on the default layout; an absurd --mfu planned 10^300 days
    (["train", "--run-dir", "x", "--mesh", ""], "--mesh '' names no axis"),
    (["plan", "tiny", "--mesh", " , "], "--mesh ' , ' names no axis"),
    (["plan", "tiny", "--mesh", "data=1", "--mfu", "1e-308"], "--mfu (1e-308) must be in [0.0001, 1]"),
])
def test_every_user_error_is_one_line(argv, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's errors leave through sys.exit, as the command does
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("moejax: error: ") and words in err and err.count("\n") == 1, err
    assert "usage:" not in err and not (tmp_path / "x").exists()


def test_an_infinite_temperature_is_refused():
    from moejax.generate import check_options

    with pytest.raises(ConfigError, match=r"--temperature \(inf\) must be a finite number >= 0"):
        check_options(8, float("inf"), 0.9)


def test_steps_is_applied_before_the_config_is_checked(tmp_path, capsys):
    """`--steps` replaced train.steps after the preset (300 steps) had been validated with `--set`: a context phase
    at half the run was checked as starting at step 150, not 4, so the error named the wrong step and a schedule
    `--set train.steps=8` accepts was refused (found by the thirty-seventh session's phase-boundary fuzz)."""
    small = ["--set", "train.batch_size=4", "--set", "train.seq_len=32"]
    assert main(["train", "--run-dir", str(tmp_path / "x"), "--steps", "8", *small,
                 "--set", "data.context_schedule=0.5:48"]) == 2
    err = capsys.readouterr().err
    assert "not divisible by seq_len 48 (from step 4)" in err and err.count("\n") == 1, err
    args = build_parser().parse_args(["train", "--run-dir", "x", "--steps", "8", "--remat", *small,
                                      "--set", "data.context_schedule=0.5:48,0.51:64"])
    cfg = cli._resolve(args)  # both phases round to step 4, where the later one wins: seq_len 48 never runs
    assert [(ph.start, ph.seq_len) for ph in cfg.phases] == [(0, 32), (4, 64)]
    assert (cfg.train.steps, cfg.train.remat) == (8, True)
    with_set = apply_overrides(preset("tiny"), ["train.batch_size=4", "train.seq_len=32", "train.steps=8",
                                                "data.context_schedule=0.5:48,0.51:64"])
    assert with_set.phases == cfg.phases  # `--steps 8` and `--set train.steps=8` alike


def test_a_coordinator_without_the_process_count_or_id_is_refused_up_front(monkeypatch, tmp_path, capsys):
    """docs/LAUNCH.md: process ids are checked before anything waits. `--coordinator H:P --process-id 0` without a
    process count reached jax after the imports ("Number of processes must be defined"); `--distributed` still
    lets jax find both."""
    for k in ("JAX_COORDINATOR_ADDRESS", "MASTER_ADDR", "MASTER_PORT", "JAX_NUM_PROCESSES", "SLURM_NTASKS",
              "WORLD_SIZE", "JAX_PROCESS_ID", "SLURM_PROCID", "RANK"):
        monkeypatch.delenv(k, raising=False)
    for given, missing in ((["--process-id", "0"], "--num-processes"), (["--num-processes", "2"], "--process-id"),
                           ([], "--num-processes and --process-id")):
        args = ["train", "--run-dir", str(tmp_path / "r"), "--coordinator", "127.0.0.1:2950", *given]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"--coordinator 127.0.0.1:2950 needs {missing} (or the launcher's" in err and err.count("\n") == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    ns = argparse.Namespace(coordinator="127.0.0.1:2950", num_processes=None, process_id=None, distributed=False,
                            dist_timeout=300)
    cli._distributed_from_env(ns)
    _validate_processes(ns)  # the launcher's variables fill both
    assert (ns.num_processes, ns.process_id) == (2, 1)
    _validate_processes(argparse.Namespace(coordinator="127.0.0.1:2950", num_processes=None, process_id=None,
                                           distributed=True, dist_timeout=300))
    assert not (tmp_path / "r").exists()
