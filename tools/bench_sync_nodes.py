"""Benchmark the weight sync for links between nodes: trainer rank 0 sends everything (--sync.senders rank0), every
rank sends its own partition (all), or every rank sends only the words that changed (--sync.delta). For the toy
and a model of about 0.5B built from a config (Qwen2.5-0.5B's shape), on CPU: ZeRO-3 over gloo, embedded servers.

    python tools/bench_sync_nodes.py                 # one host: 2 trainer ranks, 2 embedded servers here
    python tools/bench_sync_nodes.py --hostfile HOSTS --ranks 1 --workdir /shared/bench \\
        --servers http://10.0.0.3:30000 http://10.0.0.4:30000
        # trainer ranks on the hostfile's nodes (--ranks per node), servers already running on theirs, each:
        #   dsrl serve --model-path /shared/bench/<model> --host 10.0.0.3 --dtype bfloat16 \\
        #       --custom-weight-loader dsrl.serving.shard_loader.load
        # (the model directories are written under --workdir first: run once with --prepare)

Between two rounds every rank changes --changed of its partition's elements in place (each by about two bf16 ulps),
as an optimizer step does, and each mode syncs them in turn (the host's load falls on each alike); each figure is
the median of --repeats rounds, timed on rank 0 around `WeightSync.update` (heal, send, the servers' loads, version
check). `MB` is what the trainer ranks put on the wire together, one copy
(a broadcast's fan-out to several servers is the network's); `x Gbit/s` is the share of one link of that rate those
bytes would fill in that time (with `all`, every trainer node's link carries its share of them). The toy's syncs are
verified bit for bit at the end (`--sync.verify weights`; the 0.5B's JSON of every weight would take minutes).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {"rank0": {"senders": "rank0"}, "all": {"senders": "all"}, "delta": {"senders": "all", "delta": True}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["toy", "0.5b"], choices=["toy", "0.5b"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--ranks", type=int, default=2, help="Trainer ranks (per node with --hostfile).")
    p.add_argument("--num-servers", type=int, default=2, help="Embedded servers started here (without --servers).")
    p.add_argument("--servers", nargs="*", default=[], help="URLs of running servers on other nodes.")
    p.add_argument("--hostfile", default=None, help="DeepSpeed hostfile: the trainer nodes.")
    p.add_argument("--changed", type=float, default=0.01, help="Fraction of each partition's elements changed a step.")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=256)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--link-gbit", nargs="+", type=float, default=[10, 100])
    p.add_argument("--workdir", default=None, help="Models and results (default: a temporary directory).")
    p.add_argument("--prepare", action="store_true", help="Write the models' directories and stop.")
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_model(out: Path, name: str) -> Path:
    """Random weights of the toy, or of Qwen2.5-0.5B's shape (in bf16), with the toy's tokenizer padded to fit."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dsrl.tasks.toy import build_model_config, build_tokenizer

    if (out / "config.json").is_file():
        return out
    if name == "toy":
        config = build_model_config()
    else:  # Qwen2.5-0.5B's shape: 494M parameters, the embedding tied
        config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512,
                             tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32 if name == "toy" else torch.bfloat16).save_pretrained(
        out
    )
    build_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def perturb(named, fraction: float, gen) -> None:
    """`fraction` of this rank's elements, each times 1 + 2**-6 (two bf16 ulps): in place, as an optimizer step."""
    import torch

    for _, p in named:
        part = p.ds_tensor.data.view(-1)
        hit = torch.rand(part.numel(), generator=gen) < fraction
        part[hit] *= 1 + 2**-6


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from dsrl.auto import make_plan, use_cuda
    from dsrl.config import Config, DataConfig, ModelConfig, RolloutConfig, SyncConfig
    from dsrl.lending import GpuLending
    from dsrl.serving.client import RolloutClient
    from dsrl.serving.fleet import start_fleet_for_ranks
    from dsrl.serving.shard_loader import LOADER
    from dsrl.sync.weight_sync import WeightSync, make_transport
    from dsrl.zero.buckets import param_bytes
    from dsrl.zero.engine import init_distributed, load_engine

    model_dir, workdir = Path(args.model_dir), Path(args.workdir)
    server_args = {"custom_weight_loader": [LOADER], "dtype": "bfloat16" if args.precision == "bf16" else "float32"}
    rollout = RolloutConfig(prompts_per_step=2, n_samples=2, num_servers=args.num_servers, server_urls=args.servers,
                            placement="disaggregate", server_args={} if args.servers else server_args)  # fmt: skip
    cfg = Config(model=ModelConfig(path=str(model_dir)),
                 data=DataConfig(train_path=str(ROOT / "examples/toy/train.jsonl")), rollout=rollout)  # fmt: skip
    cfg.trainer.micro_batch_size, cfg.trainer.precision = 2, args.precision
    init_distributed(use_cuda(cfg))
    rank = dist.get_rank()
    actor = load_engine(
        cfg,
        str(model_dir),
        dist.get_world_size(),
        train=False,
        plan=make_plan(cfg, str(model_dir), dist.get_world_size()),
    )
    named = list(actor.module.named_parameters())
    fleet = start_fleet_for_ranks(cfg.rollout, str(model_dir), workdir / model_dir.name, cfg.seed, "embedded",
                                  bool(args.hostfile))  # fmt: skip
    client = RolloutClient(fleet.urls)
    total, verify = sum(param_bytes(p) for _, p in named), "weights" if model_dir.name == "toy" else "off"
    gen, version, rows = torch.Generator().manual_seed(rank), 0, []
    syncs, samples = {}, {mode: [] for mode in args.modes}  # (seconds, bytes, changed words, parts) per sync
    try:
        cfg.sync = SyncConfig(type="broadcast", bucket_bytes=int(args.bucket_mb * (1 << 20)), verify=verify,
                              verify_every=10**6)  # fmt: skip
        cfg.trainer.total_steps = len(args.modes) * (args.repeats + 1)  # (the last update is verified, and each first)
        for mode in args.modes:  # the first update of each forms its groups; with --sync.delta it is full
            transport = make_transport(replace(cfg.sync, **MODES[mode]), client, workdir, "gloo")
            syncs[mode] = WeightSync(cfg, actor, fleet, client, transport, GpuLending(cfg, client, [actor]))
            version += 1
            syncs[mode].update(version)
        for _ in range(args.repeats):  # the modes in turn on the same weights: the host's load falls on each alike
            perturb(named, args.changed, gen)
            for mode, weights in syncs.items():
                version += 1
                dist.barrier()
                start = time.perf_counter()
                metrics = weights.update(version)
                parts = {k.removeprefix("timing/sync_"): v for k, v in metrics.items() if k.startswith("timing/")}
                samples[mode].append((time.perf_counter() - start, metrics["sync/bytes"],
                                      metrics.get("sync/changed_words_frac", 1.0), parts))  # fmt: skip
        for mode, runs in samples.items() if rank == 0 else []:
            seconds, nbytes, changed, parts = sorted(runs)[len(runs) // 2]  # the median sync
            row = {"model": model_dir.name, "mode": mode, "model_mb": total / 1e6, "mb": nbytes / 1e6,
                   "seconds": seconds, "changed": changed, "verified": verify == "weights",
                   "link": {str(g): nbytes * 8 / seconds / (g * 1e9) for g in args.link_gbit},
                   "parts": {k: round(v, 3) for k, v in parts.items()}}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        client.close()
        fleet.stop()
    if rank == 0:
        with open(workdir / "results.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return
    from dsrl.cli import launcher_command
    from dsrl.config import TrainerConfig
    from dsrl.serving.servers import free_port

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dsrl_bench_sync_nodes_"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "results.jsonl").unlink(missing_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if args.hostfile:  # what the ranks of other nodes need of it (DeepSpeed's pdsh launch passes only PYTHON*)
        from dsrl.nodes import env_file

        env["DS_ENV_FILE"] = str(env_file(workdir, env))
    for name in args.models:
        model_dir = make_model(workdir / name, name)
        if args.prepare:
            continue
        cmd = launcher_command(TrainerConfig(num_ranks=args.ranks, hostfile=args.hostfile), False, env, free_port())
        cmd += ["--no_local_rank", __file__, *sys.argv[1:], "--workdir", str(workdir), "--model-dir", str(model_dir)]
        if subprocess.call(cmd, env=env) != 0:
            print(f"bench for {name} failed", file=sys.stderr)
    results = workdir / "results.jsonl"
    rows = [json.loads(line) for line in open(results)] if results.exists() else []
    links = " | ".join(f"{g:g} Gbit/s" for g in args.link_gbit)
    print(f"\nmodel | model MB | mode | changed words | MB sent | seconds | {links}")
    for r in rows:
        shares = " | ".join(f"{v:.3f}" for v in r["link"].values())
        print(f"{r['model']} | {r['model_mb']:.1f} | {r['mode']} | {r['changed']:.4f} | {r['mb']:.3g} | "
              f"{r['seconds']:.3f} | {shares}")  # fmt: skip
    for r in rows:
        print(f"{r['model']} | {r['mode']} | seconds in the median sync (rank 0): {r['parts']}")
    print(
        f"(median of {args.repeats} syncs each; {args.changed:g} of the elements changed between syncs; "
        f"{args.precision}; toy verified bit for bit: {all(r['verified'] for r in rows if r['model'] == 'toy')})"
    )


if __name__ == "__main__":
    main()
