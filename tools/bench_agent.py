"""Multi-turn rollout cost: episodes of 1, 2, 4, 8, 16 model turns at equal model tokens, against single
responses of the same length, on one server (the embedded engine on CPU, SGLang on GPU).

    python tools/bench_agent.py --model examples/calculator/model --engine embedded --tokens 64 --episodes 32
    python tools/bench_agent.py --model /tmp/models/0.5b-chat --engine sglang --tokens 1024 --episodes 256 \
        --schedule-policy lpm

Each episode's model turns have tokens/turns tokens (ignore_eos), and after each turn but the last the
environment answers with a short observation (a user turn, rendered by the chat template), stepped in its
episode's worker process (`--in-process`: in this one). The model tokens of a row are therefore equal
across rows; what differs is the number of requests, the observation tokens the server prefills, and the
environment's turns. Each multi-turn row is followed by its floor ("raw"): the same requests from a bare
loop with the observation's tokens rendered beforehand, i.e. what the server itself charges for that many
turns. Per row: episodes/s, model tokens/s and their ratio to single responses and to the floor; the mean
time between a turn's reply and the episode's next request (dsrl's decode, environment and rendering); and
by turn index the mean latency of a model turn and the prompt tokens the server found in its prefix cache
(SGLang's `cached_tokens`; the embedded engine has no cache). No per-turn cost may grow with the turn index.
"""

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from transformers import AutoTokenizer

from dsrl.config import Config, DataConfig, ModelConfig
from dsrl.data import Prompt
from dsrl.rollout.agents import Environment, Step
from dsrl.rollout.episode import EpisodeRunner
from dsrl.rollout.rollouts import parse_generation
from dsrl.serving.client import RolloutClient
from dsrl.serving.fleet import start_fleet

OBSERVATION = "Go on."


class Fixed(Environment):
    """The row's `turns` model turns; after each but the last, the same short user turn."""

    def __init__(self, row: dict):
        self.turns, self.seen = row["turns"], 0

    def step(self, response: str) -> Step:
        self.seen += 1
        return Step(reward=1.0, done=True) if self.seen >= self.turns else Step(observation=OBSERVATION)


class FixedInProcess(Fixed):
    in_process = True


@dataclass
class Row:
    name: str
    seconds: float = 0.0
    tokens: int = 0
    latency: dict[int, list[float]] = field(default_factory=dict)
    """Seconds of each model turn's request, by turn index."""
    cached: dict[int, list[int]] = field(default_factory=dict)
    """Prompt tokens the server had cached, by turn index."""
    gaps: list[float] = field(default_factory=list)
    """Seconds from a turn's reply to the episode's next request."""


async def timed(client: RolloutClient, row: Row, turn: int, body: dict, key: int) -> dict:
    start = time.perf_counter()
    out = await client.generate(body, route_key=key)
    row.latency.setdefault(turn, []).append(time.perf_counter() - start)
    row.cached.setdefault(turn, []).append(out["meta_info"].get("cached_tokens", 0))
    return out


def run(client, runner, prompts: list[Prompt], sampling: dict, name: str) -> Row:
    """Every episode at once, through dsrl's runner."""
    row = Row(name)

    async def one(prompt: Prompt) -> int:
        turn, last = 0, None

        async def request(episode, params):
            nonlocal turn, last
            if last is not None:
                row.gaps.append(time.perf_counter() - last)
            body = {"input_ids": prompt.prompt_ids + episode.sample.response_ids, "sampling_params": params,
                    "return_logprob": True}  # fmt: skip
            reply = parse_generation(await timed(client, row, turn, body, prompt.index))
            turn, last = turn + 1, time.perf_counter()
            return reply, reply.weight_version

        episode = runner.new(prompt, sampling)
        await runner.run(episode, request)
        return episode.sample.model_tokens()

    return finish(client, row, one, prompts)


def run_raw(client, prompts: list[Prompt], turns: int, sampling: dict, observation: list[int]) -> Row:
    """The same turn structure with no dsrl in it: a bare loop of requests, the observation's tokens
    rendered once beforehand. What the server itself charges for the turns."""
    row = Row(f"{turns} raw")

    async def one(prompt: Prompt) -> int:
        context, tokens = list(prompt.prompt_ids), 0
        for turn in range(turns):
            body = {"input_ids": context, "sampling_params": sampling, "return_logprob": True}
            out = await timed(client, row, turn, body, prompt.index)
            context += out["output_ids"] + (observation if turn < turns - 1 else [])
            tokens += len(out["output_ids"])
        return tokens

    return finish(client, row, one, prompts)


def finish(client, row: Row, one, prompts: list[Prompt]) -> Row:
    async def all_episodes():
        return await asyncio.gather(*(one(p) for p in prompts))

    start = time.perf_counter()
    row.tokens = sum(client.run(all_episodes()))
    row.seconds = time.perf_counter() - start
    return row


def show(row: Row, episodes: int, single: Row | None, floor: Row | None) -> str:
    def by_turn(values: dict) -> list:
        turns = sorted(values)
        shown = turns if len(turns) <= 4 else [turns[0], turns[1], turns[len(turns) // 2], turns[-1]]
        return [statistics.mean(values[t]) for t in shown]

    rate = row.tokens / row.seconds
    ratio = lambda base: f"{rate / (base.tokens / base.seconds):.3f}" if base else "-"  # noqa: E731
    gap = f"{statistics.mean(row.gaps) * 1e3:.2f}" if row.gaps else "-"
    latency = " ".join(f"{x:.3f}" for x in by_turn(row.latency))
    cached = " ".join(f"{x:.0f}" for x in by_turn(row.cached))
    return (f"{row.name:>8} {episodes / row.seconds:11.2f} {rate:12.0f} {ratio(single):>9} {ratio(floor):>7} "
            f"{gap:>9}  {latency:<30}  {cached}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="A model directory with a tokenizer (a chat template).")
    parser.add_argument("--engine", default="embedded", choices=["embedded", "sglang"])
    parser.add_argument("--url", default=None, help="A running server instead of starting one.")
    parser.add_argument("--tokens", type=int, default=64, help="Model tokens per episode.")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, nargs="+", default=[2, 4, 8, 16], help="Rows after single responses.")
    parser.add_argument("--repeats", type=int, default=2, help="Runs per row; the fastest is kept.")
    parser.add_argument("--in-process", action="store_true", help="The environment in this process.")
    parser.add_argument("--env-workers", type=int, default=4, help="Its worker processes otherwise.")
    parser.add_argument("--schedule-policy", default=None, help="SGLang's --schedule-policy (lpm, fcfs, ...).")
    parser.add_argument("--server-args", default="{}", help="JSON: extra server arguments.")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    cfg = Config(model=ModelConfig(path=args.model), data=DataConfig(train_path="unused.jsonl"))
    cfg.rollout.server_args = json.loads(args.server_args) | (
        {"schedule_policy": args.schedule_policy} if args.schedule_policy else {}
    )
    cfg.agent.env_workers = args.env_workers
    cfg.agent.max_turns, cfg.agent.max_episode_tokens = max(args.turns), 1 << 20
    cfg.rollout.server_urls = [args.url] if args.url else []
    cfg.rollout.fleet = "external" if args.url else "local"
    print(
        f"model tokens per episode {args.tokens}, {args.episodes} episodes at once, {args.engine}, server args "
        f"{cfg.rollout.server_args}, environment {'in process' if args.in_process else 'in worker processes'}"
    )
    print(HEAD, flush=True)
    with start_fleet(cfg.rollout, args.model, Path("/tmp/bench_agent"), 0, args.engine) as fleet:
        client = RolloutClient(fleet.urls, max_concurrency=1024, timeout_s=1800)
        client.call_all("/update_weight_version", {"new_version": "0", "abort_all_requests": False})
        # A module the environment's workers import by name (PYTHONPATH holds the repository)
        env = f"tools.bench_agent:{'FixedInProcess' if args.in_process else 'Fixed'}"
        runner = EpisodeRunner(replace(cfg, rollout=replace(cfg.rollout, env=env)), tokenizer)
        try:
            rows = bench(args, client, EpisodeRunner(), runner, tokenizer)
        finally:
            runner.close()
            client.close()
    print("\n=== bench_agent summary")
    print(HEAD)
    for row, floor in sorted(rows, key=lambda r: 0 if r[0].name == "single" else int(r[0].name.split()[0])):
        print(show(row, args.episodes, rows[0][0], floor))


HEAD = (f"{'turns':>8} {'episodes/s':>11} {'model tok/s':>12} {'vs single':>9} {'vs raw':>7} {'gap (ms)':>9}  "
        f"{'turn latency by index (s)':<30}  cached tokens by index")  # fmt: skip


def bench(args, client, single_runner, runner, tokenizer) -> list[tuple[Row, Row | None]]:
    """Single responses, then each row of turns and its floor; each printed as it is measured."""
    question = [{"role": "user", "content": "Count up from one, one number a turn."}]
    text = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    observation = runner.renderer.observation([{"role": "user", "content": OBSERVATION}], True)
    warm = [Prompt(i, ids, text, None, row={"turns": 2}) for i in range(args.episodes)]
    run(client, runner, warm, {"max_new_tokens": 2, "temperature": 1.0}, "warm-up")  # the workers start
    rows: list[tuple[Row, Row | None]] = []
    for turns in [1, *args.turns]:
        prompts = [Prompt(i, ids, text, None, row={"turns": turns}) for i in range(args.episodes)]
        sampling = {"max_new_tokens": args.tokens // turns, "temperature": 1.0, "ignore_eos": True}
        best = lambda runs: min(runs, key=lambda r: r.seconds)  # noqa: E731
        if not rows:  # once untimed first: the server's first long decode compiles kernels (the row ran at 0.6x)
            run(client, single_runner, prompts, sampling, "warm-up, single")
            rows.append(
                (best(run(client, single_runner, prompts, sampling, "single") for _ in range(args.repeats)), None)
            )
            print(show(rows[0][0], args.episodes, rows[0][0], None), flush=True)
            continue
        row = best(run(client, runner, prompts, sampling, str(turns)) for _ in range(args.repeats))
        floor = best(run_raw(client, prompts, turns, sampling, observation) for _ in range(args.repeats))
        rows += [(row, floor), (floor, None)]
        print(
            show(row, args.episodes, rows[0][0], floor),
            show(floor, args.episodes, rows[0][0], None),
            sep="\n",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
