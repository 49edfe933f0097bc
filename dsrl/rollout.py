"""Rollouts: the schedule protocol the loop drives, GRPO groups of samples from the servers
(token-in/token-out), the one parser of a `/generate` reply, and rewards."""

import asyncio
import logging
import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from tqdm import tqdm

from dsrl.config import Config, RolloutConfig
from dsrl.data import Prompt, Sample
from dsrl.rewards import RewardFn
from dsrl.serving.client import RolloutClient

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """One step's samples: whole GRPO groups, contiguous, `n_samples` each."""

    samples: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)
    """The schedule's own figures for this step (rollout/...)."""
    filtered_rows: list[int] = field(default_factory=list)
    """Dataset rows dropped since the last batch by dynamic sampling (a group with no signal)."""


class Rollouts(ABC):
    """A rollout schedule, as the training loop drives it:

        start()                                   once, before the first step
        for step: collect(step)                   the batch trained at weight version `step`
                  before_update()                 then every trainer rank syncs the weights
                  after_update(step + 1)          the servers hold version step + 1 now
        state() / restore(state, step)            what a checkpoint keeps of the schedule
        stop()                                    at the end, also on error

    The synchronous schedule generates inside `collect` and needs none of the hooks; the
    asynchronous one (`RolloutManager`) generates between them.
    """

    @abstractmethod
    def collect(self, step: int) -> Batch:
        """The batch to train on at weight version `step`."""

    def start(self) -> None:
        """Start generating ahead of the trainer, where the schedule does."""

    def before_update(self) -> None:
        """Put requests in flight in the state the weight update needs (see `rollout.interrupt`)."""

    def after_update(self, version: int) -> None:
        """The servers hold weight version `version`: resume generating."""

    def stop(self) -> None:
        """Stop generating and wait for the schedule's tasks to end."""

    def state(self) -> dict:
        """What a checkpoint keeps: enough to continue without losing or repeating a prompt."""
        return {}

    def restore(self, state: dict, version: int) -> None:
        """Continue from `state()` of a run checkpointed at weight version `version`."""


@dataclass
class Generation:
    """A `/generate` reply, parsed: the one place dsrl reads SGLang's response fields."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int | None
    """None when the request was aborted before it was sent (the client answered, not a server)."""


def parse_generation(out: dict) -> Generation:
    meta = out["meta_info"]
    version = meta.get("weight_version")
    return Generation(
        output_ids=list(out["output_ids"]),
        logprobs=[lp for lp, _, _ in meta.get("output_token_logprobs") or []],
        finish_reason=meta["finish_reason"]["type"],
        weight_version=None if version is None else int(version),
    )


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


async def generate_sample(client: RolloutClient, prompt: Prompt, params: dict, route_key: object = None) -> Sample:
    params = {**params, **prompt.sampling}
    body = {"input_ids": prompt.prompt_ids, "sampling_params": params, "return_logprob": True}
    reply = await client.generate(body, route_key)
    out = parse_generation(reply)
    return Sample(
        prompt=prompt,
        response_ids=out.output_ids,
        engine_logprobs=out.logprobs,
        finish_reason=out.finish_reason,
        weight_version=out.weight_version,
        extras={"spans": [(0, out.weight_version)]},
    )


def generate(
    client: RolloutClient, prompts: list[Prompt], cfg: RolloutConfig, seed: int = 0, progress: tqdm | None = None
) -> list[Sample]:
    """n_samples responses per prompt, one request each, groups contiguous in prompt order."""
    params = sampling_params(cfg)

    async def one(p: Prompt, j: int) -> Sample:
        params_j = {**params, "sampling_seed": request_seed(seed, p.index, j)}
        sample = await generate_sample(client, p, params_j, route_key=(seed, p.index))
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


class SyncRollouts(Rollouts):
    """The synchronous schedule: each step's batch is generated with the current weights, then scored.
    The data position follows from the step, so a checkpoint needs nothing of it."""

    def __init__(self, client: RolloutClient, cfg: Config, dataset, reward_fn: RewardFn, tokenizer, rank, world):
        self.client, self.cfg, self.dataset = client, cfg, dataset
        self.reward_fn, self.tokenizer, self.rank, self.world = reward_fn, tokenizer, rank, world

    def collect(self, step: int) -> Batch:
        prompts = self.dataset.batch(step, self.cfg.rollout.prompts_per_step, self.rank, self.world)
        samples = generate(self.client, prompts, self.cfg.rollout, request_seed(self.cfg.seed, step))
        score(samples, self.reward_fn, self.tokenizer)
        return Batch(samples)
