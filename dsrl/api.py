"""The Python API: `dsrl.train(cfg)` and `dsrl.load_config(...)`.

    import dsrl
    cfg = dsrl.load_config("configs/toy_cpu.yaml", "--trainer.total_steps", "20", "--trainer.num_ranks", "1")
    cfg.algorithm.reward_fn = my_reward            # a callable, or "module:function"
    metrics = dsrl.train(cfg)                      # the final step's metrics

With one trainer rank (`trainer.num_ranks` 1) the run happens in this process, no launcher needed;
with more, dsrl starts the ranks with the deepspeed launcher (as `dsrl train` does) and returns
the metrics the run wrote; its reward and rollout functions must then be importable by name.
"""

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from dsrl.config import Config, ConfigError, build_parser, dump_config, to_config, validate
from dsrl.rundir import STOP_SIGNALS, RunStopped, die_with_parent


def load_config(path: str | os.PathLike | None = None, *overrides: str) -> Config:
    """A Config from a YAML file (optional) and command-line style overrides, checked."""
    argv = (["--config", str(path)] if path else []) + list(overrides)
    parser = build_parser()
    cfg = to_config(parser, parser.parse_args(argv))
    validate(cfg, check_paths=False)
    return cfg


def train(cfg: Config) -> dict[str, float]:
    """Run training; returns the final step's metrics. One rank runs here; more are launched."""
    validate(cfg)
    if "RANK" not in os.environ and (cfg.trainer.num_ranks > 1 or cfg.trainer.hostfile):
        return _launch(cfg)
    import torch

    from dsrl.serving.servers import free_port

    if cfg.trainer.device == "cpu" or not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed picks its accelerator

    single = "RANK" not in os.environ
    if single:  # a world of one, without the launcher (deepspeed would look for MPI otherwise)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
    loop = importlib.import_module("dsrl.train")  # the loop's module (`dsrl.train` stays this function)
    try:
        return loop.train(cfg)
    finally:
        if single:
            _end_world()


def _end_world() -> None:
    """Tear the one-rank world down so that another `train` can run in this process: torch's groups, and
    the ones DeepSpeed cached (it would hand the next engine a destroyed group)."""
    import deepspeed.comm.comm as ds_comm
    import torch.distributed as dist
    from deepspeed.utils import groups

    if dist.is_initialized():
        dist.destroy_process_group()
    ds_comm.cdb = None
    for name, value in vars(groups).copy().items():
        if name.isupper() and name.startswith("_") and name.endswith("GROUP"):
            setattr(groups, name, None)
        elif name.startswith("_") and name.endswith(("GROUP", "GROUP_RANKS")) and isinstance(value, dict):
            setattr(groups, name, {})
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)


def _run_forwarding_signals(cmd: list[str]) -> int:
    """`dsrl train` as a child; SIGTERM and SIGINT here go to it, which stops the run cleanly, and so does
    this process's death by any signal (the kernel's parent-death signal)."""
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    forward = {sig: signal.signal(sig, lambda signum, _: proc.send_signal(signum)) for sig in STOP_SIGNALS}
    try:
        return proc.wait()
    finally:
        for sig, handler in forward.items():
            signal.signal(sig, handler)


def _launch(cfg: Config) -> dict[str, float]:
    from dsrl.rewards.rewarder import importable_spec

    for section, name in ((cfg.algorithm, "reward_fn"), (cfg.rollout, "rollout_fn")):
        fn = getattr(section, name)
        if callable(fn):
            spec = importable_spec(fn)
            if spec is None:
                raise ConfigError([f"--{name}={fn!r}: the ranks of a launched run import the function by name; "
                                   "use a module-level function, or trainer.num_ranks 1"])  # fmt: skip
            setattr(section, name, spec)
    config = Path(cfg.logging.run_dir) / "config.yaml"
    dump_config(cfg, config)
    code = _run_forwarding_signals([sys.executable, "-m", "dsrl.cli", "train", "--config", str(config)])
    if code - 128 in (signal.SIGTERM, signal.SIGINT):
        raise RunStopped(code - 128, -1, None, f"the launched run was stopped by {signal.Signals(code - 128).name}")
    if code != 0:
        raise RuntimeError(
            f"the launched run failed (exit code {code}); its log is above, its files in {config.parent}"
        )
    return json.loads((config.parent / "final_metrics.json").read_text())
