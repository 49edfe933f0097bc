"""The training loop, one rank of it: ``deepspeed --module dsrl.train --config run.yaml`` (or ``dsrl train``).

generate -> reward -> logprobs -> update -> sync, each phase timed; the details live below it.
"""

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoTokenizer

from dsrl.algorithms import grpo_advantages
from dsrl.config import Config, SyncConfig, dump_config, parse_config, validate
from dsrl.data import PromptDataset
from dsrl.metrics import MetricsWriter, mean_across_ranks, summary_line, timed
from dsrl.rewards import load_reward_fn
from dsrl.rollout import Sample, SyncRollouts
from dsrl.rollout_manager import PromptStream, RolloutManager
from dsrl.serving.client import RolloutClient
from dsrl.serving.servers import ServerFleet, start_fleet
from dsrl.sync.base import make_checkpoint_engine, probe_reference, sync_weights, verify_probe, verify_weights
from dsrl.zero.actor import compute_logprobs, logprob_mismatch, update_actor
from dsrl.zero.checkpoint import export_hf, save_checkpoint
from dsrl.zero.engine import (
    init_distributed,
    load_engine,
    offload_states,
    prepare_model_dir,
    reload_states,
    use_cuda,
)

log = logging.getLogger("dsrl")


def train(cfg: Config) -> dict[str, float]:
    init_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    validate(cfg, world)
    run_dir = Path(cfg.logging.run_dir)
    logging.basicConfig(
        level=cfg.logging.log_level if rank == 0 else "WARNING", format="%(asctime)s [dsrl] %(message)s", force=True
    )
    if rank == 0:
        dump_config(cfg, run_dir / "config.yaml")
    torch.manual_seed(cfg.seed + rank)

    model_dir = prepare_model_dir(cfg, run_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    dataset = PromptDataset(cfg.data, tokenizer, cfg.seed)
    reward_fn = load_reward_fn(cfg.algorithm.reward_fn)
    actor = load_engine(cfg, model_dir, world, train=True)
    ref = load_engine(cfg, model_dir, world, train=False) if cfg.algorithm.kl_coef > 0 else None
    colocated = cfg.rollout.placement == "colocate"
    offload = colocated and use_cuda(cfg)  # the trainer lends the GPU to the servers between updates
    if offload:  # before any server starts: it sizes its KV cache from the memory it finds free
        offload_states(actor, params=False)

    fleet = start_rollout_fleet(cfg, model_dir, run_dir, rank)
    client = RolloutClient(fleet.urls, cfg.rollout.max_concurrency, cfg.rollout.request_timeout_s)
    writer = MetricsWriter(run_dir, cfg.logging.tensorboard and rank == 0)
    backend = "nccl" if use_cuda(cfg) else "gloo"
    ckpt = make_checkpoint_engine(
        resolve_sync(cfg), client if rank == 0 else None, run_dir, backend, cfg.rollout.tp_size
    )
    if colocated:
        rollouts = SyncRollouts(client, cfg.rollout, dataset, reward_fn, tokenizer, rank, world)
    else:  # disaggregated: generation runs ahead of training by up to max_staleness versions
        stream = PromptStream(dataset, cfg.rollout.prompts_per_step, rank, world)
        rollouts = RolloutManager(client, cfg, stream, reward_fn, tokenizer)
    metrics: dict[str, float] = {}
    try:
        push_weights(actor, ckpt, cfg, "0", wake_servers=False, offload=offload)
        if not colocated:
            rollouts.start()
        steps = tqdm(range(cfg.trainer.total_steps), desc="train", disable=rank != 0, dynamic_ncols=True)
        for step in steps:
            timings: dict[str, float] = {}
            with timed(timings, "step"):
                with timed(timings, "generate"):
                    samples, rollout_stats = rollouts.collect(step)
                if colocated:
                    with timed(timings, "release"):
                        release_servers(client, rank)
                        if offload:
                            reload_states(actor)
                with timed(timings, "logprobs"):
                    compute_logprobs(actor, samples, "old_logprobs", cfg, pad_id)
                    if ref is not None:
                        compute_logprobs(ref, samples, "ref_logprobs", cfg, pad_id)
                with timed(timings, "update"):
                    rewards = torch.tensor([s.reward for s in samples])
                    advantages = grpo_advantages(rewards, cfg.rollout.n_samples, cfg.algorithm.norm_adv_by_std)
                    stats = update_actor(actor, samples, advantages, cfg, pad_id)
                with timed(timings, "sync"):
                    rollouts.before_update()
                    dist.barrier()  # every rank's rollouts are ready for the servers' pause
                    sync_stats = push_weights(actor, ckpt, cfg, str(step + 1), colocated, offload)
                    rollouts.after_update(step + 1)
            metrics = mean_across_ranks(
                {**rollout_metrics(samples, step), **rollout_stats, **logprob_mismatch(samples), **stats, **timings}
            )
            if rank == 0:
                metrics.update(sync_stats)
                writer.log(step + 1, metrics, {"rollout/staleness": [step - s.oldest_version for s in samples]})
                steps.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
                log.info(summary_line(step + 1, cfg.trainer.total_steps, metrics))
            if cfg.logging.save_every and (step + 1) % cfg.logging.save_every == 0:
                if offload:
                    reload_states(actor)
                save_checkpoint(actor, run_dir, step + 1, {"step": step + 1, "weight_version": str(step + 1)})
                if offload:
                    offload_states(actor, params=True)
        if rank == 0 and metrics:
            log.info("final metrics: %s", json.dumps({k: round(v, 6) for k, v in sorted(metrics.items())}))
        rollouts.stop()
        if offload:
            reload_states(actor)
        if cfg.logging.export_hf:
            export_hf(actor.module, model_dir, run_dir / "hf", cfg.sync.bucket_bytes)
    finally:
        rollouts.stop()
        client.close()
        writer.close()
        fleet.stop()
    return metrics


def start_rollout_fleet(cfg: Config, model_dir: str, run_dir: Path, rank: int) -> ServerFleet:
    """Rank 0 starts the servers (or takes external URLs); every rank learns their URLs."""
    engine = cfg.rollout.engine
    if engine == "auto":
        engine = "sglang" if use_cuda(cfg) else "embedded"
    fleet = [start_fleet(cfg.rollout, model_dir, run_dir, cfg.seed, engine) if rank == 0 else None]
    urls = [fleet[0].urls if rank == 0 else None]
    dist.broadcast_object_list(urls, src=0)
    return fleet[0] or ServerFleet(urls=urls[0])


def release_servers(client: RolloutClient, rank: int) -> None:
    """Colocated: once every rank has its samples, the servers give their memory to the trainer."""
    dist.barrier()
    if rank == 0:
        client.call_all("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})


def resolve_sync(cfg: Config) -> SyncConfig:
    if cfg.sync.type != "auto":
        return cfg.sync
    ipc = cfg.rollout.placement == "colocate" and use_cuda(cfg)
    return replace(cfg.sync, type="ipc" if ipc else "broadcast")


def push_weights(actor, ckpt, cfg: Config, weight_version: str, wake_servers: bool, offload: bool) -> dict:
    """Sync the actor's weights into the servers.

    Colocated on GPUs the order matters: trainer states out -> server weights back -> sync ->
    trainer params out -> server KV cache back (the KV cache needs the memory the params held).
    """
    client = ckpt.client  # None except on rank 0
    if offload:
        offload_states(actor, params=False)
    if wake_servers and client is not None:
        client.call_all("/resume_memory_occupation", {"tags": ["weights"]})
    stats = sync_weights(actor.module, ckpt, weight_version)
    if cfg.sync.verify == "weights":
        verify_weights(actor.module, client, cfg.sync.bucket_bytes)
    if cfg.sync.verify == "probe":  # the trainer's side now, while its params are still on the GPU
        probe_ids, reference = probe_reference(actor, actor.module.config.vocab_size)
    if offload:
        offload_states(actor, params=True)
    if wake_servers and client is not None:
        client.call_all("/resume_memory_occupation", {"tags": ["kv_cache"]})
    probe = None
    if cfg.sync.verify == "probe" and client is not None:  # the servers' side needs their KV cache back
        probe = verify_probe(client, probe_ids, reference, cfg.sync.probe_tolerance)
    if stats is None:
        return {}
    out = {"sync/bytes": stats.bytes, "sync/seconds": stats.seconds, "sync/gb_per_s": stats.gb_per_s}
    return out if probe is None else {**out, "sync/probe_logprob_diff": probe}


def rollout_metrics(samples: list[Sample], trainer_version: int) -> dict[str, float]:
    rewards = torch.tensor([s.reward for s in samples])
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float)
    staleness = torch.tensor([trainer_version - s.oldest_version for s in samples], dtype=torch.float)
    return {
        "rollout/staleness_mean": staleness.mean().item(),
        "rollout/staleness_max": staleness.max().item(),
        "rollout/versions_per_batch": float(len({v for s in samples for _, v in s.extras["spans"]})),
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item(),
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }


def main(argv: list[str] | None = None) -> None:
    # The deepspeed launcher appends --local_rank=N unless told not to; LOCAL_RANK carries it anyway.
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")]
    train(parse_config(argv))


if __name__ == "__main__":
    main()
