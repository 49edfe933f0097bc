"""Environments and tools for the agent tests, importable by name (worker processes import them)."""

import os
import time

import dsrl
from dsrl.rollout.agents import Environment, Step, ToolCall, ToolEnv


class Scripted(Environment):
    """Ignores what the model says: `turns` observations of `observation`, then done with reward 1."""

    def __init__(self, row: dict, turns: int = 3, observation: str = "12+", sleep_s: float = 0.0):
        self.turns, self.observation, self.sleep_s, self.seen = turns, observation, sleep_s, 0

    def step(self, response: str) -> Step:
        time.sleep(self.sleep_s)
        self.seen += 1
        if self.seen >= self.turns:
            return Step(reward=1.0, done=True)
        return Step(observation=self.observation)


class Raises(Environment):
    def step(self, response: str) -> Step:
        raise ValueError("the environment is broken")


@dsrl.tool
def echo(text: str) -> str:
    """Say it back.

    Args:
        text: What to say.
    """
    return text


@dsrl.tool
def hang(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke up"


@dsrl.tool
def fail(why: str) -> str:
    """Raise.

    Args:
        why: The message.
    """
    raise RuntimeError(why)


@dsrl.tool
def crash(code: int) -> str:
    """Kill its own process.

    Args:
        code: The exit code.
    """
    os._exit(code)


@dsrl.tool
def flood(megabytes: int) -> None:
    """Print a lot.

    Args:
        megabytes: How much.
    """
    print("x" * (megabytes << 20))


class AllTools(ToolEnv):
    """Calls every misbehaving tool on its first turn (whatever the model said), then answers."""

    tools = [echo, hang, fail, crash, flood]

    def __init__(self, row: dict, **options):
        super().__init__(row)
        self.turn = 0

    def step(self, response: str) -> Step:
        self.turn += 1
        if self.turn > 1:
            return Step(reward=0.5, done=True)
        calls = [ToolCall("echo", {"text": "hi"}), ToolCall("hang", {"seconds": 60}), ToolCall("fail", {"why": "no"}),
                 ToolCall("crash", {"code": 3}), ToolCall("flood", {"megabytes": 10}), ToolCall("nope", {}),
                 ToolCall("", error="the tool call is not valid JSON")]  # fmt: skip
        return Step(tool_calls=calls)


class EchoThrice(ToolEnv):
    """Whatever the model says, calls echo("turn N") on its first two turns, then scores 1."""

    tools = [echo]

    def __init__(self, row: dict, **options):
        super().__init__(row)
        self.turn = 0

    def step(self, response: str) -> Step:
        self.turn += 1
        if self.turn > 2:
            return Step(reward=1.0, done=True)
        return Step(tool_calls=[ToolCall("echo", {"text": f"turn {self.turn - 1}"})])


class Pids(Environment):
    """3 turns, each observation the id of the process its step ran in; the reward is how many processes
    stepped this environment object. The row whose answer is `crash` kills its process on its second turn;
    `sleep_s` makes each step that slow."""

    def __init__(self, row: dict, crash: str = "", sleep_s: float = 0.0):
        self.crash, self.sleep_s, self.pids = row["answer"] == crash, sleep_s, []

    def step(self, response: str) -> Step:
        time.sleep(self.sleep_s)
        self.pids.append(os.getpid())
        if self.crash and len(self.pids) == 2:
            os._exit(3)
        if len(self.pids) == 3:
            return Step(reward=len(set(self.pids)), done=True)
        return Step(observation=f" pid {os.getpid()}.")


class PidsInProcess(Pids):
    in_process = True
