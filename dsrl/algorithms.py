"""Advantages, the PPO-clip policy loss, KL estimators and loss aggregation.

Shapes: per-token tensors are [batch, tokens] with a float `mask` marking response tokens.
"""

from typing import Literal

import torch

LossAgg = Literal["token_mean", "seq_mean"]

LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped to +-20 before exp (as verl and OpenRLHF do): a token sampled under weights
many versions old could give exp(25) = 7e10 and a loss of 1e10; beyond e^20 a ratio is noise anyway."""


def grpo_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6):
    """Group-normalised advantages: (r - mean of its group) [/ (std of its group + eps)], as float32.

    `rewards` is flat, groups contiguous: [g0s0, g0s1, ..., g1s0, ...]. std is the unbiased one (as verl).
    Computed in float64: in float32 a group of eight 0.7 rewards has a mean 1 ulp off 0.7 and a std of
    6e-8, and got advantages of +-0.056 out of nothing.
    """
    grouped = rewards.to(torch.float64).view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1).float()


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    agg: LossAgg,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values to a scalar.

    token_mean: sum over all response tokens / num_tokens. seq_mean: each sequence's token mean,
    summed / num_seqs. The denominators default to this batch's; pass the whole mini-batch's when
    the batch is one micro-batch of several, so gradient accumulation yields the mini-batch mean.
    """
    if agg == "token_mean":
        return (values * mask).sum() / (num_tokens if num_tokens is not None else mask.sum().clamp(min=1))
    per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / (num_seqs if num_seqs is not None else values.shape[0])


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's k1/k2/k3)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":  # low variance, always >= 0: exp(-r) - 1 + r, its input clamped as verl's
        log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"--algorithm.kl_estimator={estimator!r}: expected one of k1, k2, k3")


def importance_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mode: str, cap: float
) -> torch.Tensor:
    """Per-token weights exp(old - behaviour) correcting for samples drawn by the engine's policy.

    `old` is the trainer's recomputed (proximal) policy, `behaviour` the engine's sampling logprobs.
    tis: the weight clamped at `cap` (truncated importance sampling). decoupled: decoupled PPO's
    behaviour weight, with tokens above `cap` dropped (weight 0).
    """
    ratio = torch.exp((old_logprobs - behaviour_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    if mode == "tis":
        return ratio.clamp(max=cap)
    if mode == "decoupled":
        return torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    raise ValueError(f"--algorithm.off_policy={mode!r}: expected none, decoupled or tis")


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    agg: LossAgg,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    is_weights: torch.Tensor | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip: max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)), aggregated.

    `advantages` is per token ([B, T]) or per sequence ([B]); `is_weights` (per token) multiplies
    each token's term (off-policy correction). `clip_ratio_c`: dual-clip PPO (Ye et al. 2020,
    arXiv:1912.09729), a token with a negative advantage costs at most -A * clip_ratio_c however far
    its ratio has grown. Returns the loss and detached metrics: clip fraction (tokens whose clipped
    term was the one used) and approx KL(old || new).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if clip_ratio_c is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * clip_ratio_c), per_token)
    if is_weights is not None:
        per_token = per_token * is_weights
    loss = aggregate(per_token, mask, agg, num_tokens, num_seqs)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        metrics = {
            "clip_frac": ((clipped > unclipped).float() * mask).sum() / n,
            "approx_kl": ((torch.expm1(-log_ratio) + log_ratio) * mask).sum() / n,
        }
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) over the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
