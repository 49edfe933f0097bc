"""dsrl: reinforcement learning for LLMs on DeepSpeed ZeRO-3 and SGLang.

From Python: `dsrl.train(cfg)` runs a training, `dsrl.load_config(path, *flags)` builds its config
(dsrl/api.py); `dsrl.Environment`, `dsrl.Step`, `dsrl.tool` and `dsrl.ToolEnv` make an agent's
environment (dsrl/rollout/agents.py). Importing dsrl imports nothing else: each name loads its module on first
use, so `import dsrl.tasks.toy` (verl's reward workers load the harness's reward by path, without dsrl's
requirements) needs only that module's.
"""

import importlib
import sys
import types

_NAMES = {
    "load_config": "dsrl.api",
    "train": "dsrl.api",
    "Config": "dsrl.config",
    **dict.fromkeys(("Environment", "Step", "ToolCall", "ToolEnv", "tool"), "dsrl.rollout.agents"),
}


class _Package(types.ModuleType):
    """The public names, each loaded on first use. `import dsrl.train` (the loop's module, which the launcher runs)
    would rebind `dsrl.train`, the API function, to that module: the package keeps the function."""

    def __getattr__(self, name: str):
        if name not in _NAMES:
            raise AttributeError(f"module 'dsrl' has no attribute {name!r}")
        return getattr(importlib.import_module(_NAMES[name]), name)

    def __setattr__(self, name: str, value) -> None:
        if not (name == "train" and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["Config", "Environment", "Step", "ToolCall", "ToolEnv", "load_config", "tool", "train"]
