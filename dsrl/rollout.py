"""Rollouts: GRPO groups of samples from the servers, token-in/token-out, then their rewards."""

import asyncio
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from dsrl.config import Config, RolloutConfig
from dsrl.data import Prompt
from dsrl.rewards import RewardFn
from dsrl.serving.client import RolloutClient

log = logging.getLogger(__name__)


@dataclass
class Sample:
    prompt: Prompt
    response_ids: list[int]
    engine_logprobs: list[float]
    """Logprobs the rollout engine reported for `response_ids` (its sampling distribution)."""
    finish_reason: str
    weight_version: str
    reward: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)
    """spans: [(first token index, weight version)] of the response (index None where not known: a request
    paused through an update, `rollout.interrupt pause`); per-token arrays the trainer fills in."""

    @property
    def oldest_version(self) -> int:
        return min(version for _, version in self.extras["spans"])


def sampling_params(cfg: RolloutConfig) -> dict:
    return {
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
    }


def request_seed(*parts: int) -> int:
    """A sampling seed fixed by (run seed, step, row, sample): rollouts repeat exactly on resume."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + part) % (2**31 - 1)
    return seed


async def generate_sample(client: RolloutClient, prompt: Prompt, params: dict) -> Sample:
    params = {**params, **prompt.sampling}
    out = await client.generate({"input_ids": prompt.prompt_ids, "sampling_params": params, "return_logprob": True})
    meta = out["meta_info"]
    logprobs = [lp for lp, _, _ in meta["output_token_logprobs"]]
    return Sample(
        prompt=prompt,
        response_ids=out["output_ids"],
        engine_logprobs=logprobs,
        finish_reason=meta["finish_reason"]["type"],
        weight_version=str(meta["weight_version"]),
        extras={"spans": [(0, int(meta["weight_version"]))]},
    )


def generate(
    client: RolloutClient, prompts: list[Prompt], cfg: RolloutConfig, seed: int = 0, progress: tqdm | None = None
) -> list[Sample]:
    """n_samples responses per prompt, one request each, groups contiguous in prompt order."""
    params = sampling_params(cfg)

    async def one(p: Prompt, j: int) -> Sample:
        sample = await generate_sample(client, p, {**params, "sampling_seed": request_seed(seed, p.index, j)})
        if progress is not None:
            progress.update()
        return sample

    async def all_samples() -> list[Sample]:
        return await asyncio.gather(*(one(p, j) for p in prompts for j in range(cfg.n_samples)))

    return client.run(all_samples())


def score_one(sample: Sample, reward_fn: RewardFn, tokenizer) -> float:
    """The reward of one sample; a reward function that raises or returns a non-number names the row."""
    response = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    try:
        value = reward_fn(sample.prompt.text, response, sample.prompt.answer)
    except Exception as e:
        raise RuntimeError(f"reward function failed on dataset row {sample.prompt.index}: {e!r}") from e
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(
            f"reward function returned {value!r} for dataset row {sample.prompt.index}; expected a finite float"
        )
    return float(value)


def score(samples: list[Sample], reward_fn: RewardFn, tokenizer) -> None:
    for s in samples:
        s.reward = score_one(s, reward_fn, tokenizer)


class SyncRollouts:
    """The synchronous schedule: each step's batch is generated with the current weights, then scored."""

    def __init__(self, client: RolloutClient, cfg: Config, dataset, reward_fn: RewardFn, tokenizer, rank, world):
        self.client, self.cfg, self.dataset = client, cfg, dataset
        self.reward_fn, self.tokenizer, self.rank, self.world = reward_fn, tokenizer, rank, world

    def collect(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        prompts = self.dataset.batch(step, self.cfg.rollout.prompts_per_step, self.rank, self.world)
        samples = generate(self.client, prompts, self.cfg.rollout, request_seed(self.cfg.seed, step))
        score(samples, self.reward_fn, self.tokenizer)
        return samples, {}

    def start(self) -> None:
        pass

    def before_update(self) -> None:
        pass

    def after_update(self, version: int) -> None:
        pass

    def stop(self) -> None:
        pass

    def state(self) -> dict:  # the data position follows from the step
        return {}

    def restore(self, state: dict, version: int) -> None:
        pass
