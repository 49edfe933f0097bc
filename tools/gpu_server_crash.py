"""Kill an SGLang server's scheduler and check that dsrl's fleet sees it and restarts the server.

The trainer finds dead servers it started by their process (`ServerFleet.exited`), not over HTTP
(a round trip behind a busy server's queue cost ~20 ms per sync). That holds only if SGLang's
launch process exits when its scheduler dies; this script checks it on a GPU, then restarts the
server through `ServerFleet.replace` and generates from the new one.

    python tools/gpu_server_crash.py [--workdir /tmp/crash]
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_models import build  # noqa: E402 -- tools/, this script's folder

from dsrl.config import RolloutConfig  # noqa: E402
from dsrl.serving.client import RolloutClient  # noqa: E402
from dsrl.serving.fleet import start_fleet  # noqa: E402


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def generate(urls: list[str]) -> int:
    client = RolloutClient(urls, timeout_s=120)
    body = {"input_ids": [5, 11, 6, 12], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    return len(client.run(client.generate(body))["output_ids"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="crash_"))
    model = build(work / "model", "0.5b")
    cfg = RolloutConfig(engine="sglang", placement="disaggregate", first_gpu=0, startup_timeout_s=600)
    cfg.mem_fraction_static = 0.3
    cfg.server_args = {"attention_backend": "triton", "sampling_backend": "pytorch", "disable_cuda_graph": True}
    with start_fleet(cfg, str(model), work, 0, "sglang") as fleet:
        url, proc = fleet.urls[0], fleet.processes[0].proc
        print(f"server {url} up; generated {generate(fleet.urls)} tokens; exited: {fleet.exited()}", flush=True)
        schedulers = [c for c in children(proc.pid) if "scheduler" in Path(f"/proc/{c}/cmdline").read_text()]
        victims = schedulers or children(proc.pid)  # SGLang names its scheduler process sglang::scheduler
        names = {c: Path(f"/proc/{c}/comm").read_text().strip() for c in victims}
        print(f"killing {names} (children of {proc.pid}: {children(proc.pid)})", flush=True)
        start = time.perf_counter()
        for c in victims:
            os.kill(c, signal.SIGKILL)
        while url not in fleet.exited() and time.perf_counter() - start < 60:
            time.sleep(0.05)
        seen, took = url in fleet.exited(), time.perf_counter() - start
        print(f"RESULT exited seen: {seen} after {took:.2f} s (exit code {proc.poll()})", flush=True)
        start = time.perf_counter()
        new = fleet.replace({url})
        print(
            f"RESULT restarted at {new[0]} in {time.perf_counter() - start:.1f} s; "
            f"generated {generate(new)} tokens; exited now: {fleet.exited()}",
            flush=True,
        )


if __name__ == "__main__":
    main()
