"""The advantage estimators, policy losses, aggregation and KL estimators against hand-computed values, and the ones
verl 0.9.1 has against verl's own functions where verl is installed."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from dsrl.advantages import KlController
from dsrl.algorithms import (
    LOSS_KNOBS,
    POLICY_LOSSES,
    aggregate,
    cispo_loss,
    covariance_loss,
    dppo_loss,
    dro_loss,
    gae,
    gmpo_loss,
    gpg_loss,
    grpo_advantages,
    gspo_loss,
    importance_weights,
    kl_estimate,
    opo_advantages,
    optimal_token_baseline,
    overlong_penalty,
    passk_advantages,
    ppo_clip_loss,
    reward_to_go,
    rloo_advantages,
    sapo_loss,
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


REWARD_PARTS = ("reward_baseline", "reward_model", "reward_rule")


def episodes_with_and_without_holes(seed: int):
    """Two groups of 2 samples; each sample has model tokens and, in the `holes` copy, observation tokens
    (masked, with junk per-token values) inserted at scattered places. Returns (plain, holes, where the
    model tokens sit in each holes sample)."""
    from dsrl.data import Prompt, Sample

    g = torch.Generator().manual_seed(seed)
    plain, holes, places = [], [], []
    for i in range(4):
        n = 3 + i
        per_token = {
            k: torch.randn(n, generator=g) for k in ("old_logprobs", "ref_logprobs", "values", "sum_pi_squared")
        }
        reward, extra = float(torch.rand(1, generator=g)), {k: float(torch.rand(1, generator=g)) for k in REWARD_PARTS}
        prompt = Prompt(i // 2, [1, 2], "p", None)
        plain.append(Sample(prompt, list(range(n)), [0.0] * n, "stop", 0, reward, **per_token, **extra))
        mask, where = [], []
        for t in range(n):  # an observation of 1-2 tokens before every other model token
            if t % 2 == 1:
                mask += [0] * (1 + t % 3)
            where.append(len(mask))
            mask.append(1)
        junk = {k: torch.full((len(mask),), 99.0) for k in per_token}
        for k, v in per_token.items():
            junk[k][where] = v
        holes.append(
            Sample(prompt, list(range(len(mask))), [0.0] * len(mask), "stop", 0, reward, mask, **junk, **extra)
        )
        places.append(where)
    return plain, holes, places


ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae", "remax", "opo",
              "gpg", "grpo_passk", "gdpo", "optimal_token_baseline"]  # fmt: skip


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_ignores_observation_tokens(world_of_one, estimator):
    """Inserting masked tokens anywhere changes no model token's advantage (or return); the masked ones get 0.
    With the KL folded into the reward and a discount, so the per-token paths are exercised too."""
    from dsrl.advantages import compute_advantages

    cfg = Config(model=ModelConfig(path="m"), data=DataConfig(train_path="d.jsonl"))
    cfg.rollout.n_samples, cfg.rollout.max_new_tokens = 2, 64
    a = cfg.algorithm
    a.advantage, a.gamma, a.lam, a.kl_in_reward = estimator, 0.9, 0.8, True
    cfg.reward_model.w_rule = 0.5  # (gdpo's second reward)
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
    """Every policy loss, the value loss and the KL term: the same loss and gradient with masked tokens (junk values)
    inserted between the model's."""
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
        out = []
        for name, fn in POLICY_LOSSES.items():
            torch.manual_seed(0)  # (clip_cov's draw: the same candidates, in the same order, draw the same tokens)
            knobs = {"cov_ratio": 0.5, "clip_cov_bounds": (-5.0, 5.0)} if name.endswith("_cov") else {}
            out.append(fn(lp, o, a, m, 0.2, 0.28, agg, num_tokens=6.0, num_seqs=2.0, horizon=8, **knobs)[0])
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


# -- the losses and estimators verl 0.9.1 added: by hand, then against verl's own functions ------------------------


def token_batch(seed: int, rows: int = 4, width: int = 6):
    """(logprobs with a gradient, old logprobs, per-token advantages, a mask with holes and every row non-empty)."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.nn.functional.logsigmoid(torch.randn(rows, width, generator=g) + 1)
    old = (logp + 0.3 * torch.randn(rows, width, generator=g)).clamp(max=-1e-3)
    mask = (torch.rand(rows, width, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    return logp.requires_grad_(), old, torch.randn(rows, width, generator=g), mask


def test_dppo_tv_masks_tokens_moved_past_the_threshold_toward_their_advantage_by_hand():
    """p_old 0.5 everywhere. p 0.7 with A > 0 moved +0.2 > 0.15: masked; p 0.6, A > 0: kept; p 0.3, A < 0 moved -0.2:
    masked; p 0.3, A > 0 moved against its advantage: kept. A fifth token is padding (mask 0)."""
    old = torch.log(torch.full((1, 5), 0.5))
    logp = torch.log(torch.tensor([[0.7, 0.6, 0.3, 0.3, 0.9]])).requires_grad_()
    adv, mask = torch.tensor([[1.0, 2.0, -1.0, 1.0, 5.0]]), torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, metrics = dppo_loss(logp, old, adv, mask, 0.15, 0.15, "token_mean", clip_ratio_c=1.1)
    # kept: -A * sg(min(ratio, 1.1)) * log p: ratios 1.2 (truncated to 1.1) and 0.6
    assert loss.item() == pytest.approx(-(2.0 * 1.1 * math.log(0.6) + 1.0 * 0.6 * math.log(0.3)) / 4)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -2.0 * 1.1 / 4, 0.0, -0.6 / 4, 0.0])
    assert metrics["clip_frac"].item() == pytest.approx(0.5)


def test_dppo_kl_uses_the_binary_kl_on_the_advantages_side_by_hand():
    """p_old 0.5 -> p 0.7: KL(Bern(0.5) || Bern(0.7)) = 0.5 log(0.5/0.7) + 0.5 log(0.5/0.3) = 0.0872 > 0.05, so a
    positive advantage masks it and a negative one (it moved against it) does not."""
    kl = 0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)
    old, logp = torch.log(torch.full((1, 2), 0.5)), torch.log(torch.tensor([[0.7, 0.7]]))
    loss, metrics = dppo_loss(logp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), kl - 1e-3, kl - 1e-3,
                              "token_mean", divergence="kl")  # fmt: skip
    assert loss.item() == pytest.approx(1.4 * math.log(0.7) / 2) and metrics["clip_frac"].item() == 0.5
    loss, _ = dppo_loss(logp, old, torch.tensor([[1.0, -0.5]]), torch.ones(1, 2), kl + 1e-3, kl + 1e-3, "token_mean",
                        divergence="kl")  # fmt: skip
    assert loss.item() == pytest.approx((-1.4 * math.log(0.7) + 0.5 * 1.4 * math.log(0.7)) / 2)


def test_sapo_gate_by_hand():
    """At ratio 1 the gate is 4/tau * sigmoid(0) = 2/tau and its gradient PPO's (-A per token); at ratio 1.5 with
    A < 0 it is 4/tau_neg * sigmoid(tau_neg * 0.5)."""
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.0, math.log(1.5)]]).requires_grad_()
    loss, _ = sapo_loss(logp, old, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), 0.2, 0.2, "token_mean",
                        tau_pos=1.0, tau_neg=2.0)  # fmt: skip
    gate = 4 / 2.0 / (1 + math.exp(-2.0 * 0.5))
    assert loss.item() == pytest.approx((-2.0 * 2 / 1.0 + 1.0 * gate) / 2)
    loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-2.0 / 2)


def test_gpg_loss_is_plain_policy_gradient_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    loss, _ = gpg_loss(logp, torch.zeros(1, 2), torch.tensor([2.0]), torch.tensor([[1.0, 0.0]]), 0.2, 0.2, "token_mean")
    assert loss.item() == pytest.approx(-2.0 * math.log(0.5))
    loss.backward()
    assert logp.grad.tolist()[0] == [-2.0, 0.0]


def test_clip_cov_drops_the_gradient_of_an_in_bounds_covariance_token_by_hand():
    """Advantages [3, -1, -1, -1] (mean 0), logprobs [0, -2, -2, -2] (mean -1.5): covariances 4.5, then 0.5 each.
    Only the first lies in (1, 5): it loses its gradient, the others keep PPO's (ratio 1, inside the clip)."""
    logp = torch.tensor([[0.0, -2.0, -2.0, -2.0]]).requires_grad_()
    adv = torch.tensor([[3.0, -1.0, -1.0, -1.0]])
    loss, metrics = covariance_loss(logp, logp.detach(), adv, torch.ones(1, 4), 0.2, 0.2, "token_mean",
                                    kind="clip", cov_ratio=0.5, clip_cov_bounds=(1.0, 5.0))  # fmt: skip
    assert loss.item() == pytest.approx(3 / 4)  # -A * ratio over the three kept tokens
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.25, 0.25, 0.25])
    assert metrics["clip_frac"].item() == pytest.approx(0.25)


def test_kl_cov_penalises_the_top_covariance_token_by_hand():
    """Covariances 5.25, 0.25, 0.75, 0.75: the first token alone gets kl_cov_coef * |log ratio|; no clip anywhere."""
    old = torch.tensor([[0.0, -2.0, -2.0, -2.0]])
    logp = (old + torch.tensor([[0.5, 0.5, 0.0, 0.0]])).requires_grad_()
    adv = torch.tensor([[3.0, -1.0, -1.0, -1.0]])
    loss, _ = covariance_loss(logp, old, adv, torch.ones(1, 4), 0.2, 0.2, "token_mean", kind="kl", cov_ratio=0.25,
                              kl_cov_coef=0.1)  # fmt: skip
    r = math.exp(0.5)
    assert loss.item() == pytest.approx((-3 * r + 0.1 * 0.5 + r + 1 + 1) / 4)


def test_geo_mean_clips_log_ratios_on_the_advantages_side_by_hand():
    """Log-ratios 0.5 and -0.5 with clips 0.4: a positive advantage clips the first only (ratio exp(-0.05)), a
    negative one the second only (exp(0.05)); the third token is padding with a junk log-ratio."""
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.5, -0.5, 9.0], [0.5, -0.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss, _ = gmpo_loss(logp, old, torch.tensor([1.0, -1.0]), mask, 0.4, 0.4, "token_mean")
    assert loss.item() == pytest.approx((-math.exp(-0.05) + math.exp(0.05)) / 2)


def test_dro_quadratic_penalty_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 0.5]]))
    loss, _ = dro_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.2, "token_mean", dro_beta=0.5)
    assert loss.item() == pytest.approx((-(math.log(0.5) - 0.25 * math.log(2) ** 2) - math.log(0.5)) / 2)


def test_bypass_mode_and_the_token_baseline_keep_their_old_logprobs_pass_apart(world_of_one):
    """bypass_mode's old logprobs are the engine's (no pass, and the update must not replace them with its own);
    optimal_token_baseline reads the old policy before the update, so its pass is always run."""
    from dsrl.auto import old_from_update
    from dsrl.data import Prompt, Sample
    from dsrl.zero.trainer import Trainer

    cfg = Config(model=ModelConfig(path="m"), data=DataConfig(train_path="d.jsonl"))
    assert old_from_update(cfg)
    for field, value in (("policy_loss", "bypass_mode"), ("advantage", "optimal_token_baseline")):
        other = Config(model=ModelConfig(path="m"), data=DataConfig(train_path="d.jsonl"))
        setattr(other.algorithm, field, value)
        assert not old_from_update(other), value
    cfg.algorithm.policy_loss = "bypass_mode"
    sample = Sample(Prompt(0, [1], "p", None), [3, 4], [-0.5, -1.5], "stop", 0)
    trainer = Trainer.__new__(Trainer)  # (no engines: the bypass runs no pass)
    trainer.cfg, trainer.pad_id, trainer.ref, trainer.critic = cfg, 0, None, None
    trainer.actor = SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace()))  # (a text model)
    assert trainer.logprobs([sample], 0)
    assert sample.old_logprobs.tolist() == [-0.5, -1.5]


def test_opo_length_weighted_baseline_by_hand():
    """Rewards 1 and 0 with 1 and 3 tokens: baseline (1 * 1 + 0 * 3) / 4 = 0.25; a group of one has none."""
    assert opo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 3.0]), 2).tolist() == [0.75, -0.25]
    assert opo_advantages(torch.tensor([0.5]), torch.tensor([2.0]), 1).tolist() == [0.5]


def test_passk_advantage_goes_to_the_best_sample_alone_by_hand():
    adv = passk_advantages(torch.tensor([0.0, 1.0, 0.25, 0.0]), 4, norm_by_std=False)
    assert adv.tolist() == [0.0, 0.75, 0.0, 0.0]
    std = torch.tensor([0.0, 1.0, 0.25, 0.0]).std().item()
    assert passk_advantages(torch.tensor([0.0, 1.0, 0.25, 0.0]), 4)[1].item() == pytest.approx(0.75 / (std + 1e-6))


def test_optimal_token_baseline_by_hand():
    """A group of 2: rewards 1 (2 tokens) and 0 (1 token), every p 0.5 and sum p^2 0.5, so each token adds
    1 - 1 + 0.5 to W. B_0 = (1 * 0.5 + 0 * 0.5) / 1 = 0.5; the longer one's second token runs on alone: B 0."""
    returns, mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    old, squares = torch.log(torch.full((2, 2), 0.5)), torch.full((2, 2), 0.5)
    adv = optimal_token_baseline(returns, old, squares, mask, 2)
    assert adv.flatten().tolist() == pytest.approx([0.5, 1.0, -0.5, 0.0])


def test_sum_pi_squared_of_the_old_logprobs_pass_by_hand():
    from dsrl.zero.actor import token_logprobs

    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])  # p = (1/4, 3/4) and (1/2, 1/2)
    logprobs, squares = token_logprobs(logits, torch.tensor([1, 0]), 1.0, "sum_pi_squared")
    assert squares.tolist() == pytest.approx([1 / 16 + 9 / 16, 0.5]) and logprobs.tolist() == pytest.approx(
        [math.log(0.75), math.log(0.5)]
    )


def test_new_estimators_through_the_batch_by_hand(world_of_one):
    """remax (the greedy response's reward as baseline), gpg (group-centred, times batch / nonzero rewards) and gdpo
    (each reward normalised in its group, weighted, then whitened) on 2 groups of 2 one-token samples."""
    from dsrl.advantages import compute_advantages
    from dsrl.data import Prompt, Sample

    def batch(rewards, **parts):
        return [Sample(Prompt(i // 2, [1], "p", None), [3], [0.0], "stop", 0, r, old_logprobs=torch.zeros(1),
                       **{k: v[i] for k, v in parts.items()}) for i, r in enumerate(rewards)]  # fmt: skip

    cfg = Config(model=ModelConfig(path="m"), data=DataConfig(train_path="d.jsonl"))
    cfg.rollout.n_samples = 2
    cfg.algorithm.advantage = "remax"
    samples = batch([1.0, 0.0, 0.5, 0.5], reward_baseline=[0.25, 0.25, 1.0, 1.0])
    compute_advantages(samples, cfg, 0.0)
    assert [s.advantages.item() for s in samples] == [0.75, -0.25, -0.5, -0.5]
    cfg.algorithm.advantage = "gpg"
    samples = batch([1.0, 0.0, 0.0, 0.0])
    compute_advantages(samples, cfg, 0.0)
    assert [s.advantages.item() for s in samples] == [2.0, -2.0, 0.0, 0.0]  # alpha 4 / 1
    cfg.algorithm.advantage, cfg.reward_model.w_model, cfg.reward_model.w_rule = "gdpo", 1.0, 0.5
    samples = batch([0.0] * 4, reward_model=[1.0, 0.0, 0.0, 1.0], reward_rule=[0.0, 0.0, 1.0, 0.0])
    compute_advantages(samples, cfg, 0.0)
    g = 0.5 / math.sqrt(0.5)  # a group of (1, 0), normalised
    summed = [g, -g, -g + 0.5 * g, g - 0.5 * g]
    std = math.sqrt(sum(x * x for x in summed) / 4)  # their mean is 0
    assert [s.advantages.item() for s in samples] == pytest.approx([x / std for x in summed], rel=1e-5)


def test_remax_baseline_is_a_greedy_response_generated_with_each_group(toy_weights, tmp_path):
    """On the synchronous and the asynchronous schedules: each group keeps n_samples samples, and their
    reward_baseline is the reward of the prompt's greedy response (asked of the same server separately)."""
    from dsrl.data import PromptDataset
    from dsrl.rewards.rewarder import Rewarder
    from dsrl.rollout.manager import PromptStream, RolloutManager
    from dsrl.rollout.rollouts import generate, sampling_params
    from dsrl.serving.client import RolloutClient
    from dsrl.serving.fleet import start_fleet
    from dsrl.tasks import toy

    cfg = Config(model=ModelConfig(path=str(toy_weights)), data=DataConfig(train_path=str(tmp_path / "rows.jsonl")))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in toy.make_rows(4, 0)))
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples, cfg.rollout.max_new_tokens = 4, 3, 5
    cfg.algorithm.advantage, cfg.algorithm.reward_workers, cfg.data.shuffle = "remax", 0, False
    tokenizer = toy.build_tokenizer()
    fleet = start_fleet(cfg.rollout, str(toy_weights), tmp_path, 0, "embedded")
    client = RolloutClient(fleet.urls, timeout_s=60)
    client.call_all("/update_weight_version", {"new_version": "0", "abort_all_requests": False})
    try:
        dataset, rewarder = PromptDataset(cfg.data, tokenizer), Rewarder(cfg.algorithm, tokenizer, toy.reward)
        prompts = dataset.batch(0, 4, 0, 1)
        greedy = {}
        for p in prompts:
            body = {"input_ids": p.prompt_ids, "sampling_params": sampling_params(cfg.rollout, greedy=True)}
            out = client.run(client.generate(body))
            greedy[p.index] = toy.reward(p.text, tokenizer.decode(out["output_ids"]), p.answer)
        sync = client.run(generate(client, prompts, cfg.rollout, 0, None, rewarder, baseline=True))
        cfg.rollout.placement = "disaggregate"
        manager = RolloutManager(client, cfg, PromptStream(dataset, 4, 0, 1), rewarder)
        manager.start()
        try:
            unsync = manager.collect(0).samples
        finally:
            manager.stop()
        for samples in (sync, unsync):
            assert len(samples) == 12
            assert sorted(s.prompt.index for s in samples) == sorted(3 * [p.index for p in prompts])
            assert all(s.reward_baseline == greedy[s.prompt.index] for s in samples)
    finally:
        client.close()
        fleet.stop()


def verl_core_algos():
    """verl 0.9.1's own `core_algos`, or a skip saying why (dsrl does not depend on verl)."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError as e:
        pytest.skip(f"verl is not importable here ({e}): `pip install --no-deps verl==0.9.1` (+ tensordict, pyvers, "
                    "omegaconf, codetiming, orjson) runs the comparison with verl's own functions")  # fmt: skip
    return core_algos


VERL_AGG = {
    "token_mean": "token-mean",
    "seq_mean": "seq-mean-token-mean",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
                                  "bypass_mode"])  # fmt: skip
def test_new_losses_match_verls_own_functions(name):
    """Loss and gradient of each loss verl 0.9.1 registers, on random inputs with holes in the mask, at each
    aggregation (sapo: verl always aggregates seq-mean-token-mean; geo_mean ignores it on both sides). clip_cov with
    cov_ratio 1 takes every candidate, so verl's random draw and dsrl's agree."""
    core = verl_core_algos()
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    ratio = 1.0 if name == "clip_cov" else 0.1
    knobs = {"tau_pos": 1.0, "tau_neg": 1.3, "cov_ratio": ratio, "clip_cov_bounds": (0.01, 5.0), "kl_cov_coef": 0.1,
             "dro_beta": 0.05, "clip_ratio_c": 1.5}  # fmt: skip
    losses = PolicyLossConfig(loss_mode=name, clip_cov_ratio=ratio, clip_cov_lb=0.01, clip_cov_ub=5.0,
                              kl_cov_ratio=ratio, ppo_kl_coef=0.1, dro_beta=0.05)  # fmt: skip
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                         clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=1.5, tau_pos=1.0, tau_neg=1.3,
                         policy_loss=losses)  # fmt: skip
    ours = {k: knobs[k] for k in LOSS_KNOBS.get(name, ())}
    for seed, agg in enumerate(["seq_mean"] if name == "sapo" else VERL_AGG):
        logp, old, adv, mask = token_batch(seed, rows=8, width=12)
        theirs = logp.detach().clone().requires_grad_()
        want, _ = core.get_policy_loss_fn(name)(old, theirs, adv, mask, VERL_AGG[agg], config)
        got, _ = POLICY_LOSSES[name](logp, old, adv, mask, 0.1, 0.15, agg, horizon=12, **ours)
        assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7), agg
        (got + want).backward()
        torch.testing.assert_close(logp.grad, theirs.grad, rtol=1e-5, atol=1e-7)


def random_groups(seed: int, holes: bool = False, groups: int = 16, n: int = 4):
    """Samples of `groups` prompts x n, 1-12 response tokens (with `holes`, observation tokens between them), rewards
    in {0, 0.5, 1} and the per-sample fields the new estimators read; their verl-shaped tensors beside them."""
    from dsrl.advantages import padded
    from dsrl.data import Prompt, Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(groups * n):
        length = int(torch.randint(1, 13, (1,), generator=g))
        loss_mask = (torch.rand(length, generator=g) > 0.3).int().tolist() if holes else None
        if loss_mask is not None:
            loss_mask[-1] = 1
        reward = float(torch.randint(0, 3, (1,), generator=g)) / 2
        parts = {k: float(torch.rand(1, generator=g)) for k in REWARD_PARTS}
        old = torch.nn.functional.logsigmoid(torch.randn(length, generator=g))
        squares, prompt = torch.rand(length, generator=g), Prompt(i // n, [1], "p", None)
        samples.append(Sample(prompt, [3] * length, [0.0] * length, "stop", 0, reward, loss_mask, old_logprobs=old,
                              sum_pi_squared=squares, **parts))  # fmt: skip
    last = [torch.tensor([float(t == max(i for i, m in enumerate(s.mask()) if m)) for t in range(len(s.mask()))])
            for s in samples]  # fmt: skip
    rewards, mask = padded(samples, [s.reward * x for s, x in zip(samples, last)])
    tensors = {"token_level_rewards": rewards.float(), "response_mask": mask.float()}
    tensors["old_log_probs"] = padded(samples, [s.old_logprobs for s in samples])[0].float()
    tensors["sum_pi_squared"] = padded(samples, [s.sum_pi_squared for s in samples])[0].float()
    return samples, tensors, [s.prompt.index for s in samples]


@pytest.mark.parametrize("estimator", ["remax", "opo", "gpg", "grpo_passk", "gdpo", "optimal_token_baseline",
                                       "tir_optimal_token_baseline"])  # fmt: skip
def test_new_estimators_match_verls_own_functions(world_of_one, estimator):
    """Each estimator verl 0.9.1 registers that dsrl lacked, on 64 random samples: dsrl's advantages (through
    `compute_advantages`, as a run computes them) against verl's. gdpo whitens with the biased variance (as dsrl's
    REINFORCE++ does; verl the unbiased), a factor sqrt(N/(N-1)) over ~400 tokens, within 2e-3. dsrl's
    optimal_token_baseline on agents' episodes (holes in the mask) is verl's tir_optimal_token_baseline."""
    import numpy as np

    from dsrl.advantages import compute_advantages, padded

    core = verl_core_algos()
    samples, tensors, index = random_groups(1, holes=estimator.startswith("tir"))
    index = np.array(index)
    cfg = Config(model=ModelConfig(path="m"), data=DataConfig(train_path="d.jsonl"))
    cfg.rollout.n_samples, cfg.reward_model.w_model, cfg.reward_model.w_rule = 4, 1.0, 0.5
    cfg.algorithm.advantage = estimator.removeprefix("tir_")
    compute_advantages(samples, cfg, 0.0)
    got = padded(samples, [s.advantages for s in samples])[0].float()
    r, m = tensors["token_level_rewards"], tensors["response_mask"]
    if estimator == "remax":
        want = core.compute_remax_outcome_advantage(r, torch.tensor([s.reward_baseline for s in samples]), m)[0]
    elif estimator == "gdpo":
        ones = torch.ones(len(samples), 1, dtype=torch.long)
        batch = {"prompts": ones, "attention_mask": torch.cat([ones, m.long()], 1)}
        parts = {"model": [s.reward_model for s in samples], "rule": [s.reward_rule for s in samples]}
        config = {"gdpo_reward_keys": ["model", "rule"], "gdpo_reward_weights": [1.0, 0.5]}
        want = core.compute_gdpo_outcome_advantage(r, m, index, config=config, non_tensor_batch=parts, batch=batch)[0]
    elif estimator.endswith("optimal_token_baseline"):
        fn = core.get_adv_estimator_fn(estimator)
        want = fn(r, m, index, old_log_probs=tensors["old_log_probs"], sum_pi_squared=tensors["sum_pi_squared"])[0]
    else:
        config = {"norm_adv_by_std_in_grpo": True}
        want = core.get_adv_estimator_fn(estimator)(token_level_rewards=r, response_mask=m, index=index, config=config)[
            0
        ]
    tolerance = {"rtol": 2e-3, "atol": 1e-5} if estimator == "gdpo" else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got, want.float(), **tolerance)
