"""Speed, memory and the train/rollout mismatch held: a GPU stage's figures against committed baselines (issue 89).

    python3 tools/baselines.py check tools/baselines/gate_tail_1.5b.json RECORD     # the gate: exit 1 on a flag
    python3 tools/baselines.py make tools/baselines/gate_tail_1.5b.json RECORD...   # the baseline again, from records

A RECORD is a stage's JSON: tools/peers/peers.py's peers.json (a run's figure is its median over the steady steps, the
first one being warm-up) or tools/soak.py's soak.json (the medians it computed). A baseline file holds entries, each
the runs it stands for (`run`: a regex on the record's run names) and its figures, each with a rule:

    time    seconds (a step, a phase): flagged more than 15% above the baseline (prime-rl's gate)
    peak    GB (a memory peak): flagged more than 1% above
    rate    GB/s (the sync's): flagged more than 15% slower, below the baseline / 1.15
    bound   the median mismatch/logprob_abs_diff: flagged above the bound, BOUND_MARGIN x the largest median of the
            records (NeMo-RL gates its nightly recipes on the mismatch)

`check` prints each figure of each entry the record has a run for beside its baseline, then names the flagged ones;
it exits 1 when one is, when a run checked for time did not end well (its rc: a failure, or its limit), or when the
record has no run of any entry (a stage that did not run passes nothing). `make`
keeps the file's entries and rules and sets each value (the runs' median; for a bound, the margin over their
largest) and `seen` (every run's figure, by record) from the records given.
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

SLOWER, HIGHER, BOUND_MARGIN = 0.15, 0.01, 1.2
"""A step or phase more than 15% slower, a peak more than 1% higher, flagged; a mismatch bound 20% over the largest
median seen (the medians of repeats differ by < 2%: docs/gpu_runs; a lost KV-cache scale tripled FP8 7B's)."""


def runs(path: Path) -> dict[str, dict[str, float]]:
    """Each run of a record, by name: its figures (medians)."""
    data = json.loads(Path(path).read_text())
    out = {}
    if isinstance(data, dict):  # peers.json: {"runs": {name: {"steps": [{metric: value}, ...], ...}}}
        for name, run in data["runs"].items():
            steps = run.get("steps") or []
            steady = steps[1:] or steps
            keys = {k for s in steady for k, v in s.items() if isinstance(v, (int, float))}
            out[name] = {k: statistics.median(s[k] for s in steady if k in s) for k in keys}
        return out
    for run in data:  # soak.json: [{"name", "medians", "phases_s", "step_median_s", "update_peak_gb": {...}}, ...]
        figures = dict(run.get("medians") or {})
        figures |= {f"timing/{phase}": v for phase, v in (run.get("phases_s") or {}).items()}
        if run.get("step_median_s") is not None:
            figures["timing/step"] = run["step_median_s"]
        if (run.get("update_peak_gb") or {}).get("update_peak_gb") is not None:
            figures["memory/update_peak_gb"] = run["update_peak_gb"]["update_peak_gb"]
        out[run["name"]] = figures
    return out


def unfinished(path: Path) -> dict[str, str]:
    """The runs of a peers.json that did not end well (rc not 0: a failure, its limit), each with what it did."""
    data = json.loads(Path(path).read_text())
    runs_ = data["runs"].items() if isinstance(data, dict) else []
    return {name: f"ended rc={run['rc']} after {len(run.get('steps') or [])} steps"
            for name, run in runs_ if run.get("rc") not in (0, None)}  # fmt: skip


def verdict(rule: str, base: float, now: float) -> tuple[bool, str]:
    """(flagged, why) for `now` against `base` under `rule`."""
    if rule == "time":
        return now > base * (1 + SLOWER), f"more than {SLOWER:.0%} slower"
    if rule == "peak":
        return now > base * (1 + HIGHER), f"more than {HIGHER:.0%} higher"
    if rule == "rate":
        return now < base / (1 + SLOWER), f"more than {SLOWER:.0%} slower"
    if rule == "bound":
        return now > base, "above its bound"
    raise ValueError(f"unknown rule {rule!r}: expected time, peak, rate or bound")


def check(baseline: Path, record: Path) -> int:
    entries, found = json.loads(Path(baseline).read_text())["entries"], runs(record)
    flagged, shown, cut = [], 0, unfinished(record)
    for entry_name, entry in entries.items():
        for run_name in [n for n in found if re.fullmatch(entry["run"], n)]:
            print(f"{baseline.name} [{entry_name}], run {run_name!r} of {record}:")
            timed = any(spec["rule"] == "time" for spec in entry["figures"].values())
            if run_name in cut and timed:  # (a speed gate: its figures shown, over the steps taken, but not held; a
                # bound holds over any steps: the fp8 stage's runs end at their limits)
                flagged.append(f"{run_name}: {cut[run_name]}")
                print(f"  the run {cut[run_name]}: FLAG")
            for figure, spec in entry["figures"].items():
                now, base = found[run_name].get(figure), spec["value"]
                if now is None:
                    flagged.append(f"{run_name}: {figure} missing")
                    print(f"  {figure:28s} {base:10.4g}  now: missing  FLAG")
                    continue
                bad, why = verdict(spec["rule"], base, now)
                mark = f"FLAG: {why}" if bad else "ok"
                print(f"  {figure:28s} {base:10.4g}  now {now:10.4g}  {now / base:6.3f}x  {spec['rule']:5s} {mark}")
                shown += 1
                if bad:
                    flagged.append(f"{run_name}: {figure} {now:.4g} against {base:.4g} ({why})")
    if not shown and not flagged:
        print(f"no run of {record} matches an entry of {baseline} ({', '.join(entries)}): nothing was checked")
        return 1
    print("FLAGGED: " + "; ".join(flagged) if flagged else f"held: {shown} figures within their baselines")
    return 1 if flagged else 0


def make(baseline: Path, records: list[Path]) -> None:
    data = json.loads(Path(baseline).read_text())
    found = {str(r): runs(r) for r in records}
    for entry in data["entries"].values():
        seen = {f"{r} | {n}": figures for r, rs in found.items() for n, figures in rs.items()
                if re.fullmatch(entry["run"], n)}  # fmt: skip
        if not seen:
            raise SystemExit(f"no run of {', '.join(found)} matches {entry['run']!r}")
        for figure, spec in entry["figures"].items():
            values = [figures[figure] for figures in seen.values() if figure in figures]
            best = BOUND_MARGIN * max(values) if spec["rule"] == "bound" else statistics.median(values)
            spec["value"] = float(f"{best:.4g}")
        entry["seen"] = {k: {f: round(v[f], 5) for f in entry["figures"] if f in v} for k, v in seen.items()}
    Path(baseline).write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="a record's figures against a baseline file; exit 1 on a flag")
    c.add_argument("baseline", type=Path)
    c.add_argument("record", type=Path, help="peers.json or soak.json")
    m = sub.add_parser("make", help="set a baseline file's values from records (its entries and rules kept)")
    m.add_argument("baseline", type=Path)
    m.add_argument("records", type=Path, nargs="+")
    args = p.parse_args(argv)
    if args.command == "check":
        return check(args.baseline, args.record)
    make(args.baseline, args.records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
