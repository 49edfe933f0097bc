"""End to end on CPU: `dsrl train` with 2 ZeRO-3 ranks and the embedded engine learns the toy task."""

import json
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import ROOT

STEPS = 60


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("toy_run")
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs/toy_cpu.yaml")]
    cmd += ["--trainer.total_steps", str(STEPS), "--logging.run_dir", str(run_dir), "--logging.save_every", "30"]
    cmd += ["--sync.verify", "probe", "--sync.probe_tolerance", "1e-4"]  # fp32 on both sides
    cmd += ["--eval.path", str(ROOT / "examples/toy/test.jsonl"), "--eval.every", "30", "--eval.before_train", "true"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return run_dir, events, proc.stderr


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
        *(f"timing/{phase}" for phase in ("generate", "release", "logprobs", "update", "sync", "step")),
    ]:
        assert tag in tags, tag
    # fp32 on both sides: the engine samples from exactly the distribution the trainer recomputes
    assert max(scalars(events, "mismatch/logprob_abs_diff")) < 1e-4
    assert f"step {STEPS}/{STEPS} | reward" in stderr


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


def test_servers_stay_up_through_sleep_and_wake(toy_run):
    """Colocated, the servers sleep while the trainer steps; nothing may make them generate then
    (SGLang's /health does, and its scheduler dies: the embedded engine exits the same way)."""
    log = toy_run[2]
    assert "is down" not in log and "restarted" not in log, [line for line in log.splitlines() if "down" in line][:3]
