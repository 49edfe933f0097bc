"""PPO with a critic end to end (CPU, 2 ZeRO-3 ranks): it learns, its critic learns, and a run killed
mid-way resumes bit for bit; reward functions that hang, crash or return garbage leave a run alive."""

import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.test_reliability import TIMING, run_and_kill, run_to_end, scalars, trace, train_cmd

pytestmark = pytest.mark.slow  # each test a `dsrl train` run or two: tests/conftest.py runs them first


def test_ppo_with_a_critic_learns_the_toy_task(tmp_path):
    """Packed micro-batches (the default on GPUs; on CPU each sequence's attention alone): the actor, the
    reference and the token-classification critic all run on rows of several sequences without padding."""
    run_dir = tmp_path / "ppo"
    args = ["--trainer.total_steps", "40", "--eval.path", "null", "--trainer.pack_sequences", "true"]
    log = run_to_end(train_cmd("toy_cpu_ppo.yaml", run_dir, *args))
    assert "packed micro-batches, no padding: attention by sdpa, one call per sequence" in log
    assert "gradient checkpointing off: states" in log  # (auto, decided before the first update)
    a = scalars(run_dir)
    assert set(a["actor/padded_frac"].values()) == {0.0}
    reward, value_loss = list(a["reward/mean"].values()), list(a["critic/value_loss"].values())
    assert sum(reward[-5:]) / 5 > sum(reward[:5]) / 5 + 0.05, reward
    # the fresh value head's first steps are far off; then the critic tracks the returns
    assert sum(value_loss[1:6]) / 5 > 2 * sum(value_loss[10:20]) / 10, value_loss
    assert "critic/explained_variance" in a and "actor/pg_loss" not in {k for k, s in a.items() if 1 in s}  # warm-up
    actor, critic = a["actor/optimizer_seconds"], a["critic/optimizer_seconds"]  # (the actor's after the warm-up)
    assert len(actor) > 30 and set(actor) < set(critic) == set(a["timing/update"])
    for step, update in a["timing/update"].items():  # each engine's optimizer steps, a part of the update's time
        engines = [critic[step]] + ([actor[step]] if step in actor else [])
        assert min(engines) > 0 and sum(engines) < update, (step, engines, update)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_ppo_resumes_bit_for_bit(lora, tmp_path):
    """Critic states, its optimizer and the KL coefficient come back with the actor's: a run killed after step 6
    resumes from step 4's checkpoint, and its steps 5 and 6 log every metric the uninterrupted run logged before the
    kill (step 5: the weights, RNG, KL coefficient and data position restored; step 6: the update made with the
    restored optimizer states). With LoRA the critic is an adapter on the actor's base, its states in the actor's
    engine's checkpoint: the LoRA case is also the test that the actor's adapters and their optimizer states resume
    bit for bit. (The steps before the kill are the uninterrupted run: no third run to compare with.)"""
    args = ["--model.lora_rank", "4"] if lora else []
    args += ["--trainer.total_steps", "8", "--logging.save_every", "4", "--logging.keep_last", "1"]
    args += ["--eval.path", "null"]
    args += ["--rollout.prompts_per_step", "8", "--trainer.micro_batch_size", "32", "--critic.warmup_steps", "1"]
    args += ["--algorithm.kl_coef", "0.01", "--algorithm.kl_target", "0.001"]  # an adaptive coefficient to restore
    args += ["--rollout.server_args", '{"enable_deterministic_inference": true}']
    killed = tmp_path / "killed"
    run_and_kill(train_cmd("toy_cpu_ppo.yaml", killed, *args), at_step=6, total=8)
    assert (killed / "checkpoints" / "latest").read_text() == "step_4"
    uninterrupted, straight = trace(killed), scalars(killed)  # steps 1-6, as the run logged them before the kill
    assert [r["step"] for r in uninterrupted] == list(range(6))
    log = run_to_end(train_cmd("toy_cpu_ppo.yaml", killed, *args))
    assert "resumed from" in log and "step_4 at step 4" in log
    records = trace(killed)
    assert [r["step"] for r in records] == list(range(8))
    assert records[:6] == uninterrupted, "the resumed run trained other prompts, or in another order"
    assert sorted(p.name for p in (killed / "checkpoints").glob("step_*")) == ["step_8"]  # keep_last 1
    a, b = straight, scalars(killed)  # b: steps 5 and 6 as the resumed run logged them
    events = EventAccumulator(str(killed / "tensorboard"))
    events.Reload()
    assert sorted(e.step for e in events.Scalars("reward/mean")) == [1, 2, 3, 4, 5, 5, 6, 6, 7, 8], "logged again"
    compared = [tag for tag in a if not tag.startswith(TIMING)]
    assert {"critic/value_loss", "kl/coef", "reward/mean", "actor/pg_loss", "actor/grad_norm"} <= set(compared)
    assert len(set(a["kl/coef"].values())) > 1, "the KL coefficient did not adapt"
    assert all({5, 6} <= set(a[tag]) for tag in ("critic/value_loss", "kl/coef", "actor/grad_norm"))
    for tag in compared:
        assert {step: b[tag][step] for step in a[tag]} == a[tag], f"{tag} differs after resume"


def test_rewards_that_hang_crash_or_return_a_string_leave_the_run_alive(tmp_path):
    """The toy reward, except that answer 7 hangs, 8 kills its process and 9 returns a string: with
    on_reward_error skip every such row is named and its group skipped, and the run finishes."""
    args = ["--trainer.total_steps", "6", "--rollout.prompts_per_step", "16", "--eval.path", "null"]
    args += ["--algorithm.reward_fn", "tests._bad_rewards:toy_with_faults", "--algorithm.on_reward_error", "skip"]
    args += ["--algorithm.reward_timeout_s", "2"]
    run_dir = tmp_path / "faults"
    log = run_to_end(train_cmd("toy_cpu.yaml", run_dir, *args))
    named = r"reward function (failed on|returned 'good' for) dataset row \d+"
    assert re.search(named + r": took longer than --algorithm.reward_timeout_s=2s", log)
    assert re.search(named + r": its process exited \(code 3\)", log)
    assert re.search(r"reward function returned 'good' for dataset row \d+; expected a finite float", log)
    assert sum(scalars(run_dir)["reward/failed"].values()) > 0
