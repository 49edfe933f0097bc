"""Where a training step's time and memory went, from a finished run's directory.

`python tools/step_report.py RUN_DIR` prints every phase of the step (mean over the steps after the
first, from the run's tensorboard; the last step's `final_metrics.json` when there is none), the
overhead (all but generate, logprobs and update) as seconds and as a fraction of the step, and the
peak memory per phase. The GPU stages of `tools/gpu_run.sh` call it after their runs.
`--line` prints one line instead: the step, its work phases, the sync and the plumbing's share (the `placements`
stage). `--against OTHER_RUN_DIR` prints one line instead: the step, its phases and the update's peak against the other
run's (LoRA against full fine-tuning in the `lora` stage).
"""

import argparse
import json
from pathlib import Path

PER_STEP = ("timing/step", "timing/generate_ahead", "timing/sync_drain")
"""Scalars listed step by step, the first included."""

WORK = ("generate", "logprobs", "update")
"""The phases that are the algorithm's own work; the rest of a step is the RL plumbing."""


def step_means(run_dir: Path) -> tuple[dict[str, float], int]:
    """Mean of every scalar over the steps after the first (its start-up costs are not a step's); the steps' own
    times under `per_step/` (a run's last step differs in schedules that generate ahead: it has nothing to)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        EventAccumulator = None
    if EventAccumulator is not None and (run_dir / "tensorboard").is_dir():
        events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
        events.Reload()
        means, steps = {}, 0
        for tag in events.Tags()["scalars"]:
            values = [e.value for e in events.Scalars(tag)]
            later = values[1:] or values
            means[tag], steps = sum(later) / len(later), max(steps, len(later))
            if tag in PER_STEP:
                means[f"per_step/{tag}"] = values
        if means:
            return means, steps
    return json.loads((run_dir / "final_metrics.json").read_text()), 1


def report(metrics: dict[str, float], steps: int) -> str:
    step = metrics["timing/step"]
    per_step = {k.removeprefix("per_step/"): metrics.pop(k) for k in [k for k in metrics if k.startswith("per_step/")]}
    timings = {k.removeprefix("timing/"): v for k, v in metrics.items() if k.startswith("timing/")}
    phases = {k: v for k, v in timings.items() if k != "step"}
    top = {k: v for k, v in phases.items() if "_" not in k or k in WORK}
    overhead = step - sum(top.get(k, 0.0) for k in WORK)
    lines = [f"step {step:.3f} s (mean of {steps} steps after the first)"]
    for name, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
        indent = "    " if "_" in name and name not in WORK else "  "
        lines.append(f"{indent}{name:<28} {seconds * 1e3:9.1f} ms  {seconds / step:6.1%}")
    lines.append(f"overhead (all but {', '.join(WORK)}): {overhead:.3f} s = {overhead / step:.1%} of the step")
    memory = {k: v for k, v in metrics.items() if k.startswith("memory/")}
    if memory:
        figures = [f"{k.removeprefix('memory/')} {v:.1f}" for k, v in sorted(memory.items())]
        lines.append("memory (GB): " + ", ".join(figures))
    for tag, values in per_step.items():
        lines.append(f"{tag} by step: " + " ".join(f"{v:.3f}" for v in values))
    for key in ("sync/bytes", "sync/seconds", "sync/gb_per_s", "sync/probe_seconds", "sync/probe_logprob_diff"):
        if key in metrics:
            lines.append(f"{key} {metrics[key]:.4g}")
    return "\n".join(lines)


COMPARED = ("timing/step", "timing/update", "timing/logprobs", "timing/generate", "timing/sync", "timing/sync_verify")


def compare(run_dir: Path, against: Path) -> str:
    """One line: `run_dir`'s step, its work phases, sync and update peak against `against`'s, as ratios."""
    (a, _), (b, _) = step_means(run_dir), step_means(against)
    figures = []
    for key in COMPARED + ("memory/update_peak_gb",):
        if key in a and key in b:
            ratio = f"{a[key] / b[key]:.2f}x" if b[key] else "-"
            figures.append(f"{key.split('/')[1]} {a[key]:.3g} vs {b[key]:.3g} ({ratio})")
    return f"{run_dir.name} against {against.name}: " + ", ".join(figures)


def line(run_dir: Path) -> str:
    """One line: the step, its work phases, the sync (its bytes and rate) and the plumbing's share."""
    m, steps = step_means(run_dir)
    step = m["timing/step"]
    work = sum(m.get(f"timing/{k}", 0.0) for k in WORK)
    phases = ", ".join(f"{k} {m[f'timing/{k}']:.2f}" for k in (*WORK, "sync") if f"timing/{k}" in m)
    sync = f"; sync {m['sync/bytes'] / 1e9:.2f} GB at {m['sync/gb_per_s']:.0f} GB/s" if "sync/bytes" in m else ""
    return f"step {step:.2f} s ({steps} steps after the first): {phases}{sync}; plumbing {1 - work / step:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--against", type=Path, help="Print one line: run_dir's figures against this run's.")
    parser.add_argument("--line", action="store_true", help="Print one line: the step, its phases and the sync.")
    args = parser.parse_args()
    if args.line:
        print(line(args.run_dir))
    else:
        print(compare(args.run_dir, args.against) if args.against else report(*step_means(args.run_dir)))


if __name__ == "__main__":
    main()
