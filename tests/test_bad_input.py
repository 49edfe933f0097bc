"""Fault injection: every kind of bad input gets one clear message naming the field or row, and
loses nothing. Select with `-k bad_input`."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsrl.config import (
    AlgorithmConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    build_parser,
    parse_config,
    to_config,
    validate,
)
from dsrl.data import DatasetError, Prompt, PromptDataset, Sample, check_fits_context
from dsrl.evaluate import eval_rollout
from dsrl.rewards.rewarder import Rewarder
from dsrl.rewards.rules import load_reward_fn
from dsrl.rundir import check_writable
from dsrl.serving.client import RolloutClient, ServerError
from dsrl.serving.servers import free_port, wait_healthy
from dsrl.tasks import toy
from dsrl.zero.checkpoint import find_checkpoint
from tests.conftest import ROOT

TOY = ["--model.path", str(ROOT / "examples/toy/model"), "--data.train_path", str(ROOT / "examples/toy/train.jsonl")]
TOKENIZER = toy.build_tokenizer()


def config_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        parse_config([*TOY, *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


def cross_field_errors(*argv: str) -> list[str]:
    parser = build_parser()
    with pytest.raises(ConfigError) as info:
        validate(to_config(parser, parser.parse_args([*TOY, *argv])))
    return info.value.errors


# -- config -------------------------------------------------------------------------------------


def test_bad_input_malformed_yaml(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  n_samples: [4\n")
    err = config_error(capsys, "--config", str(bad))
    assert "bad.yaml" in err or "Problem" in err or "parse" in err.lower()


def test_bad_input_unknown_key(capsys, tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("trainer:\n  learning_rate: 0.1\n")
    assert "learning_rate" in config_error(capsys, "--config", str(bad))


def test_bad_input_unknown_flag(capsys):
    assert "--rollout.n_sampels" in config_error(capsys, "--rollout.n_sampels", "4")


def test_bad_input_wrong_type(capsys):
    err = config_error(capsys, "--trainer.lr", "fast")
    assert "trainer.lr" in err and "fast" in err


def test_bad_input_wrong_choice(capsys):
    err = config_error(capsys, "--rollout.placement", "sideways")
    assert "rollout.placement" in err and "sideways" in err


def test_bad_input_lora_target_typo_is_one_line_before_any_rank_starts(tmp_path):
    """A LoRA target no module has used to end in PEFT's error inside a rank's traceback, followed by the
    reward workers' ConnectionResetError tracebacks."""
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs/toy_cpu.yaml")]
    cmd += ["--model.lora_rank", "4", "--model.lora_target_modules", "[nonexistent_proj]"]
    proc = subprocess.run(cmd + ["--logging.run_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("dsrl train: error: --model.lora_target_modules=['nonexistent_proj']") and "q_proj" in line
    assert "deepspeed" not in proc.stdout + proc.stderr and not (tmp_path / "config.yaml").exists()


def test_bad_input_server_args_typo_fails_before_launch():
    """A key the server does not know stops `dsrl train` before anything starts, naming it (SGLang's own
    ServerArgs fields when SGLang is installed; the embedded engine's flags here)."""
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs/toy_cpu.yaml")]
    cmd += ["--rollout.server_args", '{"decode_delay_msx": 3, "decode_delay_ms": 1}']
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "'decode_delay_msx' is not an argument of the embedded server; did you mean decode_delay_ms?" in proc.stderr
    assert "deepspeed" not in proc.stderr  # nothing was launched


def test_bad_input_conflicting_options():
    errors = cross_field_errors("--rollout.max_staleness", "2")  # placement is colocate by default
    assert any(e.startswith("--rollout.max_staleness=2: colocated servers generate ahead by one step") for e in errors)
    errors = cross_field_errors("--rollout.max_staleness", "1", "--trainer.offload_states", "always")
    assert not any(e.startswith("--rollout.max_staleness") for e in errors)  # one-step-off colocated is allowed
    assert any(e.startswith("--trainer.offload_states='always': one-step-off colocated") for e in errors)
    errors = cross_field_errors("--rollout.max_staleness", "1", "--trainer.offload_states", "moments")
    assert any(e.startswith("--trainer.offload_states='moments': one-step-off colocated") for e in errors)
    errors = cross_field_errors(
        "--rollout.placement", "disaggregate", "--rollout.max_staleness", "2", "--rollout.max_ahead", "3"
    )
    assert "--rollout.max_ahead=3: must be in [0, rollout.max_staleness=2]" in errors
    errors = cross_field_errors("--rollout.placement", "disaggregate", "--sync.type", "ipc")
    assert any(e.startswith("--sync.type='ipc': ipc needs --rollout.placement colocate") for e in errors)


def test_bad_input_a_lora_critic_has_no_model_of_its_own():
    lora_ppo = ["--model.lora_rank", "8", "--algorithm.advantage", "gae"]
    errors = cross_field_errors(*lora_ppo, "--critic.path", str(ROOT / "examples/toy/model"))
    assert any(e.startswith("--critic.path=") and "a second adapter and a value head on the actor's base" in e
               for e in errors), errors  # fmt: skip
    errors = cross_field_errors(*lora_ppo, "--critic.micro_batch_size", "4")
    assert any(e.startswith("--critic.micro_batch_size=4: must be unset with --model.lora_rank") for e in errors)


def test_bad_input_offload_share_out_of_range():
    errors = cross_field_errors("--trainer.offload_optimizer_ratio", "0")
    assert "--trainer.offload_optimizer_ratio=0.0: must be in (0, 1]" in errors


def test_bad_input_missing_model_path():
    assert "--model.path='/no/such/model': must be a directory with config.json" in cross_field_errors(
        "--model.path", "/no/such/model"
    )


def test_bad_input_model_dir_without_config(tmp_path):
    assert f"--model.path='{tmp_path}': must be a directory with config.json" in cross_field_errors(
        "--model.path", str(tmp_path)
    )


def test_bad_input_missing_dataset():
    assert "--data.train_path='/no/data.jsonl': file not found" in cross_field_errors(
        "--data.train_path", "/no/data.jsonl"
    )


def test_bad_input_dataset_of_unknown_format(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt\n1=\n")
    assert any("must end in .jsonl, .json or .parquet" in e for e in cross_field_errors("--data.train_path", str(path)))


def test_bad_input_evaluation_settings(tmp_path):
    errors = cross_field_errors("--eval.path", "/no/eval.jsonl", "--eval.n_samples", "0", "--eval.temperature", "-1")
    assert "--eval.path='/no/eval.jsonl': file not found" in errors
    assert "--eval.n_samples=0: must be >= 1" in errors
    assert "--eval.temperature=-1.0: must be >= 0 (0: greedy)" in errors
    path = tmp_path / "eval.csv"
    path.write_text("prompt\n1=\n")
    errors = cross_field_errors("--eval.path", str(path))
    assert f"--eval.path='{path}': must end in .jsonl, .json or .parquet" in errors


def test_bad_input_batch_not_divisible_by_ranks():
    errors = cross_field_errors("--rollout.prompts_per_step", "5")
    assert any(e.startswith("--rollout.prompts_per_step=5: must be divisible by the 2 trainer ranks") for e in errors)


def test_bad_input_missing_hostfile():
    assert "--trainer.hostfile='/no/hostfile': file not found" in cross_field_errors(
        "--trainer.hostfile", "/no/hostfile"
    )


def test_bad_input_several_errors_reported_together():
    errors = cross_field_errors("--trainer.lr", "0", "--rollout.top_p", "2", "--algorithm.is_cap", "0.5")
    assert len(errors) == 3


# -- data ---------------------------------------------------------------------------------------


def dataset(tmp_path: Path, lines: list[str], **options) -> PromptDataset:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return PromptDataset(DataConfig(train_path=str(path), **options), TOKENIZER)


def test_bad_input_empty_dataset(tmp_path):
    with pytest.raises(DatasetError, match=r"data.jsonl: no usable prompts \(0 rows\)"):
        dataset(tmp_path, [])


def test_bad_input_row_not_json_fails_naming_the_line(tmp_path):
    with pytest.raises(DatasetError, match=r"data.jsonl, line 2: not valid JSON"):
        dataset(tmp_path, ['{"prompt": "1="}', '{"prompt": ', '{"prompt": "3="}'])


def test_bad_input_row_not_json_skipped_and_counted(tmp_path):
    ds = dataset(tmp_path, ['{"prompt": "1="}', '{"prompt": ', '{"prompt": "3="}'], on_bad_row="skip")
    assert [p.text for p in ds.prompts] == ["1=", "3="]  # the good rows all kept
    assert len(ds.skipped_bad) == 1 and "line 2" in ds.skipped_bad[0][1]


def test_bad_input_row_missing_prompt_field(tmp_path):
    with pytest.raises(
        DatasetError, match=r"row 1: no field 'prompt' \(set --data.prompt_key\); row has \['question'\]"
    ):
        dataset(tmp_path, ['{"prompt": "1="}', '{"question": "2="}'])


def test_bad_input_prompt_of_wrong_type(tmp_path):
    with pytest.raises(DatasetError, match=r"row 0: 'prompt' must be a string or a list of chat messages, got 42"):
        dataset(tmp_path, ['{"prompt": 42}'])


def test_bad_input_empty_prompt(tmp_path):
    with pytest.raises(DatasetError, match=r"row 0: 'prompt' is empty"):
        dataset(tmp_path, ['{"prompt": "  "}'])


def test_bad_input_bad_sampling_params_row(tmp_path):
    with pytest.raises(DatasetError, match=r"row 0: sampling_params must be a mapping"):
        dataset(tmp_path, ['{"prompt": "1=", "sampling_params": 7}'])


def test_bad_input_bad_rows_skipped_keep_row_numbers(tmp_path):
    ds = dataset(tmp_path, ['{"prompt": "1="}', '{"prompt": 5}', '{"prompt": "3="}'], on_bad_row="skip")
    assert [p.index for p in ds.prompts] == [0, 2]
    assert ds.skipped_bad[0][0] == 1


def test_bad_input_long_prompts_skipped_and_counted(tmp_path):
    ds = dataset(tmp_path, ['{"prompt": "1="}', '{"prompt": "123456="}'], max_prompt_tokens=4)
    assert [p.text for p in ds.prompts] == ["1="] and ds.too_long == 1


def test_bad_input_long_prompts_truncated_and_counted(tmp_path):
    ds = dataset(tmp_path, ['{"prompt": "123456="}'], max_prompt_tokens=4, on_long_prompt="truncate")
    assert ds.prompts[0].prompt_ids == TOKENIZER("456=")["input_ids"] and ds.too_long == 1


# -- rewards ------------------------------------------------------------------------------------


def sample(row: int = 7) -> Sample:
    return Sample(Prompt(row, [5, 12], "1=", "1"), [5, 1], [-0.1, -0.2], "stop", 0, spans=[(0, 0)])


def test_bad_input_reward_module_missing():
    with pytest.raises(ValueError, match=r"--algorithm.reward_fn='no_such_module:f': cannot import module"):
        load_reward_fn("no_such_module:f")


def test_bad_input_reward_function_missing():
    with pytest.raises(ValueError, match=r"module 'dsrl.tasks.toy' has no function 'nope'"):
        load_reward_fn("dsrl.tasks.toy:nope")


def score_one(s: Sample, fn) -> None:
    """The sample's reward as a run computes it (a local function: in a thread of this process)."""
    asyncio.run(Rewarder(AlgorithmConfig(), TOKENIZER, fn=fn).score_group([s]))


def test_bad_input_reward_raises_names_the_row():
    def broken(prompt, response, answer):
        raise KeyError("score")

    with pytest.raises(RuntimeError, match=r"reward function failed on dataset row 7: KeyError\('score'\)"):
        score_one(sample(), broken)


def test_bad_input_reward_returns_nan():
    with pytest.raises(TypeError, match=r"reward function returned nan for dataset row 7"):
        score_one(sample(), lambda *a: float("nan"))


def test_bad_input_reward_returns_wrong_type():
    with pytest.raises(TypeError, match=r"reward function returned 'good' for dataset row 7; expected a finite float"):
        score_one(sample(), lambda *a: "good")


# -- run time -----------------------------------------------------------------------------------


def test_bad_input_checkpoint_dir_not_writable(tmp_path):
    blocked = tmp_path / "run"
    blocked.mkdir()
    (blocked / "checkpoints").write_text("a file where the checkpoint directory should be")
    with pytest.raises(PermissionError, match=r"--logging.run_dir='.*run': cannot write checkpoints there"):
        check_writable(blocked)


def test_bad_input_resume_path_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--logging.resume='.*': not a dsrl checkpoint"):
        find_checkpoint(tmp_path, str(tmp_path))


def test_bad_input_external_server_unreachable():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match=r"did not answer /health within 2s: is it running, and reachable"):
        wait_healthy(url, timeout_s=2)


def test_bad_input_request_to_dead_server_names_it():
    url = f"http://127.0.0.1:{free_port()}"
    client = RolloutClient([url], timeout_s=5, retries=0)
    try:
        with pytest.raises(ServerError, match=rf"{url}/flush_cache: connection failed"):
            client.run(client.request(url, "/flush_cache"))
    finally:
        client.close()


def test_bad_input_non_finite_rewards_skip_steps_then_stop(tmp_path):
    """Rewards too large to sum even in float64 (the advantages are computed in it) make the advantages
    non-finite: each step is skipped, then the run stops."""
    module = tmp_path / "huge_reward.py"
    module.write_text("def reward(prompt, response, answer):\n    return 1.7e308 if len(response) % 2 else 0.0\n")
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs/toy_cpu.yaml")]
    cmd += ["--logging.run_dir", str(tmp_path / "run"), "--algorithm.reward_fn", "huge_reward:reward"]
    cmd += ["--trainer.total_steps", "10", "--trainer.max_bad_steps", "2"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode != 0
    assert "step skipped (1 in a row)" in proc.stderr
    stops = "2 steps in a row had non-finite logprobs, advantages or gradients (--trainer.max_bad_steps=2)"
    assert stops in proc.stderr
    trained = [json.loads(line) for line in (tmp_path / "run" / "trained_prompts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trained] == [0]  # the skipped step is logged; nothing was applied


def test_prompt_and_max_new_tokens_past_sglangs_context_name_the_row(tmp_path):
    """SGLang refuses them mid-run; dsrl says so at start-up. A resumed partial rollout needs 6 tokens more."""
    path = tmp_path / "rows.jsonl"
    rows = [
        {"prompt": "1=", "answer": "1"},
        {"prompt": "12=", "answer": "12", "sampling_params": {"max_new_tokens": 58}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = Config(model=ModelConfig(path=str(ROOT / "examples/toy/model")), data=DataConfig(train_path=str(path)))
    cfg.rollout.max_new_tokens = 5
    dataset = PromptDataset(cfg.data, toy.build_tokenizer())
    context = toy.build_model_config().max_position_embeddings  # 64 tokens
    assert len(dataset.prompts[1].prompt_ids) + 58 <= 64
    check_fits_context(cfg.rollout, dataset, context)  # fits as a fresh request
    cfg.rollout.placement, cfg.rollout.interrupt = "disaggregate", "partial"
    with pytest.raises(DatasetError, match=r"rows.jsonl, row 1: .*over 58.*--rollout.interrupt abort"):
        check_fits_context(cfg.rollout, dataset, context)
    check_fits_context(eval_rollout(cfg), dataset, context, "eval")  # evaluation requests are never resumed
    cfg.eval.max_new_tokens = 63  # row 0: 2 + 63 tokens (row 1 keeps its own 58)
    with pytest.raises(DatasetError, match=r"rows.jsonl, row 0: .*over 64.*--eval.max_new_tokens"):
        check_fits_context(eval_rollout(cfg), dataset, context, "eval")


def test_bad_input_a_rank_killed_by_the_kernel_is_named_so(capsys, tmp_path):
    """DeepSpeed's launcher exits with a dead rank's return code, -9 as 247 (the 32B rank the host's OOM killer took):
    `dsrl train` names the signal and the likely cause; a launcher killed itself says so; other statuses as they are."""
    from dsrl.cli import supervise

    def exit_of(code: str) -> tuple[int, str]:
        status = supervise(subprocess.Popen([sys.executable, "-c", code]), tmp_path, [], 1.0)
        return status, capsys.readouterr().err

    status, err = exit_of("import sys; sys.exit(-9)")  # (what launch.py does with a rank's -9)
    assert status == 247 and "a trainer rank was killed by SIGKILL (the launcher's status 247)" in err
    assert "OOM killer" in err and "--trainer.offload_optimizer_ratio" in err
    status, err = exit_of("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert status == -11 and "the launcher was killed by SIGSEGV" in err and "OOM" not in err
    status, err = exit_of("import sys; sys.exit(3)")
    assert status == 3 and "a trainer rank failed: the launcher exited with status 3" in err
