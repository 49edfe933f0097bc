"""The toy task's reward (`dsrl.tasks.toy.reward`) in verl's reward-function interface. Both frameworks of the
harness call this one function: verl through `reward.custom_reward_function`, dsrl as `verl_reward:compute_score`
(dsrl calls a function with verl's interface as verl does)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # verl loads this file by path, in its reward workers

from dsrl.tasks.toy import reward  # noqa: E402


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return reward("", solution_str, str(ground_truth))
