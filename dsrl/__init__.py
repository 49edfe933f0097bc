"""dsrl: reinforcement learning for LLMs on DeepSpeed ZeRO-3 and SGLang.

From Python: `dsrl.train(cfg)` runs a training, `dsrl.load_config(path, *flags)` builds its config
(dsrl/api.py); `dsrl.Environment`, `dsrl.Step`, `dsrl.tool` and `dsrl.ToolEnv` make an agent's
environment (dsrl/rollout/agents.py). Importing dsrl imports no torch.
"""

import sys
import types

from dsrl.api import load_config, train
from dsrl.config import Config
from dsrl.rollout.agents import Environment, Step, ToolCall, ToolEnv, tool


class _Package(types.ModuleType):
    """`import dsrl.train` (the loop's module, which the launcher runs) would rebind `dsrl.train`, the API
    function, to that module: the package keeps the function."""

    def __setattr__(self, name: str, value) -> None:
        if not (name == "train" and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["Config", "Environment", "Step", "ToolCall", "ToolEnv", "load_config", "tool", "train"]
