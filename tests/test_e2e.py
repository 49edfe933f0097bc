"""End to end on CPU: `dsrl train` with 2 ZeRO-3 ranks and the embedded engine learns the toy task."""

import json
import os
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from dsrl.config import parse_config
from dsrl.metrics import tracker_config
from dsrl.serving.servers import server_command
from tests.conftest import ROOT

STEPS = 60
KEY = "s3cret-7f1e9a"
"""The run's --rollout.api_key (test_the_api_key_is_in_no_log_tracker_config_command_line_or_world_readable_file)."""


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("toy_run")
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs/toy_cpu.yaml")]
    cmd += ["--trainer.total_steps", str(STEPS), "--logging.run_dir", str(run_dir), "--logging.save_every", "30"]
    cmd += ["--sync.verify", "probe", "--sync.probe_tolerance", "1e-4"]  # fp32 on both sides
    cmd += ["--eval.path", str(ROOT / "examples/toy/test.jsonl"), "--eval.every", "30", "--eval.before_train", "true"]
    cmd += ["--logging.trackers", "[wandb,mlflow]"]  # offline: <run_dir>/wandb, <run_dir>/mlflow.db
    cmd += ["--rollout.api_key", KEY]
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return run_dir, events, proc.stderr + proc.stdout


def scalars(events, tag):
    return [e.value for e in events.Scalars(tag)]


def test_reward_rises(toy_run):
    _, events, _ = toy_run
    reward = scalars(events, "reward/mean")
    assert len(reward) == STEPS
    first, last = sum(reward[:5]) / 5, sum(reward[-10:]) / 10
    assert first < 0.15, f"the untrained policy already scores {first:.3f}"
    assert last > first + 0.1, f"reward did not rise: first 5 steps {first:.3f}, last 10 {last:.3f}"


def test_metrics_are_logged(toy_run):
    _, events, stderr = toy_run
    tags = set(events.Tags()["scalars"])
    for tag in [
        "reward/std",
        "response/length_mean",
        "actor/entropy",
        "actor/clip_frac",
        "actor/grad_norm",
        "actor/lr",
        "sync/gb_per_s",
        "sync/bytes",
        "mismatch/logprob_abs_diff",
        "sync/probe_logprob_diff",
        *(f"timing/{phase}" for phase in ("generate", "generate_wait", "release", "logprobs", "update", "sync")),
        "timing/step",
    ]:
        assert tag in tags, tag
    # fp32 on both sides: the engine samples from exactly the distribution the trainer recomputes
    assert max(scalars(events, "mismatch/logprob_abs_diff")) < 1e-4
    assert f"step {STEPS}/{STEPS} | reward" in stderr


def test_train_and_rollout_logprobs_agree_on_every_token_of_every_step(toy_run):
    """Train = rollout: the embedded engine's logprob of each sampled token against the trainer's (the update's own
    forward pass: trainer.old_logprobs auto), every one of the 60 steps: the largest |diff| over a batch's model tokens
    <= 5e-6 (two runs: up to 1.7e-6 and 1.4e-6, the median step 7.2e-7 and 7.7e-7), the mean <= 5e-7 (seen 1.7e-7 and
    1.6e-7). fp32 on both sides and the same weights (the sync's probe checks them), so what is left is rounding: the
    engine runs each decode step as a forward over a left-padded batch whose rows change as requests come and finish,
    and takes log_softmax(logits / T) of the last position; the trainer runs right-padded micro-batches of whole
    sequences and a chunked log-sum-exp. Other shapes give other GEMM blocking and summation orders: the logits differ
    in their last bits, a logprob of a few nats by a few fp32 ulps (2.4e-7 at 2-4)."""
    _, events, _ = toy_run
    worst, mean = scalars(events, "mismatch/logprob_max_abs_diff"), scalars(events, "mismatch/logprob_abs_diff")
    assert len(worst) == len(mean) == STEPS
    assert max(worst) <= 5e-6, worst
    assert max(mean) <= 5e-7, mean
    assert max(worst) > 0  # (two computations, not one value read twice)


def test_evaluation_scores_the_weights_of_each_sync(toy_run):
    """Greedy responses to the 256 held-out prompts, before training, at step 30 and at the end, each
    from exactly the weight version synced at that step; the trained policy must beat the initial one."""
    run_dir, events, _ = toy_run
    evals = {e.step: e.value for e in events.Scalars("eval/reward_mean")}
    assert sorted(evals) == [0, 30, STEPS]
    assert evals[STEPS] > evals[0] + 0.2, evals
    for step in evals:
        rows = [json.loads(line) for line in (run_dir / "eval" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 256 and {r["weight_version"] for r in rows} == {step}
        assert abs(sum(r["reward"] for r in rows) / len(rows) - evals[step]) < 1e-6


def test_checkpoint_written(toy_run):
    run_dir, _, _ = toy_run
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_60"
    assert list((run_dir / "checkpoints" / "step_30").glob("*model_states.pt"))


def test_exported_model_loads_and_generates(toy_run):
    run_dir, _, _ = toy_run
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "hf")
    ids = tokenizer("394=", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    assert torch.isfinite(model(ids).logits).all()
    assert (run_dir / "config.yaml").is_file()
    assert '"engine": "embedded"' in (run_dir / "plan.json").read_text()  # the start-up's decisions, beside it


def test_servers_stay_up_through_sleep_and_wake(toy_run):
    """Colocated, the servers sleep while the trainer steps; nothing may make them generate then
    (SGLang's /health does, and its scheduler dies: the embedded engine exits the same way)."""
    log = toy_run[2]
    assert "is down" not in log and "restarted" not in log, [line for line in log.splitlines() if "down" in line][:3]


def test_export_of_the_last_checkpoint_equals_the_final_model(toy_run, tmp_path):
    """`dsrl export` reads the ZeRO-3 checkpoint a parameter at a time and writes a Hugging Face model
    directory: step 60's is the run's final model, tensor for tensor, and loads with transformers. Shards of
    ~50 KB split the 0.3 MB toy over several safetensors files and an index, as a large model would be."""
    run_dir, _, _ = toy_run
    out = tmp_path / "exported"
    cmd = [sys.executable, "-m", "dsrl.cli", "export", "--checkpoint", str(run_dir / "checkpoints/step_60")]
    cmd += ["--shard-gb", "0.00005"]
    proc = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (out / "model.safetensors").exists()
    exported, final = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    for (name, a), (_, b) in zip(exported.state_dict().items(), final.state_dict().items()):
        assert torch.equal(a, b), name
    assert (
        AutoTokenizer.from_pretrained(out)("394=").input_ids
        == AutoTokenizer.from_pretrained(run_dir / "hf")("394=").input_ids
    )


def test_eval_command_scores_the_final_model_as_the_run_did(toy_run, tmp_path):
    """`dsrl eval` with the run's own config on its exported model: the greedy reward of the run's last
    evaluation (same weights, same prompts)."""
    run_dir, events, _ = toy_run
    cmd = [sys.executable, "-m", "dsrl.cli", "eval", "--config", str(run_dir / "config.yaml")]
    cmd += ["--model.path", str(run_dir / "hf"), "--model.init_from_config", "false"]
    cmd += ["--logging.run_dir", str(tmp_path), "--eval.path", str(ROOT / "examples/toy/test.jsonl")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads(proc.stdout[proc.stdout.index("{") :])
    in_run = {e.step: e.value for e in events.Scalars("eval/reward_mean")}[STEPS]
    assert abs(metrics["eval/reward_mean"] - in_run) < 0.02, (metrics["eval/reward_mean"], in_run)
    assert len((tmp_path / "eval" / "step_0.jsonl").read_text().splitlines()) == 256


def test_wandb_gets_the_tags_tensorboard_gets_and_the_generations(toy_run):
    """Through accelerate's tracker layer, wandb (offline here) logs every scalar tensorboard has, and each
    step's sampled generations (prompt, response, reward, weight version) as a table, also written to
    <run_dir>/generations.jsonl; histograms cover both ranks' samples."""
    run_dir, events, _ = toy_run
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    logged = run_file.read_bytes()  # wandb's own record format: the tag names are in it as UTF-8
    missing = [tag for tag in events.Tags()["scalars"] if tag.encode() not in logged]
    assert not missing, missing
    assert len(list((run_dir / "wandb").glob("offline-run-*/files/media/table/generations_*.table.json"))) == STEPS
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * STEPS and set(rows[0]) == {"step", "prompt", "response", "reward", "weight_version", "row"}
    assert all(r["weight_version"] == r["step"] - 1 for r in rows)  # synchronous: the weights of the step
    assert "generations/text_summary" in events.Tags()["tensors"]  # tensorboard's text
    lengths = events.Histograms("response/length")[-1].histogram_value
    assert lengths.num == 32 * 8  # the step's 256 samples over both ranks, not rank 0's 128
    for tag in ("rollout/tokens_per_s", "advantage/mean", "advantage/std", "advantage/no_signal_group_frac"):
        assert tag in events.Tags()["scalars"], tag


def test_mlflow_gets_the_tags_tensorboard_gets(toy_run):
    """--logging.trackers mlflow: the run's metrics in MLflow's store (default <run_dir>/mlflow.db), every step."""
    import mlflow

    run_dir, events, _ = toy_run
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "dsrl"]
    (run,) = client.search_runs([experiment.experiment_id])
    missing = [tag for tag in events.Tags()["scalars"] if tag not in run.data.metrics]
    assert not missing, missing
    assert len(client.get_metric_history(run.info.run_id, "reward/mean")) == STEPS
    assert run.data.params["trainer.total_steps"] == str(STEPS)


def test_the_api_key_is_in_no_log_tracker_config_command_line_or_world_readable_file(toy_run, tmp_path):
    """--rollout.api_key used to go to wandb/MLflow with the config, into the "starting rollout server" log line,
    onto the servers' command lines (ps) and into a config.yaml readable by every user of the machine. The toy run
    has one, wandb and MLflow beside it."""
    run_dir, _, log = toy_run
    assert KEY not in log
    holders = [p for p in run_dir.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert holders and all(p.stat().st_mode & 0o077 == 0 for p in holders), [
        (p, oct(p.stat().st_mode)) for p in holders
    ]

    cfg = parse_config(["--config", str(ROOT / "configs/toy_cpu.yaml"), "--rollout.api_key", KEY])
    assert KEY not in json.dumps(tracker_config(cfg))
    assert KEY not in " ".join(server_command(cfg.rollout, "sglang", "m", "127.0.0.1", 1, 0, 0, tmp_path))
