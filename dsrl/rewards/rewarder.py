"""The run's reward: rule functions in worker processes (or a thread), one group at a time as it completes."""

import asyncio
import logging
import math
import numbers

from dsrl.config import AlgorithmConfig
from dsrl.data import Sample
from dsrl.rewards.pool import NOT_SCORED, RewardPool, call_reward
from dsrl.rewards.rules import RewardFn, load_function

log = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward function that failed on a row: raised, timed out, or killed its process."""


class RewardValueError(RewardError, TypeError):
    """A reward function that returned something other than a finite number."""


def reward_item(sample: Sample, tokenizer) -> tuple:
    """What the reward function is called with: (prompt, response, answer, row)."""
    response = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return sample.prompt.text, response, sample.prompt.answer, sample.prompt.row


def check_reward(row: int, value, error: str | None, source: str = "reward function") -> float:
    """The reward as a float, or the error naming the row."""
    if error is not None:
        raise RewardError(f"{source} failed on dataset row {row}: {error}")
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise RewardValueError(f"{source} returned {value!r} for dataset row {row}; expected a finite float")
    return float(value)


class Rewarder:
    """The run's reward function: in worker processes with a timeout per call (`reward_workers` > 0), or
    in a thread of this process; off the client's event loop either way. With an environment
    (`rollout.env`) the episodes carry their rewards, and an episode whose environment failed counts as a
    failed reward. A row whose reward fails stops the run naming it, or (on_reward_error skip) its group
    leaves the loss and is counted."""

    def __init__(self, cfg: AlgorithmConfig, tokenizer, fn=None, env: bool = False):
        self.env, self.pool = env, None
        if not env:
            fn = fn or cfg.reward_fn
            self.fn = load_function(fn, "algorithm.reward_fn")
            spec = fn if isinstance(fn, str) else importable_spec(fn)  # a lambda or closure: in a thread here
            if spec and cfg.reward_workers:
                self.pool = RewardPool(spec, cfg.reward_workers, cfg.reward_timeout_s)
        self.tokenizer, self.skip = tokenizer, cfg.on_reward_error == "skip"
        self.failed = 0
        """Rows failed (and skipped) so far."""

    async def score_group(self, samples: list[Sample]) -> None:
        if self.env:
            records = [s.extras["episode"] for s in samples]
            self.settle(samples, [(r["reward"], r["error"]) for r in records], "the environment")
            return
        items = [reward_item(s, self.tokenizer) for s in samples]
        if self.pool is not None:
            results = await self.pool.score_async(items, fail_fast=True)  # one failed row skips the group
        else:
            results = await asyncio.to_thread(lambda: [_call_in_process(self.fn, item) for item in items])
        self.settle(samples, results, "reward function")

    def settle(self, samples: list[Sample], results: list[tuple], source: str) -> None:
        """Set the group's rewards from (value, error) pairs, or fail or skip it (on_reward_error)."""
        try:  # the row that failed first, not the ones left unscored after it
            for i in sorted(range(len(samples)), key=lambda i: results[i][1] == NOT_SCORED):
                check_reward(samples[i].prompt.index, *results[i], source)
            rewards = [float(value) for value, _ in results]
        except RewardError as e:
            if not self.skip:
                raise type(e)(f"{e} (--algorithm.on_reward_error skip would skip the row instead)") from None
            self.failed += 1
            log.warning("%s; the row's group is skipped (--algorithm.on_reward_error skip)", e)
            rewards = [0.0] * len(samples)
            for s in samples:
                s.extras["skip"] = True
        for s, reward in zip(samples, rewards):
            s.reward = reward

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def importable_spec(fn) -> str | None:
    """module:function of a callable that worker processes can import by name, else None (a lambda, a closure)."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in name or "." in name:
        return None
    return f"{module}:{name}"


def _call_in_process(fn, item) -> tuple[object, str | None]:
    try:
        return call_reward(fn, *item), None
    except Exception as e:  # noqa: BLE001 -- reported naming the row
        return None, repr(e)


def score_one(sample: Sample, reward_fn: RewardFn, tokenizer) -> float:
    """The reward of one sample, in this process; a reward function that raises or returns a non-number
    names the row."""
    value, error = _call_in_process(reward_fn, reward_item(sample, tokenizer))
    return check_reward(sample.prompt.index, value, error)
