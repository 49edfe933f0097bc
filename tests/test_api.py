"""The Python API: `dsrl.train(cfg)` in this very process (one rank, no launcher), with a reward and a
rollout given as Python functions."""

import asyncio
from dataclasses import replace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dsrl
from dsrl.config import AlgorithmConfig, Config, DataConfig, ModelConfig
from dsrl.data import Prompt, Sample
from dsrl.rewards.rewarder import Rewarder
from dsrl.rollout.rollouts import RolloutFnError, generate
from dsrl.serving.client import RolloutClient
from dsrl.serving.fleet import start_fleet
from dsrl.tasks import toy
from tests import _bad_rewards, _rollouts
from tests.conftest import ROOT

TOY = ["--model.path", str(ROOT / "examples/toy/model"), "--data.train_path", str(ROOT / "examples/toy/train.jsonl")]


def test_the_python_api_trains_the_toy_task_in_this_process(tmp_path):
    cfg = dsrl.load_config(
        ROOT / "configs/toy_cpu.yaml", *TOY, "--trainer.num_ranks", "1", "--trainer.total_steps", "30",
        "--rollout.prompts_per_step", "16",
        "--logging.run_dir", str(tmp_path), "--eval.path", "null", "--logging.export_hf", "false",
    )  # fmt: skip
    cfg.algorithm.reward_fn = _bad_rewards.toy_batched  # a batched callable: scored in the worker processes
    cfg.rollout.rollout_fn = _rollouts.two_pieces  # each response in two requests: still on-policy
    metrics = dsrl.train(cfg)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    reward = [e.value for e in events.Scalars("reward/mean")]
    assert len(reward) == 30 and metrics["reward/mean"] == reward[-1]
    assert sum(reward[-5:]) / 5 > sum(reward[:5]) / 5 + 0.05, reward
    assert "tests._bad_rewards:toy_batched" in (tmp_path / "config.yaml").read_text()
    assert "tests._rollouts:two_pieces" in (tmp_path / "config.yaml").read_text()
    assert not torch.distributed.is_initialized()  # the one-rank world is torn down: train can run again


def test_a_reward_given_as_a_lambda_runs_beside_the_event_loop():
    """A function nothing can import by name (a lambda, a closure) runs in a thread of this process."""
    rewarder = Rewarder(
        AlgorithmConfig(reward_fn="unused:f"), toy.build_tokenizer(), lambda p, r, a: len(r.split()) / 10
    )
    samples = [Sample(Prompt(i, [5, 12], "1=", "1"), [5] * (i + 1), [], "stop", 0) for i in range(3)]
    asyncio.run(rewarder.score_group(samples))
    assert rewarder.pool is None and [s.reward for s in samples] == [0.1, 0.2, 0.3]


def test_a_custom_rollout_function_drives_the_servers_and_is_checked(toy_weights, tmp_path):
    """`--rollout.rollout_fn` gets the servers (`engine.generate`, `engine.sample`) per sample; greedy, a
    response made of two requests equals one request's, with a weight-version span per request. A function
    that returns something else than a Sample of its prompt fails naming the function and the row."""
    cfg = Config(model=ModelConfig(path=str(toy_weights)), data=DataConfig(train_path="unused.jsonl")).rollout
    fleet = start_fleet(cfg, str(toy_weights), tmp_path, 0, "embedded")
    client = RolloutClient(fleet.urls, timeout_s=60)
    try:
        client.call_all("/update_weight_version", {"new_version": "0"})  # as the first sync of a run does
        greedy = replace(cfg, n_samples=2, max_new_tokens=6, temperature=0.0)
        prompts = [Prompt(i, [5, 6 + i, 12], "", None) for i in range(3)]
        plain = client.run(generate(client, prompts, greedy))
        custom = client.run(generate(client, prompts, replace(greedy, rollout_fn="tests._rollouts:two_pieces")))
        assert [s.response_ids for s in custom] == [s.response_ids for s in plain]
        flat = [[lp for s in samples for lp in s.engine_logprobs] for samples in (custom, plain)]
        assert flat[0] == pytest.approx(flat[1], abs=1e-5)
        assert any(len(s.response_ids) > 2 for s in custom)
        assert all(len(s.spans) == (2 if len(s.response_ids) > 2 else 1) for s in custom)
        with pytest.raises(RolloutFnError, match=r"tests._rollouts:not_a_sample: on dataset row 0: returned list"):
            client.run(generate(client, prompts[:1], replace(greedy, rollout_fn=_rollouts.not_a_sample)))
    finally:
        client.close()
        fleet.stop()
