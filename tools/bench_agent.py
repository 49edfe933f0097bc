"""Multi-turn rollout cost: episodes of 1, 2, 4, 8, 16 model turns at equal model tokens, against single
responses of the same length, on one server (the embedded engine on CPU, SGLang on GPU).

    python tools/bench_agent.py --model examples/calculator/model --engine embedded --tokens 64 --episodes 32
    python tools/bench_agent.py --model /tmp/models/0.5b-chat --engine sglang --tokens 1024 --episodes 256

Each episode's model turns have tokens/turns tokens (ignore_eos), and after each turn but the last the
environment answers with a short observation (a user turn, rendered by the chat template). The model
tokens of a row are therefore equal across rows; what differs is the number of requests, the observation
tokens the server prefills, and the environment's turns. Prints episodes/s, model tokens/s, the ratio to
single responses, and the mean latency of a model turn by its index (the per-turn cost must not grow with
the turn number: observations are rendered in O(1), never by re-tokenising the conversation). Each
multi-turn row is followed by its floor ("raw"): the same requests from a bare loop with the observation's
tokens rendered beforehand, i.e. what the server itself charges for that many turns.
"""

import argparse
import asyncio
import statistics
import time
from dataclasses import replace
from pathlib import Path

from transformers import AutoTokenizer

from dsrl.config import Config, DataConfig, ModelConfig
from dsrl.data import Prompt
from dsrl.rollout.agents import Environment, Step
from dsrl.rollout.episode import EpisodeRunner
from dsrl.rollout.rollouts import parse_generation
from dsrl.serving.client import RolloutClient
from dsrl.serving.fleet import start_fleet


class Fixed(Environment):
    """`turns` model turns; after each but the last, the same short user turn."""

    def __init__(self, row: dict, turns: int = 1):
        self.turns, self.seen = turns, 0

    def step(self, response: str) -> Step:
        self.seen += 1
        return Step(reward=1.0, done=True) if self.seen >= self.turns else Step(observation="Go on.")


def run(client, runner, prompts: list[Prompt], sampling: dict) -> tuple[float, list[float], int]:
    """Play every episode at once; (seconds, each model turn's latency by turn index, model tokens)."""
    latencies: dict[int, list[float]] = {}

    async def one(prompt: Prompt):
        turn = 0

        async def request(episode, params):
            nonlocal turn
            body = {"input_ids": prompt.prompt_ids + episode.sample.response_ids, "sampling_params": params,
                    "return_logprob": True}  # fmt: skip
            start = time.perf_counter()
            reply = parse_generation(await client.generate(body, route_key=prompt.index))
            latencies.setdefault(turn, []).append(time.perf_counter() - start)
            turn += 1
            return reply, reply.weight_version

        episode = runner.new(prompt, sampling)
        await runner.run(episode, request)
        return episode.sample.model_tokens()

    async def all_episodes():
        return await asyncio.gather(*(one(p) for p in prompts))

    start = time.perf_counter()
    tokens = client.run(all_episodes())
    seconds = time.perf_counter() - start
    return seconds, [statistics.mean(latencies[t]) for t in sorted(latencies)], sum(tokens)


def run_raw(client, prompts: list[Prompt], turns: int, sampling: dict, observation: list[int]) -> tuple[float, int]:
    """The same turn structure with no dsrl in it: a bare loop of requests, the observation's tokens
    rendered once beforehand. What the server itself charges for the turns."""

    async def one(prompt: Prompt) -> int:
        context, tokens = list(prompt.prompt_ids), 0
        for turn in range(turns):
            body = {"input_ids": context, "sampling_params": sampling, "return_logprob": True}
            out = await client.generate(body, route_key=prompt.index)
            context += out["output_ids"] + (observation if turn < turns - 1 else [])
            tokens += len(out["output_ids"])
        return tokens

    async def all_episodes():
        return await asyncio.gather(*(one(p) for p in prompts))

    start = time.perf_counter()
    tokens = client.run(all_episodes())
    return time.perf_counter() - start, sum(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="A model directory with a tokenizer (a chat template).")
    parser.add_argument("--engine", default="embedded", choices=["embedded", "sglang"])
    parser.add_argument("--url", default=None, help="A running server instead of starting one.")
    parser.add_argument("--tokens", type=int, default=64, help="Model tokens per episode.")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=2, help="Runs per row; the fastest is kept.")
    parser.add_argument("--server-args", default="{}", help="JSON: extra server arguments.")
    args = parser.parse_args()

    import json

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    cfg = Config(model=ModelConfig(path=args.model), data=DataConfig(train_path="unused.jsonl"))
    cfg.rollout.server_args = json.loads(args.server_args)
    cfg.agent.env_workers = 0  # in a thread: the benchmark measures the rollout, not the environment
    cfg.agent.max_turns, cfg.agent.max_episode_tokens = max(args.turns), 1 << 20
    cfg.rollout.server_urls = [args.url] if args.url else []
    cfg.rollout.fleet = "external" if args.url else "local"
    question = [{"role": "user", "content": "Count up from one, one number a turn."}]
    text = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = [Prompt(i, prompt_ids, text, None) for i in range(args.episodes)]
    with start_fleet(cfg.rollout, args.model, Path("/tmp/bench_agent"), 0, args.engine) as fleet:
        client = RolloutClient(fleet.urls, max_concurrency=1024, timeout_s=1800)
        client.call_all("/update_weight_version", {"new_version": "0", "abort_all_requests": False})
        rows = []
        for turns in [1, *args.turns]:
            single = turns == 1 and not rows  # the first row: single responses, no environment
            cfg_t = replace(cfg, rollout=replace(cfg.rollout, env=None if single else Fixed, env_args={"turns": turns}))
            runner = EpisodeRunner(cfg_t, tokenizer)
            per_turn = args.tokens // turns
            sampling = {"max_new_tokens": per_turn, "temperature": 1.0, "ignore_eos": True}
            best = min((run(client, runner, prompts, sampling) for _ in range(args.repeats)), key=lambda r: r[0])
            runner.close()
            seconds, latencies, tokens = best
            rows.append(("single" if single else turns, seconds, latencies, tokens))
            if turns > 1:  # the floor: the same requests without dsrl's runner, environment or rendering
                observation = runner.renderer.observation([{"role": "user", "content": "Go on."}], True)
                raw = min(run_raw(client, prompts, turns, sampling, observation) for _ in range(args.repeats))
                rows.append((f"{turns} raw", raw[0], [], raw[1]))
        client.close()
    base = rows[0][2] and rows[0][3] / rows[0][1]
    print(f"model tokens per episode {args.tokens}, {args.episodes} episodes at once, {args.engine}")
    print(
        f"{'turns':>7} {'episodes/s':>11} {'model tok/s':>12} {'vs single':>10}  model-turn latency by turn index (s)"
    )
    for turns, seconds, latencies, tokens in rows:
        shown = latencies if len(latencies) <= 4 else [*latencies[:2], latencies[len(latencies) // 2], latencies[-1]]
        shown = shown or ["(a bare request loop: the server's own cost of these turns)"]
        print(f"{turns!s:>7} {args.episodes / seconds:11.2f} {tokens / seconds:12.0f} {tokens / seconds / base:10.3f}  "
              + " ".join(x if isinstance(x, str) else f"{x:.3f}" for x in shown))  # fmt: skip


if __name__ == "__main__":
    main()
