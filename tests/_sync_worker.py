"""Run by test_sync.py under the deepspeed launcher (2 CPU ranks, and 1): real ZeRO-3, real embedded servers.

For each bucket size, new random weights go into the ZeRO-3 actor, `WeightSync.update` pushes them
and compares every server parameter with the trainer's gathered one. Then the update's sequence of
calls to the servers, per mode, and an update that fails on rank 0 only. Writes its findings as JSON.
"""

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from dsrl.auto import make_plan, use_cuda
from dsrl.config import Config, DataConfig, ModelConfig, RolloutConfig, SyncConfig
from dsrl.lending import GpuLending
from dsrl.serving.client import RolloutClient
from dsrl.serving.fleet import start_fleet_for_ranks
from dsrl.serving.shard_loader import LOADER
from dsrl.sync.base import SyncError
from dsrl.sync.verify import verify_weights
from dsrl.sync.weight_sync import WeightSync, make_transport
from dsrl.zero.buckets import FlatGatherer, gathered_buckets, param_bytes, plan_buckets
from dsrl.zero.engine import init_distributed, load_engine


def main(model_dir: str, train_path: str, out: str) -> None:
    cfg = Config(
        model=ModelConfig(path=model_dir),
        data=DataConfig(train_path=train_path),
        rollout=RolloutConfig(
            prompts_per_step=2, n_samples=2, num_servers=2, server_args={"custom_weight_loader": [LOADER]}
        ),
    )
    cfg.trainer.micro_batch_size = 2
    init_distributed(use_cuda(cfg))
    rank = dist.get_rank()
    actor = load_engine(
        cfg, model_dir, dist.get_world_size(), train=True, plan=make_plan(cfg, model_dir, dist.get_world_size())
    )
    run_dir = Path(out).parent
    fleet = start_fleet_for_ranks(cfg.rollout, model_dir, run_dir, cfg.seed, "embedded", multi_node=False)
    client = RecordingClient(fleet.urls)
    named = list(actor.module.named_parameters())
    embed_bytes = param_bytes(named[0][1])
    results = {"world": dist.get_world_size(), "num_params": len(named), "embed_bytes": embed_bytes, "cases": []}
    try:
        cases = [("broadcast", 1), ("broadcast", embed_bytes), ("broadcast", 1 << 30), ("disk", 4096)]
        cases += [("all", 1), ("all", embed_bytes), ("all", 1 << 30)]  # --sync.senders all: every rank its partition
        for version, (kind, bucket_bytes) in enumerate(cases, start=1):
            senders, kind = ("all", "broadcast") if kind == "all" else ("rank0", kind)
            cfg.sync = SyncConfig(
                type=kind, bucket_bytes=bucket_bytes, verify="weights", senders=senders
            )  # raises on a difference
            transport = make_transport(cfg.sync, client, run_dir, "gloo")
            with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=0):
                if rank == 0:
                    torch.manual_seed(version)
                    for _, p in named:
                        p.data.normal_()
            metrics = WeightSync(
                cfg, actor, fleet, client, transport, GpuLending(cfg, client, [actor], actor.plan)
            ).update(version)
            if rank == 0:
                buckets = plan_buckets(named, bucket_bytes)
                results["cases"].append(
                    {
                        "transport": kind if senders == "rank0" else "all",
                        "bucket_bytes": bucket_bytes,
                        "buckets": len(buckets),
                        "bytes": metrics["sync/bytes"],
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
            verify_weights(actor.module, client, 1 << 30, rank == 0)
            results["corrupt_detected"] = None
        except SyncError as e:
            results["corrupt_detected"] = str(e)
        results["model_bytes"] = sum(param_bytes(p) for _, p in named)
        results["delta"] = delta_syncs(cfg, actor, fleet, client, run_dir, 200 if dist.get_world_size() > 1 else 20)
        results["sequences"] = update_sequences(cfg, actor, fleet, client, run_dir)
        results["failure_on_rank0"] = failure_on_rank0(cfg, actor, fleet, client, run_dir)
        recompute = replace(cfg, trainer=replace(cfg.trainer, old_logprobs="recompute"))
        results["gradient"] = gradient_against_one_rank(recompute, actor)
        results["non_finite_update"] = non_finite_update(cfg, actor)
        results["gradient_fused"] = gradient_against_one_rank(cfg, actor)  # (after the skipped step: nothing left)
        checkpointed = replace(cfg, model=replace(cfg.model, gradient_checkpointing=True))
        engine = load_engine(
            checkpointed,
            model_dir,
            dist.get_world_size(),
            train=True,
            plan=make_plan(checkpointed, model_dir, dist.get_world_size()),
        )
        results["gradient_checkpointed"] = gradient_against_one_rank(checkpointed, engine)
    finally:
        client.close()
        fleet.stop()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()  # every group: gloo's threads left to the exit can abort a rank (_lora_worker.py)


class RecordingClient(RolloutClient):
    """The real client, keeping the path of every call it makes to a server (rank 0 makes them all)."""

    def __init__(self, urls: list[str]):
        super().__init__(urls)
        self.calls: list[str] = []

    async def request(self, url, path, payload=None, method="POST", timeout_s=None):
        self.calls.append(path if path != "/resume_memory_occupation" else f"{path} {payload['tags']}")
        return await super().request(url, path, payload, method, timeout_s)

    def take_calls(self) -> list[str]:
        """The calls since the last take, consecutive repeats (one per server, per bucket) collapsed."""
        calls, self.calls = self.calls, []
        return [c for i, c in enumerate(calls) if i == 0 or c != calls[i - 1]]


def update_sequences(cfg: Config, actor, fleet, client: RecordingClient, run_dir: Path) -> dict[str, list[str]]:
    """The calls one update makes to the servers, in order, per mode (probe verification on)."""
    modes = {
        "colocate": {"placement": "colocate"},
        "disaggregate": {"placement": "disaggregate"},
        "pause": {"placement": "disaggregate", "interrupt": "pause", "pause_mode": "retract"},
    }
    cfg.sync = SyncConfig(type="broadcast", bucket_bytes=256 << 20, verify="probe", probe_tolerance=1e-4)
    transport = make_transport(cfg.sync, client, run_dir, "gloo")
    out = {}
    for version, (mode, fields) in enumerate(modes.items(), start=10):
        cfg.rollout = replace(cfg.rollout, **fields)
        plan = replace(actor.plan, colocated=mode == "colocate")
        weights = WeightSync(cfg, actor, fleet, client, transport, GpuLending(cfg, client, [actor], plan))
        client.take_calls()
        if mode == "colocate":
            weights.await_probe()  # the servers slept while the trainer stepped
            weights.gpu.to_trainers()
        weights.update(version)
        weights.check_probe()  # disaggregated, the probe runs in the background: wait for it
        out[mode] = client.take_calls()
    return out


def delta_syncs(cfg: Config, actor, fleet, client: RecordingClient, run_dir: Path, syncs: int = 200) -> dict:
    """--sync.delta: `syncs` updates, each after a few words of every rank's partition changed in place (none at
    some, all at one), then the servers' weights compared with the trainer's bit for bit. Then a server's weights are
    corrupted in place (a tensor loaded from disk behind the trainer's back) before a delta, whose checksum fails
    (one line, then everything in full), and before a full sync; each is compared after."""
    cfg.rollout = replace(cfg.rollout, placement="disaggregate", interrupt="partial")
    cfg.trainer.total_steps = 999 + syncs  # (the last update is always verified)
    named, lines = list(actor.module.named_parameters()), []
    # Five buckets of the toy (300 kB in all); a delta sent in full every 1000 versions, i.e. never here
    cfg.sync = SyncConfig(type="broadcast", bucket_bytes=80 << 10, delta=True, delta_full_every=1000, verify="weights",
                          verify_every=syncs)  # fmt: skip
    weights = WeightSync(cfg, actor, fleet, client, make_transport(cfg.sync, client, run_dir, "gloo"),
                         GpuLending(cfg, client, [actor], actor.plan))  # fmt: skip
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("dsrl.sync.shards").addHandler(handler)
    gen = torch.Generator().manual_seed(dist.get_rank())
    out = {"delta": [], "changed": [], "bytes": [], "buckets": len(plan_buckets(named, cfg.sync.bucket_bytes))}

    def perturb(fraction: float) -> None:  # this rank's own partition, in place, as an optimizer step would
        for _, p in named:
            part = p.ds_tensor.data.view(-1)
            hit = torch.rand(part.numel(), generator=gen) < fraction
            part[hit] += torch.randn(int(hit.sum()), generator=gen) * 1e-3

    for version in range(1000, 1000 + syncs):
        perturb(0.0 if version % 10 == 3 else 1.0 if version == 1100 else 0.01)
        metrics = weights.update(version)  # the first in full; weights verified at the first and the last
        out["delta"].append(metrics["sync/delta"])
        out["changed"].append(metrics.get("sync/changed_words_frac"))
        out["bytes"].append(metrics["sync/bytes"])
    out["full_bytes"] = out["bytes"][0]
    for case, version in (("corrupt_then_delta", 1000 + syncs), ("corrupt_then_full", 1001 + syncs)):
        if dist.get_rank() == 0:
            bad = {named[3][0]: torch.full(tuple(named[3][1].ds_shape), 0.5)}
            save_file(bad, run_dir / "bad" / "model.safetensors")
            client.run(
                client.request(client.urls[1], "/update_weights_from_disk", {"model_path": str(run_dir / "bad")})
            )
        if case == "corrupt_then_full":
            weights.transport.reset([0, 1])  # (as a change of the fleet does)
        perturb(0.01)
        lines.clear()
        cfg.sync.verify_every = 1
        metrics = weights.update(version)  # verify="weights" raises on any difference
        out[case] = {"delta": metrics["sync/delta"], "checksum_failed": metrics["sync/delta_checksum_failed"],
                     "lines": list(lines)}  # fmt: skip
    logging.getLogger("dsrl.sync.shards").removeHandler(handler)
    return out


def failure_on_rank0(cfg: Config, actor, fleet, client: RecordingClient, run_dir: Path) -> str:
    """Servers that refuse the update (their weights released behind dsrl's back) fail it on rank 0;
    every rank must raise, after the retries, rather than go on alone."""
    cfg.rollout = replace(cfg.rollout, placement="disaggregate", interrupt="partial")
    cfg.sync = SyncConfig(type="broadcast", bucket_bytes=256 << 20, timeout_s=30)
    transport = make_transport(cfg.sync, client, run_dir, "gloo")
    if dist.get_rank() == 0:
        client.call_all("/release_memory_occupation", {"tags": ["weights"]})
    try:
        WeightSync(cfg, actor, fleet, client, transport, GpuLending(cfg, client, [actor], actor.plan)).update(99)
        outcome = "no error"
    except SyncError as e:
        outcome = f"SyncError: {e}"
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    if dist.get_rank() == 0:
        client.call_all("/resume_memory_occupation", {"tags": ["weights"]})
    return outcomes


def gradient_against_one_rank(cfg: Config, actor) -> dict:
    """The ZeRO-3 gradient of the token_mean PPO loss, the batch split over the ranks with unequal token
    totals (rank 0: 3 response tokens, rank 1: 16), against plain torch's gradient of the whole batch on
    one process. Each rank dividing by its own token count gave the mean of per-rank means instead.
    The loss runs as `run_updates` runs it, the engine in training mode; `layer_forwards` counts the first
    decoder layer's forward passes then (with gradient checkpointing, twice per micro-batch). The old logprobs
    come from a pass before (trainer.old_logprobs recompute) or from the update's own (auto: `old_max_abs_diff`
    is how far those it kept are from a pass's)."""
    from transformers import AutoModelForCausalLM

    from dsrl.data import Prompt, Sample
    from dsrl.zero.actor import compute_logprobs, global_denominators, micro_batch_loss, trainer_micro_batches
    from dsrl.zero.batches import MicroBatch

    lengths, advantages = [1, 2, 7, 9], torch.tensor([1.0, -0.5, 0.3, -1.2])
    batch = [
        Sample(Prompt(i, [5, 6 + i, 12], "", None), [(3 + i + j) % 12 + 2 for j in range(n)], [0.0] * n, "stop", 0)
        for i, n in enumerate(lengths)
    ]
    rank, world = dist.get_rank(), dist.get_world_size()
    named = list(actor.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=0):
        if rank == 0:  # weights at the scale of a real init (the sync cases left std 1): fp32 noise stays ~1e-8
            torch.manual_seed(0)
            for _, p in named:
                p.data.normal_(std=0.05)
    for s, a in zip(batch, advantages):
        s.advantages = torch.full((len(s.response_ids),), float(a))
    per_rank = len(batch) // world
    mine = batch[rank * per_rank : (rank + 1) * per_rank]
    # A budget of 12 tokens: rank 0's two samples (4 + 5 tokens) fit one micro-batch, rank 1's (10 + 12) need
    # two, so rank 0 splits its one to match: packed micro-batches of unequal counts, agreed over the ranks.
    cfg.trainer.max_tokens_per_micro_batch = 12
    if cfg.trainer.old_logprobs == "recompute":  # ratio 1 either way: the loss's gradient is -A grad(logp) / N
        compute_logprobs(actor, mine, "old_logprobs", cfg, pad_id=0)
    num_tokens, num_seqs = global_denominators(mine)
    chunks = trainer_micro_batches(actor, mine, cfg)
    forwards = []
    hook = actor.module.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: forwards.append(1))
    actor.train()
    for i, chunk in enumerate(chunks):
        actor.set_gradient_accumulation_boundary(i == len(chunks) - 1)
        mb = MicroBatch.build(chunk, 0, actor.device, packed=True)
        loss, _, _ = micro_batch_loss(actor, mb, cfg, num_tokens, num_seqs, 0.0, actor.plan.old_from_update)
        actor.backward(loss, scale_wrt_gas=False)
        if i + 1 < len(chunks):
            actor.step()  # not at the boundary: counts the micro-step; the optimizer runs at the last one
    actor.eval()
    hook.remove()
    from_update = [s.old_logprobs for s in mine]
    compute_logprobs(actor, mine, "old_logprobs", cfg, pad_id=0)  # (a pass of its own, after the update)
    old_diff = max((a - s.old_logprobs).abs().max().item() for a, s in zip(from_update, mine))
    grads = {name: deepspeed.utils.safe_get_full_grad(p) for name, p in named}  # every rank gathers
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
        weights = {name: p.detach().clone() for name, p in named}
    if rank != 0:
        return {}
    model = AutoModelForCausalLM.from_config(actor.module.config)
    model.load_state_dict(weights, strict=False)  # the tied lm_head follows the embedding
    seqs = [b.prompt.prompt_ids + b.response_ids for b in batch]  # right-padded rows, as the trainer once did
    width = max(map(len, seqs))
    ids, attention, mask = (
        torch.zeros(len(seqs), width, dtype=torch.long),
        torch.zeros(len(seqs), width),
        torch.zeros(len(seqs), width - 1),
    )
    for i, (b, seq) in enumerate(zip(batch, seqs)):
        ids[i, : len(seq)], attention[i, : len(seq)] = torch.tensor(seq), 1
        mask[i, len(b.prompt.prompt_ids) - 1 : len(seq) - 1] = 1
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    (-(advantages[:, None] * torch.exp(logp - logp.detach()) * mask).sum() / mask.sum()).backward()
    diff = max((grads[name] - p.grad).abs().max().item() for name, p in model.named_parameters() if name in grads)
    return {"max_abs_diff": diff, "max_abs_grad": max(g.abs().max().item() for g in grads.values()),
            "micro_batches": len(chunks), "layer_forwards": len(forwards), "old_max_abs_diff": old_diff}  # fmt: skip


def non_finite_update(cfg: Config, actor) -> dict:
    """`update_actor` on a batch with one sample's advantages NaN (on rank 0 alone): the loss and the gradients
    are NaN there, the global gradient norm on every rank, and DeepSpeed skips the optimizer step on all."""
    from dsrl.data import Prompt, Sample
    from dsrl.zero.actor import update_actor

    rank, world = dist.get_rank(), dist.get_world_size()
    batch = [Sample(Prompt(i, [5, 6 + i, 12], "", None), [3 + i, 4, 5], [0.0] * 3, "stop", 0) for i in range(4)]
    for i, s in enumerate(batch):
        s.advantages = torch.full((3,), float("nan") if i == 0 else 1.0)
    mine = batch[rank * len(batch) // world : (rank + 1) * len(batch) // world]
    named = list(actor.module.named_parameters())

    def weights():
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return [p.detach().clone() for _, p in named]

    before = weights()
    stats = update_actor(actor, mine, cfg, pad_id=0, kl_coef=0.0)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, weights()))
    return {"steps_skipped": stats["actor/steps_skipped"], "unchanged": unchanged}


def gather_to_all_padded(cfg: Config, run_dir: Path) -> dict:
    """The same check on a model whose tensor sizes are odd: with 2 ranks the last partition of most
    tensors is padded, which the all-rank gather handles apart (gathered aside, then copied)."""
    from transformers import AutoModelForCausalLM

    from dsrl.tasks.toy import build_model_config, build_tokenizer

    odd = run_dir / "odd_model"
    if dist.get_rank() == 0:
        config = build_model_config()
        config.update({"hidden_size": 45, "intermediate_size": 99, "num_attention_heads": 5, "num_key_value_heads": 1})
        AutoModelForCausalLM.from_config(config).save_pretrained(odd)
        build_tokenizer().save_pretrained(odd)
    dist.barrier()
    actor = load_engine(
        cfg, str(odd), dist.get_world_size(), train=False, plan=make_plan(cfg, str(odd), dist.get_world_size())
    )
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
