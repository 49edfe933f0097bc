"""GRPO advantages, PPO-clip loss, aggregation and KL estimators against hand-computed values."""

import math

import pytest
import torch

from dsrl.advantages import KlController
from dsrl.algorithms import (
    aggregate,
    cispo_loss,
    gae,
    grpo_advantages,
    gspo_loss,
    importance_weights,
    kl_estimate,
    overlong_penalty,
    ppo_clip_loss,
    reward_to_go,
    rloo_advantages,
    value_loss,
    whiten,
)
from dsrl.config import Config, DataConfig, ModelConfig


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


# -- the estimators and losses of --algorithm.advantage / --algorithm.policy_loss, by hand ----------


def test_groups_of_one_sample_use_no_baseline():
    """As verl: a group of one has baseline 0 (and std 1), so its advantage is its reward."""
    assert grpo_advantages(torch.tensor([0.5, -1.0]), group_size=1).tolist() == [0.5, -1.0]
    assert rloo_advantages(torch.tensor([0.3]), group_size=1).tolist() == pytest.approx([0.3])


def test_rloo_leave_one_out_baseline_by_hand():
    # r = [1, 0, 0, 1]: each baseline is the mean of the three others
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), group_size=4)
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0])


def test_reward_to_go_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # length-1, masked
    returns = reward_to_go(rewards, mask, gamma=0.5)
    assert returns.tolist() == [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # padded, fully masked
    adv, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # row 0: deltas 0.1, 0.1, 0.3 -> A2 = 0.3, A1 = 0.1 + 0.5 * 0.3, A0 = 0.1 + 0.5 * 0.25
    assert adv[0].tolist() == pytest.approx([0.225, 0.25, 0.3])
    assert returns[0].tolist() == pytest.approx([0.725, 0.85, 1.0])
    # row 1: the value past the last response token counts as 0 (not the padding's 9)
    assert adv[1].tolist() == pytest.approx([0.5, 0.6, 0.0])
    assert returns[1].tolist() == pytest.approx([0.7, 1.0, 0.0])
    assert adv[2].tolist() == [0.0, 0.0, 0.0] and returns[2].tolist() == [0.0, 0.0, 0.0]
    adv, returns = gae(rewards[:1], values[:1], mask[:1], gamma=1.0, lam=1.0)  # lam 1: Monte Carlo
    assert adv[0].tolist() == pytest.approx([0.5, 0.4, 0.3]) and returns[0].tolist() == pytest.approx([1.0] * 3)


def test_whiten_by_hand():
    out = whiten(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    assert out.tolist()[0] == pytest.approx([-math.sqrt(1.5), 0.0, math.sqrt(1.5), 0.0], rel=1e-6)


def test_dapo_overlong_penalty_by_hand():
    assert [overlong_penalty(n, 10, buffer=4, factor=1.0) for n in (6, 8, 10)] == [0.0, -0.5, -1.0]
    assert overlong_penalty(10, 10, buffer=0, factor=1.0) == 0.0


def test_seq_mean_token_sum_norm_by_hand():
    """Dr. GRPO's aggregation: token sums over a constant horizon, so a long response is not down-weighted."""
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert aggregate(values, mask, "seq_mean_token_sum_norm", horizon=4).item() == pytest.approx((4 / 4 + 4 / 4) / 2)
    assert aggregate(values, mask, "seq_mean_token_sum_norm", horizon=8).item() == pytest.approx(0.5)


def test_gspo_uses_the_sequence_ratio_by_hand():
    """Token ratios 2 and 0.5 have a geometric mean of 1: the sequence is unclipped at any range, and
    each token's gradient is the sequence's (-A * s / tokens), not its own ratio's."""
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[2.0, 0.5]])).requires_grad_()
    loss, metrics = gspo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), 3e-4, 4e-4, "token_mean")
    assert loss.item() == pytest.approx(-1.0) and metrics["clip_frac"].item() == 0.0
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-0.5, -0.5])
    # a sequence ratio of 1.1 is clipped at 1 + 4e-4 for a positive advantage
    loss, _ = gspo_loss(
        torch.full((1, 2), math.log(1.1)), old, torch.tensor([1.0]), torch.ones(1, 2), 3e-4, 4e-4, "token_mean"
    )
    assert loss.item() == pytest.approx(-(1 + 4e-4))


def test_cispo_clips_the_weight_not_the_gradient_by_hand():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0]])
    loss, metrics = cispo_loss(logp, old, torch.tensor([1.0]), mask, 0.2, 0.2, "token_mean")
    # weights sg(clip(1.5)) = 1.2 and 1.0: loss = -(1.2 * log 1.5 + 1.0 * log 1) / 2
    assert loss.item() == pytest.approx(-1.2 * math.log(1.5) / 2)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-0.6, -0.5])  # the clipped token still has a gradient
    assert metrics["clip_frac"].item() == pytest.approx(0.5)


def test_value_loss_clipping_by_hand():
    values, old, returns, mask = torch.tensor([[0.5]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1)
    loss, stats = value_loss(values, old, returns, mask, 0.2, "token_mean")
    # unclipped (0.5 - 1)^2 = 0.25; clipped value 0.2: (0.2 - 1)^2 = 0.64; the larger, halved
    assert loss.item() == pytest.approx(0.32) and stats["vf_clip_frac"].item() == 1.0
    assert value_loss(values, old, returns, mask, None, "token_mean")[0].item() == pytest.approx(0.125)


def test_losses_of_fully_masked_rows_are_zero():
    logp, old = torch.randn(2, 3), torch.randn(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, 5.0])
    for fn in (ppo_clip_loss, gspo_loss, cispo_loss):
        whole, _ = fn(logp, old, adv, mask, 0.2, 0.2, "token_mean", num_tokens=2.0)
        first, _ = fn(logp[:1], old[:1], adv[:1], mask[:1], 0.2, 0.2, "token_mean", num_tokens=2.0)
        assert whole.item() == pytest.approx(first.item()), fn.__name__


def test_adaptive_kl_controller_by_hand():
    """Ziegler et al.: beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * steps / horizon."""
    cfg = Config(model=ModelConfig(path="m"), data=DataConfig(train_path="d.jsonl"))
    cfg.algorithm.kl_coef, cfg.algorithm.kl_target, cfg.algorithm.kl_horizon = 0.1, 0.05, 10
    kl = KlController(cfg)
    kl.update(0.5)  # 10x the target: the error is clipped to 0.2
    assert kl.value == pytest.approx(0.1 * 1.02)
    kl.update(0.05)  # on target: unchanged
    assert kl.value == pytest.approx(0.1 * 1.02)
    cfg.algorithm.kl_target = None
    fixed = KlController(cfg)
    fixed.update(0.5)
    assert fixed.value == 0.1


# -- masks with holes: an agent's observation tokens between the model's ---------------------------


def test_reward_to_go_carries_across_observation_tokens_by_hand():
    """[model, obs, obs, model, model]: the first token's return is the episode's, discounted per model
    token (a hole used to restart it at 0)."""
    rewards, mask = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]]), torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0]])
    assert reward_to_go(rewards, mask, gamma=0.5).tolist() == [[0.25, 0.0, 0.0, 0.5, 1.0]]


def test_gae_carries_across_observation_tokens_by_hand():
    """The first row of test_gae_by_hand with an observation token (value 9, never read) in the middle."""
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values, mask = torch.tensor([[0.5, 9.0, 0.6, 0.7]]), torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    adv, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert adv[0].tolist() == pytest.approx([0.225, 0.0, 0.25, 0.3])
    assert returns[0].tolist() == pytest.approx([0.725, 0.0, 0.85, 1.0])


@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    from dsrl.serving.servers import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def episodes_with_and_without_holes(seed: int):
    """Two groups of 2 samples; each sample has model tokens and, in the `holes` copy, observation tokens
    (masked, with junk per-token values) inserted at scattered places. Returns (plain, holes, where the
    model tokens sit in each holes sample)."""
    from dsrl.data import Prompt, Sample

    g = torch.Generator().manual_seed(seed)
    plain, holes, places = [], [], []
    for i in range(4):
        n = 3 + i
        per_token = {k: torch.randn(n, generator=g) for k in ("old_logprobs", "ref_logprobs", "values")}
        reward = float(torch.rand(1, generator=g))
        prompt = Prompt(i // 2, [1, 2], "p", None)
        plain.append(Sample(prompt, list(range(n)), [0.0] * n, "stop", 0, reward, **per_token))
        mask, where = [], []
        for t in range(n):  # an observation of 1-2 tokens before every other model token
            if t % 2 == 1:
                mask += [0] * (1 + t % 3)
            where.append(len(mask))
            mask.append(1)
        junk = {k: torch.full((len(mask),), 99.0) for k in per_token}
        for k, v in per_token.items():
            junk[k][where] = v
        holes.append(Sample(prompt, list(range(len(mask))), [0.0] * len(mask), "stop", 0, reward, mask, **junk))
        places.append(where)
    return plain, holes, places


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus",
                                       "reinforce_plus_plus_baseline", "gae"])  # fmt: skip
def test_every_estimator_ignores_observation_tokens(world_of_one, estimator):
    """Inserting masked tokens anywhere changes no model token's advantage (or return); the masked ones get 0.
    With the KL folded into the reward and a discount, so the per-token paths are exercised too."""
    from dsrl.advantages import compute_advantages

    cfg = Config(model=ModelConfig(path="m"), data=DataConfig(train_path="d.jsonl"))
    cfg.rollout.n_samples, cfg.rollout.max_new_tokens = 2, 64
    a = cfg.algorithm
    a.advantage, a.gamma, a.lam, a.kl_in_reward = estimator, 0.9, 0.8, True
    plain, holes, places = episodes_with_and_without_holes(0)
    stats_plain = compute_advantages(plain, cfg, kl_coef=0.1)
    stats_holes = compute_advantages(holes, cfg, kl_coef=0.1)
    for p, h, where in zip(plain, holes, places):
        for key in ("advantages", "returns") if estimator == "gae" else ("advantages",):
            assert getattr(h, key)[where].tolist() == pytest.approx(getattr(p, key).tolist(), abs=1e-6), key
            others = [t for t in range(len(h.response_ids)) if t not in where]
            assert getattr(h, key)[others].abs().max().item() == 0.0, key
    assert stats_holes == pytest.approx(stats_plain)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "seq_mean_token_sum_norm"])
def test_every_loss_ignores_observation_tokens(agg):
    """PPO, GSPO, CISPO, the value loss and the KL term: the same loss and gradient with masked tokens
    (junk values) inserted between the model's."""
    g = torch.Generator().manual_seed(1)
    logp, old, ref = (torch.randn(2, 4, generator=g) for _ in range(3))
    adv, returns = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    where = [0, 2, 3, 5]  # model tokens among 7 positions
    hole_mask = torch.zeros(2, 7)
    hole_mask[:, where] = mask

    def spread(x):
        out = torch.full((2, 7), 50.0)
        out[:, where] = x
        return out

    def losses(lp, o, a, v, r, rf, m):
        out = [fn(lp, o, a, m, 0.2, 0.28, agg, num_tokens=6.0, num_seqs=2.0, horizon=8)[0]
               for fn in (ppo_clip_loss, gspo_loss, cispo_loss)]  # fmt: skip
        out.append(value_loss(v, o, r, m, 0.2, "token_mean", 6.0, 2.0)[0])  # the critic aggregates so
        out.append(aggregate(kl_estimate(lp, rf, "k3"), m, agg, 6.0, 2.0, 8))
        return out

    a = logp.clone().requires_grad_()
    b = spread(logp).requires_grad_()
    plain = losses(a, old, adv, a, returns, ref, mask)
    holes = losses(b, spread(old), spread(adv), b, spread(returns), spread(ref), hole_mask)
    for x, y in zip(plain, holes):
        assert y.item() == pytest.approx(x.item(), rel=1e-6)
    sum(plain).backward()
    sum(holes).backward()
    torch.testing.assert_close(b.grad[:, where], a.grad, atol=1e-6, rtol=0)
    assert b.grad[:, [1, 4, 6]].abs().max().item() == 0.0
