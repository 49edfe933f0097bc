"""Kill one of two rollout servers near an async weight update, many times: does the run survive it?

Each run is tests/test_reliability.py's async crash scenario (configs/toy_cpu_async.yaml, 6 steps, 2 servers,
--rollout.interrupt pause); server 1 gets SIGKILL a random --min-delay to --max-delay seconds after the
"step 2/6" line, which puts the kill just before, during or after step 3's update on a 2-core machine. A run
that dies at a stuck update takes --sync-timeout-s (see 2026-11-27's fix in dsrl/sync/broadcast.py).

    python tools/kill_near_sync.py --runs 20 --parallel 2
"""

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"step (\d)/6 \|.*\| ([\d.]+)s$")


def one_run(run_dir: Path, delay: float, sync_timeout_s: int) -> dict:
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs/toy_cpu_async.yaml"),
           "--logging.run_dir", str(run_dir), "--logging.export_hf", "false", "--trainer.total_steps", "6",
           "--logging.save_every", "6", "--rollout.num_servers", "2", "--rollout.interrupt", "pause",
           "--rollout.server_args", json.dumps({"decode_delay_ms": 10}),
           "--sync.timeout_s", str(sync_timeout_s)]  # fmt: skip

    def kill() -> None:
        time.sleep(delay)
        pid = re.search(r"\(pid (\d+)\)", (run_dir / "logs" / "server_1.log").read_text()).group(1)
        os.kill(int(pid), signal.SIGKILL)

    start, steps, met = time.monotonic(), {}, False
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "step 2/6 |" in line:
            threading.Thread(target=kill, daemon=True).start()
        met |= "syncing again" in line  # an update met the death and was retried
        if m := STEP.search(line.rstrip()):
            steps[int(m.group(1))] = float(m.group(2))
    return {"delay": delay, "rc": proc.wait(), "seconds": time.monotonic() - start, "met": met, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--min-delay", type=float, default=0.0)
    parser.add_argument("--max-delay", type=float, default=0.35)
    parser.add_argument("--sync-timeout-s", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng, root = random.Random(args.seed), Path(tempfile.mkdtemp(prefix="kill_near_sync_"))
    delays = [round(rng.uniform(args.min_delay, args.max_delay), 3) for _ in range(args.runs)]
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda i: one_run(root / f"run{i}", delays[i], args.sync_timeout_s), range(args.runs)))
    for i, r in enumerate(results):
        steps = " ".join(f"{r['steps'].get(s, float('nan')):.2f}" for s in range(1, 7))
        print(f"run {i}: kill at +{r['delay']:.3f} s, rc {r['rc']}, {r['seconds']:.0f} s, "
              f"update met the death: {r['met']}, steps (s): {steps}")  # fmt: skip
    print(f"RESULT {sum(r['rc'] != 0 for r in results)} of {len(results)} runs died; "
          f"{sum(r['met'] for r in results)} had an update meet the death; logs under {root}")  # fmt: skip


if __name__ == "__main__":
    main()
