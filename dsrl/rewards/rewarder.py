"""The run's reward: rule functions in worker processes (or a thread) and reward models, a group at a time as it
completes."""

import asyncio
import copy
import logging
import math
import numbers
import statistics

from dsrl.config import AlgorithmConfig
from dsrl.data import Sample
from dsrl.rewards.models import RewardModel
from dsrl.rewards.pool import NOT_SCORED, WorkerPool, call_reward
from dsrl.rewards.rules import load_function
from dsrl.rewards.teacher import Teacher

log = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward function that failed on a row: raised, timed out, or killed its process."""


class RewardValueError(RewardError, TypeError):
    """A reward function that returned something other than a finite number."""


def _checked(samples: list[Sample], results: list[tuple], source: str) -> list[float]:
    """The group's rewards from one source as floats, or the error naming the row that failed first (not of those left
    unscored after it)."""
    for i in sorted(range(len(samples)), key=lambda i: results[i][1] == NOT_SCORED):
        (value, error), row = results[i], samples[i].prompt.index
        if error is not None:
            raise RewardError(f"{source} failed on dataset row {row}: {error}")
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
            raise RewardValueError(f"{source} returned {value!r} for dataset row {row}; expected a finite float")
    return [float(value) for value, _ in results]


class Rewarder:
    """The run's reward: the rule function (or with `rollout.env` the episodes' own rewards), a reward model or
    judge (`model`), or both, reward = w_model * model + w_rule * rule. The rule function runs in worker
    processes with a timeout per call (`reward_workers` > 0), or in a thread of this process; off the client's
    event loop either way. A row whose reward fails stops the run naming it, or (on_reward_error skip) its group
    leaves the loss and is counted."""

    def __init__(self, cfg: AlgorithmConfig, tokenizer, fn=None, env: bool = False, model: RewardModel | None = None,
                 teacher: Teacher | None = None):  # fmt: skip
        self.env, self.pool, self.model, self.teacher = env, None, model, teacher
        self.rule = model is None or model.cfg.w_rule is not None
        """Whether the rule reward is computed (with a reward model, only when --reward_model.w_rule is set)."""
        if self.rule and not env:
            fn = fn or cfg.reward_fn
            self.fn = load_function(fn, "algorithm.reward_fn")
            spec = fn if isinstance(fn, str) else importable_spec(fn)  # a lambda or closure: in a thread here
            if spec and cfg.reward_workers:
                self.pool = WorkerPool(spec, cfg.reward_workers, cfg.reward_timeout_s)
        self.tokenizer, self.skip = tokenizer, cfg.on_reward_error == "skip"
        self.failed = 0
        """Rows failed (and skipped) so far."""
        self.moments = [0, 0.0, 0.0]
        """The model's scores so far (--reward_model.normalize running): count, mean, sum of squared deviations."""
        self.learn = True
        """Whether scored groups update `moments` (not an evaluation's: `frozen`)."""

    async def score_group(self, samples: list[Sample]) -> None:
        """The group's rewards, its rule and model scores (and the teacher's logprobs) computed side by side, each part
        (its source's name, a (value, error) per sample); the teacher's only fail or skip the group."""
        parts = {}
        if self.rule:
            parts["rule"] = ("the environment" if self.env else "reward function", self._rule(samples))
        if self.model is not None:
            parts["model"] = ("judge" if self.model.parse else "reward model", self.model.score(samples))
        if self.teacher is not None:
            parts["teacher"] = ("teacher", self.teacher.score(samples))
        results = await asyncio.gather(*(job for _, job in parts.values()))
        self.settle(samples, {kind: (source, r) for (kind, (source, _)), r in zip(parts.items(), results)})

    async def _rule(self, samples: list[Sample]) -> list[tuple]:
        if self.env:
            return [(s.episode.reward, s.episode.error) for s in samples]
        decode = self.tokenizer.decode  # (prompt, response, answer, row): what the reward function is called with
        items = [(s.prompt.text, decode(s.response_ids, skip_special_tokens=True), s.prompt.answer, s.prompt.row)
                 for s in samples]  # fmt: skip
        if self.pool is not None:
            return await self.pool.run_async(items, fail_fast=True)  # one failed row skips the group
        return await asyncio.to_thread(lambda: [_call_in_process(self.fn, item) for item in items])

    def settle(self, samples: list[Sample], parts: dict[str, tuple[str, list[tuple]]]) -> None:
        """Set the group's rewards from each part's (value, error) pairs, or fail or skip it (on_reward_error)."""
        try:
            values = {kind: _checked(samples, results, source) for kind, (source, results) in parts.items()}
        except RewardError as e:
            if not self.skip:
                raise type(e)(f"{e} (--algorithm.on_reward_error skip would skip the row instead)") from None
            self.failed += 1
            log.warning("%s; the row's group is skipped (--algorithm.on_reward_error skip)", e)
            for s in samples:
                s.reward, s.skip = 0.0, True
            return
        rule, model = values.get("rule"), values.get("model")
        scores = self.normalize(model) if model is not None else None
        for i, s in enumerate(samples):
            if model is None:
                s.reward = rule[i]
                continue
            s.reward_model, s.reward = model[i], self.model.cfg.w_model * scores[i]
            if rule is not None:
                s.reward_rule = rule[i]
                s.reward += self.model.cfg.w_rule * rule[i]

    def normalize(self, scores: list[float]) -> list[float]:
        """--reward_model.normalize running: minus the running mean, over the running std (Welford's update)."""
        if self.model.cfg.normalize == "none":
            return scores
        for x in scores if self.learn else ():
            n, mean, m2 = self.moments
            delta = x - mean
            mean += delta / (n + 1)
            self.moments = [n + 1, mean, m2 + delta * (x - mean)]
        n, mean, m2 = self.moments
        std = (m2 / (n - 1)) ** 0.5 if n > 1 else 0.0
        return [(x - mean) / (std or 1.0) for x in scores]

    def metrics(self, samples: list[Sample], prefix: str = "reward/") -> dict[str, float]:
        """The batch's model and rule scores, raw (the same keys on every rank); the model's timing (`take_timing`)."""
        out = self.teacher.take_timing() if self.teacher and prefix == "reward/" else {}
        if self.model is None:
            return out
        out |= self.model.take_timing() if prefix == "reward/" else {}
        scores = {"model": [s.reward_model for s in samples], "rule": [s.reward_rule for s in samples]}
        for kind in ("model", "rule") if self.rule else ("model",):
            values = [v for v in scores[kind] if v is not None] or [0.0]
            out[f"{prefix}{kind}_mean"] = statistics.fmean(values)
            out[f"{prefix}{kind}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        return out

    def frozen(self) -> "Rewarder":
        """This rewarder, scoring without moving the running normalisation and without the teacher (an evaluation's)."""
        view = copy.copy(self)
        view.learn, view.teacher = False, None
        return view

    def state(self) -> dict:
        return {"moments": list(self.moments)}

    def restore(self, state: dict | None) -> None:
        self.moments = list((state or {}).get("moments", self.moments))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        for served in (self.model, self.teacher):
            if served is not None:
                served.fleet.stop()


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
