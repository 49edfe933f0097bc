"""Agent episodes against the real embedded engine: token-exact over several turns, masks, tools that
misbehave, deadlines, a chat template that cannot render turn by turn, episodes interrupted by weight
updates (partial, pause) that finish with the same tokens, and the toy agent task learning end to end."""

import json
import os
import re
import sys
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from dsrl.config import Config, DataConfig, ModelConfig
from dsrl.data import PromptDataset
from dsrl.rewards.rewarder import Rewarder, RewardError
from dsrl.rollout.episode import EpisodeRunner, Renderer, TemplateError, check_rendering
from dsrl.rollout.manager import PromptStream, RolloutManager
from dsrl.rollout.rollouts import generate, parse_generation
from dsrl.serving.client import RolloutClient
from dsrl.serving.fleet import start_fleet
from dsrl.tasks import calculator, toy
from dsrl.zero.batches import MicroBatch
from tests.conftest import ROOT
from tests.test_reliability import run_to_end

CALC = ROOT / "examples/calculator"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Qwen2 with the locally built Qwen2-style tokenizer (Qwen2.5's chat template)."""
    out = tmp_path_factory.mktemp("chat_model")
    tokenizer = AutoTokenizer.from_pretrained(CALC / "model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(calculator.build_model_config(tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def chat_server(chat_model, tmp_path_factory):
    cfg = Config(model=ModelConfig(path=str(chat_model)), data=DataConfig(train_path="unused.jsonl")).rollout
    fleet = start_fleet(cfg, str(chat_model), tmp_path_factory.mktemp("run"), 0, "embedded")
    client = RolloutClient(fleet.urls, timeout_s=120)
    client.call_all("/update_weight_version", {"new_version": "0", "abort_all_requests": False})
    yield client
    client.close()
    fleet.stop()


def agent_config(model, env: str, **agent) -> Config:
    cfg = Config(model=ModelConfig(path=str(model)), data=DataConfig(train_path=str(CALC / "test.jsonl")))
    cfg.rollout.env, cfg.rollout.max_new_tokens, cfg.rollout.n_samples = env, 8, 2
    cfg.data.max_prompt_tokens = 2048  # the tools' schemas are in the system prompt
    for key, value in agent.items():
        setattr(cfg.agent, key, value)
    return cfg


def play_recorded(client, runner, prompt, sampling):
    """Play one episode through the real server, recording every request's input and reply."""
    calls = []

    async def request(episode, params):
        body = {"input_ids": prompt.prompt_ids + episode.sample.response_ids, "return_logprob": True,
                "sampling_params": {**params, "sampling_seed": len(calls)}}  # fmt: skip
        reply = parse_generation(await client.generate(body))
        calls.append((body["input_ids"], reply))
        return reply, reply.weight_version

    episode = runner.new(prompt, sampling)
    assert client.run(runner.run(episode, request))
    return episode, calls


def test_an_episode_is_the_servers_tokens_and_the_rendered_observations_token_for_token(chat_model, chat_server):
    """Three model turns and two tool results: every request's input is the prompt and exactly what came
    before (no re-tokenisation); the sample is the server's output ids and each observation rendered once
    as the chat template renders it; masks and logprobs line up; the trainer packs the same ids."""
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    cfg = agent_config(chat_model, "tests._agents:EchoThrice")
    runner = EpisodeRunner(cfg, tokenizer)
    try:
        prompt = PromptDataset(cfg.data, tokenizer, tools=runner.tool_schemas).prompts[0]
        episode, calls = play_recorded(chat_server, runner, prompt, {"max_new_tokens": 8, "temperature": 1.0})
    finally:
        runner.close()
    s, renderer = episode.sample, Renderer(tokenizer, runner.tool_schemas)
    record = episode.record
    assert len(calls) == 3 and record.turns == 3 and record.stop == "done" and record.reward == 1.0
    expected, mask, logprobs = [], [], []
    for turn, (sent, reply) in enumerate(calls):
        assert sent == prompt.prompt_ids + expected, f"turn {turn} was sent other tokens than the sample holds"
        expected += reply.output_ids
        mask += [1] * len(reply.output_ids)
        logprobs += reply.logprobs
        if turn < 2:
            result = [{"role": "tool", "name": "echo", "content": f"turn {turn}"}]
            ended = reply.output_ids[-1] == tokenizer.eos_token_id
            observation = renderer.observation(result, ended_with_eos=ended)
            assert f"<tool_response>\nturn {turn}\n</tool_response>" in tokenizer.decode(observation)
            expected += observation
            mask += [0] * len(observation)
            logprobs += [0.0] * len(observation)
    assert s.response_ids == expected and s.loss_mask == mask and s.engine_logprobs == logprobs
    turn_starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    assert s.spans == [(start, 0) for start in turn_starts]  # one per model turn, each its version
    for packed in (False, True):  # what the trainer runs on: the same tokens, the loss on the model's alone
        mb = MicroBatch.build([s], tokenizer.pad_token_id, torch.device("cpu"), packed)
        assert mb.input_ids[0].tolist() == prompt.prompt_ids + s.response_ids
        assert mb.mask[0].tolist() == mask and mb.targets.tolist() == s.response_ids
    assert s.episode is record and record.tool_calls == 2 and record.tool_errors == 0


def test_tools_that_hang_raise_crash_or_flood_become_error_results_and_the_episode_goes_on(chat_model, chat_server):
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    cfg = agent_config(chat_model, "tests._agents:AllTools", tool_timeout_s=2.0, max_tool_output_chars=200,
                       max_observation_tokens=400, max_parallel_calls=7, tool_workers=3)  # fmt: skip
    runner = EpisodeRunner(cfg, tokenizer)
    try:
        prompt = PromptDataset(cfg.data, tokenizer, tools=runner.tool_schemas).prompts[0]
        start = time.monotonic()
        episode, _ = play_recorded(chat_server, runner, prompt, {"max_new_tokens": 4, "temperature": 1.0})
        took = time.monotonic() - start
        again, _ = play_recorded(chat_server, runner, prompt, {"max_new_tokens": 4, "temperature": 1.0})
    finally:
        runner.close()
    record = episode.record
    assert record.stop == "done" and record.reward == 0.5 and record.turns == 2
    assert record.tool_calls == 7 and record.tool_errors == 5 and record.tool_timeouts == 1
    assert took < 30, "the hanging tool held the episode past its timeout"
    text = tokenizer.decode(episode.sample.response_ids)
    for said in ("<tool_response>\nhi\n</tool_response>",
                 "error: took longer than --agent.tool_timeout_s=2s (its process was replaced)",
                 "error: RuntimeError('no')",
                 "error: its process exited (code 3) while running it",
                 "error: no tool named 'nope'",
                 "error: the tool call is not valid JSON",
                 "characters cut ..."):  # fmt: skip
        assert said in text, said
    assert len(episode.sample.response_ids) < 2000, "the flood reached the episode"
    assert again.record.tool_errors == 5 and "<tool_response>\nhi\n</tool_response>" in tokenizer.decode(
        again.sample.response_ids
    ), "the pool did not recover from the crash"


def test_an_episode_stops_at_its_deadline(chat_model, chat_server):
    """Steps of 1 s against a 3 s deadline: the third ends it. In the trainer's process: a worker's start, several
    seconds on a loaded machine, would count against the deadline (a tool's process that hangs: above)."""
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    cfg = agent_config(chat_model, "tests._agents:Scripted", episode_timeout_s=3.0, max_turns=20, env_workers=0)
    cfg.rollout.env_args = {"turns": 20, "observation": "go on", "sleep_s": 1.0}
    runner = EpisodeRunner(cfg, tokenizer)
    try:
        prompt = PromptDataset(cfg.data, tokenizer).prompts[0]
        episode, calls = play_recorded(chat_server, runner, prompt, {"max_new_tokens": 2, "temperature": 1.0})
    finally:
        runner.close()
    assert episode.record.stop == "deadline" and 2 <= len(calls) <= 4, (episode.record.stop, len(calls))
    assert episode.sample.episode.stop == "deadline"


def test_an_environment_that_raises_fails_its_row_or_skips_its_group(chat_model, chat_server):
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    cfg = agent_config(chat_model, "tests._agents:Raises")
    runner = EpisodeRunner(cfg, tokenizer)
    try:
        dataset = PromptDataset(cfg.data, tokenizer)
        rewarder = Rewarder(cfg.algorithm, tokenizer, env=True)
        with pytest.raises(RewardError, match=r"the environment failed on dataset row 0: the environment failed "
                                              r"on turn 1: ValueError\('the environment is broken'\)"):  # fmt: skip
            chat_server.run(generate(chat_server, dataset.prompts[:1], cfg.rollout, rewarder=rewarder, runner=runner))
        cfg.algorithm.on_reward_error = "skip"
        rewarder = Rewarder(cfg.algorithm, tokenizer, env=True)
        samples = chat_server.run(generate(chat_server, dataset.prompts[:2], cfg.rollout, rewarder=rewarder,
                                           runner=runner))  # fmt: skip
    finally:
        runner.close()
    assert rewarder.failed == 2 and all(s.skip and s.episode.stop == "error" for s in samples)


def played(cfg, tokenizer, client, rows: int) -> list:
    """The episodes of the first `rows` rows, scored; each sample's observed process ids with it."""
    runner = EpisodeRunner(cfg, tokenizer)
    try:
        prompts = PromptDataset(cfg.data, tokenizer).prompts[:rows]
        rewarder = Rewarder(cfg.algorithm, tokenizer, env=True)
        samples = client.run(generate(client, prompts, cfg.rollout, rewarder=rewarder, runner=runner))
    finally:
        runner.close()
    return [(s, {int(p) for p in re.findall(r"pid (\d+)", tokenizer.decode(s.response_ids))}) for s in samples]


def test_an_episode_lives_in_one_worker_and_a_worker_crash_fails_only_its_row(chat_model, chat_server):
    """Each episode's environment is made and stepped in one worker process (not this one) for all its turns;
    a worker that dies mid-episode fails that episode's row alone: the other episodes it held are played
    again in its replacement and finish."""
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    cfg = agent_config(chat_model, "tests._agents:Pids", env_workers=2)
    cfg.rollout.env_args, cfg.algorithm.on_reward_error = {"crash": "6863"}, "skip"  # test.jsonl's second row
    samples = played(cfg, tokenizer, chat_server, 4)
    crashed = [s for s, _ in samples if s.prompt.row["answer"] == "6863"]
    assert len(crashed) == 2 and all(s.skip for s in crashed)
    assert all("its process exited (code 3)" in s.episode.error for s in crashed)
    for s, _ in samples:
        if s not in crashed:  # reward: how many processes stepped its environment
            assert s.episode.stop == "done" and not s.skip and s.reward == 1.0
    pids = set().union(*(p for _, p in samples))
    assert len(pids) >= 2 and os.getpid() not in pids


def test_an_in_process_environment_steps_in_the_trainer_within_its_timeout(chat_model, chat_server):
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    cfg = agent_config(chat_model, "tests._agents:PidsInProcess", env_timeout_s=0.5)
    cfg.algorithm.on_reward_error = "skip"
    samples = played(cfg, tokenizer, chat_server, 2)
    assert all(s.reward == 1.0 and pids == {os.getpid()} for s, pids in samples)
    cfg.rollout.env_args = {"sleep_s": 2.0}
    samples = played(cfg, tokenizer, chat_server, 1)
    assert all("took longer than --agent.env_timeout_s=0.5s" in s.episode.error for s, _ in samples)


def test_a_template_that_renders_turns_differently_whole_is_refused(chat_model):
    """A template whose rendering of a turn depends on what follows it (Qwen3's, which drops earlier turns'
    reasoning, is one) would make the trainer see tokens the model never did."""
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    check_rendering(Renderer(tokenizer))  # Qwen2.5's renders turn by turn as it renders a whole conversation
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if not loop.last %} {% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TemplateError, match=r"the chat template renders .* differently"):
        check_rendering(Renderer(tokenizer))
    # One that rewrites what the model said (its newlines) when it renders a conversation: the whole comparison.
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{{ m.content | replace('\n', "
        "' ') }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TemplateError, match=r"renders a conversation whole differently from turn by turn, from token"):
        check_rendering(Renderer(tokenizer))


# -- weight updates in the middle of episodes ------------------------------------------------------


@pytest.fixture(scope="module")
def toy_server(toy_weights, tmp_path_factory):
    """The toy model, 25 ms per decode step (a turn of 6 tokens is still generating 50 ms after it started, even
    on a loaded machine), batch-invariant (greedy tokens do not depend on what else runs)."""
    cfg = Config(model=ModelConfig(path=str(toy_weights)), data=DataConfig(train_path="unused.jsonl")).rollout
    cfg.server_args = {"decode_delay_ms": 25, "enable_deterministic_inference": True}
    fleet = start_fleet(cfg, str(toy_weights), tmp_path_factory.mktemp("run"), 0, "embedded")
    client = RolloutClient(fleet.urls, timeout_s=60)
    yield client
    client.close()
    fleet.stop()


def scripted_config(tmp_path, interrupt: str) -> Config:
    """Greedy episodes of 3 model turns of 6 tokens each and two observations "12+", each step of the environment 20 ms
    long: an episode outlasts the 50 ms an update waits for (the test's thread, late on a loaded machine, once let every
    episode finish before the update, and none spanned one)."""
    rows = [{**row, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}} for row in toy.make_rows(40, 3)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = Config(model=ModelConfig(path=str(ROOT / "examples/toy/model")), data=DataConfig(train_path=str(path)))
    cfg.data.shuffle = False
    r = cfg.rollout
    r.env, r.env_args, r.temperature, r.prompts_per_step, r.n_samples = (
        "tests._agents:Scripted",
        {"turns": 3, "sleep_s": 0.02},
        0.0,
        2,
        2,
    )
    r.max_staleness, r.interrupt, r.placement = 2, interrupt, "disaggregate"
    cfg.agent.env_workers = 0  # in this process: quick to start (the worker processes are tested above)
    return cfg


def simulated_update(client, version: int, mode: str) -> None:
    client.call_all("/pause_generation", {"mode": mode})
    client.call_all("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
    client.call_all("/continue_generation", {})


def wait_for_a_request_in_flight(manager: RolloutManager, timeout_s: float = 10.0) -> None:
    """Until a request is at the servers (or none comes): a fixed sleep after a collect let the update land before
    the groups admitted at the last update had started, on a loaded machine, and then no episode spanned it."""
    deadline = time.monotonic() + timeout_s
    while manager.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.002)


@pytest.mark.parametrize("interrupt", ["partial", "pause"])
def test_episodes_interrupted_by_weight_updates_finish_with_the_uninterrupted_tokens(toy_server, tmp_path, interrupt):
    """Weight updates land in the middle of model turns and between them; every episode then goes on at the
    same turn from its exact token state. Under unchanged weights, greedy, the result equals episodes played
    without an interruption; each model token's weight version is recorded (partial: where the newer span
    starts; pause: that the turn finished under a newer version)."""
    tokenizer = toy.build_tokenizer()
    cfg = scripted_config(tmp_path, interrupt)
    dataset = PromptDataset(cfg.data, tokenizer)
    runner = EpisodeRunner(cfg, tokenizer)
    simulated_update(toy_server, 0, "abort")
    reference = toy_server.run(generate(toy_server, dataset.prompts[:16], cfg.rollout, runner=runner))
    by_row = {s.prompt.index: s for s in reference}
    rewarder = Rewarder(cfg.algorithm, tokenizer, env=True)
    manager = RolloutManager(toy_server, cfg, PromptStream(dataset, 2, 0, 1), rewarder, runner)
    manager.start()
    interrupted, samples, pause = 0, [], interrupt == "pause"
    try:
        for step in range(8):  # 4 steps, more while no episode went on across one (a fresh clone's suite, once)
            samples += manager.collect(step).samples
            if step >= 3 and any(len({v for _, v in s.spans}) > 1 for s in samples) and (interrupted or pause):
                break
            if step:  # the groups admitted at the last update
                wait_for_a_request_in_flight(manager)
            time.sleep(0.05)  # the trainer's update: a turn is a few tokens in now
            manager.before_update()
            simulated_update(toy_server, step + 1, "in_place" if pause else "abort")
            manager.after_update(step + 1)
            interrupted += manager.take_stats().interrupted
    finally:
        manager.stop()
        runner.close()
    observation = tokenizer("12+", add_special_tokens=False)["input_ids"]
    for s in samples:
        assert s.response_ids == by_row[s.prompt.index].response_ids, f"row {s.prompt.index}: other tokens"
        assert s.loss_mask == [1] * 6 + [0] * len(observation) + [1] * 6 + [0] * len(observation) + [1] * 6
        assert s.episode.turns == 3 and s.episode.stop == "done" and s.reward == 1.0
        versions = [v for _, v in s.spans]
        assert versions == sorted(versions)
    spanning = [s for s in samples if len({v for _, v in s.spans}) > 1]
    assert spanning, "no episode went on across a weight update"
    if interrupt == "partial":
        assert interrupted > 0, "no model turn was in flight at an update"
        turn_starts = {0, 6 + len(observation), 12 + 2 * len(observation)}
        assert any(start not in turn_starts for s in spanning for start, _ in s.spans), (
            "no turn was resumed from the middle"
        )
    else:
        assert interrupted == 0 and any(start is None for s in spanning for start, _ in s.spans)


# -- end to end ------------------------------------------------------------------------------------


def test_the_toy_agent_learns_to_call_the_tool_and_answer(tmp_path):
    """`configs/toy_cpu_agent.yaml` (2 ZeRO-3 ranks, the embedded engine): the reward rises from ~0 (a random
    policy neither calls the tool with the key nor answers its value) within 80 steps; the engine's and the
    trainer's logprobs of every model token agree to fp32 rounding, which they could not if a single token
    the trainer trains on differed from what the server saw."""
    steps = 80
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs/toy_cpu_agent.yaml")]
    cmd += ["--trainer.total_steps", str(steps), "--logging.run_dir", str(tmp_path), "--eval.every", "0"]
    cmd += ["--logging.export_hf", "false"]
    run_to_end(cmd)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()

    def series(tag):
        return [e.value for e in events.Scalars(tag)]

    reward = series("reward/mean")
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    assert first < 0.01 and last > first + 0.02, (first, last)
    assert max(series("mismatch/logprob_abs_diff")) < 1e-4
    assert series("agent/turns_mean")[-1] > 1.5, "the policy does not call the tool"
    assert 0 < series("agent/masked_token_frac")[-1] < 0.5
    for tag in ("agent/env_s_mean", "agent/stop_done_frac", "agent/stop_max_turns_frac", "agent/tool_calls"):
        assert tag in events.Tags()["scalars"], tag
    rows = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    turns = rows[-1]["episode"]["turns"]
    assert [t["from"] for t in turns][:2] == ["model", "environment"]
    held_out = [json.loads(line) for line in (tmp_path / "eval" / f"step_{steps}.jsonl").read_text().splitlines()]
    assert len(held_out) == 256 and all("episode" in r for r in held_out)
