"""Soak: `dsrl train` on tools/peers' `tail` workload for many steps, optionally with a rollout server killed (-9)
mid-step, and one line per run: steps, server deaths, restarts, the median and the largest step, the step a death
hit against its neighbours, each rank's update peak, and the first error line of any server that died (issue 60).

    python tools/soak.py --model /tmp/models/1.5b --out $OUT --name colo1 --steps 50 -- --rollout.prompts_per_step 32
    python tools/soak.py ... --kill-at 6 --kill-server 0      # kill -9 of server 0 once step 6 has logged

Flags after `--` go to `dsrl train` last (they win). The run directory and its logs stay under --workdir; the run's
output goes to <out>/run_<name>.log and the record to <out>/soak.json.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools" / "peers")]

import peers  # noqa: E402
from report import WORKLOADS  # noqa: E402

from dsrl.rundir import reporting  # noqa: E402

SERVER_ERRORS = re.compile(r"Scheduler hit an exception|out of memory|OutOfMemoryError|Traceback|RuntimeError|Killed")


def server_pids(run_pid: int, number: int) -> list[int]:
    """The processes of rollout server `number` among the run's (its log is server_<number>.log; SGLang's HTTP process
    is the one whose command line says sglang.launch_server, the embedded engine's dsrl.serving.embedded)."""
    pids = []
    for p in psutil.Process(run_pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            files = [f.path for f in p.open_files()]
        except psutil.Error:
            continue
        if ("sglang.launch_server" in cmd or "dsrl.serving.embedded" in cmd) and any(
            f.endswith(f"server_{number}.log") for f in files
        ):
            pids.append(p.pid)
    return pids


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def first_errors(log_dir: Path) -> list[str]:
    """The first error line of each server log that has one (what killed it)."""
    out = []
    for log in sorted(log_dir.glob("*server_*.log")):
        lines = log.read_text(errors="replace").splitlines()
        bad = [i for i, line in enumerate(lines) if SERVER_ERRORS.search(line)]
        if bad:
            i = bad[0]
            out.append(f"{log.name}: " + " / ".join(line.strip()[:200] for line in lines[i : i + 3]))
    return out


def eager_decodes(log_dir: Path) -> dict[str, dict[str, int]]:
    """Each SGLang server's decode batches run without CUDA graphs (more requests than it captured graphs for:
    several times slower), and the most requests one of them held."""
    out = {}
    for log in sorted(log_dir.glob("server_*.log")):
        text = log.read_text(errors="replace")
        held = [int(n) for n in re.findall(r"Decode batch[^\n]*#running-req: (\d+)[^\n]*cuda graph: False", text)]
        if held:
            out[log.stem] = {"batches": len(held), "most_requests": max(held)}
    return out


PHASES = ("generate", "generate_wait", "release", "logprobs", "update", "sync")
MEDIANS = ("sync/bytes", "sync/seconds", "sync/probe_logprob_diff", "mismatch/logprob_abs_diff",
           "moe/routing_mismatch_frac", "reward/mean", "actor/optimizer_seconds")  # fmt: skip


def steady_median(series: dict[int, float]) -> float | None:
    values = [series[k] for k in sorted(series)][1:]  # (the first step warms up)
    return round(statistics.median(values), 3) if values else None


def summary(name: str, run_dir: Path, rc, kill_step: int | None, started: float, samples: int, gpus: int) -> dict:
    s = scalars(run_dir) if (run_dir / "tensorboard").is_dir() else {}
    steps = s.get("timing/step", {})
    times = [steps[k] for k in sorted(steps)][1:]  # (the first step warms up)
    lengths = [steady_median(s.get(f"{part}/length_mean", {})) for part in ("prompt", "response")]
    peaks = {tag.rsplit("/", 1)[-1]: max(v.values()) for tag, v in s.items() if tag.startswith("memory/update_peak")}
    record = {
        "name": name, "rc": rc, "steps": len(steps), "wall_s": round(time.monotonic() - started, 1),
        "deaths": max(s.get("fleet/server_deaths", {0: 0}).values()),
        "restarts": max(s.get("fleet/restarts", {0: 0}).values()),
        "step_median_s": round(statistics.median(times), 2) if times else None,
        "step_max_s": round(max(times), 2) if times else None,
        "update_peak_gb": {k: round(v, 1) for k, v in sorted(peaks.items())},
        "update_peak_by_step_gb": {tag.rsplit("/", 1)[-1]: [round(v[k], 1) for k in sorted(v)] for tag, v in s.items()
                                   if tag.startswith("memory/update_peak")},  # fmt: skip
        "step_s": [round(steps[k], 2) for k in sorted(steps)],
        "phases_s": {p: steady_median(s[f"timing/{p}"]) for p in PHASES if f"timing/{p}" in s},
        "phases_by_step_s": {p: [round(v, 2) for _, v in sorted(s[f"timing/{p}"].items())] for p in PHASES
                             if f"timing/{p}" in s},  # fmt: skip
        "medians": {k: steady_median(s[k]) for k in MEDIANS if k in s},
        "first_step": {k: round(s[k][min(s[k])], 4) for k in MEDIANS if k in s},
        # prompt + response tokens trained a step, over the median step and the GPUs (NeMo-RL's tokens/s/GPU)
        "tokens_per_s_gpu": round(sum(lengths) * samples / statistics.median(times) / gpus)
        if times and None not in lengths else None,
        "server_errors": first_errors(run_dir / "logs"),
        "decodes_without_graphs": eager_decodes(run_dir / "logs"),
    }  # fmt: skip
    hit = {k: v for k, v in steps.items() if kill_step is not None and k in (kill_step + 1, kill_step + 2)}
    if hit and times:
        record["death_steps_s"] = {k: round(v, 2) for k, v in hit.items()}
        # the step the death hit against the steps before it (the first warms up), where there are any
        before = [v for k, v in steps.items() if 1 < k <= kill_step] or times
        record["death_step_ratio"] = round(hit.get(kill_step + 1, max(hit.values())) / statistics.median(before), 2)
    return record


def await_sync(log: Path, deadline: float) -> None:
    """Until the server's log says it woke for the next weight update (colocated, the update's first request), polled
    every 5 ms: a kill then lands in the send or the KV cache's wake."""
    with open(log, "rb") as f:
        f.seek(0, os.SEEK_END)
        seen = b""
        while time.monotonic() < deadline and b"POST /resume_memory_occupation" not in seen:
            seen = seen[-200:] + f.read()
            time.sleep(0.005)


class HostMemory:
    """The host's memory in use (total less available) at its peak, in GB, sampled every 2 s while the run lasts (the
    32B run whose rank the kernel killed when ZeRO-Offload's states filled the host said only "status 247")."""

    def __init__(self):
        self.peak_gb = 0.0

    def sample(self, _: str) -> None:  # (rundir.reporting's callback)
        self.peak_gb = max(self.peak_gb, round(peers.host_used_gb(), 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--split", action="store_true", help="trainer ranks and servers on GPUs of their own (half each)")
    p.add_argument("--kill-at", type=int, help="kill -9 a rollout server once this step has logged")
    p.add_argument("--kill-server", type=int, default=0)
    p.add_argument("--kill-in-sync", action="store_true",
                   help="with --kill-at: kill at the next weight update instead, once the server has woken its weights "
                   "for it (its log's next `POST /resume_memory_occupation`; colocated)")  # fmt: skip
    p.add_argument("--limit", type=float, default=540, help="seconds the run may take")
    p.add_argument("--data", type=Path, default=ROOT / "examples/toy/train.jsonl")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/soak"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("extra", nargs="*", help="flags for dsrl train, after --")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.workdir / args.name
    w = WORKLOADS["tail"]
    model = peers.chat_model(args.model, args.workdir / f"model_{args.model.name}")
    rows = peers.tail_rows([json.loads(line) for line in args.data.read_text().splitlines() if line.strip()])
    data = peers.write_parquet(rows, args.workdir / "train_dsrl.parquet", w["source"], "dsrl")
    pair = peers.Pair("soak", split=True) if args.split else None
    argv = peers.dsrl_command(w, model, data, work / "run", args.steps, 0, gpus=args.gpus, pair=pair)
    argv += ["--logging.tensorboard", "true", "--logging.export_hf", "false", *args.extra]
    paths = [str(ROOT), str(ROOT / "tools" / "peers"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    started, kill_step, host = time.monotonic(), None, HostMemory()
    with reporting(host.sample, every_s=2.0), open(args.out / f"run_{args.name}.log", "w") as log:
        log.write(" ".join(map(str, argv)) + "\n")
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.PIPE, text=True)
        deadline = started + args.limit
        for line in proc.stderr:
            log.write(line)
            log.flush()
            logged = re.search(rf"step (\d+)/{args.steps} \|", line)
            if args.kill_at and kill_step is None and logged and int(logged.group(1)) >= args.kill_at:
                if args.kill_in_sync:
                    await_sync(work / "run" / "logs" / f"server_{args.kill_server}.log", deadline)
                pids = server_pids(proc.pid, args.kill_server)
                for pid in pids:
                    os.kill(pid, 9)
                kill_step = int(logged.group(1))
                log.write(f"soak: kill -9 of server {args.kill_server} (pids {pids}) after step {kill_step}\n")
            if time.monotonic() > deadline:
                proc.kill()
                log.write(f"soak: stopped at its limit, {args.limit:.0f} s\n")
                break
        rc = proc.wait(60)
    flag = dict(zip(argv, argv[1:]))  # (the last value of a flag given twice)
    samples = int(flag["--rollout.prompts_per_step"]) * int(flag["--rollout.n_samples"])
    record = summary(args.name, work / "run", rc, kill_step, started, samples, args.gpus)
    logged = (args.out / f"run_{args.name}.log").read_text()  # (train.py's lines: not the writes' progress lines)
    record |= {"host_peak_gb": host.peak_gb, "host_total_gb": round(psutil.virtual_memory().total / 1e9, 1)}
    record |= {"checkpoint": re.findall(r"checkpoint step_\d+ written in ([0-9.]+) s", logged),
               "exported": re.findall(r"\] exported \S+ in ([0-9.]+) s", logged)}  # fmt: skip
    path = args.out / "soak.json"
    records = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(records + [record], indent=1))
    death = (f", the death's steps {record['death_steps_s']} (the first {record['death_step_ratio']}x the steps before)"
             if "death_steps_s" in record else "")  # fmt: skip
    print(f"soak {args.name}: rc {rc}, {record['steps']}/{args.steps} steps in {record['wall_s']} s, server deaths "
          f"{record['deaths']:.0f}, restarts {record['restarts']:.0f}, step median {record['step_median_s']} s, max "
          f"{record['step_max_s']} s{death}, update peak {record['update_peak_gb']} GB, phases {record['phases_s']}"
          f", host memory in use at most {record['host_peak_gb']} of {record['host_total_gb']} GB"
          f", {record['tokens_per_s_gpu']} tokens/s/GPU, checkpoint {record['checkpoint']} s, "
          f"export {record['exported']} s\n  medians {record['medians']}, first step {record['first_step']}"
          f"\n  decode batches without CUDA graphs: {record['decodes_without_graphs'] or 'none'}"
          + "".join(f"\n  {e}" for e in record["server_errors"]), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
