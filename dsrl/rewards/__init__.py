"""Rewards: rule functions (`rules.py`, built in: `math_reward`), the worker processes they run in (`pool.py`)
and the run's rewarder (`rewarder.py`). `dsrl.rewards:math_reward` and `@dsrl.rewards.batched` are public."""

from dsrl.rewards.rules import RewardFn, batched, load_function, load_reward_fn, math_reward

__all__ = ["RewardFn", "batched", "load_function", "load_reward_fn", "math_reward"]
