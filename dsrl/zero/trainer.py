"""The trainer of a run, one rank of it: the actor, the reference policy, the critic and the KL coefficient, with one
call per phase of a step (`logprobs`, then `update`) and what outlives the run (`save`, `export`)."""

import logging
from pathlib import Path

import torch

from dsrl.advantages import KlController, compute_advantages
from dsrl.collectives import all_ranks
from dsrl.config import Config, critic_of_its_own
from dsrl.data import Sample
from dsrl.metrics import reduce_across_ranks
from dsrl.plan import Plan
from dsrl.vision import check_ranks_agree
from dsrl.zero.actor import compute_logprobs, update_actor
from dsrl.zero.checkpoint import export_hf, find_checkpoint, load_checkpoint, save_checkpoint, warn_disk_room
from dsrl.zero.critic import compute_values, has_values, update_actor_and_critic, update_critic
from dsrl.zero.engine import load_engine
from dsrl.zero.lora import is_lora, reference_off, save_adapter
from dsrl.zero.memory import check_device_memory, check_host_memory

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps in a row)."""


def mask_truncated(samples: list[Sample]) -> dict[str, float]:
    """--algorithm.mask_truncated: the responses cut at max_new_tokens add no loss (`Sample.skip`; their rewards have
    made their groups' baselines), and their share."""
    cut = [s for s in samples if s.finish_reason == "length"]
    for s in cut:
        s.skip = True
    return {"actor/masked_truncated_frac": len(cut) / len(samples)}


class Trainer:
    def __init__(self, cfg: Config, plan: Plan, model_dir: str, world: int, tokenizer):
        self.cfg, self.plan, self.model_dir = cfg, plan, model_dir
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
        check_host_memory(cfg, plan, world)  # ZeRO-Offload's states, before DeepSpeed allocates them
        check_device_memory(cfg, plan, model_dir, world)  # and the GPU's share
        warn_disk_room(cfg, plan)  # and the run directory's disk, for what the run will write
        self.actor = load_engine(cfg, model_dir, world, train=True, plan=plan)
        self.ref = None
        """The reference policy (KL); with LoRA the actor itself, its adapters off (`reference_off`)."""
        if cfg.algorithm.kl_coef > 0:
            self.ref = (
                self.actor if cfg.model.lora_rank > 0 else load_engine(cfg, model_dir, world, train=False, plan=plan)
            )
        self.critic = None
        """With --algorithm.advantage gae, the critic's own engine; None with LoRA, where the actor is the critic too
        (`PolicyAndValue`: an adapter and a value head on its base)."""
        if critic_of_its_own(cfg):
            self.critic = load_engine(cfg, model_dir, world, train=True, critic=True, plan=plan)
        self.engines = [e for e in (self.actor, self.critic) if e is not None]
        """The engines with states (colocated, they lend the GPU to the servers: `dsrl.lending`)."""
        self.kl = KlController(cfg)
        self.bad_steps = 0

    def resume(self, run_dir: Path) -> tuple[int, dict | None]:
        """The latest checkpoint restored, when there is one: (the step to start from, this rank's saved state)."""
        path = find_checkpoint(run_dir, self.cfg.logging.resume)
        if path is None:
            return 0, None
        state, rank_state = load_checkpoint(self.actor, path, self.critic)
        self.kl.value = state.get("kl_coef", self.kl.value)
        log.info("resumed from %s at step %d", path, state["step"])
        return state["step"], rank_state

    def trains_actor(self, step: int) -> bool:
        """Whether `step` updates the actor: with GAE, not before the critic's warm-up steps."""
        return step >= self.cfg.critic.warmup_steps or self.cfg.algorithm.advantage != "gae"

    def logprobs(self, samples: list[Sample], step: int) -> bool:
        """Old logprobs (unless the update's forward pass gives them: `old_from_update`), reference logprobs and the
        critic's values; False on every rank when any rank saw a non-finite value."""
        cfg, pad_id = self.cfg, self.pad_id
        check_ranks_agree(self.actor.module, samples)
        if cfg.algorithm.policy_loss == "bypass_mode":  # (verl's bypass mode: the engine's logprobs are the old ones)
            for s in samples:
                s.old_logprobs = torch.tensor(s.engine_logprobs, dtype=torch.float32)
        elif not (self.plan.old_from_update and self.trains_actor(step)):
            compute_logprobs(self.actor, samples, "old_logprobs", cfg, pad_id)
        if self.ref is not None:
            with reference_off(self.ref.module):
                compute_logprobs(self.ref, samples, "ref_logprobs", cfg, pad_id)
        if self.critic is not None or has_values(self.actor):
            compute_values(self.critic or self.actor, samples, cfg, pad_id)
        values = [v for s in samples for v in (s.old_logprobs, s.ref_logprobs, s.values) if v is not None]
        return all_ranks(all(torch.isfinite(v).all() for v in values))

    def update(self, samples: list[Sample], step: int, finite: bool, beside=None) -> dict[str, float]:
        """Advantages, then the critic's and the actor's updates (the actor waits out critic.warmup_steps); a step
        with non-finite inputs, or whose actor step DeepSpeed skipped (a non-finite gradient norm), is skipped and
        counted. `beside()`, before the actor's last optimizer step, starts what runs beside it (a step that trains
        no actor starts nothing)."""
        cfg, pad_id, kl = self.cfg, self.pad_id, self.kl.value
        stats = compute_advantages(samples, cfg, kl) if finite else {}
        stats |= mask_truncated(samples) if cfg.algorithm.mask_truncated else {}
        advantages = [s.advantages for s in samples] if finite else []
        if finite and all_ranks(all(torch.isfinite(a).all() for a in advantages)):
            actor = self.trains_actor(step)
            if has_values(self.actor):
                stats |= update_actor_and_critic(self.actor, samples, cfg, pad_id, kl, actor, beside if actor else None)
            else:
                if self.critic is not None:
                    stats |= update_critic(self.critic, samples, cfg, pad_id)
                if actor:
                    stats |= update_actor(self.actor, samples, cfg, pad_id, kl, beside)
            if not stats.get("actor/steps_skipped"):
                self.bad_steps = 0
                replay = getattr(self.actor.module, "routing_replay", None)
                stats |= replay.metrics() if replay is not None else {}
                return {**stats, **self.kl_in_batch(samples), "train/skipped_step": 0.0}
        self.bad_steps += 1
        log.warning("non-finite logprobs, advantages or gradients: step skipped (%d in a row)", self.bad_steps)
        if self.bad_steps >= cfg.trainer.max_bad_steps:
            raise TrainingError(
                f"{self.bad_steps} steps in a row had non-finite logprobs, advantages or gradients "
                f"(--trainer.max_bad_steps={cfg.trainer.max_bad_steps}); check the rewards' scale and the learning rate"
            )
        return {"train/skipped_step": 1.0}

    def kl_in_batch(self, samples: list[Sample]) -> dict[str, float]:
        """The batch's KL(old || ref) per model token (k1), and the coefficient, which adapts to it (kl_target)."""
        if self.ref is None:
            return {}
        model = torch.cat([torch.tensor(s.mask(), dtype=torch.bool) for s in samples])
        old = torch.cat([s.old_logprobs for s in samples])
        kl = (old - torch.cat([s.ref_logprobs for s in samples]))[model].mean().item()
        coef = self.kl.value
        self.kl.update(reduce_across_ranks({"kl": kl})["kl"])
        return {"kl/coef": coef, "kl/old_ref_k1": kl}

    def save(self, run_dir: Path, step: int, rank_state: dict) -> None:
        """A checkpoint of weight version `step`, with this rank's `rank_state` (the schedule's, the rewarder's)."""
        state = {"step": step, "weight_version": step, "kl_coef": self.kl.value}
        save_checkpoint(self.actor, run_dir, state, rank_state, self.cfg.logging.keep_last, self.critic)

    def export(self, out: Path, rank: int) -> None:
        """The trained model as a Hugging Face model in `out`; with LoRA, its adapter beside it (`adapter`)."""
        # The probe's forward may leave ZeRO-3 prefetches in flight, which a gather refuses to partition
        # again (seen on an H200 with the states kept on the GPU).
        self.actor.empty_partition_cache()
        export_hf(self.actor.module, self.model_dir, out, self.cfg.sync.bucket_bytes)
        if is_lora(self.actor.module):
            save_adapter(self.actor.module, out.parent / "adapter", rank == 0)
