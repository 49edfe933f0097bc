"""Rollout correction (`--algorithm.rollout_correction`) and `--algorithm.mask_truncated` against hand-computed values:
every rejection mask of verl's, IcePop, the geometric mask, OPSM and the importance weights, each at values where a
wrong sign, an inverted ratio or a masked token counted in changes the answer; then through the update's loss on a toy
model, where a rejected or truncated sample adds nothing to the loss or its gradient."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsrl.algorithms import importance_weights
from dsrl.auto import old_from_update
from dsrl.config import Config, DataConfig, ModelConfig, RolloutCorrectionConfig, parse_config
from dsrl.correction import correct, with_ess
from dsrl.data import Prompt, Sample
from dsrl.tasks import toy
from dsrl.zero.actor import global_denominators, micro_batch_loss
from dsrl.zero.batches import MicroBatch
from dsrl.zero.trainer import mask_truncated
from tests.conftest import ROOT
from tests.test_algorithms import world_of_one  # noqa: F401 -- a fixture

L2, L3 = math.log(2), math.log(3)
LOG_RATIO = torch.tensor([[L2, L2, L2], [L2, -L3, 10.0]])  # log(pi / mu); the last token is the environment's
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
"""Per token: k1 = -log w: row 0 -0.693 each, row 1 -0.693, 1.099; k2: 0.240, and 0.240, 0.603; k3 = w - 1 - log w:
0.307, and 0.307, 0.432. Sums: k1 -2.079 and 0.405, k2 0.721 and 0.844, k3 0.921 and 0.739."""


def keep_of(old, behaviour, mask=MASK, current=None, advantages=None, **settings):
    c = RolloutCorrectionConfig(**settings)
    current = behaviour if current is None else current
    advantages = torch.ones_like(old) if advantages is None else advantages
    weights, kept, stats = correct(c, old, behaviour, current, advantages, mask)
    return weights, kept, {k: v.item() for k, v in stats.items()}


@pytest.mark.parametrize(
    "name, bound, expected",
    [
        ("token_k1", [0.6, 4.0], [[0, 0, 0], [0, 1]]),  # log(mu / pi) in [-0.511, 1.386]; log(pi / mu) keeps row 0
        ("token_k2", 0.5, [[1, 1, 1], [1, 0]]),
        ("token_k3", 0.35, [[1, 1, 1], [1, 0]]),
        ("token_k3", 0.5, [[1, 1, 1], [1, 1]]),  # with k3 of log(mu / pi) (0.193, 0.901) the 3 of row 1 goes
        ("seq_sum_k1", [0.1, 1.2], [[1, 1, 1], [0, 0]]),  # sums in [-2.303, 0.182]
        ("seq_sum_k2", 0.8, [[1, 1, 1], [0, 0]]),
        ("seq_sum_k2", 0.85, [[1, 1, 1], [1, 1]]),  # the environment's token (k2 50) counted in: row 1 goes
        ("seq_sum_k3", 0.8, [[0, 0, 0], [1, 1]]),
        ("seq_mean_k1", [0.6, 4.0], [[0, 0, 0], [1, 1]]),  # means -0.693 and 0.203
        ("seq_mean_k2", 0.3, [[1, 1, 1], [0, 0]]),  # means 0.240 and 0.422 (0.281 over 3 tokens)
        ("seq_mean_k3", 0.35, [[1, 1, 1], [0, 0]]),  # means 0.307 and 0.369
        ("seq_max_k2", 0.5, [[1, 1, 1], [0, 0]]),
        ("seq_max_k2", 0.7, [[1, 1, 1], [1, 1]]),  # the environment's token counted in: row 1 goes
        ("seq_max_k3", 0.4, [[1, 1, 1], [0, 0]]),
    ],
)
def test_each_rejection_mask_keeps_what_verl_defines_by_hand(name, bound, expected):
    _, kept, stats = keep_of(LOG_RATIO, torch.zeros(2, 3), rejection={name: bound})
    assert kept[0].tolist() == expected[0] and kept[1, :2].tolist() == expected[1]
    level = "token" if name.startswith("token") else "seq"
    removed = 5 - sum(map(sum, expected))
    assert stats[f"rollout_corr/{level}_masked_frac"] == stats["rollout_corr/masked_frac"] == pytest.approx(removed / 5)


def test_rejection_masks_chain_and_one_number_bounds_k1_both_ways():
    _, kept, _ = keep_of(LOG_RATIO, torch.zeros(2, 3), rejection={"token_k2": 0.5, "seq_sum_k3": 0.8})
    assert kept[0].tolist() == [0, 0, 0] and kept[1, :2].tolist() == [1, 0]
    _, kept, _ = keep_of(LOG_RATIO, torch.zeros(2, 3), rejection={"token_k1": 2.5})  # [1 / 2.5, 2.5]: 1/3 < 0.4
    assert kept[0].tolist() == [1, 1, 1] and kept[1, :2].tolist() == [1, 0]


def test_icepop_masks_tokens_whose_weight_is_outside_half_to_five_by_default():
    w = torch.tensor([[6.0, 0.25, 4.9, 0.5, 1.0]])
    _, kept, stats = keep_of(w.log(), torch.zeros(1, 5), torch.ones(1, 5), icepop=True)
    assert kept.tolist() == [[0, 0, 1, 1, 1]]  # (of mu / pi, 0.25 would be 4 and kept, 4.9 0.2 and masked)
    assert stats["rollout_corr/token_masked_frac"] == pytest.approx(0.4) and stats["rollout_corr/seq_masked_frac"] == 0


def test_the_geometric_mask_judges_each_sequence_by_its_tokens_geometric_mean_weight():
    w = torch.tensor([[1.05, 1 / 1.05, 1.0], [1.02, 1.02, 1.0], [0.98, 1.0, 1.0], [1.015, 1.0, 50.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 0]])
    _, kept, stats = keep_of(w.log(), torch.zeros(4, 3), mask, geo_mask=True, geo_mask_bounds=(0.95, 1.01))
    assert kept[:, 0].tolist() == [1, 0, 1, 1]  # geometric means 1, 1.02, 0.990, 1.007 (inverted: 1.010 kept row 1)
    assert (kept[:, 0] == kept[:, 1]).all() and stats["rollout_corr/seq_masked_frac"] == pytest.approx(0.25)


def test_opsm_masks_negative_advantages_of_sequences_the_current_policy_left():
    """Row 0: the current policy gives its tokens 0.5 nats less than the sampler did, its advantage negative: masked.
    Row 1: the same with a positive advantage; row 2 the current policy gives them more; row 3 within delta."""
    behaviour = torch.tensor([[-1.0, -1], [-1, -1], [-1.5, -1.5], [-1, -1]])
    current = torch.tensor([[-1.5, -1.5], [-1.5, -1.5], [-1, -1], [-1.05, -1.05]])
    advantages = torch.tensor([[-1.0, -1], [1, 1], [-1, -1], [-1, -1]])
    _, kept, _ = keep_of(behaviour, behaviour, torch.ones(4, 2), current, advantages, opsm=True, opsm_delta=0.1)
    assert kept[:, 0].tolist() == [0, 1, 1, 1] and (kept[:, 0] == kept[:, 1]).all()


def test_importance_weights_truncate_or_mask_per_token_or_sequence_and_report_mean_max_and_ess():
    old, mask = torch.tensor([[math.log(3), math.log(0.5), math.log(1.5)]]), torch.ones(1, 3)
    weights, kept, stats = keep_of(old, torch.zeros(1, 3), mask, is_level="token")
    assert weights[0].tolist() == pytest.approx([2.0, 0.5, 1.5]) and kept.tolist() == [[1, 1, 1]]
    ess = (4 / 3) ** 2 / ((4 + 0.25 + 2.25) / 3)  # mean(w)^2 / mean(w^2) of the truncated weights
    stats = with_ess(stats)
    assert stats["rollout_corr/token_weight_mean"] == pytest.approx(4 / 3)
    assert stats["rollout_corr/token_weight_max"] == pytest.approx(3.0)  # (before truncation)
    assert stats["rollout_corr/token_weight_ess"] == pytest.approx(ess)
    assert stats["rollout_corr/seq_weight_max"] == pytest.approx(2.25)  # the sequence's product 3 * 0.5 * 1.5
    weights, _, _ = keep_of(old, torch.zeros(1, 3), mask, is_level="token", is_low=0.6)
    assert weights[0].tolist() == pytest.approx([2.0, 0.6, 1.5])
    weights, kept, stats = keep_of(old, torch.zeros(1, 3), mask, is_level="token", is_mode="mask", is_low=0.6)
    assert weights[0].tolist() == pytest.approx([0.0, 0.0, 1.5]) and kept.tolist() == [[0, 0, 1]]
    assert stats["rollout_corr/token_masked_frac"] == pytest.approx(2 / 3)
    weights, _, _ = keep_of(old, torch.zeros(1, 3), mask, is_level="sequence")
    assert weights[0].tolist() == pytest.approx([2.0] * 3)  # the product 2.25, truncated at 2
    weights, kept, _ = keep_of(old, torch.zeros(1, 3), mask, is_level="sequence", is_mode="mask", is_high=2.0)
    assert weights[0].tolist() == [0.0] * 3 and kept.tolist() == [[0, 0, 0]]


def test_off_policy_tis_and_decoupled_are_its_token_level_truncate_and_mask():
    g = torch.Generator().manual_seed(0)
    old, behaviour, mask = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g), torch.ones(4, 6)
    for mode, is_mode in (("tis", "truncate"), ("decoupled", "mask")):
        weights, _, _ = keep_of(old, behaviour, mask, is_level="token", is_mode=is_mode, is_high=1.5)
        assert torch.allclose(weights, importance_weights(old, behaviour, mode, 1.5))


def test_bad_settings_are_named_and_off_policy_auto_gives_way_to_it(tmp_path):
    toy_cfg = ["--config", str(ROOT / "configs/toy_cpu.yaml")]
    with pytest.raises(SystemExit):
        parse_config([*toy_cfg, "--algorithm.off_policy", "tis", "--algorithm.rollout_correction.icepop", "true"])
    from dsrl.auto import resolve
    from dsrl.config import ConfigError, validate

    rc = RolloutCorrectionConfig(rejection={"seq_max_k1": 2.0, "token_k2": [0.1, 1.0]}, is_level="token")
    cfg = parse_config(toy_cfg)
    cfg.algorithm.rollout_correction, cfg.algorithm.policy_loss = rc, "gspo"
    with pytest.raises(ConfigError) as e:
        validate(cfg, check_paths=False)
    assert "rejection='seq_max_k1'" in str(e.value) and "rejection.token_k2=[0.1, 1.0]" in str(e.value)
    assert "is_level='token': its importance weights multiply PPO's" in str(e.value)
    cfg = parse_config([*toy_cfg, "--rollout.precision", "fp8", "--algorithm.rollout_correction.icepop", "true"])
    resolved, _ = resolve(cfg, str(ROOT / "examples/toy/model"))
    assert resolved.algorithm.off_policy == "none"  # (without rollout_correction: tis)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(toy.build_model_config())


def toy_samples(finish=("stop", "length", "stop", "length")) -> list[Sample]:
    """Four responses to one prompt with advantages of both signs; the engine's logprobs the trainer's (w = 1)."""
    prompt = Prompt(0, [4, 5, 12], "23=", "23")
    out = []
    for i, reason in enumerate(finish):
        ids = [4, 5, 1][: 2 + i % 2]
        s = Sample(prompt, ids, [-2.5] * len(ids), reason, 0)
        s.advantages = torch.full((len(ids),), [1.0, -2.0, 0.5, 3.0][i])
        s.old_logprobs = torch.full((len(ids),), -2.5)
        out.append(s)
    return out


def loss_and_grad(model, samples, cfg, kept=None):
    """micro_batch_loss of `samples` as one micro-batch with the global denominators of `kept` (default: them)."""
    model.zero_grad()
    num_tokens, num_seqs = global_denominators(kept or samples)
    mb = MicroBatch.build(samples, 0, torch.device("cpu"))
    loss, stats, _ = micro_batch_loss(model, mb, cfg, num_tokens, num_seqs, 0.0, old_from_update(cfg))
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()]), stats


def toy_config(**algorithm) -> Config:
    cfg = Config(model=ModelConfig(path="m"), data=DataConfig(train_path="d.jsonl"))
    cfg.trainer.old_logprobs = "recompute"  # (the samples' own old_logprobs)
    for key, value in algorithm.items():
        setattr(cfg.algorithm, key, value)
    return cfg


def test_a_rejected_sample_adds_nothing_to_the_loss_or_its_gradient(model, world_of_one):  # noqa: F811
    """Two samples' engine logprobs far below the trainer's (w = e^5, outside IcePop's [0.5, 5]): the loss and the
    gradient are those of the other two alone, over the denominators of all four."""
    cfg = toy_config(rollout_correction=RolloutCorrectionConfig(icepop=True))
    samples = toy_samples()
    for s in samples[1::2]:
        s.engine_logprobs = [-7.5] * len(s.response_ids)
    got, grad, stats = loss_and_grad(model, samples, cfg)
    want, want_grad, _ = loss_and_grad(model, samples[::2], cfg, kept=samples)
    assert got == pytest.approx(want, abs=1e-6) and torch.allclose(grad, want_grad, atol=1e-7)
    assert stats["rollout_corr/token_masked_frac"].item() == pytest.approx(6 / 10)  # 3 + 3 of 2 + 3 + 2 + 3 tokens
    plain, plain_grad, _ = loss_and_grad(model, samples, toy_config())
    assert abs(plain - got) > 1e-3 and not torch.allclose(plain_grad, grad)  # (uncorrected, they count)


def test_mask_truncated_leaves_cut_responses_out_of_the_loss_and_its_denominators(model, world_of_one):  # noqa: F811
    cfg = toy_config()
    samples = toy_samples()
    assert mask_truncated(samples) == {"actor/masked_truncated_frac": 0.5}
    assert [s.skip for s in samples] == [False, True, False, True]
    got, grad, _ = loss_and_grad(model, samples, cfg)
    want, want_grad, _ = loss_and_grad(model, toy_samples()[::2], cfg)
    assert got == pytest.approx(want, abs=1e-6) and torch.allclose(grad, want_grad, atol=1e-7)
