"""What one more rollout server costs and gives: weight-sync time and rollout throughput per fleet size.

Runs `dsrl train` once per fleet size (synchronous, disaggregated, so a step's generate phase is the
rollout throughput and its sync phase the update of every server), and prints, per size, the
median over the steps after the first two of: the whole weight update (timing/sync), its send
(timing/sync_send), the generate phase, and response tokens per second.

    python tools/bench_fleet.py                                   # CPU: 1, 2, 3 embedded servers
    python tools/bench_fleet.py --fleet ray                       # the same, placed by Ray
    python tools/bench_fleet.py --config configs/toy_gpu.yaml --servers 1 2 --extra --rollout.first_gpu 1
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(config: str, servers: int, fleet: str, steps: int, workdir: Path, extra: list[str]) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = workdir / f"{fleet}_{servers}"
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", config, "--logging.run_dir", str(run_dir)]
    cmd += ["--trainer.total_steps", str(steps), "--rollout.num_servers", str(servers), "--rollout.fleet", fleet]
    cmd += ["--rollout.placement", "disaggregate", "--rollout.max_staleness", "0", "--logging.export_hf", "false"]
    cmd += ["--eval.path", "null", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"the run with {servers} servers failed")
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()

    def median(tag: str) -> float:
        return statistics.median(e.value for e in events.Scalars(tag)[2:])  # past the warm-up steps

    tokens = [e.value for e in events.Scalars("response/length_mean")[2:]]
    generate = [e.value for e in events.Scalars("timing/generate")[2:]]
    per_step = _samples_per_step(config, extra)
    return {
        "sync_ms": median("timing/sync") * 1e3,
        "send_ms": median("timing/sync_send") * 1e3,
        "generate_s": median("timing/generate"),
        "tokens_per_s": statistics.median(t * per_step / g for t, g in zip(tokens, generate)),
    }


def _samples_per_step(config: str, extra: list[str]) -> int:
    from dsrl.config import parse_config

    cfg = parse_config(["--config", config, *extra])
    return cfg.rollout.prompts_per_step * cfg.rollout.n_samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs/toy_cpu.yaml"))
    p.add_argument("--servers", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--fleet", choices=["local", "ray"], default="local")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--workdir", default=None)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags passed on to dsrl train")
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dsrl_bench_fleet_"))
    print(f"fleet | servers | sync ms | send ms | generate s | response tokens/s   ({args.config}, {args.steps} steps)")
    for n in args.servers:
        r = run(args.config, n, args.fleet, args.steps, workdir, args.extra)
        print(
            f"{args.fleet} | {n} | {r['sync_ms']:.1f} | {r['send_ms']:.1f} | {r['generate_s']:.3f} | "
            f"{r['tokens_per_s']:.0f}",
            flush=True,
        )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
