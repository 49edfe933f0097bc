"""Reward functions: loaded by import path, called as fn(prompt, response, answer) -> float, or with
`row=` (the whole dataset row) when they take it, or batched (`@batched`), or async, or with verl's
interface (`pool.call_reward`)."""

import importlib
import re
from collections.abc import Callable

RewardFn = Callable[[str, str, object], float]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def load_reward_fn(spec: str) -> RewardFn:
    return load_function(spec, "algorithm.reward_fn")


def load_function(spec, flag: str):
    """A function given by config: itself (from Python), or imported from `module:function`, with an error
    naming the flag and what went wrong."""
    if callable(spec):
        return spec
    module_name, _, fn_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--{flag}={spec!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--{flag}={spec!r}: module {module_name!r} has no function {fn_name!r}")
    return fn


def batched(fn):
    """Mark a reward function as batched: it gets lists (prompts, responses, answers[, row]) for a whole
    group and returns a list of floats, in one call."""
    fn.dsrl_batched = True
    return fn


def extract_final_number(text: str) -> float | None:
    """The answer after GSM8K's '####' marker or in a \\boxed{}, else the last number in the text."""
    for marker in ("####", "\\boxed{"):
        if marker in text:
            text = text.rsplit(marker, 1)[1]
            found = _NUMBER.search(text)
            return _to_float(found.group()) if found else None
    found = _NUMBER.findall(text)
    return _to_float(found[-1]) if found else None


def _to_float(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def math_reward(prompt: str, response: str, answer) -> float:
    """1.0 when the response's final number equals the answer's (GSM8K style), else 0.0."""
    want = extract_final_number(str(answer))
    got = extract_final_number(response)
    return float(want is not None and got is not None and abs(got - want) < 1e-6)
