"""Benchmark the weight update's transports against the hardware's own limit, measured in the same run.

Modes:
  cpu   2 ZeRO-3 ranks over gloo -> one embedded server; limit: a raw gloo broadcast of the same
        bucket sizes from trainer rank 0 to a bare receiver process.
  ipc   1 GPU: ZeRO-3 trainer and SGLang colocated, CUDA IPC flattened buckets; limit: a
        device-to-device copy of the same bytes.
  nccl  2 GPUs: trainer on GPU 0, SGLang on GPU 1, NCCL broadcast; limit: a raw NCCL broadcast of
        the same bucket sizes to a bare receiver on GPU 1.

The sync path is timed end to end as the trainer runs it (`WeightSync.update`, its requests drained,
so no pause unless --pause): heal -> gather into flat buckets -> send -> server load -> KV flush ->
version check. Each figure is the
best of --repeats, printed with where that run's time went (rank 0's view: `gather` waits for the
next bucket, `broadcast` for the wire, `server_load`/`server_replies` for SGLang's answers).

    python tools/bench_sync.py                                   # cpu, ~750 MB fp32 model
    python tools/bench_sync.py --mode ipc --models 0.5b 1.5b 3b --bucket-mb 64 256 1024 0
    python tools/bench_sync.py --mode nccl --models 0.5b 1.5b 3b --bucket-mb 64 256 1024 0
    python tools/bench_sync.py --mode ipc --server-gpu 1 --models 3b --bucket-mb 0   # IPC to another GPU
(--bucket-mb 0 = the whole model in one bucket)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["cpu", "ipc", "nccl"], default="cpu")
    p.add_argument("--models", nargs="+", default=["cpu-750mb"], help="0.5b 1.5b 3b on GPU")
    p.add_argument("--bucket-mb", nargs="+", type=float, default=[256], help="0 = whole model")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2, help="ZeRO-3 trainer ranks (cpu mode).")
    p.add_argument(
        "--pause",
        choices=["retract", "in_place"],
        default=None,
        help="pause the servers around each sync (interrupt pause)",
    )
    p.add_argument("--server-urls", default=None, help="cpu mode: servers running elsewhere (a JSON list), not started")
    p.add_argument("--workdir", default=None, help="Models, logs, results (default: a temporary directory).")
    p.add_argument("--server-gpu", type=int, default=None, help="ipc mode: the server's GPU (default 0, the trainer's)")
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--receiver", nargs=4, metavar=("PORT", "SIZES", "REPEATS", "BACKEND"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_cpu_model(out: Path, hidden: int = 1024, layers: int = 8, vocab: int = 32000) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dsrl.tasks.toy import build_tokenizer

    if (out / "config.json").is_file():
        return out
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def receiver(port: int, sizes: list[int], repeats: int, backend: str) -> None:
    """Rank 1 of a bare group: receive the buffers the sync path would send, nothing else."""
    import torch
    import torch.distributed as dist

    from dsrl.collectives import init_weight_update_group

    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(1)
        device = "cuda"
    group = init_weight_update_group("127.0.0.1", port, 1, 2, f"raw_{port}", backend, 300)
    buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    for _ in range(repeats + 1):
        for buf in buffers:
            dist.broadcast(buf, group=group, group_src=0)
    if device == "cuda":
        torch.cuda.synchronize()


def raw_limit(mode: str, sizes: list[int], repeats: int) -> float:
    """Seconds the hardware needs to move the same buckets: best of `repeats` after one warm-up."""
    import torch
    import torch.distributed as dist

    from dsrl.collectives import init_weight_update_group
    from dsrl.serving.servers import free_port

    if mode == "ipc":  # a device-to-device copy of the same bytes
        src = torch.empty(sum(sizes), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        del src, dst
        torch.cuda.empty_cache()
        return min(times[1:])
    backend = "nccl" if mode == "nccl" else "gloo"
    device = "cuda" if mode == "nccl" else "cpu"
    port = free_port()
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    cmd = [sys.executable, __file__, "--receiver", str(port), json.dumps(sizes), str(repeats), backend]
    peer = subprocess.Popen(cmd, env=env)
    group = init_weight_update_group("127.0.0.1", port, 0, 2, f"raw_{port}", backend, 300)
    buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    times = []
    for _ in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for buf in buffers:
            dist.broadcast(buf, group=group, group_src=0)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peer.wait(120)
    return min(times[1:])


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from dsrl.auto import make_plan, use_cuda
    from dsrl.config import Config, DataConfig, ModelConfig, RolloutConfig, SyncConfig
    from dsrl.lending import GpuLending
    from dsrl.serving.client import RolloutClient
    from dsrl.serving.fleet import start_fleet_for_ranks
    from dsrl.sync.verify import probe_reference, probe_servers
    from dsrl.sync.weight_sync import WeightSync, make_transport
    from dsrl.zero.buckets import param_bytes
    from dsrl.zero.engine import init_distributed, load_engine

    gpu = args.mode != "cpu"
    model_dir = Path(args.model_dir)
    workdir = Path(args.workdir)
    rollout = RolloutConfig(prompts_per_step=2, n_samples=2)
    if gpu:
        rollout.engine = "sglang"
        rollout.first_gpu = 1 if args.mode == "nccl" else args.server_gpu or 0
        rollout.placement = "colocate" if rollout.first_gpu == 0 else "disaggregate"
        rollout.mem_fraction_static = 0.35
        rollout.startup_timeout_s = 600
        rollout.server_args = {"attention_backend": "triton", "sampling_backend": "pytorch", "disable_cuda_graph": True}
    if args.pause:
        rollout.placement, rollout.interrupt, rollout.pause_mode = "disaggregate", "pause", args.pause
    cfg = Config(
        model=ModelConfig(path=str(model_dir)), data=DataConfig(train_path=str(ROOT / "examples/toy/train.jsonl"))
    )
    if args.server_urls:  # (tools/bench_cluster.py: servers on other nodes)
        rollout.fleet, rollout.server_urls = "external", json.loads(args.server_urls)
    cfg.rollout = rollout
    cfg.trainer.micro_batch_size = 2
    cfg.trainer.device = "cuda" if gpu else "cpu"
    init_distributed(use_cuda(cfg))
    rank = dist.get_rank()
    # train=True, as the actor in training: with an optimizer DeepSpeed keeps the parameter partitions in
    # one flat buffer, which a single rank sends from without a copy (FlatGatherer)
    actor = load_engine(
        cfg,
        str(model_dir),
        dist.get_world_size(),
        train=True,
        plan=make_plan(cfg, str(model_dir), dist.get_world_size()),
    )
    engine = "sglang" if gpu else "embedded"
    fleet = start_fleet_for_ranks(cfg.rollout, str(model_dir), workdir / model_dir.name, cfg.seed, engine, False)
    client = RolloutClient(fleet.urls)
    total = sum(param_bytes(p) for p in actor.module.parameters())
    rows = []
    kind = {"cpu": "broadcast", "ipc": "ipc", "nccl": "broadcast"}[args.mode]
    transport = make_transport(
        SyncConfig(type=kind, bucket_bytes=256 << 20), client, workdir, "nccl" if gpu else "gloo"
    )
    # The update as training runs it (heal, send, version check), without offloading the trainer's states:
    # the figure is the sync's own. Versions count up across bucket sizes.
    weights = WeightSync(cfg, actor, fleet, client, transport, GpuLending(cfg, client, [actor], cuda=gpu))
    version = 0
    try:
        for bucket_mb in args.bucket_mb:
            bucket_bytes = int(bucket_mb * (1 << 20)) if bucket_mb > 0 else total
            transport.cfg = cfg.sync = SyncConfig(type=kind, bucket_bytes=bucket_bytes)
            probe, probe_before = None, None
            if gpu:  # the mean |logprob diff| of the probe: before any sync, and after one
                ids, reference = probe_reference(actor, actor.module.config.vocab_size)
                probe_before = client.run(probe_servers(client, ids, reference, float("inf"))) if rank == 0 else None
            version += 1
            weights.update(version)  # forms the group, first-touch allocations
            if gpu:
                probe = client.run(probe_servers(client, ids, reference, float("inf"))) if rank == 0 else None
            times, phases = [], []
            for _ in range(args.repeats):
                version += 1
                dist.barrier()
                start = time.perf_counter()
                metrics = weights.update(version)
                dist.barrier()
                times.append(time.perf_counter() - start)
                phases.append(
                    {k.removeprefix("timing/sync_"): v for k, v in metrics.items() if k.startswith("timing/")}
                )
                if args.mode == "ipc":  # as in training: the buffers go back to the server after each sync
                    transport.release()
                    torch.cuda.empty_cache()
            if rank == 0:
                sizes = transport.gatherer.sizes  # the buckets as sent (one rank over IPC: one bucket, whatever asked)
                limit = raw_limit(args.mode, sizes, args.repeats)
                best = min(times)
                rows.append(
                    {
                        "model": model_dir.name,
                        "gb": total / 1e9,
                        "bucket_mb": bucket_mb or "whole",
                        "buckets": len(sizes),
                        "sync_ms": best * 1e3,
                        "sync_median_ms": statistics.median(times) * 1e3,
                        "limit_ms": limit * 1e3,
                        "fraction": limit / best,
                        "probe_diff": probe,
                        "probe_diff_before_sync": probe_before,
                        "phases_ms": {k: round(v * 1e3, 2) for k, v in phases[times.index(best)].items()},
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        client.close()
        fleet.stop()
    if rank == 0:
        with open(workdir / "results.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def main() -> None:
    args = parse_args()
    if args.receiver:
        port, sizes, repeats, backend = args.receiver
        receiver(int(port), json.loads(sizes), int(repeats), backend)
        return
    if "RANK" in os.environ:
        rank_main(args)
        return
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dsrl_bench_sync_"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "results.jsonl").unlink(missing_ok=True)
    from dsrl.serving.servers import free_port

    for name in args.models:
        if args.mode == "cpu":
            model_dir = make_cpu_model(workdir / name)
            env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
            launch = ["--num_accelerators", str(args.ranks)]
        else:
            from tools.gpu_models import build

            model_dir = build(workdir / name, name)
            env = dict(os.environ, NCCL_CUMEM_ENABLE="0", PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
            launch = ["--include", "localhost:0"]
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", *launch, "--master_port", str(free_port())]
        cmd += ["--no_local_rank", __file__, *sys.argv[1:], "--workdir", str(workdir), "--model-dir", str(model_dir)]
        if subprocess.call(cmd, env=env) != 0:
            print(f"bench for {name} failed", file=sys.stderr)
    rows = (
        [json.loads(line) for line in open(workdir / "results.jsonl")] if (workdir / "results.jsonl").exists() else []
    )
    gpu = args.mode != "cpu"
    limit_name = {"cpu": "raw gloo bcast", "ipc": "D2D copy", "nccl": "raw NCCL bcast"}[args.mode]
    print(f"\n{args.mode} sync | model | GB | bucket MB | buckets | sync ms (best/median) | {limit_name} ms | fraction")
    for r in rows:
        print(
            f"{args.mode} | {r['model']} | {r['gb']:.2f} | {r['bucket_mb']} | {r['buckets']} | "
            f"{r['sync_ms']:.1f} / {r['sync_median_ms']:.1f} | {r['limit_ms']:.1f} | {r['fraction']:.2f}"
        )
    for r in rows:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in r.get("phases_ms", {}).items())
        probe = f"probe |dlogp| before {r['probe_diff_before_sync']:.4f} after {r['probe_diff']:.4f}; " if gpu else ""
        print(f"{args.mode} phases ms | {r['model']} | {r['bucket_mb']} | {probe}{parts}")


if __name__ == "__main__":
    main()
