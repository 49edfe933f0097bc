"""dsrl: reinforcement learning for LLMs on DeepSpeed ZeRO-3 and SGLang.

From Python: `dsrl.train(cfg)` runs a training, `dsrl.load_config(path, *flags)` builds its config
(dsrl/api.py); `dsrl.Environment`, `dsrl.Step`, `dsrl.tool` and `dsrl.ToolEnv` make an agent's
environment (dsrl/agents.py). Importing dsrl imports no torch.
"""

from dsrl.agents import Environment, Step, ToolCall, ToolEnv, tool
from dsrl.api import load_config, train
from dsrl.config import Config

__all__ = ["Config", "Environment", "Step", "ToolCall", "ToolEnv", "load_config", "tool", "train"]
