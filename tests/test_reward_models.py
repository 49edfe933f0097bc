"""Rewards from models on CPU, on the embedded engine's /classify and /generate: a reward model trained here on
synthetic preferences steers GRPO on the toy task (its score and the task's hidden rule reward both rise), a scripted
judge really generates its verdicts, a reward server that dies is restarted and its rows scored again, and settings
that cannot work stop `dsrl train` before launch."""

import json
import os
import re
import runpy
import signal
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from dsrl.cli import main as dsrl_main
from dsrl.config import build_parser, side_rollout, to_config
from dsrl.data import Prompt, Sample
from dsrl.rewards.models import RewardModel
from dsrl.rewards.rewarder import Rewarder, RewardError
from dsrl.serving.client import RolloutClient, ServedAdapter
from dsrl.serving.fleet import start_fleet
from dsrl.tasks import toy
from tests.conftest import ROOT
from tests.test_reliability import run_to_end

TOKENIZER = toy.build_tokenizer()
TOY = ["--model.path", str(ROOT / "examples/toy/model"), "--data.train_path", str(ROOT / "examples/toy/train.jsonl")]
STEPS = 40


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """tools/toy_reward_model.py's classifier, trained here (Bradley-Terry on synthetic pairs, 15-40 s)."""
    out = tmp_path_factory.mktemp("reward_model")
    accuracy = runpy.run_path(str(ROOT / "tools/toy_reward_model.py"))["train"](out)
    assert accuracy > 0.8, f"held-out preference accuracy {accuracy:.3f}"
    return out


@pytest.mark.slow
def test_grpo_against_a_reward_model_raises_its_score_and_the_hidden_rule_reward(reward_model, tmp_path):
    """GRPO on the toy task, 1 rank, 40 steps, rewarded by the reward model alone (the rule reward is logged with
    weight 0). Measured: the model's score -2.7 -> 0.0 and the rule reward 0.06 -> 0.14 (first 5 steps against
    the last 5; the rule itself as the reward takes it to 0.20). The running normalisation's state is in the
    checkpoint, and `dsrl eval` reports the same model score of the final weights as the run's own evaluation."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(row) + "\n" for row in toy.make_rows(16, 7)))
    run_dir = tmp_path / "run"
    common = ["--reward_model.path", str(reward_model), "--eval.path", str(held_out), "--logging.run_dir", str(run_dir)]
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs/toy_cpu_rm.yaml"), *common]
    cmd += ["--trainer.total_steps", str(STEPS), "--logging.save_every", "20", "--reward_model.normalize", "running"]
    log = run_to_end(cmd)
    # each step's line names the trained reward's parts (it used to show the model's raw score as 'reward')
    assert re.search(rf"step {STEPS}/{STEPS} \| reward \S+ \| model score -?[\d.]+ \| rule reward [\d.]+ ", log)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for tag, rise in (("reward/model_mean", 1.0), ("reward/rule_mean", 0.04)):
        values = [e.value for e in events.Scalars(tag)]
        first, last = sum(values[:5]) / 5, sum(values[-5:]) / 5
        assert len(values) == STEPS and last > first + rise, f"{tag}: first 5 steps {first:.3f}, last 5 {last:.3f}"
    assert {"reward/model_seconds", "reward/model_exposed_s", "eval/model_mean"} <= set(events.Tags()["scalars"])
    state = torch.load(run_dir / "checkpoints/step_20/dsrl_rank0.pt", weights_only=False)["rewarder"]
    assert state["moments"][0] == 20 * 32 * 8  # every sample scored up to step 20, none of step 21
    cmd = [sys.executable, "-m", "dsrl.cli", "eval", "--config", str(run_dir / "config.yaml"), *common]
    cmd += ["--model.path", str(run_dir / "hf"), "--model.init_from_config", "false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reported = json.loads(proc.stdout[proc.stdout.index("{") :])["eval/model_mean"]
    assert reported == pytest.approx(events.Scalars("eval/model_mean")[-1].value, abs=1e-4)


def tiny(**fields) -> Qwen2Config:
    """A one-layer Qwen2 of width 16 on the toy vocabulary."""
    shape = dict(vocab_size=14, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0)  # fmt: skip
    return Qwen2Config(**shape | fields)


def samples_of(responses: list[str]) -> list[Sample]:
    prompt = Prompt(3, TOKENIZER("394=")["input_ids"], "394=", "394")
    return [Sample(prompt, TOKENIZER(r)["input_ids"] + [1], [0.0] * (len(r) + 1), "stop", 0) for r in responses]


def reward_servers(tmp_path, *argv: str):
    """A config of `argv`, its reward servers (the embedded engine), a client and a rewarder of the model alone."""
    cfg = to_config(build_parser(), build_parser().parse_args([*TOY, *argv, "--logging.run_dir", str(tmp_path)]))
    fleet = start_fleet(
        side_rollout(cfg, cfg.reward_model), cfg.reward_model.path, tmp_path, 0, "embedded", role="reward"
    )
    client, policy = RolloutClient(fleet.urls), AutoTokenizer.from_pretrained(cfg.model.path)  # (as a run loads it)
    rewarder = Rewarder(cfg.algorithm, policy, model=RewardModel(cfg, policy, client, fleet, rank0=True))
    return cfg, fleet, client, rewarder


def test_a_scripted_judge_generates_its_verdicts_greedily_and_one_it_cannot_parse_names_the_row(tmp_path):
    """A causal LM whose next token depends on the last one alone: a digit repeats itself, any other token ends the
    sequence (its layers are zero, its embeddings one-hot). Judging "{prompt}{response}" its verdict is the
    response's last digit, which the default parse function reads as the reward."""
    judge = Qwen2ForCausalLM(tiny(tie_word_embeddings=False, eos_token_id=1, bos_token_id=None))
    with torch.no_grad():
        for p in judge.parameters():
            p.zero_()
        judge.model.norm.weight.fill_(1.0)
        judge.model.embed_tokens.weight[:, :14] = torch.eye(14)
        for token in range(14):
            judge.lm_head.weight[token if 2 <= token <= 11 else 1, token] = 10.0
    judge.save_pretrained(tmp_path / "judge")
    TOKENIZER.save_pretrained(tmp_path / "judge")
    args = ["--reward_model.path", str(tmp_path / "judge"), "--reward_model.judge_template", "{prompt}{response}"]
    cfg, fleet, client, rewarder = reward_servers(tmp_path, *args, "--reward_model.judge_max_new_tokens", "1")
    client.adapter = ServedAdapter("dsrl-v3", 3)  # the policy's LoRA adapter, served on its own: not the judge's
    try:
        for _ in range(2):  # greedy: the same verdicts again
            samples = samples_of(["394", "12", "7"])
            client.run(rewarder.score_group(samples))
            assert [s.reward for s in samples] == [4.0, 2.0, 7.0]
            assert [s.reward_model for s in samples] == [4.0, 2.0, 7.0]
        with pytest.raises(RewardError, match=r"judge returned None for dataset row 3; expected a finite float"):
            client.run(rewarder.score_group(samples_of(["5", "39="])))  # "=" ends the verdict at once: no number
    finally:
        client.close()
        fleet.stop()


def test_a_reward_server_that_dies_is_restarted_at_its_url_and_its_rows_scored_again(tmp_path):
    """Scores are SGLang's pooling, the logits at the last token (HF's own classifier gives the same here); after a
    SIGKILL the group is scored again by a new process on the same port, with the same scores."""
    torch.manual_seed(0)
    classifier = Qwen2ForSequenceClassification(tiny(num_labels=1))
    classifier.save_pretrained(tmp_path / "rm")
    TOKENIZER.save_pretrained(tmp_path / "rm")
    cfg, fleet, client, rewarder = reward_servers(tmp_path, "--reward_model.path", str(tmp_path / "rm"))
    try:
        samples = samples_of(["394", "3", "0000"])
        client.run(rewarder.score_group(samples))
        with torch.no_grad():
            hf = [classifier(torch.tensor([s.prompt.prompt_ids + s.response_ids])).logits.item() for s in samples]
        assert [s.reward for s in samples] == pytest.approx(hf, abs=1e-5)
        url, pid = fleet.urls[0], fleet.processes[0].proc.pid
        os.killpg(pid, signal.SIGKILL)
        fleet.processes[0].proc.wait()
        again = samples_of(["394", "3", "0000"])
        client.run(rewarder.score_group(again))
        assert [s.reward for s in again] == [s.reward for s in samples]
        assert fleet.urls == [url] and fleet.processes[0].proc.pid != pid
        assert (tmp_path / "logs/reward_server_0.log").is_file()
    finally:
        client.close()
        fleet.stop()


def test_bad_input_reward_models_that_cannot_work_stop_dsrl_train_before_launch(capsys, tmp_path):
    """One line each, exit status 2, nothing launched: a directory that is not a reward model, a reward model whose
    vocabulary is not the policy's when token ids are sent, a judge whose parse function does not import, a server
    argument the reward model's server does not know."""
    other = tiny(vocab_size=20, num_labels=1, architectures=["Qwen2ForSequenceClassification"])
    other.save_pretrained(tmp_path / "other")
    toy.build_tokenizer(20).save_pretrained(tmp_path / "other")
    judge = toy.build_model_config()
    judge.architectures = ["Qwen2ForCausalLM"]
    judge.save_pretrained(tmp_path / "judge")
    TOKENIZER.save_pretrained(tmp_path / "judge")
    train = ["train", "--config", str(ROOT / "configs/toy_cpu_rm.yaml"), "--logging.run_dir", str(tmp_path / "run")]
    cases = [
        (["--reward_model.path", str(tmp_path / "not_built")],
         f"`python tools/toy_reward_model.py {tmp_path}/not_built` builds the toy task's"),
        (["--reward_model.path", str(ROOT / "examples/toy/model")],
         f"--reward_model.path='{ROOT}/examples/toy/model': a model with no architectures: a reward model is a "
         "*ForSequenceClassification with one label"),
        (["--reward_model.path", str(tmp_path / "other"), "--reward_model.input", "token_ids"],
         f"--reward_model.input=token_ids: the vocabulary of --reward_model.path='{tmp_path}/other' (21 tokens) "
         "differs from the policy's (15)"),
        (["--reward_model.path", str(tmp_path / "judge"), "--reward_model.judge_template", "{response}",
          "--reward_model.judge_parse_fn", "no_such_module:parse"],
         "--reward_model.judge_parse_fn='no_such_module:parse': cannot import module 'no_such_module'"),
        (["--reward_model.path", str(tmp_path / "other"), "--reward_model.server_args", '{"decode_delay_msx": 1}'],
         "--reward_model.server_args: 'decode_delay_msx' is not an argument of the embedded server; did you mean "
         "decode_delay_ms?"),
    ]  # fmt: skip
    for argv, line in cases:
        assert dsrl_main([*train, *argv]) == 2
        err = capsys.readouterr().err
        assert line in err and "deepspeed" not in err, err
