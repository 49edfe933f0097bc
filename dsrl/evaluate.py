"""Evaluation: the reward of the weights the servers hold, on held-out prompts (`--eval.path`).

Called by the loop right after a sync, on trainer rank 0, so every response comes from exactly
that weight version (checked: each sample carries its `weight_version`). It runs beside an
asynchronous rollout's own requests, on the same servers, and no update can come between: the
other ranks wait for rank 0 in the next step's collectives. The generations go to
<run_dir>/eval/step_<N>.jsonl.
"""

import json
import logging
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from tqdm import tqdm

from dsrl.config import Config, eval_rollout
from dsrl.data import PromptDataset, Sample
from dsrl.rewards.rewarder import Rewarder, RewardError
from dsrl.rollout.episode import EpisodeRunner, sample_row
from dsrl.rollout.rollouts import generate, request_seed
from dsrl.serving.client import RolloutClient

log = logging.getLogger(__name__)


class Evaluator:
    def __init__(self, cfg: Config, tokenizer, rewarder: Rewarder, run_dir: Path, dataset: PromptDataset | None = None,
                 runner: EpisodeRunner | None = None):  # fmt: skip
        self.cfg, self.tokenizer, self.rewarder, self.out_dir = cfg, tokenizer, rewarder, run_dir / "eval"
        self.runner = runner or EpisodeRunner(cfg, tokenizer)
        self.dataset = dataset or PromptDataset(cfg.data, tokenizer, cfg.seed, cfg.eval.path, self.runner.tool_schemas)
        self.rollout = eval_rollout(cfg)

    def due(self, step: int) -> bool:
        """Whether the weights of `step` are evaluated: every `eval.every` steps and the last."""
        every = self.cfg.eval.every
        return step == self.cfg.trainer.total_steps or (every > 0 and step % every == 0)

    def __call__(self, client: RolloutClient, step: int) -> dict[str, float]:
        start = time.perf_counter()
        prompts = self.dataset.prompts
        # disable=None: a bar on a terminal, none in a log file (it would sit inside the train bar)
        with tqdm(total=len(prompts) * self.rollout.n_samples, desc=f"eval {step}", leave=False, disable=None) as bar:
            try:
                seed = request_seed(self.cfg.seed, step)
                samples = client.run(generate(client, prompts, self.rollout, seed, bar, self.rewarder, self.runner))
            except RewardError as e:  # it names the row; say which file
                raise RewardError(f"--eval.path={self.dataset.path!r}: {e}") from e
        samples = [s for s in samples if not s.skip]  # rows whose reward failed (on_reward_error skip)
        others = {s.weight_version for s in samples} - {step}
        if others:  # the sync's version check makes this a bug, not a setting
            raise RuntimeError(f"evaluation of weight version {step} got responses from versions {sorted(others)}")
        self.write(step, samples)
        rewards = torch.tensor([s.reward for s in samples])
        metrics = {
            "eval/reward_mean": rewards.mean().item(),
            "eval/reward_std": rewards.std().item() if len(samples) > 1 else 0.0,
            "eval/response_length_mean": sum(len(s.response_ids) for s in samples) / len(samples),
            "eval/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "timing/eval": time.perf_counter() - start,
            **self.rewarder.metrics(samples, "eval/"),  # the reward model's and the rule's scores, raw
        }
        n = self.rollout.n_samples
        if n > 1:  # best of n per prompt (generate keeps each prompt's samples together)
            metrics["eval/reward_best_mean"] = rewards.view(-1, n).max(-1).values.mean().item()
        log.info(
            "eval at step %d: reward %.3f±%.3f over %d responses to %s (%.1fs)",
            step, metrics["eval/reward_mean"], metrics["eval/reward_std"], len(samples), self.dataset.path,
            metrics["timing/eval"],
        )  # fmt: skip
        return metrics

    def write(self, step: int, samples: list[Sample]) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / f"step_{step}.jsonl", "w") as f:
            for s in samples:
                row = {**sample_row(s, self.tokenizer), "answer": s.prompt.answer, "finish_reason": s.finish_reason}
                f.write(json.dumps(row, default=str) + "\n")


def evaluate_model(cfg: Config, model_dir: str, engine: str) -> dict[str, float]:
    """`dsrl eval`: score the weights in `model_dir` on --eval.path with the run's reward (its reward model's servers
    started beside), on a server started for it (SGLang on GPU, the embedded engine on CPU); the responses go to
    <run_dir>/eval/step_0.jsonl."""
    from transformers import AutoTokenizer

    from dsrl.rewards.models import RewardModel, side_servers
    from dsrl.serving.fleet import start_fleet

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    run_dir, r = Path(cfg.logging.run_dir), cfg.rollout
    with ExitStack() as stack:
        fleet = stack.enter_context(start_fleet(r, model_dir, run_dir, cfg.seed, engine))
        client = RolloutClient(fleet.urls, r.max_concurrency, r.request_timeout_s, api_key=r.api_key)
        stack.callback(client.close)
        model = None
        if cfg.reward_model.path:
            servers = side_servers(cfg, cfg.reward_model, engine == "sglang")
            path = cfg.reward_model.path
            reward_fleet = stack.enter_context(start_fleet(servers, path, run_dir, cfg.seed, engine, role="reward"))
            model = RewardModel(cfg, tokenizer, client, reward_fleet, rank0=True)
        rewarder = Rewarder(cfg.algorithm, tokenizer, env=bool(cfg.rollout.env), model=model)
        stack.callback(rewarder.close)
        evaluator = Evaluator(cfg, tokenizer, rewarder, run_dir)
        stack.callback(evaluator.runner.close)
        # the weights the servers loaded are version 0 of this evaluation
        client.call_all("/update_weight_version", {"new_version": "0", "abort_all_requests": False})
        return evaluator(client, 0)
