"""Run by test_sync.py under the deepspeed launcher (2 CPU ranks, and 1): real ZeRO-3, real embedded server.

For each bucket size, new random weights go into the ZeRO-3 actor, a sync pushes them, and every
server parameter is compared with the trainer's gathered one. Writes its findings as JSON.
"""

import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from dsrl.config import Config, DataConfig, ModelConfig, RolloutConfig, SyncConfig
from dsrl.serving.client import RolloutClient
from dsrl.sync.base import SyncError, make_checkpoint_engine, sync_weights, verify_weights
from dsrl.train import start_rollout_fleet
from dsrl.zero.buckets import FlatGatherer, gathered_buckets, param_bytes, plan_buckets
from dsrl.zero.engine import init_distributed, load_engine


def main(model_dir: str, train_path: str, out: str) -> None:
    cfg = Config(
        model=ModelConfig(path=model_dir),
        data=DataConfig(train_path=train_path),
        rollout=RolloutConfig(prompts_per_step=2, n_samples=2, num_servers=2),
    )
    cfg.trainer.micro_batch_size = 2
    init_distributed(cfg)
    rank = dist.get_rank()
    actor = load_engine(cfg, model_dir, dist.get_world_size(), train=True)
    run_dir = Path(out).parent
    fleet = start_rollout_fleet(cfg, model_dir, run_dir, rank)
    client = RolloutClient(fleet.urls) if rank == 0 else None
    named = list(actor.module.named_parameters())
    embed_bytes = param_bytes(named[0][1])
    results = {"world": dist.get_world_size(), "num_params": len(named), "embed_bytes": embed_bytes, "cases": []}
    try:
        cases = [("broadcast", 1), ("broadcast", embed_bytes), ("broadcast", 1 << 30), ("disk", 4096)]
        for version, (transport, bucket_bytes) in enumerate(cases, start=1):
            sync_cfg = SyncConfig(type=transport, bucket_bytes=bucket_bytes)
            engine = make_checkpoint_engine(sync_cfg, client, run_dir, "gloo")
            with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=0):
                if rank == 0:
                    torch.manual_seed(version)
                    for _, p in named:
                        p.data.normal_()
            stats = sync_weights(actor.module, engine, str(version))
            verify_weights(actor.module, client, bucket_bytes)  # raises on any difference
            if rank == 0:
                buckets = plan_buckets(named, bucket_bytes)
                results["cases"].append(
                    {
                        "transport": transport,
                        "bucket_bytes": bucket_bytes,
                        "buckets": len(buckets),
                        "bytes": stats.bytes,
                        "versions": client.weight_versions(),
                    }
                )
        # The IPC transport's gather: every rank gets each bucket whole, byte for byte as GatheredParameters has it.
        # With one rank every bucket is a view of DeepSpeed's own parameter memory (nothing copied).
        results["flat_to_all"], results["zero_copy"] = {}, True
        params_storage = named[0][1].ds_tensor.untyped_storage().data_ptr()
        for bucket_bytes in (1, embed_bytes, 1 << 30):
            gatherer = FlatGatherer(actor.module, bucket_bytes, to_all=True)
            equal = True
            for flat, want in zip(gatherer, gathered_buckets(actor.module, bucket_bytes)):
                expect = torch.cat([t.detach().reshape(-1).view(torch.uint8) for _, t in want])
                equal &= flat.names == [n for n, _ in want] and torch.equal(flat.flat, expect)
                results["zero_copy"] &= flat.flat.untyped_storage().data_ptr() == params_storage
            ok = torch.tensor([int(equal)])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            results["flat_to_all"][str(bucket_bytes)] = bool(ok.item())
        results["flat_to_all_padded"] = gather_to_all_padded(cfg, run_dir)
        # A server holding one different tensor must fail verification, naming it.
        if rank == 0:
            bad = {named[3][0]: torch.zeros(tuple(named[3][1].ds_shape))}
            (run_dir / "bad").mkdir()
            save_file(bad, run_dir / "bad" / "model.safetensors")
            client.run(
                client.request(client.urls[1], "/update_weights_from_disk", {"model_path": str(run_dir / "bad")})
            )
        try:
            verify_weights(actor.module, client, 1 << 30)
            results["corrupt_detected"] = None
        except SyncError as e:
            results["corrupt_detected"] = str(e)
        results["model_bytes"] = sum(param_bytes(p) for _, p in named)
    finally:
        if client:
            client.close()
        fleet.stop()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def gather_to_all_padded(cfg: Config, run_dir: Path) -> dict:
    """The same check on a model whose tensor sizes are odd: with 2 ranks the last partition of most
    tensors is padded, which the all-rank gather handles apart (gathered aside, then copied)."""
    from transformers import AutoModelForCausalLM

    from dsrl.toy import build_model_config, build_tokenizer

    odd = run_dir / "odd_model"
    if dist.get_rank() == 0:
        config = build_model_config()
        config.update({"hidden_size": 45, "intermediate_size": 99, "num_attention_heads": 5, "num_key_value_heads": 1})
        AutoModelForCausalLM.from_config(config).save_pretrained(odd)
        build_tokenizer().save_pretrained(odd)
    dist.barrier()
    actor = load_engine(cfg, str(odd), dist.get_world_size(), train=False)
    named = list(actor.module.named_parameters())
    padded = sum(p.ds_tensor.numel() * dist.get_world_size() != p.ds_numel for _, p in named)
    out = {"padded_tensors": padded}
    for bucket_bytes in (1, 1 << 30):
        equal = True
        for flat, want in zip(
            FlatGatherer(actor.module, bucket_bytes, to_all=True), gathered_buckets(actor.module, bucket_bytes)
        ):
            expect = torch.cat([t.detach().reshape(-1).view(torch.uint8) for _, t in want])
            equal &= torch.equal(flat.flat, expect)
        ok = torch.tensor([int(equal)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        out[str(bucket_bytes)] = bool(ok.item())
    return out


if __name__ == "__main__":
    main(*sys.argv[1:4])
