"""Trainer-side work on a rollout batch: logprobs (old, reference) and the PPO update of the actor."""

from collections import defaultdict

import torch
import torch.distributed as dist

from dsrl.algorithms import (
    LOG_RATIO_LIMIT,
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
    """Right-padded prompt+response ids, attention mask, and a [B, T-1] mask of response targets."""
    seqs = [s.prompt.prompt_ids + s.response_ids for s in samples]
    width = max(map(len, seqs))
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    targets = torch.zeros((len(seqs), width - 1))
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        targets[i, len(s.prompt.prompt_ids) - 1 : len(seq) - 1] = 1
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
    """How far the engine's sampling logprobs are from the trainer's recomputed ones."""
    engine = torch.cat([torch.tensor(s.engine_logprobs) for s in samples])
    trainer = torch.cat([s.extras["old_logprobs"] for s in samples])
    diff = engine - trainer
    return {
        "mismatch/logprob_abs_diff": diff.abs().mean().item(),
        "mismatch/prob_abs_diff": (engine.exp() - trainer.exp()).abs().mean().item(),
        "mismatch/logprob_max_abs_diff": diff.abs().max().item(),
    }


def global_denominators(mini: list[Sample]) -> tuple[float, float]:
    """The mini-batch's response tokens and sequences over every rank, divided by the number of ranks.

    DeepSpeed averages the ranks' gradients; a rank that divides its sum by (global count / ranks)
    then contributes exactly its share of the global mean. Dividing by its own count instead made
    `token_mean` the mean of per-rank means: wrong whenever ranks hold different token totals.
    """
    counts = [float(sum(len(s.response_ids) for s in mini)), float(len(mini))]
    counts = torch.tensor(counts, dtype=torch.float64, device=reduce_device())
    dist.all_reduce(counts)
    counts /= dist.get_world_size()
    return counts[0].item(), counts[1].item()


def micro_batch_loss(
    engine, chunk: list[Sample], advantages: torch.Tensor, cfg: Config, pad_id: int, num_tokens: float, num_seqs: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The policy loss of one micro-batch as its share of the mini-batch loss (`global_denominators`),
    its metrics, and its response mask."""
    a = cfg.algorithm
    input_ids, attention, mask = pack(chunk, pad_id, engine.device)
    width = mask.shape[1]
    old = per_token(chunk, "old_logprobs", width, engine.device)
    logprobs, entropy = forward_logprobs(engine, input_ids, attention, cfg.rollout.temperature, True)
    weights = None
    if a.off_policy != "none":
        behaviour = per_token(chunk, "engine_logprobs", width, engine.device)
        weights = importance_weights(old, behaviour, a.off_policy, a.is_cap)
    loss, stats = ppo_clip_loss(
        logprobs, old, advantages.to(engine.device), mask, a.clip_low, a.clip_high, a.loss_agg, num_tokens,
        num_seqs, weights, a.clip_ratio_c,
    )  # fmt: skip
    n = mask.sum().clamp(min=1)
    if weights is not None:
        raw = torch.exp((old - behaviour).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
        stats["is_weight_mean"] = (weights * mask).sum() / n
        stats["is_weight_max"] = (raw * mask).max()
        stats["is_capped_frac"] = ((raw > a.is_cap).float() * mask).sum() / n
    stats["pg_loss"] = loss.detach()
    if a.kl_coef > 0:
        kl = kl_estimate(logprobs, per_token(chunk, "ref_logprobs", width, engine.device), a.kl_estimator)
        loss = loss + a.kl_coef * aggregate(kl, mask, a.loss_agg, num_tokens, num_seqs)
        stats["kl"] = (kl.detach() * mask).sum() / n
    if a.entropy_coef > 0:
        loss = loss - a.entropy_coef * aggregate(entropy, mask, a.loss_agg, num_tokens, num_seqs)
    stats["entropy"] = (entropy.detach() * mask).sum() / n
    return loss, stats, mask


def update_actor(engine, samples: list[Sample], advantages: torch.Tensor, cfg: Config, pad_id: int) -> dict:
    """PPO-clip epochs over the batch: `updates_per_step` optimizer steps per epoch, micro-batched."""
    t = cfg.trainer
    mini_size = len(samples) // t.updates_per_step
    for s in samples:
        s.extras["engine_logprobs"] = torch.tensor(s.engine_logprobs)
    sums: dict[str, float] = defaultdict(float)
    maxima: dict[str, float] = {}
    tokens_seen, grad_norms, lrs = 0.0, [], []
    for _ in range(t.ppo_epochs):
        for m in range(0, len(samples), mini_size):
            mini = samples[m : m + mini_size]
            num_tokens, num_seqs = global_denominators(mini)
            for i in range(0, len(mini), t.micro_batch_size):
                chunk = mini[i : i + t.micro_batch_size]
                adv = advantages[m + i : m + i + len(chunk)]
                loss, stats, mask = micro_batch_loss(engine, chunk, adv, cfg, pad_id, num_tokens, num_seqs)
                # The loss is already a share of the mini-batch mean: no extra 1/accumulation scaling.
                engine.backward(loss, scale_wrt_gas=False)
                engine.step()
                weight = mask.sum().item()
                for key in [k for k in stats if k.endswith("_max")]:
                    maxima[key] = max(maxima.get(key, 0.0), stats.pop(key).item())
                for key, value in stats.items():
                    # pg_loss is a share of the mini-batch loss already; the rest are per-token means
                    sums[key] += value.item() * (num_tokens if key == "pg_loss" else weight)
                tokens_seen += weight
            grad_norms.append(float(engine.get_global_grad_norm() or 0.0))
            lrs.append(engine.get_lr()[0])
    out = {f"actor/{k}": v / tokens_seen for k, v in sums.items()}
    out.update({f"actor/{k}": v for k, v in maxima.items()})
    out["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["actor/lr"] = lrs[-1]
    return out
