"""Reward functions that misbehave on purpose, imported by name by the reward workers in tests."""

import os
import time

from dsrl.rewards.rules import batched
from dsrl.tasks import toy


def misbehave(kind: str | None):
    """Fail as `kind` says: hang, crash (the process exits), string (returned), raise; None: no failure."""
    if kind == "hang":
        time.sleep(3600)
    if kind == "crash":
        os._exit(3)
    if kind == "raise":
        raise ValueError("no answer here")
    return "good" if kind == "string" else None


def by_row_kind(prompt, response, answer, row=None):
    """The row's `kind` says how to fail: hang, crash (the process exits), string, raise; else 1.0."""
    return misbehave((row or {}).get("kind")) or 1.0


def toy_with_faults(prompt, response, answer):
    """The toy reward, except that answer 7 hangs, 8 kills the process and 9 returns a string."""
    return misbehave({"7": "hang", "8": "crash", "9": "string"}.get(answer)) or toy.reward(prompt, response, answer)


@batched
def toy_batched(prompts, responses, answers):
    """The toy reward as a batched function: one call per group, lists in, a list out."""
    return [toy.reward(p, r, a) for p, r, a in zip(prompts, responses, answers)]
