"""Each framework's own step metrics, mapped to the same phases; the table and the PNGs of a harness run.

verl logs `timing_s/<phase>` per step (its console logger: `step:3 - timing_s/gen:4.1 - ...`, and its file logger:
one JSON line {"step", "data"} per step); dsrl logs `timing/<phase>` per step to tensorboard (and the last step to
final_metrics.json). Both are reduced to the phases below, as the mean over the steps after the first (whose
start-up costs are not a step's).

    python tools/peers/report.py OUT_DIR [DIR ...]  # the table of OUT_DIR/peers.json (and of each DIR's, merged:
                                                    # one call per framework), and its PNGs into OUT_DIR; a DIR
                                                    # may be a verl console log (verl_toy_s0.log, `log_run`)
    python tools/peers/report.py /tmp/toy docs/peers_runs/toy   # the toy runs in docs/benchmarks/verl.md, redrawn
    python tools/peers/report.py /tmp/t A/auto01 B/auto2        # matched pairs from two machines: the runs, the pair
                                                                # table (pair_table) and verl's settings
"""

import argparse
import json
import re
from itertools import accumulate
from pathlib import Path

PHASES = ("generate", "old log-probs", "reference", "update", "weight sync")
"""The phases of one synchronous colocated GRPO step; the rest of the step is `other`."""

TIMERS = {
    # verl's `gen` ends with its servers put to sleep (sleep_replicas), so dsrl's `release` counts with generate
    # (and `generate_wait`, a rank's wait for the slowest rank's generation, split off `release` on 2026-11-27).
    "verl": {"generate": ("gen",), "old log-probs": ("old_log_prob",), "reference": ("ref",),
             "update": ("update_actor",), "weight sync": ("update_weights",)},
    "dsrl": {"generate": ("generate", "generate_wait", "release"), "old log-probs": ("logprobs",), "reference": (),
             "update": ("update",), "weight sync": ("sync",)},
}  # fmt: skip
"""Each framework's timers (its metric names less the prefix) that make up each phase."""

PREFIX = {"verl": "timing_s/", "dsrl": "timing/"}
REWARD = {"verl": "critic/score/mean", "dsrl": "reward/mean"}
LENGTH = {"verl": "response_length/mean", "dsrl": "response/length_mean"}
KEEP = re.compile(
    r"^(timing_s/|timing/|perf/|memory/|critic/score/|reward/mean|response_length/mean|response/length|sync/|mismatch/"
    r"|trace/)"
)
"""The per-step metrics a run's record keeps."""

WORKLOADS = {
    # prompts per step, samples per prompt, new tokens, lr, token budget per micro-batch, SGLang memory fraction
    "step": {"prompts": 64, "n": 8, "new_tokens": 512, "lr": 1e-6, "tokens": 16384, "mem": 0.4},
    "toy": {"prompts": 32, "n": 8, "new_tokens": 5, "lr": 3e-3, "tokens": 16384, "mem": 0.3},
    "7b": {"prompts": 16, "n": 4, "new_tokens": 256, "lr": 1e-6, "tokens": 4096, "mem": 0.3, "offload": True},
    "tail": {
        "prompts": 32,
        "n": 8,
        "new_tokens": 1024,
        "lr": 1e-6,
        "tokens": 16384,
        "mem": 0.4,
        "tail": True,
        "source": "graded",
    },
}
"""The issue's workloads: the colocated step (every sample to 512 tokens, every reward 0 on a random-init model), the
toy task of configs/toy_gpu.yaml, 7B full-parameter on one GPU with the optimizer's states on the host (`offload`:
verl's FSDP optimizer offload with gradient checkpointing, its parameters kept on the GPU, since offloading them as
well ran the host out of memory; dsrl's ZeRO-Offload of 60% of the states, one-step-off colocated with TIS, as the
7B rows of docs/history.md ran; on several GPUs neither offloads), and the realistic one, `tail`: each row its own
`max_new_tokens` (peers.TAIL_CAPS, 64 to 1024, `ignore_eos`) and the `graded` reward (tools/peers/verl_reward.py),
whose groups have a spread, so the gradients are not 0."""

MIN_STEADY = 10
"""Steady steps a pair's run should have (issue 53); the pair table marks a run with fewer."""

_CONSOLE = re.compile(r"step:(\d+) - (.*)$")


def trace_steps(path: Path) -> dict[int, dict[str, float]]:
    """Per step, where verl's samples spent its `gen`, from its agent loop's trace (tools/peers/verl_agent.py, one
    line a sample): `trace/span_s` from the first sample's start to the last one's end (`gen` less it: the servers'
    sleep, the poll and the last sample's scoring and storing; the prompts are handed out before `gen` starts),
    `trace/start_spread_s` from the first start to the last, `trace/longest_sample_s` and
    `trace/longest_request_s` (its request alone: the balancer, the server's actor, SGLang)."""
    samples: dict[int, list[dict]] = {}
    for line in path.read_text().splitlines() if path.is_file() else ():
        if line.strip():
            sample = json.loads(line)
            samples.setdefault(int(sample["step"]), []).append(sample)
    return {
        step: {
            "trace/span_s": max(s["end"] for s in rows) - min(s["start"] for s in rows),
            "trace/start_spread_s": max(s["start"] for s in rows) - min(s["start"] for s in rows),
            "trace/longest_sample_s": max(s["end"] - s["start"] for s in rows),
            "trace/longest_request_s": max(s["request_s"] or 0.0 for s in rows),
        }
        for step, rows in samples.items()
    }


def verl_steps(jsonl: Path | None = None, console: str = "", trace: Path | None = None) -> list[dict[str, float]]:
    """verl's per-step metrics, from its file logger's JSON lines, else from its console lines; with its agent
    loop's `trace` (trace_steps) where there is one."""
    steps: dict[int, dict[str, float]] = {}
    if jsonl is not None and jsonl.is_file():
        for line in jsonl.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                steps[int(record["step"])] = {k: float(v) for k, v in record["data"].items() if _number(v)}
    else:
        for line in console.splitlines():
            found = _CONSOLE.search(line)
            if found:
                pairs = (item.split(":", 1) for item in found.group(2).split(" - ") if ":" in item)
                steps[int(found.group(1))] = {k.strip(): float(v) for k, v in pairs if _number(v)}
    traced = trace_steps(trace) if trace is not None else {}
    return [_kept(steps[k] | traced.get(k, {})) for k in sorted(steps)]


def dsrl_steps(run_dir: Path) -> list[dict[str, float]]:
    """dsrl's per-step metrics, from the run's tensorboard, else its last step from final_metrics.json."""
    events_dir = run_dir / "tensorboard"
    if events_dir.is_dir():
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
        events.Reload()
        steps: dict[int, dict[str, float]] = {}
        for tag in events.Tags()["scalars"]:
            for event in events.Scalars(tag):
                steps.setdefault(event.step, {})[tag] = event.value
        if steps:
            return [_kept(steps[k]) for k in sorted(steps)]
    final = run_dir / "final_metrics.json"
    return [_kept(json.loads(final.read_text()))] if final.is_file() else []


def _number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _kept(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if KEEP.match(k) and _number(v)}


def phases(framework: str, step: dict[str, float]) -> dict[str, float]:
    """One step's seconds per phase, `other` (the step less the phases) and `step`."""
    prefix = PREFIX[framework]
    seconds = {p: sum(step.get(prefix + t, 0.0) for t in TIMERS[framework][p]) for p in PHASES}
    total = step.get(prefix + "step", 0.0)
    return seconds | {"other": max(total - sum(seconds.values()), 0.0), "step": total}


def steady(framework: str, steps: list[dict[str, float]], first: bool = False) -> dict[str, float]:
    """The mean of each phase over the steps after the first, or (`first`, or a run that logged one step) the first
    step's, which carries start-up work (compilation, warm-up); the reward of the last step, and `steady_steps`:
    how many steps the mean is of (0: the first step alone)."""
    if not steps:
        return {}
    alone = first or len(steps) == 1
    later = steps[:1] if alone else steps[1:]
    each = [phases(framework, s) for s in later]
    out = {k: sum(e[k] for e in each) / len(each) for k in each[0]}
    out["step_min"], out["step_max"] = min(e["step"] for e in each), max(e["step"] for e in each)
    out["reward"] = steps[-1].get(REWARD[framework], float("nan"))
    out["length"] = sum(s.get(LENGTH[framework], 0.0) for s in later) / len(later)
    out["steady_steps"] = 0 if alone else len(later)
    return out


def rows(record: dict, first: bool = False) -> list[dict]:
    """One row per finished run of the harness's record (peers.json): its phases, memory, tokens/s; of the steady
    steps, or (`first`) of the first step."""
    out = []
    for name, run in record.get("runs", {}).items():
        summary = steady(run["framework"], run.get("steps", []), first)
        if not summary:
            out.append({"name": name, **run, "failed": True})
            continue
        samples = run.get("samples", 0)
        tokens_per_s = samples * summary["length"] / summary["step"] if summary["step"] else 0.0
        out.append({"name": name, **run, **summary, "tokens_per_s": tokens_per_s, "failed": False})
    return out


def table(record: dict) -> str:
    """The markdown table of every run: the steady steps' means, and the first step of each run (start-up work
    included) where a run logged no later step; each dsrl run's step time over verl's at the same workload, on the
    steady steps where both have them, else on the first steps: over a verl run's on the same GPU (the records'
    `gpu`, nvidia-smi's UUID) where there is one, since step times differ by up to 25% between hosts."""
    lines = [
        "| run | framework | mode | steps | step s | " + " | ".join(PHASES) + " | other | GPU peak GB "
        "| host peak GB | tokens/s | reward (last) |",
        "|---" * (10 + len(PHASES)) + "|",
    ]
    steady_rows, first_rows = rows(record), rows(record, first=True)
    for r, r1 in zip(steady_rows, first_rows):
        shown = [r1] if r["failed"] or not r["steady_steps"] else [r, r1]
        for x in shown:
            if x["failed"]:
                lines.append(f"| {x['name']} | {x['framework']} | {x.get('mode', '')} | failed (rc {x.get('rc')}) |")
                continue
            which = f"{x['steady_steps']} after the first" if x["steady_steps"] else "the first"
            cells = [f"{x[p]:.2f}" for p in (*PHASES, "other")]
            lines.append(
                f"| {x['name']} | {x['framework']} | {x.get('mode', '')} | {which} | **{x['step']:.2f}** | "
                + " | ".join(cells) + f" | {x.get('gpu_peak_gb', 0):.1f} | {x.get('host_peak_gb', 0):.1f} "
                f"| {x['tokens_per_s']:.0f} | {x['reward']:.3f} |"
            )  # fmt: skip
    for r, r1 in zip(steady_rows, first_rows):
        if r["framework"] != "dsrl" or r["failed"] or r.get("pair"):  # a pair's ratios: pair_table
            continue
        verls = [(v, v1) for v, v1 in zip(steady_rows, first_rows) if v["framework"] == "verl" and not v["failed"]]
        verls = [(v, v1) for v, v1 in verls if v.get("workload") == r.get("workload")]
        same_gpu = [(v, v1) for v, v1 in verls if r.get("gpu") and v.get("gpu") == r["gpu"]]
        if not verls:
            continue
        v, v1 = (same_gpu or verls)[0]
        both = r["steady_steps"] and v["steady_steps"]
        mine, theirs, basis = (r, v, "steady steps") if both else (r1, v1, "first steps")
        where = f"on one GPU, beside {v['name']}" if same_gpu else f"beside {v['name']}, on another or unrecorded GPU"
        lines.append(f"\n{r['name']}: dsrl step / verl step = {mine['step'] / theirs['step']:.2f} ({basis}; {where})")
    return "\n".join(lines)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def pair_ratios(record: dict) -> dict[str, dict]:
    """Each matched pair's repeats: dsrl's steady step over verl's of the same repeat (the two runs back to back on
    one host), and per phase; the median of the repeats' ratios and their min–max; the steady steps each run has;
    the hosts and GPUs its runs name. A repeat with a side failed or missing has no ratio."""
    by_pair: dict[str, dict[int, dict]] = {}
    for r in rows(record):
        if r.get("pair"):
            by_pair.setdefault(r["pair"], {}).setdefault(r.get("repeat", 0), {})[r["framework"]] = r
    out = {}
    for pair, repeats in by_pair.items():
        done = {i: sides for i, sides in sorted(repeats.items())
                if all(k in sides and not sides[k]["failed"] for k in ("verl", "dsrl"))}  # fmt: skip
        ratios = {i: s["dsrl"]["step"] / s["verl"]["step"] for i, s in done.items()}
        runs = [x for sides in repeats.values() for x in sides.values()]
        out[pair] = {
            "repeats": done, "ratios": ratios,
            "median": _median(list(ratios.values())) if ratios else float("nan"),
            "min": min(ratios.values(), default=float("nan")), "max": max(ratios.values(), default=float("nan")),
            "phases": {p: _median([s["dsrl"][p] / s["verl"][p] for s in done.values() if s["verl"][p] > 0])
                       for p in PHASES if any(s["verl"][p] > 0 for s in done.values())},
            "few_steps": sorted(x["name"] for x in runs if not x["failed"] and x["steady_steps"] < MIN_STEADY),
            "failed": sorted(x["name"] for x in runs if x["failed"]),
            "hosts": sorted({x.get("host", "") for x in runs}), "gpus": sorted({x.get("gpu", "") for x in runs}),
        }  # fmt: skip
    return out


def pair_table(record: dict) -> str:
    """The matched pairs: per repeat, each side's steady step (mean, and its steps' min–max) and the ratio, in the
    order they ran; then each pair's ratio as the median of its repeats with their min–max, per phase too."""
    lines = ["| pair | repeat | first | verl step s (min–max) | dsrl step s (min–max) | dsrl / verl |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    summary = []
    for pair, p in pair_ratios(record).items():
        for i, s in p["repeats"].items():
            v, d = s["verl"], s["dsrl"]
            first = "verl" if v.get("order", 0) < d.get("order", 0) else "dsrl"
            lines.append(
                f"| {pair} | {i} | {first} | {v['step']:.2f} ({v['step_min']:.2f}–{v['step_max']:.2f}) "
                f"| {d['step']:.2f} ({d['step_min']:.2f}–{d['step_max']:.2f}) | {p['ratios'][i]:.3f} |"
            )
        if not p["ratios"]:
            summary.append(f"{pair}: no repeat with both sides done")
            continue
        by_phase = ", ".join(f"{k} {v:.2f}" for k, v in p["phases"].items())
        where = "one host" if len(p["hosts"]) == 1 and len(p["gpus"]) == 1 else f"hosts {p['hosts']}, GPUs {p['gpus']}"
        line = (f"{pair}: dsrl / verl = {p['median']:.3f} (median of {len(p['ratios'])} repeats, min–max "
                f"{p['min']:.3f}–{p['max']:.3f}; {where}); by phase (medians): {by_phase}")  # fmt: skip
        if p["few_steps"]:
            line += f"; fewer than {MIN_STEADY} steady steps: {', '.join(p['few_steps'])}"
        if p["failed"]:
            line += f"; failed: {', '.join(p['failed'])}"
        summary.append(line)
    return "\n".join(lines + [""] + summary)


def settings_text(record: dict) -> str:
    """Every setting the harness gave verl, with its reason, once each (from the verl runs' records), grouped by
    reason; the workload's own (data files, batch, lengths) are listed in one line."""
    seen: dict[str, tuple[str, str]] = {}
    for run in record.get("runs", {}).values():
        for key, value, why in run.get("settings", []):
            seen.setdefault(key, (value, why))
    if not seen:
        return ""
    workload = [f"{k}={v}" for k, (v, why) in seen.items() if why.startswith("the workload")]
    lines = ["verl's settings beside its defaults, and why:", f"- the same on both sides: {', '.join(workload)}"]
    lines += [f"- {k}={v}: {why}" for k, (v, why) in seen.items() if not why.startswith(("the workload", "the harn"))]
    return "\n".join(lines)


def plot_phases(record: dict, path: Path) -> None:
    """Stacked bars, phase by phase: each run's first step, and the mean of its later steps where it has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = []
    for r, r1 in zip(rows(record), rows(record, first=True)):
        if not r1["failed"]:
            done.append(r1 | {"name": f"{r1['name']}, step 1"})
        if not r["failed"] and r["steady_steps"]:
            later = f"steps 2-{r['steady_steps'] + 1}" if r["steady_steps"] > 1 else "step 2"
            done.append(r | {"name": f"{r['name']}, {later}"})
    if not done:
        return
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(done) + 1.5))
    names = [r["name"] for r in done]
    left = [0.0] * len(done)
    for phase in (*PHASES, "other"):
        widths = [r[phase] for r in done]
        ax.barh(names, widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (step 1 carries start-up work: compilation, warm-up)")
    ax.legend(ncol=3, fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_curves(record: dict, path: Path) -> None:
    """Reward by step and by seconds of training steps after the first, every run of the toy task (each framework,
    each seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(n, r) for n, r in record.get("runs", {}).items() if r["workload"].startswith("toy") and r.get("steps")]
    if not runs:
        return
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, run in runs:
        framework = run["framework"]
        rewards = [s.get(REWARD[framework], float("nan")) for s in run["steps"]]
        # the first step's one-time work (verl: ~50-130 s of compiles) left out: the clock starts at its end
        clock = list(accumulate((s.get(PREFIX[framework] + "step", 0.0) for s in run["steps"][1:]), initial=0.0))
        style = "-" if framework == "dsrl" else "--"
        by_step.plot(range(1, len(rewards) + 1), rewards, style, label=name)
        by_time.plot(clock, rewards, style, label=name)
    by_step.set_xlabel("step")
    by_time.set_xlabel("seconds of training steps after the first")
    for ax in (by_step, by_time):
        ax.set_ylabel("mean reward")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


_LOG_NAME = re.compile(r"verl_(\w+)_s(\d+)\.log$")


def log_run(path: Path) -> tuple[str, dict]:
    """A verl run from its console log alone, as the harness names it (`verl_<workload>_s<seed>.log`): what is left
    of a run whose call ended before the harness wrote its record. Its name and record are the harness's (the toy
    builds its model, toy_model, and serves it from model_toy_model)."""
    found = _LOG_NAME.search(path.name)
    if not found:
        raise ValueError(f"{path}: not a harness log (verl_<workload>_s<seed>.log)")
    workload, seed = found.group(1), int(found.group(2))
    w, model = WORKLOADS[workload], "toy_model" if workload == "toy" else ""
    steps = verl_steps(None, path.read_text(errors="replace"))
    served = f"{workload} model_{model}" if model else workload
    run = {"framework": "verl", "mode": "best", "seed": seed, "workload": served, "samples": w["prompts"] * w["n"],
           "steps": steps}  # fmt: skip
    return f"verl {model or workload} seed {seed}", run


def merged(paths: list[Path]) -> dict:
    """The runs of every directory's peers.json (or verl console log, `log_run`) in one record; a run's name gets
    its directory's (a log's: the folder holding it) where two clash, unless the first has no step (a run cut off
    before its first, rerun in a later call): the later one takes its place."""
    record: dict = {"runs": {}}
    for d in paths:
        if d.is_file():
            runs, label = dict([log_run(d)]), d.parent.name
        else:
            runs, label = json.loads((d / "peers.json").read_text())["runs"], d.name
        for name, run in runs.items():
            clash = name in record["runs"] and record["runs"][name].get("steps")
            record["runs"][f"{name} ({label})" if clash else name] = run
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the PNGs go there; its peers.json, if any, is read too")
    p.add_argument("dirs", type=Path, nargs="*", help="more records: a run's directory, or a verl console log")
    args = p.parse_args()
    out = args.out  # may hold no record of its own: then it only takes the PNGs
    out.mkdir(parents=True, exist_ok=True)
    record = merged([p for p in [out, *args.dirs] if p.is_file() or (p / "peers.json").exists()])
    print(table(record))
    if any(run.get("pair") for run in record["runs"].values()):
        print(pair_table(record))
        print(settings_text(record))
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # (the tables above are the record; the figures need matplotlib)
        print(f"no figures in {out}: matplotlib is not installed (pip install matplotlib)")
        return
    plot_phases(record, out / "phases.png")
    plot_curves(record, out / "curves.png")


if __name__ == "__main__":
    main()
