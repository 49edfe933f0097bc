"""Rollout correction (`--algorithm.rollout_correction`): importance weights and rejection masks between the trainer's
logprobs (pi, the proximal policy of the update) and the engine's (mu, the behaviour policy that sampled the tokens),
as verl's rollout_corr_helper defines them, with IcePop, SkyRL's geometric mask and DeepSeek-V3.2's OPSM beside.

Tensors are [samples, tokens] over a micro-batch, `mask` 1 on the model's tokens; a sequence's value is broadcast
to its tokens. Every sample is whole in one micro-batch, so per-sequence values are exact there."""

import math

import torch

from dsrl.algorithms import LOG_RATIO_LIMIT
from dsrl.config import RolloutCorrectionConfig

STATISTICS = {
    "k1": lambda lr: -lr,  # log(mu / pi): verl's k1, whose ratio bounds are on mu / pi
    "k2": lambda lr: 0.5 * lr.square(),
    "k3": lambda lr: torch.expm1(lr) - lr,  # w - 1 - log w: KL(mu || pi)'s low-variance estimate
}
"""verl's per-token divergence statistics of the log-ratio log w = log(pi / mu)."""


def rejection_keep(name: str, bound, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Where rejection mask `name` (token_k1 ... seq_max_k3) keeps a token: its statistic, per token or as its
    sequence's sum, mean or max over model tokens, within `bound` (k1: ratio bounds, one number U is [1/U, U])."""
    level, k = name.rsplit("_", 1)
    stat = STATISTICS[k](log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    if level == "seq_max":
        stat = stat.masked_fill(mask == 0, -math.inf).amax(-1, keepdim=True)
    elif level != "token":
        stat = (stat * mask).sum(-1, keepdim=True)
        stat = stat / mask.sum(-1, keepdim=True).clamp(min=1) if level == "seq_mean" else stat
    if k != "k1":
        return (stat <= bound).expand_as(mask)
    low, high = bound if isinstance(bound, (list, tuple)) else (1 / bound, bound)
    return ((stat >= math.log(low)) & (stat <= math.log(high))).expand_as(mask)


def within(x: torch.Tensor, bounds) -> torch.Tensor:
    return (x >= bounds[0]) & (x <= bounds[1])


def correct(
    c: RolloutCorrectionConfig,
    old: torch.Tensor,
    behaviour: torch.Tensor,
    current: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """(the importance weights of `c.is_level`, or None; the 0/1 keep mask of every rejection; detached metrics).
    `old` is pi, `behaviour` mu, `current` the update's own logprobs (OPSM's), all of the sampled tokens."""
    log_ratio = (old - behaviour) * mask
    seq_log_ratio = log_ratio.sum(-1, keepdim=True)
    count = mask.sum(-1, keepdim=True).clamp(min=1)
    keep = {"token": torch.ones_like(mask, dtype=torch.bool), "seq": torch.ones_like(mask, dtype=torch.bool)}
    for name, bound in c.rejection.items():
        keep["token" if name.startswith("token") else "seq"] &= rejection_keep(name, bound, log_ratio, mask)
    token_w = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    if c.icepop:
        keep["token"] &= within(token_w, c.icepop_bounds)
    if c.geo_mask:
        keep["seq"] &= within(torch.exp(seq_log_ratio / count), c.geo_mask_bounds).expand_as(mask)
    if c.opsm:
        divergence = ((behaviour - current) * mask).sum(-1, keepdim=True) / count
        keep["seq"] &= ~((advantages < 0) & (divergence > c.opsm_delta))
    raw = {"token": token_w, "seq": torch.exp(seq_log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)).expand_as(mask)}
    n, stats, weights = mask.sum().clamp(min=1), {}, None
    for level, w in raw.items():
        if c.is_mode == "truncate":
            applied = w.clamp(c.is_low, c.is_high)
        else:
            applied = torch.where(within(w, (c.is_low, c.is_high)), w, torch.zeros_like(w))
        if c.is_level.startswith(level):  # ("sequence": the seq level)
            weights = applied
            keep[level] &= applied > 0  # (mask: a weight of 0 is a masked token; truncated weights are > 0)
        prefix = f"rollout_corr/{level}_"
        stats[prefix + "weight_mean"] = (applied * mask).sum() / n
        stats[prefix + "weight_sq_mean"] = (applied.square() * mask).sum() / n  # (`with_ess` makes it the ESS)
        stats[prefix + "weight_max"] = (w * mask).max()
        stats[prefix + "masked_frac"] = ((~keep[level]).float() * mask).sum() / n
    kept = (keep["token"] & keep["seq"]).float()
    stats["rollout_corr/masked_frac"] = ((1 - kept) * mask).sum() / n
    return weights, kept, {k: v.detach() for k, v in stats.items()}


def with_ess(stats: dict[str, float]) -> dict[str, float]:
    """The update's token-weighted means of w and w^2 as the effective sample size, mean(w)^2 / mean(w^2) in (0, 1]
    (verl's rollout_is_eff_sample_size): exact over micro-batches, where a mean of their ESSs would not be."""
    out = {k: v for k, v in stats.items() if not k.endswith("_weight_sq_mean")}
    for key in stats.keys() - out.keys():
        base = key.removesuffix("_sq_mean")
        out[base + "_ess"] = stats[base + "_mean"] ** 2 / max(stats[key], 1e-12)
    return out
