"""Trainer-side work on a rollout batch: logprobs (old, reference) and the PPO update of the actor."""

from collections import defaultdict

import torch
import torch.distributed as dist

from dsrl.algorithms import (
    LOG_RATIO_LIMIT,
    POLICY_LOSSES,
    aggregate,
    entropy_from_logits,
    importance_weights,
    kl_estimate,
    ppo_clip_loss,
)
from dsrl.collectives import reduce_device
from dsrl.config import Config
from dsrl.data import Sample


def pack(samples: list[Sample], pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Right-padded prompt+response ids, attention mask, and a [B, T-1] mask of the targets the loss counts:
    the model's response tokens (not an agent's observation tokens)."""
    seqs = [s.prompt.prompt_ids + s.response_ids for s in samples]
    width = max(map(len, seqs))
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    targets = torch.zeros((len(seqs), width - 1))
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        if not s.extras.get("skip"):  # a sample whose reward failed (on_reward_error skip) has no loss
            targets[i, len(s.prompt.prompt_ids) - 1 : len(seq) - 1] = torch.tensor(s.mask(), dtype=targets.dtype)
    return input_ids.to(device), attention.to(device), targets.to(device)


def per_token(samples: list[Sample], key: str, width: int, device: torch.device) -> torch.Tensor:
    """Gather each sample's response-aligned `extras[key]` into a [B, width] tensor at target positions."""
    out = torch.zeros((len(samples), width), device=device)
    for i, s in enumerate(samples):
        start = len(s.prompt.prompt_ids) - 1
        out[i, start : start + len(s.response_ids)] = s.extras[key]
    return out


def forward_logprobs(engine, input_ids, attention, temperature: float, with_entropy: bool = False):
    logits = engine(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float() / temperature
    logprobs = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return logprobs, (entropy_from_logits(logits) if with_entropy else None)


@torch.no_grad()
def compute_logprobs(engine, samples: list[Sample], key: str, cfg: Config, pad_id: int) -> None:
    """Store each sample's response-token logprobs under `extras[key]` (micro-batched, no grad)."""
    mb = cfg.trainer.micro_batch_size
    for i in range(0, len(samples), mb):
        chunk = samples[i : i + mb]
        input_ids, attention, _ = pack(chunk, pad_id, engine.device)
        logprobs, _ = forward_logprobs(engine, input_ids, attention, cfg.rollout.temperature)
        for row, s in zip(logprobs, chunk):
            start = len(s.prompt.prompt_ids) - 1
            s.extras[key] = row[start : start + len(s.response_ids)].float().cpu()


def logprob_mismatch(samples: list[Sample]) -> dict[str, float]:
    """How far the engine's sampling logprobs are from the trainer's recomputed ones, over the model's tokens."""
    model = torch.cat([torch.tensor(s.mask(), dtype=torch.bool) for s in samples])
    engine = torch.cat([torch.tensor(s.engine_logprobs) for s in samples])[model]
    trainer = torch.cat([s.extras["old_logprobs"] for s in samples])[model]
    diff = engine - trainer
    return {
        "mismatch/logprob_abs_diff": diff.abs().mean().item(),
        "mismatch/prob_abs_diff": (engine.exp() - trainer.exp()).abs().mean().item(),
        "mismatch/logprob_max_abs_diff": diff.abs().max().item(),
    }


def global_denominators(mini: list[Sample]) -> tuple[float, float]:
    """The mini-batch's model tokens and sequences over every rank, divided by the number of ranks.

    DeepSpeed averages the ranks' gradients; a rank that divides its sum by (global count / ranks)
    then contributes exactly its share of the global mean. Dividing by its own count instead made
    `token_mean` the mean of per-rank means: wrong whenever ranks hold different token totals.
    Skipped samples (a failed reward, `on_reward_error skip`) count for nothing.
    """
    kept = [s for s in mini if not s.extras.get("skip")]
    counts = [float(sum(s.model_tokens() for s in kept)), float(len(kept))]
    counts = torch.tensor(counts, dtype=torch.float64, device=reduce_device())
    dist.all_reduce(counts)
    counts = counts.clamp(min=1) / dist.get_world_size()
    return counts[0].item(), counts[1].item()


def micro_batch_loss(
    engine, chunk: list[Sample], cfg: Config, pad_id: int, num_tokens: float, num_seqs: float, kl_coef: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The policy loss of one micro-batch as its share of the mini-batch loss (`global_denominators`),
    its metrics, and its response mask. Advantages come per token from extras["advantages"]."""
    a = cfg.algorithm
    input_ids, attention, mask = pack(chunk, pad_id, engine.device)
    width, device = mask.shape[1], engine.device
    old = per_token(chunk, "old_logprobs", width, device)
    advantages = per_token(chunk, "advantages", width, device)
    logprobs, entropy = forward_logprobs(engine, input_ids, attention, cfg.rollout.temperature, True)
    agg = (a.loss_agg, num_tokens, num_seqs)
    if a.policy_loss == "ppo":
        weights = None
        if a.off_policy != "none":
            behaviour = per_token(chunk, "engine_logprobs", width, device)
            weights = importance_weights(old, behaviour, a.off_policy, a.is_cap)
        loss, stats = ppo_clip_loss(
            logprobs, old, advantages, mask, a.clip_low, a.clip_high, *agg, weights, a.clip_ratio_c,
            cfg.rollout.max_new_tokens,
        )  # fmt: skip
        if weights is not None:
            stats |= importance_stats(old, behaviour, weights, mask, a.is_cap)
    else:
        policy_loss = POLICY_LOSSES[a.policy_loss]
        loss, stats = policy_loss(
            logprobs, old, advantages, mask, a.clip_low, a.clip_high, *agg, horizon=cfg.rollout.max_new_tokens
        )
    n = mask.sum().clamp(min=1)
    stats["pg_loss"] = loss.detach()
    if kl_coef > 0 and not a.kl_in_reward:
        kl = kl_estimate(logprobs, per_token(chunk, "ref_logprobs", width, device), a.kl_estimator)
        loss = loss + kl_coef * aggregate(kl, mask, *agg, cfg.rollout.max_new_tokens)
        stats["kl"] = (kl.detach() * mask).sum() / n
    if a.entropy_coef > 0:
        loss = loss - a.entropy_coef * aggregate(entropy, mask, *agg, cfg.rollout.max_new_tokens)
    stats["entropy"] = (entropy.detach() * mask).sum() / n
    return loss, stats, mask


def importance_stats(old, behaviour, weights, mask, cap: float) -> dict[str, torch.Tensor]:
    n = mask.sum().clamp(min=1)
    raw = torch.exp((old - behaviour).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    return {
        "is_weight_mean": (weights * mask).sum() / n,
        "is_weight_max": (raw * mask).max(),
        "is_capped_frac": ((raw > cap).float() * mask).sum() / n,
    }


def update_actor(engine, samples: list[Sample], cfg: Config, pad_id: int, kl_coef: float) -> dict[str, float]:
    """The policy update: `ppo_epochs` passes of `updates_per_step` optimizer steps, micro-batched."""
    for s in samples:
        s.extras["engine_logprobs"] = torch.tensor(s.engine_logprobs)

    def loss(chunk, num_tokens, num_seqs):
        return micro_batch_loss(engine, chunk, cfg, pad_id, num_tokens, num_seqs, kl_coef)

    return {f"actor/{k}": v for k, v in run_updates(engine, samples, cfg, cfg.trainer.micro_batch_size, loss).items()}


def run_updates(engine, samples: list[Sample], cfg: Config, micro_batch_size: int, loss_fn) -> dict[str, float]:
    """`ppo_epochs` passes over the batch, each `updates_per_step` optimizer steps of micro-batched
    gradient accumulation; `loss_fn(chunk, num_tokens, num_seqs)` -> (loss, metrics, mask) gives each
    micro-batch's share of its mini-batch loss. Returns token-weighted means of the metrics."""
    t = cfg.trainer
    mini_size = len(samples) // t.updates_per_step
    sums: dict[str, float] = defaultdict(float)
    maxima: dict[str, float] = {}
    tokens_seen, grad_norms, lrs = 0.0, [], []
    for _ in range(t.ppo_epochs):
        for m in range(0, len(samples), mini_size):
            mini = samples[m : m + mini_size]
            num_tokens, num_seqs = global_denominators(mini)
            for i in range(0, len(mini), micro_batch_size):
                loss, stats, mask = loss_fn(mini[i : i + micro_batch_size], num_tokens, num_seqs)
                # The loss is already a share of the mini-batch mean: no extra 1/accumulation scaling.
                engine.backward(loss, scale_wrt_gas=False)
                engine.step()
                weight = mask.sum().item()
                for key in [k for k in stats if k.endswith("_max")]:
                    maxima[key] = max(maxima.get(key, 0.0), stats.pop(key).item())
                for key, value in stats.items():
                    # the loss is a share of the mini-batch loss already; the rest are per-token means
                    sums[key] += value.item() * (num_tokens if key.endswith("_loss") else weight)
                tokens_seen += weight
            grad_norms.append(float(engine.get_global_grad_norm() or 0.0))
            lrs.append(engine.get_lr()[0])
    out = {k: v / max(tokens_seen, 1.0) for k, v in sums.items()}
    out.update(maxima)
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["lr"] = lrs[-1]
    return out
