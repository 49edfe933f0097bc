"""Episodes: the model's turns and an environment's observations, as one token-exact training sample.

Every rollout is an episode: without `--rollout.env` it is one model turn (a response); with one, the
model's turns alternate with the environment's observations until it ends the episode or a limit does.
`EpisodeRunner.run` plays an episode through a `request` function the schedule supplies (the
synchronous one sends it; the asynchronous one also tags, counts and routes it), and returns early when
a weight update aborts a model turn: the episode keeps its exact token state and resumes at that turn.

Token exactness: the model's tokens are the server's output ids, never re-tokenised. An observation is
rendered once, as the chat template renders it after a model turn: the template's tokens after the
model's end-of-turn token, then the observation's messages, then the generation prompt, taken as the
difference between a fixed two-message conversation with and without them (O(1) per turn, not O(turns)).
`check_rendering` proves at start-up, per tokenizer, that this equals the template's rendering of a
whole conversation. Observation tokens get loss mask 0 and logprob 0; consecutive turns stay one sample.
"""

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from dsrl.config import Config, function_spec
from dsrl.data import EpisodeRecord, Prompt, Sample
from dsrl.rewards.pool import StickyPool, TimedOut, WorkerPool
from dsrl.rewards.rules import load_function
from dsrl.rollout.agents import Step, ToolCall, cap_text, tool_schema

log = logging.getLogger(__name__)

STOP_REASONS = ("done", "max_turns", "max_tokens", "deadline", "error")
"""Why an episode ended: the environment ended it, agent.max_turns, agent.max_episode_tokens,
agent.episode_timeout_s, or the environment failed. (A model turn cut by rollout.max_new_tokens goes to
the environment like any other: its finish_reason says "length".)"""


class TemplateError(ValueError):
    """The chat template cannot be rendered turn by turn as it renders a whole conversation."""


class Renderer:
    """Observations as tokens, rendered once as the chat template renders them after a model turn; without
    a chat template (or with `data.apply_chat_template` false) an observation is its text, tokenized."""

    def __init__(self, tokenizer, tools: list[dict] | None = None, use_template: bool = True):
        self.tokenizer, self.tools = tokenizer, tools or None
        self.templated = use_template and bool(getattr(tokenizer, "chat_template", None))
        self.eos = tokenizer.eos_token_id
        if self.templated:
            self.base = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
            self.base_text = self.render(self.base, generation_prompt=False)
            eos_text = tokenizer.convert_ids_to_tokens(self.eos)
            end = self.base_text.rfind(eos_text)
            if end < 0:
                raise TemplateError(f"the chat template does not end an assistant turn with the eos token {eos_text}")
            self.after_eos = self.base_text[end + len(eos_text) :]
            """What the template puts after the model's end-of-turn token (Qwen: a newline)."""

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def observation(self, messages: list[dict], ended_with_eos: bool) -> list[int]:
        """The tokens that follow a model turn: `messages` and the next generation prompt."""
        if not self.templated:
            return self.encode("".join(m["content"] for m in messages))
        whole = self.render(self.base + messages, generation_prompt=True)
        if not whole.startswith(self.base_text):
            raise TemplateError("the chat template renders the conversation before an observation differently "
                                "once the observation follows it: turns cannot be rendered one at a time")  # fmt: skip
        ids = self.encode(self.after_eos + whole[len(self.base_text) :])
        return ids if ended_with_eos else [self.eos, *ids]

    def cap(self, text: str, limit: int, side: str) -> str:
        """`text` cut to `limit` tokens (agent.max_observation_tokens), keeping the side(s) asked for."""
        if len(text.encode()) < limit:  # fewer tokens than bytes (+1: a leading space token)
            return text
        ids = self.encode(text)
        if len(ids) <= limit:
            return text
        keep = {"head": (limit, 0), "tail": (0, limit), "middle": (limit - limit // 2, limit // 2)}[side]
        cut = f"\n[... {len(ids) - limit} tokens cut ...]\n"
        head = self.tokenizer.decode(ids[: keep[0]]) if keep[0] else ""
        tail = self.tokenizer.decode(ids[len(ids) - keep[1] :]) if keep[1] else ""
        return head + cut + tail


def check_rendering(renderer: Renderer) -> None:
    """Render a tool-calling conversation turn by turn as an episode does and whole as the chat template
    does: the tokens must be the same, else training would see tokens the model never did (the drift
    peers' users report). Raise naming the first token that differs."""
    if not renderer.templated:
        return
    user = {"role": "user", "content": "What is 12 * 7?"}
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
    answer = "12 * 7 = 84."
    result = [{"role": "tool", "name": "calculator", "content": "84"}]
    whole_messages = [user, {"role": "assistant", "content": call}, *result, {"role": "assistant", "content": answer}]
    whole = renderer.encode(renderer.render(whole_messages, generation_prompt=False))
    eos = [renderer.eos]
    ours = renderer.encode(renderer.render([user], generation_prompt=True)) + renderer.encode(call) + eos
    ours += renderer.observation(result, ended_with_eos=True) + renderer.encode(answer) + eos
    ours += renderer.encode(renderer.after_eos)
    if ours != whole:
        at = next((i for i, (a, b) in enumerate(zip(ours, whole)) if a != b), min(len(ours), len(whole)))
        show = renderer.tokenizer.decode
        raise TemplateError(
            f"the chat template renders a conversation whole differently from turn by turn, from token {at}: whole "
            f"{show(whole[at : at + 12])!r}, turn by turn {show(ours[at : at + 12])!r}. An episode would train on "
            "tokens the model never saw; use a template that renders every turn the same way whatever follows it "
            "(e.g. one that does not drop earlier turns' reasoning), or --data.apply_chat_template false"
        )


@dataclass
class Episode:
    """An episode in progress: its sample (all tokens so far, masks, logprobs, versions) and what the
    environment and the limits need to go on from exactly here."""

    sample: Sample
    sampling: dict
    """The sampling parameters of its model turns (the prompt's own overrides applied)."""
    env: Any = None
    """Its environment: the object (in process), or (worker, key) of where it lives; None before its first turn."""
    responses: list[str] = field(default_factory=list)
    """The model's turns as the environment got them (played again if its worker process was replaced)."""
    turn_tokens: int = 0
    """Tokens of the model turn in progress (one a weight update interrupted), or of the last one until the
    environment answers it."""
    record: EpisodeRecord = field(default_factory=EpisodeRecord)
    """Its turns, why it stopped, its reward and error, what its turns cost: the sample's `episode` at its end."""
    started: float = field(default_factory=time.monotonic)


Request = Callable[[Episode, dict], Awaitable[tuple[Any, int]]]
"""(episode, sampling params) -> (the parsed `/generate` reply, the weight version it was sent under): one
model turn's request, built from the episode's tokens so far by the schedule."""


class EpisodeRunner:
    """Plays episodes: model turns through the schedule's `request`, environment turns in one worker process per
    episode (or in this one: `Environment.in_process`), tool calls in others, observations by `Renderer`."""

    def __init__(self, cfg: Config | None = None, tokenizer=None):
        """Episodes of `cfg.rollout.env`; without one (or without `cfg`), single responses."""
        self.env_cls = load_function(cfg.rollout.env, "rollout.env") if cfg and cfg.rollout.env else None
        self.env_workers = self.tool_workers = None
        self.tools: dict[str, str] = {}
        self.tool_schemas = tool_schemas(self.env_cls)
        """The chat template's `tools` for the prompts: the environment's (None without)."""
        if self.env_cls is None:
            return
        self.agent, self.tokenizer = cfg.agent, tokenizer
        self.env_spec, self.env_args = function_spec(cfg.rollout.env), dict(cfg.rollout.env_args)
        tools = zip(getattr(self.env_cls, "tools", None) or [], self.tool_schemas or [])
        self.tools = {schema["function"]["name"]: function_spec(fn) for fn, schema in tools}
        self.renderer = Renderer(tokenizer, self.tool_schemas, cfg.data.apply_chat_template)
        check_rendering(self.renderer)
        g = self.agent
        if g.env_workers and not getattr(self.env_cls, "in_process", False):
            self.env_workers = StickyPool("dsrl.rollout.agents:env_step", g.env_workers, g.env_timeout_s,
                                          "--agent.env_timeout_s")  # fmt: skip
        if self.tools:
            self.tool_workers = WorkerPool("dsrl.rollout.agents:call_tool", g.tool_workers, g.tool_timeout_s, True,
                                           "--agent.tool_timeout_s")  # fmt: skip

    def close(self) -> None:
        for workers in (self.env_workers, self.tool_workers):
            if workers is not None:
                workers.close()

    def new(self, prompt: Prompt, sampling: dict, version: int = 0) -> Episode:
        return Episode(Sample(prompt, [], [], "", version), {**sampling, **prompt.sampling})

    async def run(self, episode: Episode, request: Request) -> bool:
        """Play `episode` to its end (then its sample is complete), or until a weight update aborts a model
        turn: False, and the episode stays as it is, to go on from there."""
        record = episode.record
        while record.stop is None:
            if not await self.model_turn(episode, request):
                return False
            if record.stop is None:
                start = time.monotonic()
                await self.env_turn(episode)
                record.between_s += time.monotonic() - start
        if self.env_cls is not None:
            record.seconds = time.monotonic() - episode.started
            episode.sample.episode = record
        if self.env_workers is not None and episode.env is not None:
            self.env_workers.release(episode.env[1])
        return True

    async def model_turn(self, episode: Episode, request: Request) -> bool:
        s = episode.sample
        params = dict(episode.sampling)
        budget = params["max_new_tokens"] - episode.turn_tokens
        if self.env_cls is not None:
            budget = min(budget, self.agent.max_episode_tokens - len(s.response_ids))
        if budget <= 0:  # aborted as its last token came out (SGLang then says "abort", not "length")
            self.end_turn(episode, "length", s.spans[-1][1] if s.spans else s.weight_version)
            return True
        params["max_new_tokens"] = budget
        reply, sent_under = await request(episode, params)
        tokens = reply.output_ids[:budget]
        if tokens:  # (none when aborted before it was sent: the client's reply carries no version)
            finished_under = reply.weight_version
            s.spans.append((len(s.response_ids), min(sent_under, finished_under)))
            if finished_under > sent_under:  # paused through an update: where the newer tokens start is unseen
                s.spans.append((None, finished_under))
            s.response_ids += tokens  # in place: a turn costs its own tokens, not the episode's so far
            s.engine_logprobs += reply.logprobs[: len(tokens)]
            if reply.routed_experts is not None:  # (each reply's covers the whole sequence so far)
                s.routed_experts = reply.routed_experts
            if s.loss_mask is not None:
                s.loss_mask += [1] * len(tokens)
            episode.turn_tokens += len(tokens)
        if reply.finish_reason == "abort":
            return False
        self.end_turn(episode, reply.finish_reason, reply.weight_version)
        return True

    def end_turn(self, episode: Episode, finish_reason: str, version: int) -> None:
        s, record = episode.sample, episode.record
        s.finish_reason, s.weight_version = finish_reason, version
        if not s.spans:
            s.spans.append((0, version))
        record.turns += 1
        if self.env_cls is None:
            record.stop = "done"
        elif len(s.response_ids) >= self.agent.max_episode_tokens:
            record.stop = "max_tokens"

    async def env_turn(self, episode: Episode) -> None:
        """The environment's answer to the model's last turn, rendered; or the episode's end."""
        s, g, record = episode.sample, self.agent, episode.record
        left = g.episode_timeout_s - (time.monotonic() - episode.started)
        if left <= 0:
            record.stop = "deadline"
            return
        turn = s.response_ids[len(s.response_ids) - episode.turn_tokens :]
        episode.turn_tokens = 0
        text = self.tokenizer.decode(turn, skip_special_tokens=True)
        episode.responses.append(text)
        start = time.monotonic()
        step, error = await self.call_env(episode, text, left)
        shown = step.observation if step is not None and isinstance(step.observation, list) else []
        if any(not isinstance(m.get("content", ""), str) for m in shown):  # (an image, a tool's picture)
            step, error = None, "its observation is not text: an episode adds text only (images come with the row)"
        if error is not None:
            record.stop, record.error = "error", f"the environment failed on turn {record.turns}: {error}"
        if step is None:
            return
        record.reward += float(step.reward)
        if step.done:
            record.stop = "done"
            return
        if record.turns >= g.max_turns:
            record.stop = "max_turns"
            return
        messages = observation_messages(step.observation, self.renderer.templated)
        if step.tool_calls:
            messages += await self.run_tools(episode, step.tool_calls, left - (time.monotonic() - start))
        for m in messages:
            m["content"] = self.renderer.cap(str(m["content"]), g.max_observation_tokens, g.truncate_side)
        ids = self.renderer.observation(messages, ended_with_eos=bool(turn) and turn[-1] == self.renderer.eos)
        if len(s.response_ids) + len(ids) >= g.max_episode_tokens:
            record.stop = "max_tokens"  # no room for the observation and a turn after it
            return
        if s.loss_mask is None:
            s.loss_mask = [1] * len(s.response_ids)
        s.response_ids += ids
        s.engine_logprobs += [0.0] * len(ids)
        s.loss_mask += [0] * len(ids)

    async def call_env(self, episode: Episode, text: str, left: float) -> tuple[Step | None, str | None]:
        """The environment's step on the model's turn `text`: (step, None), (None, why it failed), or (None, None)
        when the episode's deadline passed first. The environment is made from the row on the first turn. Its
        time (agent/env_s) runs until the answer is here, not until the event loop, busy with the other
        episodes' turns, comes back to this one (agent/between_s counts that too)."""
        start = time.monotonic()
        try:
            if self.env_workers is None:
                step, error, answered = await self.step_in_process(episode, text, left)
            else:
                first = episode.env is None
                if first:  # one worker for the whole episode: its environment never leaves it
                    episode.env = self.env_workers.place(episode)
                worker, key = episode.env
                item = (key, self.env_spec, self.env_args, episode.sample.prompt.row)
                call = self.env_workers.submit(worker, (*item, [text], first))
                step, error, answered = await asyncio.wait_for(call, left)
                if step is None and error is None:  # its worker was replaced (another episode's step crashed or hung)
                    again = self.env_workers.submit(worker, (*item, episode.responses, True))
                    step, error, answered = await asyncio.wait_for(again, start + left - time.monotonic())
        except TimeoutError:  # the episode's deadline passed while the environment thought
            step, error, answered = None, None, time.monotonic()
            episode.record.stop = "deadline"
        episode.record.env_s += answered - start
        return step, error

    async def step_in_process(self, episode: Episode, text: str, left: float) -> tuple[Step | None, str | None, float]:
        """An `in_process` environment's step: a plain one in a thread (the event loop goes on), an async one here."""
        timeout, future = min(left, self.agent.env_timeout_s), None
        try:
            if episode.env is None:
                episode.env = self.env_cls(episode.sample.prompt.row, **self.env_args)
            step = episode.env.step
            if inspect.iscoroutinefunction(step):
                future = asyncio.ensure_future(_answered(step(text)))
            else:
                future = asyncio.get_running_loop().run_in_executor(None, lambda: (step(text), time.monotonic()))
            value, answered = await asyncio.wait_for(future, timeout)
        except Exception as e:  # noqa: BLE001 -- reported as the episode's failure, naming the row
            if not (isinstance(e, TimeoutError) and future is not None and future.cancelled()):  # it raised
                return None, repr(e), time.monotonic()
            if timeout == left:
                raise
            return None, f"took longer than --agent.env_timeout_s={timeout:g}s", time.monotonic()
        if not isinstance(value, Step):
            return None, f"{self.env_spec}.step returned {type(value).__name__}, not a dsrl.Step", answered
        return value, None, answered

    async def run_tools(self, episode: Episode, calls: list[ToolCall], left: float) -> list[dict]:
        """Each call's result as a `tool` message, in order; at most agent.max_parallel_calls at once. A call
        that raises, hangs, kills its process or names no known tool gets an error message instead."""
        g, record = self.agent, episode.record
        slots = asyncio.Semaphore(g.max_parallel_calls)

        async def one(call: ToolCall) -> dict:
            record.tool_calls += 1
            spec = self.tools.get(call.name)
            error = call.error or (None if spec else f"no tool named {call.name!r}; tools: {sorted(self.tools)}")
            output = None
            if error is None:
                async with slots:
                    item = (spec, call.arguments, g.max_tool_output_chars, g.truncate_side)
                    calling = self.tool_workers.run_async([item])
                    try:
                        ((output, error),) = await asyncio.wait_for(calling, max(left, 0.01))
                    except TimeoutError:
                        error = TimedOut("took longer than the episode had left (--agent.episode_timeout_s)")
            if error is not None:
                record.tool_errors += 1
                record.tool_timeouts += isinstance(error, TimedOut)
                output = cap_text(f"error: {error}", g.max_tool_output_chars, g.truncate_side)
            return {"role": "tool", "name": call.name, "content": output}

        start = time.monotonic()
        messages = list(await asyncio.gather(*(one(c) for c in calls)))
        record.tool_s += time.monotonic() - start
        return messages


async def _answered(step: Awaitable) -> tuple[Any, float]:
    return await step, time.monotonic()


def observation_messages(observation, templated: bool) -> list[dict]:
    """An environment's observation as chat messages: a string is a user turn (or, without a chat template,
    the text itself)."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if not templated and any(m.get("role") != "user" for m in observation):
        return [{"role": "user", "content": "".join(str(m["content"]) for m in observation)}]
    return [dict(m) for m in observation]


def tool_schemas(env_cls) -> list[dict] | None:
    """The tools an environment class offers, as the chat template's `tools` (None: it offers none, or no class)."""
    return [tool_schema(fn) for fn in getattr(env_cls, "tools", None) or []] or None


def episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """agent/*: turns, tool calls and failures, seconds, stop reasons and the masked fraction of a batch's
    episodes (the same keys on every rank: they are averaged or summed over ranks)."""
    records = [s.episode for s in samples if s.episode is not None]
    if not records:
        return {}
    n = len(records)
    tokens = sum(len(s.response_ids) for s in samples)
    out = {
        f"agent/{k}": float(sum(getattr(r, k) for r in records)) for k in ("tool_calls", "tool_errors", "tool_timeouts")
    }
    out |= {
        f"agent/{k}_mean": sum(getattr(r, k) for r in records) / n for k in ("turns", "env_s", "tool_s", "between_s")
    }
    out |= {
        "agent/between_turns_frac": sum(r.between_s for r in records) / max(sum(r.seconds for r in records), 1e-9),
        "agent/masked_token_frac": sum(len(s.response_ids) - s.model_tokens() for s in samples) / max(tokens, 1),
    }
    out.update({f"agent/stop_{why}_frac": sum(r.stop == why for r in records) / n for why in STOP_REASONS})
    return out


def sample_row(sample: Sample, tokenizer) -> dict:
    """A sample as generations.jsonl, the eval files and the trackers' tables show it; an episode with its record
    and whole conversation."""
    s, response = sample, tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    row = {"row": s.prompt.index, "prompt": s.prompt.text, "response": response, "reward": s.reward,
           "weight_version": s.weight_version}  # fmt: skip
    if s.episode is not None:
        row["episode"] = {**asdict(s.episode), "turns": conversation(s, tokenizer)}
    return row


def conversation(sample: Sample, tokenizer) -> list[dict]:
    """The response as turns, the model's and the environment's told apart (for generations.jsonl, tables)."""
    turns, mask = [], sample.mask()
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            text = tokenizer.decode(sample.response_ids[start:i], skip_special_tokens=False)
            turns.append({"from": "model" if mask[start] else "environment", "text": text})
            start = i
    return turns
