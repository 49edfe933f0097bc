"""GRPO advantages, PPO-clip loss, aggregation and KL estimators against hand-computed values."""

import math

import pytest
import torch

from dsrl.algorithms import (
    aggregate,
    entropy_from_logits,
    grpo_advantages,
    importance_weights,
    kl_estimate,
    ppo_clip_loss,
)


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = grpo_advantages(rewards, group_size=4, norm_by_std=True)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std]
    assert adv[:4].tolist() == pytest.approx(expected, rel=1e-5)
    # a group whose rewards are all equal carries no signal
    assert adv[4:].tolist() == [0.0] * 4


def test_grpo_advantages_without_std():
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 0.0, 0.0]), group_size=2, norm_by_std=False)
    assert adv.tolist() == [1.0, -1.0, 0.0, 0.0]


def test_ppo_loss_unclipped_token_mean():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = ppo_clip_loss(logp, old, torch.tensor([2.0]), mask, 0.2, 0.2, "token_mean")
    assert loss.item() == pytest.approx(-2.0)  # ratio 1: -A averaged over the 2 response tokens
    assert metrics["clip_frac"].item() == 0.0


def test_ppo_loss_clipping_by_hand():
    # ratios 1.5 (A>0: clipped to 1.2), 0.5 (A<0: clipped to 0.8), 1.1 (A>0, inside the range)
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, metrics = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, "token_mean")
    expected = (-1.0 * 1.2 + 1.0 * 0.8 - 1.0 * 1.1) / 3
    assert loss.item() == pytest.approx(expected)
    assert metrics["clip_frac"].item() == pytest.approx(2 / 3)


def test_ppo_loss_clip_higher():
    old = torch.zeros(1, 1)
    logp = torch.log(torch.tensor([[1.5]]))
    loss, _ = ppo_clip_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.28, "token_mean")
    assert loss.item() == pytest.approx(-1.28)


def test_token_mean_vs_seq_mean():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(8 / 5)
    assert aggregate(values, mask, "seq_mean").item() == pytest.approx((1.0 + 4.0) / 2)


def test_micro_batch_denominators_sum_to_the_mini_batch_mean():
    values = torch.tensor([[1.0, 2.0], [3.0, 0.0], [5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    for agg in ("token_mean", "seq_mean"):
        whole = aggregate(values, mask, agg)
        parts = aggregate(values[:1], mask[:1], agg, 5.0, 3) + aggregate(values[1:], mask[1:], agg, 5.0, 3)
        assert parts.item() == pytest.approx(whole.item())


def test_kl_estimators_by_hand():
    logp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.4)])
    r = [math.log(2.0), math.log(0.5)]  # log(p / ref)
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx(r)
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.5 * x * x for x in r])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-x) - 1 + x for x in r])
    assert kl_estimate(logp, logp, "k3").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k4")


def test_k3_is_unbiased_for_kl():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(5), 0)
    q = torch.softmax(torch.randn(5), 0)
    samples = torch.multinomial(p, 200_000, replacement=True)
    estimate = kl_estimate(p.log()[samples], q.log()[samples], "k3").mean().item()
    exact = (p * (p.log() - q.log())).sum().item()
    assert estimate == pytest.approx(exact, rel=0.05)


def test_entropy_of_uniform_logits():
    assert entropy_from_logits(torch.zeros(2, 8)).tolist() == pytest.approx([math.log(8)] * 2)


def test_dual_clip_caps_the_loss_of_a_negative_advantage():
    # ratio 5 with A = -1: clipped PPO alone gives max(5, 0.8) = 5; dual-clip caps it at -A * c = 3
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[5.0, 5.0]]))
    adv = torch.tensor([[-1.0, 1.0]])  # a positive advantage is never dual-clipped: min(-5, -1.2) = -1.2
    loss, _ = ppo_clip_loss(logp, old, adv, torch.ones(1, 2), 0.2, 0.2, "token_mean", clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    loss, _ = ppo_clip_loss(logp, old, adv, torch.ones(1, 2), 0.2, 0.2, "token_mean")
    assert loss.item() == pytest.approx((5.0 - 1.2) / 2)


def test_a_very_stale_token_cannot_blow_up_the_loss():
    """A token whose log-ratio is 25 (sampled under weights long gone) gave exp(25) = 7.2e10; the ratio is
    clamped at exp(20) before the clip, and dual-clip caps a negative advantage's loss at 3."""
    logp, old, adv, mask = torch.tensor([[25.0]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1)
    loss, _ = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, "token_mean")
    assert loss.item() == pytest.approx(math.exp(20), rel=1e-5)
    loss, _ = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, "token_mean", clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert importance_weights(torch.tensor([30.0]), torch.zeros(1), "tis", 1e12).item() == pytest.approx(math.exp(20))
    assert kl_estimate(torch.tensor([-30.0]), torch.zeros(1), "k3").item() == pytest.approx(math.exp(20) - 21)
    assert kl_estimate(torch.tensor([-2.0]), torch.zeros(1), "k3").item() == pytest.approx(math.exp(2) - 1 - 2)


def test_equal_rewards_give_exactly_zero_advantage():
    """In float32 a group of eight 0.7 rewards had a spurious +-0.056 advantage (mean 1 ulp off, std 6e-8)."""
    adv = grpo_advantages(torch.tensor([0.7] * 8, dtype=torch.float64), group_size=8)
    assert adv.dtype == torch.float32 and adv.abs().max().item() < 1e-6
