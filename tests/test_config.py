"""Config parsing: YAML + CLI overrides, help from docstrings, every shipped YAML, errors reported together."""

import base64
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from dsrl.auto import resolve_sync
from dsrl.config import ConfigError, build_parser, parse_config, to_config, validate

ROOT = Path(__file__).resolve().parents[1]
TOY = ["--model.path", str(ROOT / "examples/toy/model"), "--data.train_path", str(ROOT / "examples/toy/train.jsonl")]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_parses_and_validates(path):
    parser = build_parser()
    cfg = to_config(parser, parser.parse_args(["--config", str(path)]))
    validate(cfg, check_paths=False)
    header = path.read_text().splitlines()[:12]
    assert any("dsrl train --config configs/" + path.name in line for line in header), "launch command in header"


def test_cli_overrides_yaml():
    cfg = parse_config(["--config", str(ROOT / "configs/toy_cpu.yaml"), "--rollout.n_samples", "4"])
    assert cfg.rollout.n_samples == 4
    assert cfg.algorithm.reward_fn == "dsrl.tasks.toy:reward"


def test_help_comes_from_field_docstrings(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--rollout.n_samples" in out and "GRPO group size" in out
    assert "Config(" not in out and "trainer - DeepSpeed ZeRO-3 training:" in out  # no dataclass signature
    assert len(out.split("\n\n")[0].splitlines()) == 1, "a usage line, not every flag (147 lines)"


TOY_YAML = ["--config", "configs/toy_cpu.yaml"]


@pytest.mark.parametrize(
    "argv,named,meant",
    [
        ([*TOY_YAML, "--trainer.total_step", "5"], "--trainer.total_step 5", "--trainer.total_steps"),
        (["--config", "TYPO.yaml"], "'trainer' does not accept option 'total_step'", "trainer.total_steps"),
        (["--config", "configs/toy_cpu.yml"], "configs/toy_cpu.yml", "configs/toy_cpu.yaml"),
        ([*TOY_YAML, "--total_steps=5"], "--total_steps=5", "--trainer.total_steps"),
        (["configs/toy_cpu.yaml"], "unrecognized arguments: configs/toy_cpu.yaml", "--config configs/toy_cpu.yaml"),
    ],
    ids=["flag", "yaml_key", "config_path", "flag_without_group", "config_without_flag"],
)
def test_a_typo_gets_two_lines_naming_it_and_the_name_meant(argv, named, meant, capsys, tmp_path, monkeypatch):
    """`dsrl train` with a misspelt flag, YAML key or --config path: the error and "did you mean", not jsonargparse's
    usage block (145 lines) above them."""
    from dsrl.cli import main

    monkeypatch.chdir(ROOT)
    typo = tmp_path / "TYPO.yaml"  # toy_cpu.yaml with `total_step: 200` under `trainer:`
    typo.write_text((ROOT / "configs/toy_cpu.yaml").read_text().replace("total_steps:", "total_step:"))
    with pytest.raises(SystemExit) as info:
        main(["train", *(str(typo) if a == "TYPO.yaml" else a for a in argv)])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("dsrl train: error: ") and named in lines[0], lines
    assert lines[1] == f"dsrl train: did you mean {meant}?", lines


@pytest.mark.parametrize(
    "argv,named,meant",
    [
        (["export", "--chekpoint", "x"], "dsrl export: error: the following arguments are required: --checkpoint",
         "dsrl export: did you mean --checkpoint?"),
        (["fleet", "list", "--run", "x", "--cuont", "2"], "dsrl fleet: error: unrecognized arguments: --cuont 2",
         "dsrl fleet: did you mean --count?"),
        (["trian"], "dsrl: error: unknown command 'trian'", "dsrl: did you mean `dsrl train`?"),
    ],
)  # fmt: skip
def test_the_other_commands_name_a_typo_in_two_lines_too(argv, named, meant, capsys):
    from dsrl.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # (argparse exits)
        code = e.code
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [named, meant]


def test_unknown_key_is_named(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  n_sampels: 4\n")
    with pytest.raises(SystemExit):
        parse_config([*TOY, "--config", str(bad)])
    assert "n_sampels" in capsys.readouterr().err


def test_wrong_type_is_named(capsys):
    with pytest.raises(SystemExit):
        parse_config([*TOY, "--rollout.n_samples", "many"])
    err = capsys.readouterr().err
    assert "rollout.n_samples" in err and "many" in err


def test_all_cross_field_errors_reported_together():
    parser = build_parser()
    argv = [*TOY, "--rollout.n_samples", "1", "--rollout.top_p", "0", "--algorithm.reward_fn", "nocolon"]
    argv += ["--rollout.prompts_per_step", "3", "--sync.bucket_bytes", "0"]
    argv += ["--trainer.max_tokens_per_micro_batch", "null"]  # micro_batch_size rows: they must divide the batch
    cfg = to_config(parser, parser.parse_args(argv))
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    errors = info.value.errors
    flags = [e.split("=")[0] for e in errors]
    assert flags == [
        "--rollout.n_samples",
        "--rollout.top_p",
        "--algorithm.reward_fn",
        "--sync.bucket_bytes",
        "--rollout.prompts_per_step",
        "--trainer.micro_batch_size",
    ]
    assert "--rollout.top_p=0.0: must be in (0, 1]" in errors
    assert str(info.value).startswith("6 config errors:")


def test_the_new_losses_and_estimators_knobs_are_checked():
    """Each error names the flag, the value and what is allowed; gdpo needs its two rewards, a group estimator two
    samples of each prompt."""
    parser = build_parser()
    argv = [*TOY, "--algorithm.advantage", "gdpo", "--algorithm.dro_beta", "0", "--algorithm.clip_cov_bounds", "[5, 1]"]
    argv += ["--algorithm.tau_neg", "-1", "--rollout.n_samples", "1"]
    with pytest.raises(ConfigError) as info:
        validate(to_config(parser, parser.parse_args(argv)))
    errors = info.value.errors
    assert "--rollout.n_samples=1: --algorithm.advantage gdpo compares a prompt's samples: at least 2" in errors
    assert "--algorithm.tau_neg=-1.0: must be > 0" in errors and "--algorithm.dro_beta=0.0: must be > 0" in errors
    assert "--algorithm.clip_cov_bounds=(5.0, 1.0): must be (low, high), low < high" in errors
    assert any(e.startswith("--algorithm.advantage='gdpo': gdpo normalises two rewards") for e in errors)
    validate(to_config(parser, parser.parse_args([*TOY, "--algorithm.advantage", "remax", "--rollout.n_samples", "1"])))


def test_sync_buckets_are_1_gib_on_gpus_and_256_mib_on_cpu_unless_given():
    """On GPUs each bucket costs SGLang a request and a load: a 7B NCCL sync took 80 ms in 1 GiB buckets, 244 ms
    in 256 MiB (docs/benchmarks/several-gpus.md)."""
    parser = build_parser()

    def buckets(*argv: str) -> int:
        return resolve_sync(to_config(parser, parser.parse_args([*TOY, *argv]))).bucket_bytes

    assert buckets("--trainer.device", "cpu") == 256 << 20
    assert buckets("--trainer.device", "cuda") == 1 << 30
    assert buckets("--trainer.device", "cuda", "--sync.bucket_bytes", "1000") == 1000


def test_delta_sync_refuses_what_it_cannot_send_and_starts_the_servers_with_its_loader():
    """--sync.delta and --sync.senders all: every rank's own partition, so not a LoRA model's merged weights nor FP8's
    blocks; not colocated (the servers drop their weights between syncs); and the servers get the custom loader."""
    from dsrl.auto import SHARD_LOADER, resolve
    from dsrl.serving.shard_loader import LOADER

    parser = build_parser()
    argv = [*TOY, "--sync.delta", "true", "--model.lora_rank", "8", "--rollout.precision", "fp8"]
    argv += ["--sync.senders", "rank0", "--sync.delta_full_every", "0"]
    with pytest.raises(ConfigError) as info:
        validate(to_config(parser, parser.parse_args(argv)))
    flags = [e.split(":")[0] for e in info.value.errors if "sync.delta" in e or "senders" in e]
    assert flags == ["--sync.delta_full_every=0", "--sync.senders='rank0'", "--sync.delta=True", "--sync.delta=True",
                     "--sync.delta=True"], info.value.errors  # fmt: skip
    assert "colocated servers drop their weights" in info.value.errors[-1]
    cfg = to_config(parser, parser.parse_args([*TOY, "--sync.delta", "true", "--rollout.placement", "disaggregate"]))
    validate(cfg)
    resolved, _ = resolve(cfg, cfg.model.path)
    assert resolved.sync.senders == "all" and SHARD_LOADER == LOADER
    assert resolved.rollout.server_args["custom_weight_loader"] == [LOADER]


def test_a_custom_rollout_is_checked_for_its_name_and_schedule():
    parser = build_parser()
    argv = [*TOY, "--rollout.rollout_fn", "tests._rollouts:two_pieces", "--rollout.placement", "disaggregate"]
    cfg = to_config(parser, parser.parse_args(argv + ["--sync.type", "broadcast"]))
    with pytest.raises(ConfigError, match="rollout_fn='tests._rollouts:two_pieces': custom rollouts run in colocated"):
        validate(cfg)
    cfg = to_config(parser, parser.parse_args([*TOY, "--rollout.rollout_fn", "two_pieces"]))
    with pytest.raises(ConfigError, match="rollout_fn='two_pieces': must be module:function"):
        validate(cfg)


def test_config_errors_exit_before_anything_starts(capsys):
    with pytest.raises(SystemExit) as info:
        parse_config([*TOY, "--trainer.lr", "-1", "--data.train_path", "missing.jsonl"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--trainer.lr=-1.0: must be > 0" in err and "--data.train_path='missing.jsonl': file not found" in err


def test_batch_shape_must_split_into_micro_batches():
    parser = build_parser()
    by_rows = ["--trainer.micro_batch_size", "7", "--trainer.max_tokens_per_micro_batch", "null"]
    cfg = to_config(parser, parser.parse_args([*TOY, *by_rows]))
    with pytest.raises(ConfigError, match="trainer.micro_batch_size=7"):
        validate(cfg, world=2)
    # by tokens (the default), micro_batch_size only sizes the budget: any value splits the batch
    validate(to_config(parser, parser.parse_args([*TOY, "--trainer.micro_batch_size", "7"])), world=2)


def test_config_module_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, dsrl.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_launcher_keeps_the_trainer_on_the_visible_gpus():
    """The trainer's ranks get the first visible GPUs, as the servers do (a colocated server must sit on its
    trainer rank's GPU); DeepSpeed's node launcher is told them and sets CUDA_VISIBLE_DEVICES itself."""
    from dsrl.cli import launcher_command, local_gpus
    from dsrl.config import TrainerConfig

    def count():
        return 4

    assert local_gpus(1, "2,3", count) == [2]
    assert local_gpus(2, "5,1,7", count) == [5, 1]
    assert local_gpus(2, "", count) == [0, 1]
    assert local_gpus(0, "2,3", count) == [2, 3]  # all visible GPUs
    assert local_gpus(0, "", count) == [0, 1, 2, 3]
    with pytest.raises(SystemExit, match="num_ranks=3"):
        local_gpus(3, "0,1", count)
    env = {"CUDA_VISIBLE_DEVICES": "1"}
    cmd = launcher_command(TrainerConfig(num_ranks=1), True, env, 29500)
    world = next(a.split("=", 1)[1] for a in cmd if a.startswith("--world_info="))
    assert json.loads(base64.urlsafe_b64decode(world)) == {"localhost": [1]} and "CUDA_VISIBLE_DEVICES" not in env
    cmd = launcher_command(TrainerConfig(num_ranks=2, hostfile="hosts"), True, {}, 29500)  # the runner: other nodes
    assert cmd[2] == "deepspeed.launcher.runner" and cmd[-2:] == ["--num_gpus", "2"]


def test_cpu_ranks_run_avx2_kernels_on_an_x86_cpu_with_avx512_too():
    """The toy run's numbers are the same on AVX-512 and AVX2 machines only while torch and MKL run their AVX2 kernels
    on both (docs/getting-started.md): the pins `dsrl train` gives its ranks, torch's honoured; a user's own choice
    stays."""
    import os
    import subprocess
    import sys

    from dsrl.cli import pin_cpu_kernels

    env: dict[str, str] = {}
    pin_cpu_kernels(env)
    if not env:
        pytest.skip("not an x86 CPU with AVX2")
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert run.stdout.strip() == "AVX2", run.stdout + run.stderr
    assert env["MKL_CBWR"] == "AVX2"  # MKL's GEMMs too: they chose by the CPU, and an AMX-capable VM's numbers parted
    own = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO"}
    pin_cpu_kernels(own)
    assert own == {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO"}


def test_pause_retract_starts_sglang_without_the_prefix_cache_unless_told():
    """A retracted request is prefilled again after the update; a prefix cached under the old weights
    would make that prefill reuse old KV. The user's own server_args win."""
    from dsrl.serving.servers import sglang_command

    def flags(*overrides):
        cfg = parse_config(["--config", str(ROOT / "configs/toy_gpu_async.yaml"), *overrides]).rollout
        return sglang_command(cfg, "m", "127.0.0.1", 30000, 0, colocated=False)

    assert "--disable-radix-cache" in flags("--rollout.interrupt", "pause")
    assert "--disable-radix-cache" not in flags("--rollout.interrupt", "pause", "--rollout.pause_mode", "in_place")
    assert "--disable-radix-cache" not in flags("--rollout.interrupt", "partial")
    told = ["--rollout.interrupt", "pause", "--rollout.server_args", '{"disable_radix_cache": false}']
    assert "--disable-radix-cache" not in flags(*told)


def test_a_server_argument_whose_flag_is_not_its_field_reaches_the_server_as_its_flag():
    """SGLang spells some flags apart from their fields (`fp8_gemm_runner_backend` is `--fp8-gemm-backend`): either
    name in server_args becomes the flag its parser takes. The parser here stands in for SGLang's, not installed on
    CPU; `server_flags("sglang")` reads SGLang's own where it is."""
    import argparse

    from dsrl.serving.servers import as_flags, flag_names

    parser = argparse.ArgumentParser()
    parser.add_argument("--fp8-gemm-backend", dest="fp8_gemm_runner_backend")
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--cuda-graph-max-bs-decode", type=int)
    parser.add_argument("--cuda-graph-max-bs", dest="cuda_graph_max_bs_decode", type=int)  # (a deprecated alias)
    names = flag_names(parser)
    assert names["cuda_graph_max_bs_decode"] == "--cuda-graph-max-bs-decode"
    for name in ("fp8_gemm_runner_backend", "fp8_gemm_backend", "fp8-gemm-backend"):
        flags = as_flags({name: "deep_gemm", "mem_fraction_static": 0.5, "skip_tokenizer_init": True}, names)
        assert flags == ["--fp8-gemm-backend", "deep_gemm", "--mem-fraction-static", "0.5", "--skip-tokenizer-init"]
        parsed = parser.parse_args(flags)
        assert (parsed.fp8_gemm_runner_backend, parsed.mem_fraction_static) == ("deep_gemm", 0.5)


def test_sglang_servers_capture_decode_graphs_for_as_many_requests_as_one_may_run():
    """SGLang decodes more requests than its CUDA graphs hold without them, several times slower (256 on one H100 or
    H200): after a death, 4 ranks sent 352 to each of 3 servers. The servers capture graphs for the most one may run
    with one server down; the user's own setting, and the embedded engine, are left alone."""
    from dsrl.auto import decode_graphs
    from dsrl.serving.servers import sglang_command

    def decided(world, *flags):
        model = ["--model.path", str(ROOT / "examples/toy/model")]
        cfg = parse_config(
            ["--config", str(ROOT / "configs/gpu_colocate.yaml"), *model, "--rollout.n_samples", "8", *flags]
        )
        return decode_graphs(cfg, world)

    def graphs(world, *flags):
        return decided(world, *flags)[0].rollout.server_args.get("cuda_graph_max_bs_decode")

    assert graphs(4, "--rollout.num_servers", "4") == 4 * (86 + 8)  # 256 over 3, a group's 8 at once
    assert graphs(2, "--rollout.num_servers", "1") == 512  # two ranks' 256 each to one server
    assert graphs(1, "--rollout.num_servers", "1") is None  # at most 256: SGLang's own graphs hold them
    assert graphs(4, "--rollout.num_servers", "1", "--rollout.tp_size", "4") is None  # SGLang's 512 at TP 4
    assert graphs(4, "--rollout.num_servers", "4", "--rollout.server_args", '{"cuda-graph-max-bs": 300}') is None
    assert graphs(4, "--rollout.num_servers", "4", "--rollout.engine", "embedded") is None
    cfg, lines = decided(4, "--rollout.num_servers", "4")
    assert "cuda_graph_max_bs_decode 376" in lines[0]
    flags = sglang_command(cfg.rollout, "m", "127.0.0.1", 30000, 0, colocated=True)
    assert flags[flags.index("--cuda-graph-max-bs-decode") + 1] == "376"


def test_the_config_reference_is_current():
    """docs/config.md is generated from the fields' docstrings (tools/config_reference.py)."""
    import runpy

    render = runpy.run_path(str(ROOT / "tools/config_reference.py"))["render"]
    assert (ROOT / "docs/config.md").read_text() == render(), "run python tools/config_reference.py"


def test_liger_kernel_is_checked_before_anything_loads(monkeypatch):
    """--model.liger_kernel needs the package, and CUDA: each lack is named before a weight is loaded."""
    import importlib.util

    parser = build_parser()
    cfg = to_config(parser, parser.parse_args([*TOY, "--model.liger_kernel", "true", "--trainer.device", "cpu"]))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as info:
        validate(cfg, world=2)
    assert "--model.liger_kernel=True: liger-kernel is not installed" in str(info.value)
    assert "--model.liger_kernel=True: its kernels run on CUDA (--trainer.device cpu)" in str(info.value)


def test_the_plan_is_decided_once_from_the_config_and_round_trips():
    """`dsrl.auto.make_plan`: the start-up's decisions the rooms read, the same from the config as resolved (each
    auto decided) as from the user's; plan.json, written beside config.yaml, reads back as the same plan."""
    from dsrl.auto import make_plan, resolve
    from dsrl.plan import Plan

    parser = build_parser()
    cfg = to_config(parser, parser.parse_args([*TOY, "--trainer.device", "cpu"]))
    plan = make_plan(cfg, cfg.model.path)
    assert not plan.cuda and not plan.bf16 and plan.weight_bytes == 4 and not plan.packs and plan.old_from_update
    assert (plan.engine, plan.fleet, plan.colocated, plan.servers_first) == ("embedded", "local", True, False)
    assert plan.params > 0 and plan.device_memory > 0 and not plan.replicated_base
    assert make_plan(resolve(cfg, cfg.model.path)[0], cfg.model.path) == plan
    assert Plan(**json.loads(json.dumps(asdict(plan)))) == plan
