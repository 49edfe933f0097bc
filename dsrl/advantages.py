"""A batch's advantages (and, with a critic, its returns), by `--algorithm.advantage`.

Every rank holds whole groups, so group baselines need no communication; the estimators that
normalise over the batch (REINFORCE++, GAE's whitening) reduce their statistics over every rank.
Results go into each sample's response-aligned `advantages`, and `returns` (the critic's targets) with GAE.
"""

import torch
import torch.distributed as dist

from dsrl.algorithms import (
    gae,
    grpo_advantages,
    opo_advantages,
    optimal_token_baseline,
    overlong_penalty,
    passk_advantages,
    reward_to_go,
    rloo_advantages,
    whiten,
)
from dsrl.collectives import reduce_device
from dsrl.config import Config
from dsrl.data import Sample


class KlController:
    """The KL coefficient: fixed, or adaptive toward `kl_target` nats per token (Ziegler et al. 2019,
    arXiv:1909.08593): beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * steps / horizon."""

    def __init__(self, cfg: Config):
        self.value = cfg.algorithm.kl_coef
        self.target, self.horizon = cfg.algorithm.kl_target, cfg.algorithm.kl_horizon

    def update(self, kl: float, steps: int = 1) -> None:
        if self.target:
            error = min(max(kl / self.target - 1, -0.2), 0.2)
            self.value *= 1 + error * steps / self.horizon


def padded(samples: list[Sample], values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Response-aligned per-sample tensors as one right-padded [B, T] float64 tensor, and the loss mask
    (model tokens 1; an agent's observation tokens and the padding 0)."""
    width = max(len(s.response_ids) for s in samples)
    out = torch.zeros(len(samples), width, dtype=torch.float64)
    mask = torch.zeros(len(samples), width, dtype=torch.float64)
    for i, (s, v) in enumerate(zip(samples, values)):
        out[i, : len(s.response_ids)] = v
        mask[i, : len(s.response_ids)] = torch.tensor(s.mask(), dtype=torch.float64)
    return out, mask


def token_rewards(samples: list[Sample], cfg: Config, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] rewards: each sample's reward (plus DAPO's overlong penalty) on its last model token, less
    kl_coef * (log pi_old - log pi_ref) on every model token when the KL is folded into the reward."""
    a = cfg.algorithm
    rows = []
    for s in samples:
        r = torch.zeros(len(s.response_ids), dtype=torch.float64)
        model = [i for i, m in enumerate(s.mask()) if m]
        if model:
            r[model[-1]] = s.reward + overlong_penalty(
                len(s.response_ids), cfg.rollout.max_new_tokens, a.overlong_buffer, a.overlong_penalty
            )
        if a.kl_in_reward and kl_coef > 0:
            kl = (s.old_logprobs - s.ref_logprobs).to(torch.float64)
            r -= kl_coef * kl * torch.tensor(s.mask(), dtype=torch.float64)
        rows.append(r)
    return padded(samples, rows)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over this rank's tokens: how much of the return the critic
    predicted (before this step's update); 1 is perfect, 0 no better than a constant."""
    n = mask.sum().clamp(min=1)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * mask).sum() / n
        return ((x - mean).square() * mask).sum() / n

    return float(1 - var(returns - values) / var(returns).clamp(min=1e-12))


def batch_stats(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """(sum, sum of squares, count) of the masked values over every rank."""
    t = torch.tensor([(values * mask).sum(), (values.square() * mask).sum(), mask.sum()], dtype=torch.float64)
    t = t.to(reduce_device())
    dist.all_reduce(t)
    return tuple(t.tolist())


def distill_advantages(samples: list[Sample], adv: torch.Tensor, mask: torch.Tensor, coef: float, with_reward: bool):
    """On-policy distillation: each model token's advantage less coef * its reverse KL to the teacher, the student's
    (sampling) logprob minus the teacher's, or (not `with_reward`) that alone; and the batch's mean reverse KL. A
    sample the teacher did not score (skipped: on_reward_error skip) has none."""
    student, _ = padded(samples, [torch.tensor(s.engine_logprobs, dtype=torch.float64) for s in samples])
    teacher, _ = padded(samples, [torch.tensor(s.teacher_logprobs or s.engine_logprobs, dtype=torch.float64)
                                  for s in samples])  # fmt: skip
    reverse_kl = (student - teacher) * mask
    return (adv if with_reward else 0.0) - coef * reverse_kl, (reverse_kl.sum() / mask.sum().clamp(min=1)).item()


def compute_advantages(samples: list[Sample], cfg: Config, kl_coef: float) -> dict[str, float]:
    """Fill every sample's `advantages` (and `returns` with gae); returns metrics."""
    a, n, extra = cfg.algorithm, cfg.rollout.n_samples, {}
    rewards, mask = token_rewards(samples, cfg, kl_coef)
    scores = rewards.sum(-1)  # the outcome (and any in-reward KL) as one number per sample
    if a.advantage in ("grpo", "dr_grpo"):
        adv = grpo_advantages(scores, n, a.norm_adv_by_std and a.advantage == "grpo")[:, None] * mask
    elif a.advantage == "rloo":
        adv = rloo_advantages(scores, n)[:, None] * mask
    elif a.advantage == "reinforce_plus_plus":
        returns = reward_to_go(rewards, mask, a.gamma)
        adv = whiten(returns, mask, batch_stats(returns, mask))
    elif a.advantage == "reinforce_plus_plus_baseline":
        grouped = scores.view(-1, n)
        baseline = grouped.mean(dim=1, keepdim=True) if n > 1 else 0.0  # a group of one: none (as verl)
        centred = (grouped - baseline).reshape(-1)[:, None] * mask
        adv = whiten(centred, mask, batch_stats(centred, mask))
    elif a.advantage == "remax":  # the return less the greedy response's reward (`dsrl.rollout.rollouts.generate`)
        adv = reward_to_go(rewards, mask) - torch.tensor([s.reward_baseline for s in samples])[:, None] * mask
    elif a.advantage == "opo":
        adv = opo_advantages(scores, mask.sum(-1), n)[:, None] * mask
    elif a.advantage == "gpg":  # GPG's alpha: the batch's samples over those with a nonzero reward (all ranks)
        nonzero, _, count = batch_stats((scores != 0).double()[:, None], torch.ones(len(samples), 1))
        adv = count / max(nonzero, 1) * grpo_advantages(scores, n, norm_by_std=False)[:, None] * mask
    elif a.advantage == "grpo_passk":
        adv = passk_advantages(scores, n, a.norm_adv_by_std)[:, None] * mask
    elif a.advantage == "gdpo":  # each reward group-normalised on its own, weighted, summed, whitened
        w_model, w_rule = cfg.reward_model.w_model, cfg.reward_model.w_rule
        parts = [(w_model, [s.reward_model or 0.0 for s in samples]), (w_rule, [s.reward_rule or 0.0 for s in samples])]
        adv = sum(w * grpo_advantages(torch.tensor(r), n, a.norm_adv_by_std).double() for w, r in parts)
        adv = whiten(adv[:, None] * mask, mask, batch_stats(adv[:, None] * mask, mask))
    elif a.advantage == "optimal_token_baseline":
        old, _ = padded(samples, [s.old_logprobs.double() for s in samples])
        squares, _ = padded(samples, [s.sum_pi_squared.double() for s in samples])
        adv = optimal_token_baseline(reward_to_go(rewards, mask), old, squares, mask, n)
    elif a.advantage == "gae":
        values, _ = padded(samples, [s.values.to(torch.float64) for s in samples])
        adv, returns = gae(rewards, values, mask, a.gamma, a.lam)
        adv = whiten(adv, mask, batch_stats(adv, mask))
        for s, row in zip(samples, returns):
            s.returns = row[: len(s.response_ids)].float()
        extra["critic/explained_variance"] = explained_variance(values, returns, mask)
    else:
        raise ValueError(f"--algorithm.advantage={a.advantage!r}: unknown estimator")
    if cfg.distill.teacher_path:
        adv, extra["distill/reverse_kl"] = distill_advantages(
            samples, adv, mask, cfg.distill.coef, cfg.distill.with_reward
        )
    adv = adv.float()
    for s, row in zip(samples, adv):
        s.advantages = row[: len(s.response_ids)]
    total, squares, count = batch_stats(adv.double(), mask)
    mean = total / max(count, 1)
    groups = scores.view(-1, n)
    no_signal = float((groups.max(dim=1).values == groups.min(dim=1).values).float().mean()) if n > 1 else 0.0
    return extra | {
        "advantage/mean": mean,
        "advantage/std": max(squares / max(count, 1) - mean * mean, 0.0) ** 0.5,
        "advantage/no_signal_group_frac": no_signal,
    }
