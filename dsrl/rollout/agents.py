"""Environments and tools for multi-turn agent episodes (`--rollout.env module:Class`).

An environment is user code in ~20 lines (the README's Agents section has two); it never sees tokens, servers or
DeepSpeed. `step` gets each of the model's turns as text and returns the next observation (a string, or chat messages
such as tool results and user turns), tool calls for dsrl to run, or the end of the episode with a reward. dsrl
renders the observation into tokens, once, and owns the token state, masks, versions, limits and deadlines around it.
An episode's environment lives in one worker process (`--agent.env_workers`) from its first turn to its last; one
that is cheap and trusted may say `in_process = True` and run in the trainer's process instead.

Tools are plain functions, made tools by `@dsrl.tool` (their JSON schema comes from the type hints and
the docstring). `ToolEnv` is the built-in tool-calling environment: it reads Hermes/Qwen
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks from the model's turn; dsrl runs them
in worker processes (`--agent.tool_workers`), each with a timeout and an output cap, and the results
come back as `tool` messages. A turn without a tool call is the answer, scored by `ToolEnv.reward`.
"""

import contextlib
import io
import json
import re
from dataclasses import dataclass, field

from dsrl.rewards.rules import load_function


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None
    """Why the call could not be read (bad JSON, no name): dsrl answers it with this error, counted."""


@dataclass
class Step:
    """What an environment returns for one of the model's turns."""

    observation: str | list[dict] | None = None
    """The next turn's input: text, or chat messages ({role, content}: tool results, a user turn)."""
    reward: float = 0.0
    """Added to the episode's reward (usually given once, with done)."""
    done: bool = False
    """The episode ends here; the model takes no more turns."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """Calls for dsrl to run (ToolEnv's); their results follow the observation as `tool` messages."""


class Environment:
    """One episode of a multi-turn task. Subclass it: `__init__(row, **options)` starts the episode from
    the dataset row (options: `--rollout.env_args`), `step(response)` answers each of the model's turns."""

    tools: list = []
    """Functions decorated with `@dsrl.tool` the model may call; their schemas go into the prompt
    (the chat template's `tools`)."""
    in_process: bool = False
    """Cheap, trusted code: `step` runs in the trainer's process (a plain one in a thread, an `async def` one on
    the event loop), within `--agent.env_timeout_s`, not in a worker process: no process hop, no isolation (a
    step that crashes takes the trainer along; one that hangs is abandoned, running). Tools stay in theirs."""

    def __init__(self, row: dict, **options):
        self.row = row

    def step(self, response: str) -> Step:
        raise NotImplementedError


def tool(fn):
    """Make a plain, module-level function a tool: its JSON schema (name, description, parameters) comes
    from its type hints and its docstring's Args section (`tool_schema`, when the run starts)."""
    fn.dsrl_tool = True
    return fn


def tool_schema(fn) -> dict:
    """A tool's JSON schema, as chat templates take it (transformers' `get_json_schema`). Computed where the
    prompts are rendered, not on import: the worker processes that call tools never import transformers."""
    from transformers.utils import get_json_schema

    if not getattr(fn, "dsrl_tool", False):
        raise TypeError(f"{getattr(fn, '__qualname__', fn)!r} is not a tool: decorate it with @dsrl.tool")
    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 -- transformers raises several kinds; all mean the same here
        why = "every argument needs a type hint and a line under Args:"
        raise TypeError(f"@dsrl.tool {fn.__qualname__}: {e} ({why})") from e


TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Hermes/Qwen tool calls: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in `text`."""
    calls = []
    for raw in TOOL_CALL.findall(text):
        try:
            call = json.loads(raw)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", error=f"the tool call is not valid JSON ({e.msg}): {raw[:200]}"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall("", error=f'a tool call needs {{"name": ..., "arguments": {{...}}}}: {raw[:200]}'))
            continue
        arguments = call.get("arguments") or {}
        if isinstance(arguments, str):  # some models send the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            calls.append(ToolCall(call["name"], error=f"the arguments of {call['name']} must be an object"))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


class ToolEnv(Environment):
    """Tool calling in the Hermes/Qwen format. Subclass it with `tools = [...]` and `reward(response)`: the
    model's turns with `<tool_call>` blocks get the tools' results back; its first turn without one is its
    answer, scored by `reward` (which may read `self.row`)."""

    def step(self, response: str) -> Step:
        calls = parse_tool_calls(response)
        if calls:
            return Step(tool_calls=calls)
        return Step(reward=float(self.reward(response)), done=True)

    def reward(self, response: str) -> float:
        raise NotImplementedError(f"{type(self).__name__} must define reward(self, response) -> float")


# -- run in worker processes (dsrl.rewards.pool, plain mode) ----------------------------------------


_ENVS: dict[int, Environment] = {}
"""A worker's environments, by the key of the episode they belong to (`dsrl.rewards.pool.StickyPool`)."""


def env_step(released: list[int], key: int, env_spec: str, options: dict, row: dict, responses: list[str],
             first: bool) -> Step | None:  # fmt: skip
    """Episode `key`'s environment, kept in this worker process, on the model's turns `responses`; made from the
    row when `first` (then `responses` are every turn so far: one, or all when its worker was replaced and the
    episode is played again here). None: this process does not hold it (it replaced the one that did)."""
    for done in released:
        _ENVS.pop(done, None)
    env = _ENVS.get(key)
    if env is None:
        if not first:
            return None
        env = _ENVS[key] = load_function(env_spec, "rollout.env")(row, **options)
    for response in responses:
        step = env.step(response)
    if not isinstance(step, Step):
        why = " (an `async def` step runs in process only: in_process = True)" if hasattr(step, "__await__") else ""
        raise TypeError(f"{env_spec}.step returned {type(step).__name__}, not a dsrl.Step{why}")
    return step


def cap_text(text: str, limit: int, side: str) -> str:
    """`text` cut to `limit` characters, keeping its head, its tail, or both ends ("middle")."""
    if len(text) <= limit:
        return text
    note = f"\n[... {len(text) - limit} characters cut ...]\n"
    if side == "head":
        return text[:limit] + note
    if side == "tail":
        return note + text[-limit:]
    return text[: limit // 2] + note + text[len(text) - (limit - limit // 2) :]


def call_tool(tool_spec: str, arguments: dict, max_chars: int, side: str) -> str:
    """A tool's output: what it printed, then its return value (if not None), capped at `max_chars`."""
    fn = load_function(tool_spec, "tool")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        value = fn(**arguments)
    out = printed.getvalue() + ("" if value is None else str(value))
    return cap_text(out, max_chars, side)
