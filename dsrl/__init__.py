"""dsrl: reinforcement learning for LLMs on DeepSpeed ZeRO-3 and SGLang.

From Python: `dsrl.train(cfg)` runs a training, `dsrl.load_config(path, *flags)` builds its config
(dsrl/api.py). Importing dsrl imports no torch.
"""

from dsrl.api import load_config, train
from dsrl.config import Config

__all__ = ["Config", "load_config", "train"]
