"""The harness's rewards in verl's reward-function interface. Both frameworks of the harness call this one function:
verl through `reward.custom_reward_function`, dsrl as `verl_reward:compute_score` (dsrl calls a function with verl's
interface as verl does), with the row's `data_source` choosing the reward:

- `toy`: the toy task's reward (`dsrl.tasks.toy.reward`). A random-init model of the 151,936-token shapes writes
  none of the toy's digits, so it scores 0 on every sample, every group's advantages are 0 and so are the gradients.
- `graded`: the share of the response's digit characters that are even, 0 where it has none. A random-init model's
  responses are mostly the padded tokenizer's `<unused_N>` tokens, so every response scores near 0.5 and no two alike:
  each group has a spread, its advantages and the gradients are not 0, and a policy can learn it (more tokens whose
  numbers are even). It reads the text both frameworks decode the same way (skip_special_tokens)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # verl loads this file by path, in its reward workers

from dsrl.tasks.toy import reward  # noqa: E402


def graded(response: str) -> float:
    digits = [c for c in response if c.isdigit()]
    return sum(int(c) % 2 == 0 for c in digits) / len(digits) if digits else 0.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    if data_source == "graded":
        return graded(solution_str)
    return reward("", solution_str, str(ground_truth))
