"""On-policy distillation (`--distill.teacher_path`) on CPU: the teacher, on the embedded engine, returns its
logprobs of every response token (an agent episode's environment tokens too); the advantage is minus the reverse KL
on the model's tokens and 0 on the environment's, alone or beside the reward; a teacher of another tokenizer is
refused before launch; and a student trained on the toy task against a scripted teacher learns to answer as it does."""

import json
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from dsrl.advantages import compute_advantages
from dsrl.cli import main as dsrl_main
from dsrl.config import build_parser, side_rollout, to_config
from dsrl.data import Prompt, Sample
from dsrl.rewards.rewarder import Rewarder
from dsrl.rewards.teacher import Teacher
from dsrl.serving.client import RolloutClient
from dsrl.serving.fleet import start_fleet
from dsrl.tasks import toy
from tests.conftest import ROOT
from tests.test_algorithms import world_of_one  # noqa: F401 -- a fixture
from tests.test_reliability import run_to_end
from tests.test_reward_models import tiny

TOKENIZER = toy.build_tokenizer()
TOY = ["--model.path", str(ROOT / "examples/toy/model"), "--data.train_path", str(ROOT / "examples/toy/train.jsonl")]
SEVEN, EQUALS, EOS = TOKENIZER.convert_tokens_to_ids(["7", "=", "<eos>"])


def scripted_teacher(out) -> None:
    """A causal LM whose next token depends on the last one alone: after "=" it says "7", after anything else it
    ends (its layers zero, its embeddings one-hot): its answer to every prompt is "7"."""
    teacher = Qwen2ForCausalLM(tiny(tie_word_embeddings=False, eos_token_id=EOS, bos_token_id=None))
    with torch.no_grad():
        for p in teacher.parameters():
            p.zero_()
        teacher.model.norm.weight.fill_(1.0)
        teacher.model.embed_tokens.weight[:, :14] = torch.eye(14)
        for token in range(14):
            teacher.lm_head.weight[SEVEN if token == EQUALS else EOS, token] = 10.0
    teacher.save_pretrained(out)
    TOKENIZER.save_pretrained(out)


def group() -> list[Sample]:
    """One prompt's two samples: a plain response, and an episode whose 3rd and 4th tokens are the environment's."""
    prompt = Prompt(5, TOKENIZER("39=")["input_ids"], "39=", "39")
    plain = Sample(prompt, TOKENIZER("39")["input_ids"] + [EOS], [-1.0, -2.0, -0.5], "stop", 0)  # (reward 1)
    episode = Sample(prompt, [4, 13, 6, 13, 6, EOS], [-1.0, -1.5, 0.0, 0.0, -0.2, -0.1], "stop", 0)  # "2+4+4"
    episode.loss_mask = [1, 1, 0, 0, 1, 1]
    return [plain, episode]


def test_the_teacher_scores_every_response_token_and_the_advantage_is_minus_the_reverse_kl(
    toy_weights,
    tmp_path,
    world_of_one,  # noqa: F811
):
    """Its logprobs are the teacher model's own of each response token given all before it (prompt included); the
    advantage of a model token is -coef * (engine logprob - teacher logprob), 0 on the environment's, alone or added
    to GRPO's."""
    argv = [*TOY, "--distill.teacher_path", str(toy_weights), "--distill.coef", "0.5", "--rollout.n_samples", "2"]
    cfg = to_config(build_parser(), build_parser().parse_args([*argv, "--logging.run_dir", str(tmp_path)]))
    cfg.algorithm.reward_fn, cfg.algorithm.reward_workers = "dsrl.tasks.toy:reward", 0
    fleet = start_fleet(side_rollout(cfg, cfg.distill), str(toy_weights), tmp_path, 0, "embedded", role="teacher")
    client, policy = RolloutClient(fleet.urls), AutoTokenizer.from_pretrained(cfg.model.path)
    rewarder = Rewarder(cfg.algorithm, policy, teacher=Teacher(cfg, policy, client, fleet, rank0=True))
    try:
        samples = group()
        client.run(rewarder.score_group(samples))
    finally:
        client.close()
        rewarder.close()
    model = AutoModelForCausalLM.from_pretrained(toy_weights)
    for s in samples:
        ids = torch.tensor([s.prompt.prompt_ids + s.response_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert s.teacher_logprobs == pytest.approx(logprobs[len(s.prompt.prompt_ids) - 1 :].tolist(), abs=1e-4)
    assert [s.reward for s in samples] == [1.0, 0.0]  # (the toy reward, beside)
    assert (tmp_path / "logs/teacher_server_0.log").is_file()

    stats = compute_advantages(samples, cfg, kl_coef=0.0)
    for s in samples:
        want = [-0.5 * (e - t) * m for e, t, m in zip(s.engine_logprobs, s.teacher_logprobs, s.mask())]
        assert s.advantages.tolist() == pytest.approx(want, abs=1e-5)
    assert s.advantages[2:4].tolist() == [0.0, 0.0]  # the environment's tokens
    reverse_kl = [e - t for s in samples for e, t, m in zip(s.engine_logprobs, s.teacher_logprobs, s.mask()) if m]
    assert stats["distill/reverse_kl"] == pytest.approx(sum(reverse_kl) / len(reverse_kl), abs=1e-5)
    cfg.distill.with_reward = True  # GRPO's advantage of two rewards 1 and 0 is +-0.707 beside
    alone = [s.advantages.clone() for s in samples]
    compute_advantages(samples, cfg, kl_coef=0.0)
    for s, a, sign in zip(samples, alone, (1, -1)):
        mask = torch.tensor(s.mask(), dtype=torch.float)
        assert (s.advantages - a).tolist() == pytest.approx((sign * 0.7071 * mask).tolist(), abs=1e-3)


def test_a_teacher_of_another_tokenizer_is_refused_before_launch(capsys, tmp_path):
    other = tiny(vocab_size=20, architectures=["Qwen2ForCausalLM"])
    other.save_pretrained(tmp_path / "other")
    toy.build_tokenizer(20).save_pretrained(tmp_path / "other")
    train = ["train", "--config", str(ROOT / "configs/toy_cpu_opd.yaml"), "--logging.run_dir", str(tmp_path / "run")]
    assert dsrl_main([*train, "--distill.teacher_path", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    line = f"--distill.teacher_path='{tmp_path}/other': its tokenizer (21 tokens) is not the policy's (15)"
    assert line in err and len(err.strip().splitlines()) == 1 and "deepspeed" not in err, err
    assert dsrl_main([*train, "--distill.teacher_path", str(tmp_path / "none")]) == 2
    assert "must be a model directory with config.json" in capsys.readouterr().err


STEPS = 20


@pytest.mark.slow
def test_a_student_distilled_from_a_scripted_teacher_answers_as_it_does(tmp_path):
    """The toy task on 1 rank, 20 steps, the teacher's reverse KL alone as the advantage: the student, whose greedy
    answers start as no teacher's, ends answering "7" to most held-out prompts, and the reverse KL per token falls.
    Measured: "7" for 0 of 32 held-out prompts before, 32 of 32 after; the reverse KL 35.4 -> 9.0 nats a token
    (27 s of the test on the 2-core box)."""
    scripted_teacher(tmp_path / "teacher")
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(row) + "\n" for row in toy.make_rows(32, 7)))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs/toy_cpu_opd.yaml")]
    cmd += ["--distill.teacher_path", str(tmp_path / "teacher"), "--eval.path", str(held_out), "--eval.every", "0"]
    cmd += ["--trainer.total_steps", str(STEPS), "--rollout.prompts_per_step", "16", "--logging.run_dir", str(run_dir)]
    cmd += ["--logging.export_hf", "false"]
    run_to_end(cmd)
    answers = {}
    for step in (0, STEPS):
        rows = [json.loads(line) for line in (run_dir / f"eval/step_{step}.jsonl").read_text().splitlines()]
        answers[step] = sum(row["response"] == "7" for row in rows) / len(rows)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    kl = [e.value for e in events.Scalars("distill/reverse_kl")]
    assert answers[0] < 0.2 and answers[STEPS] > 0.8, answers
    assert len(kl) == STEPS and sum(kl[-3:]) / 3 < 0.6 * sum(kl[:3]) / 3, kl
    assert {"distill/teacher_seconds", "eval/reward_mean"} <= set(events.Tags()["scalars"])
