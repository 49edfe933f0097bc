"""`kill -9` of `dsrl train` mid-step: how long until every process of the run (and, on a GPU, its memory) is gone.

    python tools/bench_kill9.py --config configs/toy_cpu.yaml --ranks 2                      # CPU
    python tools/bench_kill9.py --config configs/gpu_colocate.yaml --model /tmp/models/0.5b  # GPU (gpu_run.sh kill9)

Starts `dsrl train` under `timeout -k 10 300`, SIGKILLs the CLI once step `--at` has been logged (the next step is
under way), then polls every 0.5 s and prints when the run's processes were gone and, where nvidia-smi is, when
the GPUs' memory was back to what it was before the run. On an H200 a 0.5B colocated run took over 120 s to its
second step (SGLang's start with CUDA graphs, DeepSpeed's init): give it 240 s.
"""

import argparse
import shutil
import subprocess
import sys
import time

import psutil


def gpu_state() -> tuple[set[int], int] | None:
    """(pids with a CUDA context, MiB used on all GPUs together); None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout  # fmt: skip
    used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True).stdout  # fmt: skip
    return {int(p) for p in apps.split() if p.strip().isdigit()}, sum(int(u) for u in used.split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/toy_cpu.yaml")
    parser.add_argument("--model", default=None, help="--model.path (default: the config's)")
    parser.add_argument("--ranks", type=int, default=None, help="--trainer.num_ranks (default: the config's)")
    parser.add_argument("--at", type=int, default=2, help="Kill once this step is logged.")
    parser.add_argument("--run-dir", default="/tmp/runs/kill9")
    parser.add_argument("train_args", nargs="*", help="More `dsrl train` flags, after `--`.")
    args = parser.parse_args()
    before = gpu_state()
    cmd = ["timeout", "-k", "10", "300", sys.executable, "-m", "dsrl.cli", "train", "--config", args.config,
           "--trainer.total_steps", "200", "--eval.path", "null", "--logging.export_hf", "false",
           "--logging.tensorboard", "false", "--logging.run_dir", args.run_dir]  # fmt: skip
    cmd += ["--model.path", args.model] if args.model else []
    cmd += ["--trainer.num_ranks", str(args.ranks)] if args.ranks else []
    cmd += args.train_args
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stderr:
        if f"step {args.at}/200 |" in line:
            break
    cli = next(p for p in psutil.Process(proc.pid).children() if "dsrl.cli" in " ".join(p.cmdline()))
    run = cli.children(recursive=True)
    print(f"before: {len(run) + 1} processes of the run" + (f", GPUs {before[1]} MiB used" if before else ""))
    start = time.monotonic()
    cli.kill()
    gone_at = freed_at = None
    while time.monotonic() - start < 60 and (gone_at is None or (before is not None and freed_at is None)):
        now = time.monotonic() - start
        if gone_at is None and not [p for p in run if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
            gone_at = now
        state = gpu_state()
        if state is not None and freed_at is None and not state[0] & {p.pid for p in run}:
            freed_at = now if state[1] <= before[1] + 1024 else None
        time.sleep(0.5)
    gpu = "" if before is None else f"; GPU memory back to within 1 GiB of {before[1]} MiB after {freed_at} s"
    print(f"RESULT kill -9 of dsrl train at step {args.at + 1}: {len(run)} processes gone after {gone_at} s{gpu}",
          flush=True)  # fmt: skip
    proc.kill()


if __name__ == "__main__":
    main()
