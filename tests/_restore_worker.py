"""Run by test_parity.py under the deepspeed launcher (2 CPU ranks): corrupt a server's weights, then sync.

For each transport and mode the CPU runs (broadcast over gloo, disk, LoRA merged and served as an adapter, FP8 servers
over broadcast and disk, a mixture of experts), the trainer's weights are first made new (seeded noise), then every
weight a real embedded server holds (each name of the checkpoint it started from) is overwritten in place with random
values (SGLang's /update_weights_from_disk), and the next `WeightSync.update` must bring them back (with --sync.verify
weights it raises on a parameter that differs, but only among those the trainer sends: the names here are the
server's own). Writes, per case, what was seen as JSON (rank 0)."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from dsrl.auto import make_plan, use_cuda
from dsrl.config import Config, DataConfig, ModelConfig, RolloutConfig, SyncConfig
from dsrl.fp8 import KV_SCALES, SCALE, dequantize, is_quantized, quantize, servers_model_dir
from dsrl.lending import GpuLending
from dsrl.serving.client import RolloutClient
from dsrl.serving.fleet import start_fleet_for_ranks
from dsrl.sync.base import SyncError
from dsrl.sync.verify import probe_reference, probe_servers
from dsrl.sync.weight_sync import WeightSync, make_transport
from dsrl.zero.buckets import gathered_buckets
from dsrl.zero.engine import init_distributed, load_engine
from dsrl.zero.lora import target_modules


def renew(engine, seed: int, trained_only: bool = False) -> None:
    """The trainer's weights (or the trained ones only) replaced by seeded noise at the scale of an init (LoRA's B too:
    not 0)."""
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad or not trained_only]
    with deepspeed.zero.GatheredParameters([p for _, p in named if hasattr(p, "ds_id")], modifier_rank=0):
        if dist.get_rank() == 0 or not all(hasattr(p, "ds_id") for _, p in named):
            gen = torch.Generator().manual_seed(seed)
            for _, p in named:
                p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def served(engine, fp8: bool, merge: bool = True) -> dict[str, torch.Tensor]:
    """What the servers should hold after a sync (every rank joins the gathers)."""
    return {n: t.detach().clone() for bucket in gathered_buckets(engine.module, 1 << 30, merge, fp8) for n, t in bucket}


def checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint a server started from, by name: every weight it holds (FP8: with the scales)."""
    return {n: t for f in sorted(Path(model_dir).glob("*.safetensors")) for n, t in load_file(f).items()}


def corrupt(client: RolloutClient, held: dict[str, torch.Tensor], where: Path) -> None:
    """(rank 0) Every server's weights under `held`'s names overwritten in place: random values, of each one's dtype."""
    gen = torch.Generator().manual_seed(99)
    where.mkdir(parents=True)
    save_file(
        {n: (torch.randn(t.shape, generator=gen) + 3).to(t.dtype) for n, t in held.items()}, where / "bad.safetensors"
    )
    client.call_all("/update_weights_from_disk", {"model_path": str(where)})


def server_weights(client: RolloutClient, names: list[str]) -> dict[str, torch.Tensor]:
    """(rank 0) The first server's parameters, whole (the embedded engine's /get_weights_by_name)."""
    out = {}
    for name in names:
        rows = client.call_all("/get_weights_by_name", {"name": name, "truncate_size": 1 << 30})[0]
        out[name] = torch.tensor(rows, dtype=torch.float32)
    return out


def differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, t in got.items() if n not in want or not torch.equal(t, want[n].float())]


def restore(cfg: Config, engine, fleet, client, run_dir: Path, version: int, held: dict, fp8: bool = False) -> dict:
    """One case: `engine`'s weights made new, the server's corrupted (`held`), one sync under `cfg.sync`; the first
    server's parameters then against the trainer's (FP8 servers: through FP8 and back where quantized)."""
    rank0 = dist.get_rank() == 0
    renew(engine, version)
    trainer = served(engine, fp8=False)
    want = {n: dequantize(*quantize(t)) if fp8 and is_quantized(n, t) else t for n, t in trainer.items()}
    names = [n for n in held if not n.endswith((SCALE, *KV_SCALES))]
    case = {"params": len(names), "unsent": sorted(set(names) - set(want))}
    if rank0:
        corrupt(client, held, run_dir / f"bad_{version}")
        case["corrupted"] = len(differing(server_weights(client, names), want))
    case["error"] = sync(cfg, engine, fleet, client, run_dir, version, fp8)
    if rank0:
        got = server_weights(client, names)
        case["differ"] = differing(got, want)
        quantized = [n for n in names if fp8 and n in trainer and is_quantized(n, trainer[n])]
        case["quantized"] = len(quantized)
        errors = [(got[n] - trainer[n]).norm().item() / trainer[n].norm().item() for n in quantized]
        case["fp8_rel_error"] = max(errors, default=None)
    return case


def sync(cfg: Config, actor, fleet, client, run_dir: Path, version: int, fp8: bool = False) -> str | None:
    """One `WeightSync.update` under `cfg.sync`; the error it raised, if any."""
    transport = make_transport(cfg.sync, client, run_dir / cfg.sync.type, "gloo", fp8=fp8)
    try:
        WeightSync(cfg, actor, fleet, client, transport, GpuLending(cfg, client, [actor], actor.plan)).update(version)
    except SyncError as e:
        return f"{e}: {e.__cause__ or ''}"
    return None


def dense_cases(cfg: Config, model_dir: str, run_dir: Path, out: dict) -> None:
    """Broadcast and disk, the full model; LoRA merged, then served as an adapter."""
    world = dist.get_world_size()
    lora_cfg = replace(cfg, model=replace(cfg.model, lora_rank=4))
    lora = load_engine(lora_cfg, model_dir, world, train=True, plan=make_plan(lora_cfg, model_dir, world))
    servers = {"enable_lora": True, "max_lora_rank": 4, "lora_target_modules": target_modules(lora.module)}
    cfg = replace(cfg, rollout=replace(cfg.rollout, server_args=servers))
    fleet = start_fleet_for_ranks(cfg.rollout, model_dir, run_dir, cfg.seed, "embedded", multi_node=False)
    client = RolloutClient(fleet.urls)
    actor = load_engine(cfg, model_dir, world, train=True, plan=make_plan(cfg, model_dir, world))
    held = checkpoint(model_dir)
    try:
        for version, (name, engine, sync_cfg) in enumerate([
            ("broadcast", actor, SyncConfig(type="broadcast", verify="weights", bucket_bytes=64 << 10)),
            ("disk", actor, SyncConfig(type="disk", verify="weights", bucket_bytes=64 << 10)),
            ("lora_merged", lora, SyncConfig(type="broadcast", verify="weights", lora="merged", bucket_bytes=1 << 20)),
        ], start=1):  # fmt: skip
            out[name] = restore(replace(cfg, sync=sync_cfg), engine, fleet, client, run_dir, version, held)
        out["lora_adapter"] = adapter_case(replace(lora_cfg, rollout=cfg.rollout), lora, fleet, client, run_dir)
    finally:
        client.close()
        fleet.stop()


def adapter_case(cfg: Config, lora, fleet, client: RolloutClient, run_dir: Path) -> dict:
    """LoRA served as an adapter: the base goes once, then a new adapter per version (`dsrl.sync.adapter`). The served
    adapter is replaced in place by a random one under its name; the next sync must serve the trainer's. A base that
    changes behind dsrl's back is not sent again (only a fleet change sends it): verification must name it."""
    rank0 = dist.get_rank() == 0
    cfg = replace(cfg, sync=SyncConfig(type="broadcast", verify="weights", lora="adapter", bucket_bytes=1 << 20))
    transport = make_transport(cfg.sync, client, run_dir / "adapter", "gloo")
    weights = WeightSync(cfg, lora, fleet, client, transport, GpuLending(cfg, client, [lora], lora.plan))
    renew(lora, 10)
    weights.update(10)
    base = served(lora, fp8=False, merge=False)
    case = {}

    def probe() -> float | None:
        ids, reference = probe_reference(lora, lora.module.config.vocab_size)
        return client.run(probe_servers(client, ids, reference, 1e9)) if rank0 else None

    if rank0:  # a random adapter served under the current one's name
        name, path = client.adapter.name, transport.root / client.adapter.name
        bad = run_dir / "bad_adapter"
        bad.mkdir()
        (bad / "adapter_config.json").write_text((path / "adapter_config.json").read_text())
        gen = torch.Generator().manual_seed(5)
        tensors = load_file(path / "adapter_model.safetensors")
        save_file(
            {k: torch.randn(v.shape, generator=gen) for k, v in tensors.items()}, bad / "adapter_model.safetensors"
        )
        client.call_all("/unload_lora_adapter", {"lora_name": name})
        client.call_all("/load_lora_adapter", {"lora_name": name, "lora_path": str(bad)})
    case["probe_corrupted"] = probe()
    renew(lora, 11, trained_only=True)  # (a step trains the adapter alone)
    weights.update(11)
    case["probe_restored"] = probe()
    case["base_differ"] = differing(server_weights(client, list(base)), base) if rank0 else None
    if rank0:
        corrupt(client, {n: base[n] for n in list(base)[:2]}, run_dir / "bad_base")
    try:
        weights.update(12)
        case["base_corrupted_error"] = None
    except SyncError as e:
        case["base_corrupted_error"] = str(e)
    return case


def fp8_case(cfg: Config, model_dir: str, run_dir: Path, out: dict) -> None:
    """FP8 servers (their linear layers dequantized on arrival, `dsrl.fp8`), over broadcast and disk: after the sync a
    quantized weight is exactly the trainer's through FP8 and back, every other one the trainer's."""
    world = dist.get_world_size()
    cfg = replace(cfg, rollout=replace(cfg.rollout, precision="fp8"))
    fp8_dir = servers_model_dir(cfg, model_dir, run_dir)
    fleet = start_fleet_for_ranks(cfg.rollout, fp8_dir, run_dir, cfg.seed, "embedded", multi_node=False)
    client = RolloutClient(fleet.urls)
    actor = load_engine(cfg, model_dir, world, train=True, plan=make_plan(cfg, model_dir, world))
    held = checkpoint(fp8_dir)
    try:
        for version, kind in enumerate(("broadcast", "disk"), start=20):
            sync_cfg = SyncConfig(type=kind, verify="off", bucket_bytes=64 << 10)  # (weights: never equal, FP8)
            out[f"fp8_{kind}"] = restore(
                replace(cfg, sync=sync_cfg), actor, fleet, client, run_dir, version, held, True
            )
    finally:
        client.close()
        fleet.stop()


def moe_case(cfg: Config, moe_dir: str, run_dir: Path, out: dict) -> None:
    """A mixture of experts over broadcast: its experts go as the checkpoint's per-expert tensors."""
    world = dist.get_world_size()
    cfg = replace(cfg, model=replace(cfg.model, path=moe_dir))
    fleet = start_fleet_for_ranks(cfg.rollout, moe_dir, run_dir / "moe", cfg.seed, "embedded", multi_node=False)
    client = RolloutClient(fleet.urls)
    actor = load_engine(cfg, moe_dir, world, train=True, plan=make_plan(cfg, moe_dir, world))
    try:
        sync_cfg = SyncConfig(type="broadcast", verify="weights", bucket_bytes=256 << 10)
        out["moe"] = restore(replace(cfg, sync=sync_cfg), actor, fleet, client, run_dir, 30, checkpoint(moe_dir))
        out["moe"]["experts"] = sum(".experts." in n for n in checkpoint(moe_dir))
    finally:
        client.close()
        fleet.stop()


def main(model_dir: str, moe_dir: str, out: str) -> None:
    cfg = Config(
        model=ModelConfig(path=model_dir),
        data=DataConfig(train_path="unused"),
        rollout=RolloutConfig(prompts_per_step=2, n_samples=2, num_servers=1, placement="disaggregate"),
    )
    init_distributed(use_cuda(cfg))
    run_dir, results = Path(out).parent, {"world": dist.get_world_size()}
    dense_cases(cfg, model_dir, run_dir / "dense", results)
    fp8_case(cfg, model_dir, run_dir / "fp8", results)
    moe_case(cfg, moe_dir, run_dir, results)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()  # (joins gloo's threads: _lora_worker.py)


if __name__ == "__main__":
    main(*sys.argv[1:])
