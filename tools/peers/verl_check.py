"""verl 0.9.1's own checks of the harness's settings, without a GPU: each workload x pair x GPU count's settings
(peers.verl_settings) composed into verl's ppo_trainer config by hydra as its entry point composes them (a key that
does not exist, or a `+` key that does, fails here), then `validate_config` (what its main runs first) and the
dataclasses its workers build (actor, rollout, algorithm). A setting verl would refuse shows here in seconds rather
than minutes into a run. Needs verl and its config imports (hydra, omegaconf, torch, tensordict, ...) importable:
on the GPU machine the stack's (gpu_run.sh's peers stage runs it after unpacking); on a CPU box, the verl wheel
unpacked with those packages.

    PYTHONPATH=/tmp/verlstack:$PWD:$PWD/tools/peers python3 tools/peers/verl_check.py --gpus 1 4
"""

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402


def check(settings: list[peers.Setting], config_dir: str) -> str:
    """'' where verl takes the settings, else its error."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    overrides = [a for a in peers.verl_command(settings)[3:] if not a.startswith("hydra.")]
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name="ppo_trainer", overrides=overrides)
        validate_config(config=cfg, use_reference_policy=False, use_critic=False)
        for part in (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.algorithm):
            omega_conf_to_dataclass(part)
    except Exception as e:  # noqa: BLE001 -- any refusal of verl's is the answer, reported with the case
        return f"{type(e).__name__}: {str(e)[:400]}"
    return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[1])
    p.add_argument("--workloads", nargs="+", default=sorted(peers.WORKLOADS))
    args = p.parse_args()
    config_dir = str(Path(importlib.util.find_spec("verl").submodule_search_locations[0]) / "trainer/config")
    failed = 0
    for gpus in args.gpus:
        for name in args.workloads:
            for pair in [None, *(k for k, v in peers.PAIRS.items() if gpus > 1 or not v.split)]:
                for server in (peers.SERVER, peers.SERVER_0512):
                    w, spec = peers.WORKLOADS[name], peers.PAIRS[pair] if pair else None
                    paths = Path("/tmp/m"), Path("/tmp/d.parquet"), Path("/tmp/w")
                    settings = peers.verl_settings(w, *paths, 11, 0, gpus, spec, server=server)
                    error = check(settings, config_dir)
                    failed += bool(error)
                    stack = "own stack" if server is peers.SERVER_0512 else "dsrl's stack"
                    print(f"verl settings, {gpus} GPU(s), {name}, {pair or 'verl alone'}, {stack}: {error or 'ok'}")
    print(f"verl settings: {failed} refused" if failed else "verl settings: all taken")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
