"""Advantage estimators, policy losses (PPO-clip and its relatives: verl 0.9.1's set), the value loss, KL
estimators and loss aggregation, each held to its published definition.

Shapes: per-sequence tensors are [batch]; per-token tensors are [batch, tokens] with a float `mask`
marking response tokens. Groups (a prompt's samples) are contiguous: [g0s0, g0s1, ..., g1s0, ...].
"""

import math
from functools import partial, wraps
from typing import Literal

import torch

LossAgg = Literal["token_mean", "seq_mean", "seq_mean_token_sum_norm"]
LossValue = tuple[torch.Tensor, dict[str, torch.Tensor]]
"""A policy loss's value and its detached metrics."""

LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped to +-20 before exp (as verl and OpenRLHF do): a token sampled under weights
many versions old could give exp(25) = 7e10 and a loss of 1e10; beyond e^20 a ratio is noise anyway."""


def grpo_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6):
    """GRPO (Shao et al. 2024, arXiv:2402.03300): (r - mean of its group) / (std of its group + eps), as
    float32; without `norm_by_std`, Dr. GRPO's (Liu et al. 2025, arXiv:2503.20783) r - mean.

    std is the unbiased one (as verl). A group of one sample has baseline 0 and std 1 (as verl): its
    advantage is its reward. Computed in float64: in float32 a group of eight 0.7 rewards has a mean
    1 ulp off 0.7 and a std of 6e-8, and got advantages of +-0.056 out of nothing.
    """
    grouped = rewards.to(torch.float64).view(-1, group_size)
    if group_size == 1:
        return grouped.reshape(-1).float()
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1).float()


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): each sample's reward less the mean of the *other*
    samples of its group, r_i - (sum_j r_j - r_i) / (n - 1). A group of one has baseline 0."""
    grouped = rewards.to(torch.float64).view(-1, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / max(group_size - 1, 1)  # (one: the sum less itself, 0)
    return (grouped - others).reshape(-1).float()


def opo_advantages(rewards: torch.Tensor, lengths: torch.Tensor, group_size: int) -> torch.Tensor:
    """OPO (Hao et al. 2025, arXiv:2505.23585): the reward less its group's length-weighted mean reward,
    sum_j len_j r_j / sum_j len_j (the optimal baseline under exact on-policy training). A group of one: none."""
    r, n = rewards.to(torch.float64).view(-1, group_size), lengths.to(torch.float64).view(-1, group_size)
    if group_size == 1:
        return r.reshape(-1).float()
    return (r - (r * n).sum(1, keepdim=True) / n.sum(1, keepdim=True)).reshape(-1).float()


def passk_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6):
    """Pass@k training (Tang et al. 2025, arXiv:2503.19595, as verl's grpo_passk): only each group's best sample
    has an advantage, its reward less the second best's (over the group's std + eps with `norm_by_std`)."""
    grouped = rewards.to(torch.float64).view(-1, group_size)
    top, where = grouped.topk(2, dim=1)
    gap = top[:, 0] - top[:, 1]
    if norm_by_std:
        gap = gap / (grouped.std(dim=1) + eps)
    return torch.zeros_like(grouped).scatter(1, where[:, :1], gap[:, None]).reshape(-1).float()


def optimal_token_baseline(
    returns: torch.Tensor, old_logprobs: torch.Tensor, sum_pi_squared: torch.Tensor, mask: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The optimal token baseline (OTB; Li et al. 2025, richardli.xyz/optimal-token-baseline, verl's
    optimal_token_baseline): the baseline of each sample's t-th model token is its group's t-th returns weighted by
    each sample's accumulated "energy" up to there, B_t = sum_i G_t W_t / sum_i W_t, W_t = sum_{j<=t} (1 - 2 pi_j +
    sum pi^2); advantage G_t - B_t. Model tokens are counted past an agent's observations (verl's multi-turn form,
    tir_optimal_token_baseline). Where a group's single longest sample runs on alone its baseline is 0 (verl's
    handle_zero_tail: it would be the sample's own return). A group of one has no baseline."""
    if group_size == 1:
        return returns * mask
    order = torch.argsort(1 - mask, dim=-1, stable=True)  # each row's model tokens first, in their order
    shape = (-1, group_size, mask.shape[1])
    g, lp, sq, m = (x.gather(-1, order).view(shape) for x in (returns, old_logprobs, sum_pi_squared, mask))
    w = ((1 - 2 * lp.exp() + sq) * m).cumsum(-1)
    baseline = ((g * w * m).sum(1, keepdim=True) / ((w * m).sum(1, keepdim=True) + 1e-8)).expand_as(g).clone()
    lengths = m.sum(-1)  # [groups, samples]
    top = lengths.topk(2, dim=1).values
    for k in (top[:, 0] > top[:, 1]).nonzero()[:, 0].tolist():
        baseline[k, lengths[k].argmax(), int(top[k, 1]) :] = 0.0
    return torch.zeros_like(returns).scatter(-1, order, (g - baseline).view_as(returns)) * mask


def reward_to_go(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted return of every model token: sum over the model tokens k >= t of gamma^(steps) r_k
    (REINFORCE's return). Masked tokens (an agent's observations, padding) are skipped, not a new start:
    the return carries across them, and the discount counts model tokens only."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        running = torch.where(m > 0, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv:1506.02438): (advantages, returns).

    Over each row's model tokens in order: delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam
    A_next, where "next" is the next model token (masked tokens, an agent's observations, are skipped and
    carry nothing), and the value after the last model token is 0; returns = A + V (the critic's targets).
    """
    advantages = torch.zeros_like(token_rewards)
    next_value = torch.zeros_like(token_rewards[:, 0])
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(m, delta + gamma * lam * running, running)
        next_value = torch.where(m, values[:, t], next_value)
        advantages[:, t] = running
    return advantages * mask, (advantages + values) * mask


def whiten(values: torch.Tensor, mask: torch.Tensor, stats: tuple[float, float, float] | None = None) -> torch.Tensor:
    """(x - mean) / std over the masked tokens. `stats` = (sum, sum of squares, count) over the whole
    batch when it is spread over ranks (REINFORCE++ normalises over the global batch)."""
    total, squares, count = stats or (
        (values * mask).sum().item(),
        (values.square() * mask).sum().item(),
        mask.sum().item(),
    )
    mean = total / max(count, 1)
    std = math.sqrt(max(squares / max(count, 1) - mean * mean, 0.0))
    return (values - mean) / (std + 1e-8) * mask


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476): 0 up to max_new_tokens - buffer
    tokens, then falling linearly to -factor at max_new_tokens."""
    if buffer <= 0 or length <= max_new_tokens - buffer:
        return 0.0
    return -factor * min(1.0, (length - (max_new_tokens - buffer)) / buffer)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    agg: LossAgg,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """Reduce per-token values to a scalar.

    token_mean: sum over all response tokens / num_tokens (DAPO's token-level loss). seq_mean: each
    sequence's token mean, summed / num_seqs. seq_mean_token_sum_norm: each sequence's token sum /
    `horizon` (max_new_tokens, a constant), summed / num_seqs (Dr. GRPO: no length normalisation). The
    denominators default to this batch's; pass the whole mini-batch's (over every rank) when the batch
    is one micro-batch of several, so gradient accumulation yields the mini-batch mean.
    """
    if agg == "token_mean":
        return (values * mask).sum() / (num_tokens if num_tokens is not None else mask.sum().clamp(min=1))
    seqs = num_seqs if num_seqs is not None else values.shape[0]
    if agg == "seq_mean_token_sum_norm":
        return (values * mask).sum() / (horizon or values.shape[1]) / seqs
    per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / seqs


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


def policy_loss(term):
    """A policy loss from its per-token `term`, called as every loss is: loss(logprobs, old_logprobs, advantages, mask,
    clip_low, clip_high, agg, num_tokens=None, num_seqs=None, horizon=None, is_weights=None, **knobs) -> (loss, its
    detached metrics). The frame is the same for each: advantages per token ([B, T]) or per sequence ([B]), the
    log-ratio clamped (`LOG_RATIO_LIMIT`) and given to `term` as `log_ratio`, `is_weights` (per token: an off-policy
    correction) multiplying each token's term, `aggregate`; metrics clip_frac (the tokens `term` says it clipped or
    masked) and approx_kl (KL(old || new))."""

    @wraps(term)
    def loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, agg, num_tokens=None, num_seqs=None,
             horizon=None, is_weights=None, **knobs) -> LossValue:  # fmt: skip
        advantages = _per_token(advantages, logprobs)
        log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        args = (logprobs, old_logprobs, advantages, mask, clip_low, clip_high)
        per_token, clipped = term(*args, log_ratio=log_ratio, **knobs)
        if is_weights is not None:
            per_token = per_token * is_weights
        return aggregate(per_token, mask, agg, num_tokens, num_seqs, horizon), _ratio_metrics(clipped, log_ratio, mask)

    return loss


@policy_loss
def ppo_clip_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, *, log_ratio, clip_ratio_c=None):
    """PPO-clip (Schulman et al. 2017): max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)).
    `clip_ratio_c`: dual-clip PPO (Ye et al. 2020, arXiv:1912.09729), a token with a negative advantage costs at most
    -A * clip_ratio_c however far its ratio has grown. clip_frac: the tokens whose clipped term was the one used."""
    per_token, clip_used = _clipped_objective(advantages, log_ratio.exp(), clip_low, clip_high)
    if clip_ratio_c is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * clip_ratio_c), per_token)
    return per_token, clip_used


def gspo_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, agg, num_tokens=None, num_seqs=None,
              horizon=None) -> LossValue:  # fmt: skip
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): the ratio is the sequence's, the geometric mean of its
    tokens' ratios s = exp(mean_t log(pi / pi_old)), clipped at the sequence level (the paper's ranges
    are small: clip_low 3e-4, clip_high 4e-4). Token form GSPO-token: s_t = sg(s) * pi_t / sg(pi_t), so
    each token's gradient is its sequence's; with sequence-level advantages the two are equal. (Outside
    `policy_loss`: its mean is of the log-ratios before their clamp, and so is its approx_kl.)
    """
    advantages = _per_token(advantages, logprobs)
    log_ratio = (logprobs - old_logprobs) * mask
    seq_log_ratio = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach())
    per_token, clip_used = _clipped_objective(advantages, ratio, clip_low, clip_high)
    loss = aggregate(per_token, mask, agg, num_tokens, num_seqs, horizon)
    return loss, _ratio_metrics(clip_used, log_ratio, mask)


@policy_loss
def cispo_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, *, log_ratio):
    """CISPO (MiniMax-M1, 2025, arXiv:2506.13585): REINFORCE with a clipped, stop-gradient importance
    weight, -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * log pi. Unlike PPO no token's gradient is
    dropped: a clipped token still contributes, with its weight capped."""
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach()
    return -advantages * weight * logprobs, (ratio < 1 - clip_low) | (ratio > 1 + clip_high)


@policy_loss
def dppo_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, *, log_ratio,
              divergence: Literal["tv", "kl"] = "tv", clip_ratio_c: float | None = None):  # fmt: skip
    """DPPO (Qi et al. 2026, arXiv:2602.04879): the trust region is a divergence between the token's old and new
    Bernoulli (the token, or not), not its ratio: a token the update has moved by more than clip_high toward its
    advantage's side (clip_low against) is masked. tv: p - p_old; kl: KL(Bern(p_old) || Bern(p)), counted
    only on the side the advantage pushes. The rest: -A * sg(min(ratio, clip_ratio_c)) * log pi (its truncated
    importance weight; null: untruncated). Metrics: clip_frac = the masked share."""
    p, p_old = logprobs.detach().exp(), old_logprobs.exp()
    if divergence == "tv":
        outside = torch.where(advantages > 0, p - p_old > clip_high, p - p_old < -clip_low)
    else:
        kl = p_old * (old_logprobs - logprobs.detach()) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        outside = torch.where(advantages > 0, (kl > clip_high) & (p > p_old), (kl > clip_low) & (p < p_old))
    weight = log_ratio.detach().exp()
    weight = weight if clip_ratio_c is None else weight.clamp(max=clip_ratio_c)
    return -advantages * weight * logprobs * ~outside, outside


@policy_loss
def sapo_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, *, log_ratio, tau_pos: float = 1.0,
              tau_neg: float = 1.05):  # fmt: skip
    """SAPO (Gao et al. 2025, arXiv:2511.20347): a soft gate instead of the clip, -A * 4/tau * sigmoid(tau (r - 1)),
    whose gradient is PPO's at r = 1 and fades smoothly away from it; tau_pos for A > 0, tau_neg otherwise. The
    paper (and verl, always) aggregate seq_mean; the clips are unused."""
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    return -advantages * torch.sigmoid(tau * (log_ratio.exp() - 1)) * 4 / tau, torch.zeros_like(mask)


@policy_loss
def gpg_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, *, log_ratio):
    """GPG (Chu et al. 2025, arXiv:2504.02546): plain policy gradient, -A * log pi: no ratio, no clip."""
    return -advantages * logprobs, torch.zeros_like(mask)


@policy_loss
def covariance_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, *, log_ratio,
                    kind: Literal["clip", "kl"] = "clip", cov_ratio: float = 2e-4,
                    clip_cov_bounds: tuple[float, float] = (1.0, 5.0), kl_cov_coef: float = 0.1):  # fmt: skip
    """Clip-Cov and KL-Cov (Cui et al. 2025, arXiv:2505.22617): entropy collapse is driven by tokens whose
    log-prob and advantage covary most, cov = (A - mean A)(log pi - mean log pi) over the micro-batch's tokens.
    clip: PPO-clip, with the gradient of cov_ratio of the tokens (at least one), drawn at random among the
    unclipped ones whose cov lies in clip_cov_bounds, dropped. kl: -A * ratio (no clip), plus kl_cov_coef *
    |log ratio| on the cov_ratio of the tokens with the largest cov. Metrics: clip_frac = the tokens so treated."""
    valid, lp = mask > 0, logprobs.detach()
    cov = (advantages - advantages[valid].mean()) * (lp - lp[valid].mean())
    count = max(int(cov_ratio * valid.sum().item()), 1)
    chosen = torch.zeros_like(valid)
    if kind == "clip":
        per_token, clipped = _clipped_objective(advantages, log_ratio.exp(), clip_low, clip_high)
        lower, upper = clip_cov_bounds
        where = (valid & ~clipped & (cov > lower) & (cov < upper)).flatten().nonzero()[:, 0]
        chosen.view(-1)[where[torch.randperm(len(where))[:count]]] = True
        return per_token * ~chosen, chosen
    where = valid.flatten().nonzero()[:, 0]
    chosen.view(-1)[where[cov.flatten()[where].topk(min(count, len(where))).indices]] = True
    return -advantages * log_ratio.exp() + kl_cov_coef * log_ratio.abs() * chosen, chosen


def gmpo_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, agg, num_tokens=None, num_seqs=None,
              horizon=None, is_weights=None) -> LossValue:  # fmt: skip
    """GMPO (Zhao et al. 2025, arXiv:2507.20673; verl's geo_mean): the sequence's ratio is the geometric mean of its
    tokens', each token's log-ratio first clipped to [-clip_low, clip_high] on the side its advantage pushes
    (the paper's range is wide: 0.4 each, in log space); loss -mean_t(A) * ratio, a mean over sequences whatever
    loss_agg says. `is_weights` enter as each sequence's geometric mean."""
    advantages = _per_token(advantages, logprobs)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    sign = advantages.sign()
    clipped = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-clip_low, clip_high))
    tokens = mask.sum(-1).clamp(min=1)
    per_seq = -(advantages * mask).sum(-1) / tokens * torch.exp((clipped * mask).sum(-1) / tokens)
    if is_weights is not None:
        per_seq = per_seq * torch.exp((torch.log(is_weights + 1e-10) * mask).sum(-1) / tokens)
    loss = per_seq.sum() / (num_seqs if num_seqs is not None else logprobs.shape[0])
    return loss, _ratio_metrics(clipped != log_ratio, log_ratio, mask)


@policy_loss
def dro_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, *, log_ratio, dro_beta: float = 0.05):
    """DRO (Richemond et al. 2024, arXiv:2405.19107), in the per-token form Tinker and verl register:
    -(A * log pi - dro_beta / 2 * (log pi - log pi_old)^2), a quadratic trust region instead of a clip (on every
    model token, an advantage of 0 included; its log-ratio unclamped)."""
    return -(advantages * logprobs - 0.5 * dro_beta * (logprobs - old_logprobs).square()), torch.zeros_like(mask)


POLICY_LOSSES = {
    "ppo": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "dppo_tv": partial(dppo_loss, divergence="tv"),
    "dppo_kl": partial(dppo_loss, divergence="kl"),
    "sapo": sapo_loss,
    "gpg": gpg_loss,
    "clip_cov": partial(covariance_loss, kind="clip"),
    "kl_cov": partial(covariance_loss, kind="kl"),
    "geo_mean": gmpo_loss,
    "dro": dro_loss,
    "bypass_mode": ppo_clip_loss,  # (its old logprobs are the engine's: `dsrl.zero.trainer.Trainer.logprobs`)
}
LOSS_KNOBS = {
    "ppo": ("clip_ratio_c",),
    "bypass_mode": ("clip_ratio_c",),
    "dppo_tv": ("clip_ratio_c",),
    "dppo_kl": ("clip_ratio_c",),
    "sapo": ("tau_pos", "tau_neg"),
    "clip_cov": ("cov_ratio", "clip_cov_bounds"),
    "kl_cov": ("cov_ratio", "kl_cov_coef"),
    "dro": ("dro_beta",),
}
"""The `--algorithm.*` fields each loss takes beside the common arguments, by their names."""


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    agg: LossAgg,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's loss, 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2) (PPO's value
    clipping, as OpenRLHF and verl); `clip` None: 0.5 * (V - R)^2."""
    unclipped = (values - returns).square()
    per_token = unclipped
    if clip is not None:
        clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns).square()
        per_token = torch.maximum(unclipped, clipped)
    loss = 0.5 * aggregate(per_token, mask, agg, num_tokens, num_seqs)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        frac = ((per_token > unclipped).float() * mask).sum() / n if clip is not None else torch.zeros(())
    return loss, {"vf_clip_frac": frac}


def _clipped_objective(
    advantages: torch.Tensor, ratio: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic term per token, max(-A * ratio, -A * clip(ratio)), and where the clipped one won."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return advantages[:, None].expand_as(like) if advantages.dim() == 1 else advantages


def _ratio_metrics(clipped: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        return {
            "clip_frac": (clipped.float() * mask).sum() / n,
            "approx_kl": ((torch.expm1(-log_ratio) + log_ratio) * mask).sum() / n,
        }
