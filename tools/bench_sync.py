"""Benchmark the checkpoint engine's broadcast path against a raw torch.distributed.broadcast.

On CPU: 2 ZeRO-3 ranks over gloo and one embedded server; the sync path (pause -> flush ->
gather buckets -> broadcast -> server load -> continue -> version check) is timed end to end, and
in the same run trainer rank 0 broadcasts the same bucket sizes to a bare receiver process over
gloo. Prints both and their ratio.

    python tools/bench_sync.py                       # ~600 MB fp32 model, 256 MB buckets
    python tools/bench_sync.py --hidden 512 --layers 4 --bucket-mb 64
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--bucket-mb", type=float, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2, help="ZeRO-3 trainer ranks.")
    p.add_argument("--workdir", default=None, help="Where the model and logs go (default: a temporary directory).")
    p.add_argument("--receiver", nargs=3, metavar=("PORT", "SIZES_JSON", "REPEATS"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_model(workdir: Path, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dsrl.toy import build_tokenizer

    out = workdir / "model"
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


def receiver(port: int, sizes: list[int], repeats: int) -> None:
    """Rank 1 of a bare gloo group: receive the same buffers the sync path sends, nothing else."""
    import torch
    import torch.distributed as dist

    from dsrl.sync.group import init_weight_update_group

    group = init_weight_update_group("127.0.0.1", port, 1, 2, "raw", "gloo", 120)
    buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(repeats + 1):
        for buf in buffers:
            dist.broadcast(buf, group=group, group_src=0)


def rank_main(args, model_dir: Path, workdir: Path) -> None:
    import torch
    import torch.distributed as dist

    from dsrl.config import Config, DataConfig, ModelConfig, RolloutConfig, SyncConfig
    from dsrl.serving.client import RolloutClient
    from dsrl.serving.servers import free_port
    from dsrl.sync.base import make_checkpoint_engine, sync_weights
    from dsrl.sync.group import init_weight_update_group
    from dsrl.train import start_rollout_fleet
    from dsrl.zero.buckets import param_bytes, plan_buckets
    from dsrl.zero.engine import init_distributed, load_engine

    bucket_bytes = int(args.bucket_mb * (1 << 20))
    cfg = Config(
        model=ModelConfig(path=str(model_dir)),
        data=DataConfig(train_path=str(ROOT / "examples/toy/train.jsonl")),
        rollout=RolloutConfig(prompts_per_step=2, n_samples=2),
        sync=SyncConfig(bucket_bytes=bucket_bytes),
    )
    cfg.trainer.micro_batch_size = 2
    init_distributed(cfg)
    rank = dist.get_rank()
    actor = load_engine(cfg, str(model_dir), dist.get_world_size(), train=False)
    fleet = start_rollout_fleet(cfg, str(model_dir), workdir, rank)
    client = RolloutClient(fleet.urls) if rank == 0 else None
    engine = make_checkpoint_engine(cfg.sync, client, workdir, "gloo")
    try:
        sync_weights(actor.module, engine, "warmup")  # forms the group, first-touch allocations
        sync_times = []
        for i in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            stats = sync_weights(actor.module, engine, str(i))
            dist.barrier()
            sync_times.append(time.perf_counter() - start)
        if rank != 0:
            return
        named = list(actor.module.named_parameters())
        sizes = [sum(param_bytes(named[j][1]) for j in b) for b in plan_buckets(named, bucket_bytes)]
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        peer = subprocess.Popen(
            [sys.executable, __file__, "--receiver", str(port), json.dumps(sizes), str(args.repeats)], env=env
        )
        group = init_weight_update_group("127.0.0.1", port, 0, 2, "raw", "gloo", 120)
        buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        raw_times = []
        for i in range(args.repeats + 1):
            start = time.perf_counter()
            for buf in buffers:
                dist.broadcast(buf, group=group, group_src=0)
            if i:  # the first round warms up
                raw_times.append(time.perf_counter() - start)
        peer.wait(60)
        total = stats.bytes
        sync_s, raw_s = min(sync_times), min(raw_times)
        print(
            f"\nmodel {total / 1e6:.0f} MB fp32, {len(named)} tensors, bucket {args.bucket_mb:g} MB -> "
            f"{len(sizes)} buckets, {dist.get_world_size()} ZeRO-3 ranks (gloo), 1 embedded server\n"
            f"sync path   : {sync_s * 1e3:8.1f} ms  {total / sync_s / 1e9:6.2f} GB/s  (best of {args.repeats})\n"
            f"raw gloo bcast: {raw_s * 1e3:6.1f} ms  {total / raw_s / 1e9:6.2f} GB/s  (same bucket sizes)\n"
            f"ratio (sync / raw bandwidth): {raw_s / sync_s:.2f}   goal >= 0.8",
            flush=True,
        )
    finally:
        if client:
            client.close()
        fleet.stop()


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(ROOT))
    if args.receiver:
        port, sizes, repeats = args.receiver
        receiver(int(port), json.loads(sizes), int(repeats))
        return
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dsrl_bench_sync_"))
    if "RANK" in os.environ:
        rank_main(args, workdir / "model", workdir)
        return
    workdir.mkdir(parents=True, exist_ok=True)
    make_model(workdir, args.hidden, args.layers, args.vocab)
    from dsrl.serving.servers import free_port

    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_accelerators", str(args.ranks)]
    cmd += ["--master_port", str(free_port()), "--no_local_rank", __file__, *sys.argv[1:], "--workdir", str(workdir)]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
