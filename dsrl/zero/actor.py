"""Trainer-side work on a rollout batch: logprobs (old, reference) and the PPO update of the actor."""

from collections import defaultdict

import torch

from dsrl.algorithms import aggregate, entropy_from_logits, importance_weights, kl_estimate, ppo_clip_loss
from dsrl.config import Config
from dsrl.rollout import Sample


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


def update_actor(engine, samples: list[Sample], advantages: torch.Tensor, cfg: Config, pad_id: int) -> dict:
    """PPO-clip epochs over the batch: `updates_per_step` optimizer steps per epoch, micro-batched."""
    a, t = cfg.algorithm, cfg.trainer
    mini_size = len(samples) // t.updates_per_step
    for s in samples:
        s.extras["engine_logprobs"] = torch.tensor(s.engine_logprobs)
    sums: dict[str, float] = defaultdict(float)
    maxima: dict[str, float] = {}
    tokens_seen, grad_norms, lrs = 0.0, [], []
    for _ in range(t.ppo_epochs):
        for m in range(0, len(samples), mini_size):
            mini = samples[m : m + mini_size]
            num_tokens = float(sum(len(s.response_ids) for s in mini))
            for i in range(0, len(mini), t.micro_batch_size):
                chunk = mini[i : i + t.micro_batch_size]
                input_ids, attention, mask = pack(chunk, pad_id, engine.device)
                width = mask.shape[1]
                old = per_token(chunk, "old_logprobs", width, engine.device)
                adv = advantages[m + i : m + i + len(chunk)].to(engine.device)
                logprobs, entropy = forward_logprobs(engine, input_ids, attention, cfg.rollout.temperature, True)
                weights = None
                if a.off_policy != "none":
                    behaviour = per_token(chunk, "engine_logprobs", width, engine.device)
                    weights = importance_weights(old, behaviour, a.off_policy, a.is_cap)
                loss, stats = ppo_clip_loss(
                    logprobs, old, adv, mask, a.clip_low, a.clip_high, a.loss_agg, num_tokens, len(mini), weights
                )
                if weights is not None:
                    raw = torch.exp(old - behaviour)
                    stats["is_weight_mean"] = (weights * mask).sum() / mask.sum()
                    stats["is_weight_max"] = (raw * mask).max()
                    stats["is_capped_frac"] = ((raw > a.is_cap).float() * mask).sum() / mask.sum()
                stats["pg_loss"] = loss.detach()
                if a.kl_coef > 0:
                    kl = kl_estimate(logprobs, per_token(chunk, "ref_logprobs", width, engine.device), a.kl_estimator)
                    kl_loss = aggregate(kl, mask, a.loss_agg, num_tokens, len(mini))
                    loss = loss + a.kl_coef * kl_loss
                    stats["kl"] = (kl.detach() * mask).sum() / mask.sum()
                if a.entropy_coef > 0:
                    loss = loss - a.entropy_coef * aggregate(entropy, mask, a.loss_agg, num_tokens, len(mini))
                stats["entropy"] = (entropy.detach() * mask).sum() / mask.sum()
                # The loss is already a mean over the whole mini-batch: no extra 1/accumulation scaling.
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
