"""Rollouts: the schedule protocol the loop drives, GRPO groups of samples from the servers
(token-in/token-out), the one parser of a `/generate` reply, and the colocated schedule."""

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from base64 import b64decode
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from dsrl.config import Config, RolloutConfig, function_spec
from dsrl.data import Prompt, Sample
from dsrl.rewards.rewarder import Rewarder
from dsrl.rewards.rules import load_function
from dsrl.rollout.episode import Episode, EpisodeRunner
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
                  generate_ahead(step + 1)        beside the optimizer step (colocated one-step-off)
                  before_update()                 then every trainer rank syncs the weights
                  after_update(step + 1)          the servers hold version step + 1 now
        state() / restore(state, step)            what a checkpoint keeps of the schedule
        stop()                                    at the end, also on error

    The synchronous schedule generates inside `collect` (or, one-step-off, from `generate_ahead`); the
    asynchronous one (`RolloutManager`) generates between the hooks.
    """

    @abstractmethod
    def collect(self, step: int) -> Batch:
        """The batch to train on at weight version `step`."""

    def start(self) -> None:
        """Start generating ahead of the trainer, where the schedule does."""

    def generate_ahead(self, step: int) -> None:
        """Start generating the batch of `step` now, beside the trainer's last optimizer step, with the weights the
        servers hold (`dsrl.train.beside_optimizer_step` says when); a schedule that generates ahead on its own
        (`RolloutManager`) has nothing to start."""

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


def rollout_metrics(samples: list[Sample], trainer_version: int) -> dict[str, float]:
    """A batch's rewards, lengths and staleness, and the engine's logprobs against the trainer's."""
    rewards = torch.tensor([s.reward for s in samples])
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float)
    staleness = torch.tensor([trainer_version - s.oldest_version for s in samples], dtype=torch.float)
    return {
        "rollout/staleness_mean": staleness.mean().item(),
        "rollout/staleness_max": staleness.max().item(),
        "rollout/versions_per_batch": float(len({v for s in samples for _, v in s.spans})),
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item(),
        "prompt/length_mean": sum(len(s.prompt.prompt_ids) for s in samples) / len(samples),
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        **logprob_mismatch(samples),
    }


def logprob_mismatch(samples: list[Sample]) -> dict[str, float]:
    """How far the engine's sampling logprobs are from the trainer's recomputed ones, over the model's tokens
    (none when the step was skipped before the update gave them: `old_from_update`)."""
    if any(s.old_logprobs is None for s in samples):
        return {}
    model = torch.cat([torch.tensor(s.mask(), dtype=torch.bool) for s in samples])
    engine = torch.cat([torch.tensor(s.engine_logprobs) for s in samples])[model]
    trainer = torch.cat([s.old_logprobs for s in samples])[model]
    diff = engine - trainer
    return {
        "mismatch/logprob_abs_diff": diff.abs().mean().item(),
        "mismatch/prob_abs_diff": (engine.exp() - trainer.exp()).abs().mean().item(),
        "mismatch/logprob_max_abs_diff": diff.abs().max().item(),
    }


@dataclass
class Generation:
    """A `/generate` reply, parsed: the one place dsrl reads SGLang's response fields."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int | None
    """None when the request was aborted before it was sent (the client answered, not a server)."""
    routed_experts: torch.Tensor | None = None
    """A mixture of experts' routing of the request's tokens but the last (`Sample.routed_experts`), when asked."""


async def generate_one(client: RolloutClient, input_ids: list[int], sampling: dict, route_key, **fields) -> Generation:
    """One `/generate`, the only place its request is built: token ids in (`fields`: SGLang's own, e.g. rid,
    priority); the tokens out with their logprobs and weight version."""
    body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True, **fields}
    return parse_generation(await client.generate(body, route_key))


def request_of(prompt: Prompt, response_ids: list[int]) -> tuple[list[int], dict]:
    """The token ids of a request that continues `prompt` with `response_ids`, and its other fields: a vision-language
    prompt's images (`image_data`) beside its ids with one placeholder per image, which the server expands. A resumed
    request (a partial rollout, an episode's next turn) carries them too: a server keeps nothing between requests."""
    if prompt.images is None:
        return prompt.prompt_ids + response_ids, {}
    return prompt.images.request(response_ids), {"image_data": prompt.images.image_data()}


def parse_generation(out: dict) -> Generation:
    meta = out["meta_info"]
    # A LoRA adapter served on its own generates all of a request's tokens, even past a later update
    version = out.get("adapter_version", meta.get("weight_version"))
    routed = meta.get("routed_experts")  # base64 of int32 [tokens, layers, top k], flat; "" when aborted unsent
    return Generation(
        output_ids=list(out["output_ids"]),
        logprobs=[lp for lp, _, _ in meta.get("output_token_logprobs") or []],
        finish_reason=meta["finish_reason"]["type"],
        weight_version=None if version is None else int(version),
        routed_experts=torch.frombuffer(bytearray(b64decode(routed)), dtype=torch.int32) if routed else None,
    )


def sampling_params(cfg: RolloutConfig, greedy: bool = False) -> dict:
    params = {key: getattr(cfg, key) for key in ("max_new_tokens", "temperature", "top_p", "top_k")}
    return params | {"temperature": 0.0} if greedy else params


def with_baseline(group: list[Sample]) -> list[Sample]:
    """A scored group whose last sample is a greedy response (ReMax's baseline): the others, its reward theirs."""
    *samples, greedy = group
    for s in samples:
        s.reward_baseline = greedy.reward
    return samples


def request_seed(*parts: int) -> int:
    """A sampling seed fixed by (run seed, step, row, sample): rollouts repeat exactly on resume."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + part) % (2**31 - 1)
    return seed


class Engine:
    """The rollout servers as a custom rollout function sees them (`--rollout.rollout_fn`): requests of one
    prompt's group, routed together (its prefix cached once)."""

    def __init__(self, client: RolloutClient, route_key: object, runner: "EpisodeRunner | None" = None):
        self.client, self.route_key, self.runner = client, route_key, runner

    async def generate(self, input_ids: list[int], sampling: dict) -> Generation:
        return await generate_one(self.client, input_ids, sampling, self.route_key)

    async def sample(self, prompt: Prompt, sampling: dict) -> Sample:
        """dsrl's own rollout: one response to `prompt`."""
        ids, images = request_of(prompt, [])
        out = await generate_one(self.client, ids, {**sampling, **prompt.sampling}, self.route_key, **images)
        return Sample(prompt, out.output_ids, out.logprobs, out.finish_reason, out.weight_version,
                      spans=[(0, out.weight_version)], routed_experts=out.routed_experts)  # fmt: skip


class RolloutFnError(RuntimeError):
    """A custom rollout function failed, or returned something that is not a sample of its prompt."""


async def custom_sample(fn, spec: str, engine: Engine, prompt: Prompt, sampling: dict) -> Sample:
    try:
        sample = await fn(engine, prompt, sampling)
    except Exception as e:
        raise RolloutFnError(f"--rollout.rollout_fn={spec}: raised on dataset row {prompt.index}: {e!r}") from e
    problem = None
    if not isinstance(sample, Sample):
        problem = f"returned {type(sample).__name__}, not a dsrl.data.Sample"
    elif sample.prompt is not prompt:
        problem = "returned a sample of another prompt"
    elif len(sample.engine_logprobs) != len(sample.response_ids) or not sample.response_ids:
        problem = f"{len(sample.response_ids)} response tokens with {len(sample.engine_logprobs)} engine logprobs"
    elif not isinstance(sample.weight_version, int):
        problem = f"weight_version {sample.weight_version!r} is not the int of a server's reply"
    if problem:
        raise RolloutFnError(f"--rollout.rollout_fn={spec}: on dataset row {prompt.index}: {problem}")
    sample.spans = sample.spans or [(0, sample.weight_version)]
    return sample


async def generate(
    client: RolloutClient,
    prompts: list[Prompt],
    cfg: RolloutConfig,
    seed: int = 0,
    progress: tqdm | None = None,
    rewarder: Rewarder | None = None,
    runner: EpisodeRunner | None = None,
    baseline: bool = False,
) -> list[Sample]:
    """n_samples responses (or `runner`'s episodes) per prompt, or `rollout.rollout_fn`'s samples, groups
    contiguous in prompt order; each group is scored by `rewarder` as soon as it is complete, while the
    others still generate. With `baseline`, one greedy response more per group, scored with it and kept only as its
    samples' `reward_baseline` (ReMax's). On the client's event loop (`client.run(generate(...))` from elsewhere)."""
    fn = None if cfg.rollout_fn is None else load_function(cfg.rollout_fn, "rollout.rollout_fn")
    spec = function_spec(cfg.rollout_fn)
    runner = runner or EpisodeRunner()

    async def one(p: Prompt, j: int) -> Sample:
        params = sampling_params(cfg, greedy=j == cfg.n_samples)
        if fn is None:
            episode = runner.new(p, params)
            sample = await play(client, runner, episode, (seed, p.index, j), route_key=(seed, p.index))
        else:
            params_j = {**params, "sampling_seed": request_seed(seed, p.index, j)}
            sample = await custom_sample(fn, spec, Engine(client, (seed, p.index)), p, {**params_j, **p.sampling})
        if progress is not None:
            progress.update()
        return sample

    async def group(p: Prompt) -> list[Sample]:
        samples = await asyncio.gather(*(one(p, j) for j in range(cfg.n_samples + baseline)))
        if rewarder is not None:
            await rewarder.score_group(samples)
        return with_baseline(samples) if baseline else samples

    return [s for g in await asyncio.gather(*(group(p) for p in prompts)) for s in g]


async def play(client: RolloutClient, runner: EpisodeRunner, episode: Episode, seed: tuple, route_key) -> Sample:
    """An episode (a response, without an environment) with nothing interrupting it but a server leaving the
    fleet, after which its turn goes on from the tokens so far. Its requests' sampling seeds are fixed by
    `seed` and the tokens so far, so a resumed run repeats them."""

    async def request(episode: Episode, params: dict) -> tuple[Generation, int]:
        s = episode.sample
        params.setdefault("sampling_seed", request_seed(*seed, *([len(s.response_ids)] if s.response_ids else [])))
        ids, images = request_of(s.prompt, s.response_ids)
        reply = await generate_one(client, ids, params, route_key, **images)
        return reply, reply.weight_version

    while not await runner.run(episode, request):
        pass
    return episode.sample


class SyncRollouts(Rollouts):
    """The colocated schedule: each step's batch is generated with the current weights, each group scored as it
    completes. The data position follows from the step, so a checkpoint needs nothing of it.

    One-step-off (`rollout.max_staleness` 1): the next step's batch starts (`generate_ahead`) while
    the trainer's last optimizer step runs, with the weights the servers still hold; the weight update waits
    for it (`before_update`). A checkpoint keeps no batch generated ahead: a resumed run generates it again,
    with the weights of the checkpoint."""

    def __init__(self, client: RolloutClient, cfg: Config, dataset, rewarder: Rewarder, rank: int, world: int,
                 runner: EpisodeRunner | None = None):  # fmt: skip
        self.client, self.cfg, self.dataset = client, cfg, dataset
        self.rewarder, self.rank, self.world, self.runner = rewarder, rank, world, runner
        self.ahead: tuple[int, Future] | None = None
        """(step, its batch being generated) when one is generated ahead."""

    def collect(self, step: int) -> Batch:
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == step:
            return ahead[1].result()
        return self.client.run(self._generate(step))

    def generate_ahead(self, step: int) -> None:
        """On the client's event loop; `collect(step)` takes it, and the weight update waits for it."""
        self.ahead = (step, self.client.submit(self._generate(step, ahead=True)))

    def before_update(self) -> None:
        """The batch generated ahead is complete (its errors raised here) before the weights change."""
        if self.ahead is not None:
            self.ahead[1].result()

    def stop(self) -> None:
        if self.ahead is not None:
            self.ahead[1].cancel()

    async def _generate(self, step: int, ahead: bool = False) -> Batch:
        start = time.perf_counter()
        prompts = self.dataset.batch(step, self.cfg.rollout.prompts_per_step, self.rank, self.world)
        failed = self.rewarder.failed
        seed = request_seed(self.cfg.seed, step)
        remax = self.cfg.algorithm.advantage == "remax"
        samples = await generate(self.client, prompts, self.cfg.rollout, seed, None, self.rewarder, self.runner, remax)
        metrics = {"reward/failed": float(self.rewarder.failed - failed)}
        if ahead:  # beside the last step's update: the loop's own timer of this step sees none of it
            metrics["timing/generate_ahead"] = time.perf_counter() - start
        return Batch(samples, metrics)
