"""`kill -9` of `dsrl train` mid-step on a GPU: every process of the run and its GPU memory gone within 15 s.

    python tools/gpu_kill9.py --model /tmp/models/0.5b        # (tools/gpu_run.sh kill9)

Starts `dsrl train --config configs/gpu_colocate.yaml` (ZeRO-3 and SGLang on one GPU), SIGKILLs the CLI once step
2 is under way (mid-step: generation or update of step 3), then polls nvidia-smi every 0.5 s and prints when the
run's processes and its memory were gone. Give it 240 s: a 0.5B run took over 120 s to its second step on an H200
(SGLang's start with CUDA graphs, DeepSpeed's init), and a stage limit of 120 s ended it before the kill.
"""

import argparse
import subprocess
import sys
import time

import psutil


def gpu_state() -> tuple[set[int], int]:
    """(pids with a CUDA context, MiB used) of GPU 0."""
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout  # fmt: skip
    used = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True).stdout  # fmt: skip
    return {int(p) for p in apps.split() if p.strip().isdigit()}, int(used.strip() or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="/tmp/models/0.5b")
    parser.add_argument("--run-dir", default="/tmp/runs/kill9")
    args = parser.parse_args()
    baseline = gpu_state()[1]
    cmd = ["timeout", "-k", "10", "300", sys.executable, "-m", "dsrl.cli", "train", "--config",
           "configs/gpu_colocate.yaml", "--model.path", args.model, "--trainer.total_steps", "50",
           "--logging.tensorboard", "false", "--logging.run_dir", args.run_dir]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stderr:
        if "step 2/50 |" in line:
            break
    time.sleep(1.0)  # into step 3
    cli = next(p for p in psutil.Process(proc.pid).children() if "dsrl.cli" in " ".join(p.cmdline()))
    run = cli.children(recursive=True)
    apps, used = gpu_state()
    print(f"before: {len(run) + 1} processes of the run, {len(apps)} on the GPU, {used} MiB used "
          f"(baseline {baseline} MiB)", flush=True)  # fmt: skip
    start = time.monotonic()
    cli.kill()
    gone_at = freed_at = None
    while time.monotonic() - start < 60 and (gone_at is None or freed_at is None):
        alive = [p for p in run if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        apps, used = gpu_state()
        now = time.monotonic() - start
        if gone_at is None and not alive:
            gone_at = now
        if freed_at is None and not (apps & {p.pid for p in run}) and used <= baseline + 1024:
            freed_at = now
        time.sleep(0.5)
    print(
        f"RESULT kill -9 of dsrl train mid-step: processes gone after {gone_at} s, GPU memory back to "
        f"{used} MiB (baseline {baseline}) after {freed_at} s; nvidia-smi apps now: {sorted(apps)}",
        flush=True,
    )
    proc.kill()


if __name__ == "__main__":
    main()
