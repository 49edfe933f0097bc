"""The calculator environment for chat models: arithmetic problems, a `calculator` tool called in the
Hermes/Qwen format, the final number rewarded as GSM8K's (`dsrl.rewards:math_reward`).

    dsrl train --config configs/gpu_calculator_agent.yaml

`python -m dsrl.tasks.calculator DIR` writes the problems (train.jsonl, test.jsonl) and, for machines that
cannot download one, a Qwen2-style tokenizer: byte-level BPE trained here, Qwen's special tokens and tool
tags, and Qwen2.5's chat template (tools in the system prompt, tool results as `<tool_response>` in a
user turn), with a small Qwen2 config of its vocabulary.
"""

import ast
import json
import operator
import random
import sys
from pathlib import Path

from dsrl.rewards.rules import math_reward
from dsrl.rollout.agents import Step, ToolCall, ToolEnv, tool, tool_schema

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}  # fmt: skip


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:80]}")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / ** and parentheses.

    Args:
        expression: The expression, for example "12 * (3 + 4)".
    """
    value = _evaluate(ast.parse(expression, mode="eval"))
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


SYSTEM = ("You are a careful assistant. Use the calculator tool for arithmetic, then give the final answer "
          "as a number after ####.")  # fmt: skip


class CalculatorEnv(ToolEnv):
    """Tool calls get the calculator's result; the first turn without one is the answer.

    `scripted_calls` N: on its first N turns the environment calls the calculator on the row's expression
    itself, whatever the model said (a model that cannot call tools yet, e.g. a random-init one in a
    benchmark, still plays multi-turn episodes through the real tool path)."""

    tools = [calculator]

    def __init__(self, row: dict, scripted_calls: int = 0):
        super().__init__(row)
        self.scripted_calls, self.turns = scripted_calls, 0

    def step(self, response: str) -> Step:
        self.turns += 1
        if self.turns <= self.scripted_calls:
            return Step(tool_calls=[ToolCall("calculator", {"expression": self.row["expression"]})])
        return super().step(response)

    def reward(self, response: str) -> float:
        return math_reward("", response, self.row["answer"])


def make_problems(n: int, seed: int) -> list[dict]:
    """Rows of chat messages: 'What is a * b + c?' with a system prompt, and the answer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(12, 999), rng.randint(12, 99), rng.randint(1, 999)
        op = rng.choice(["+", "-"])
        expression = f"{a} * {b} {op} {c}"
        answer = a * b + c if op == "+" else a * b - c
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {expression}?"}]
        rows.append({"prompt": messages, "answer": str(answer), "expression": expression})
    return rows


QWEN25_CHAT_TEMPLATE = (Path(__file__).parent / "qwen25_chat_template.jinja").read_text()
"""Qwen2.5-Instruct's chat template (its tokenizer_config.json, as transformers saves one: a .jinja file), for the
tokenizer built here."""


def build_tokenizer(vocab_size: int = 1024):
    """A Qwen2-style tokenizer trained here on calculator conversations: byte-level BPE, `<|endoftext|>`
    (pad), `<|im_start|>`, `<|im_end|>` (eos: the end of a turn), the tool tags as added tokens, and Qwen2.5's
    chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [json.dumps(row) for row in make_problems(2000, 7)] + [
        QWEN25_CHAT_TEMPLATE,
        json.dumps(tool_schema(calculator)),
    ]
    core.train_from_iterator(corpus, trainer)
    core.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN25_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_model_config(tokenizer, **shape):
    """A Qwen2 config for `tokenizer`'s vocabulary; `shape` overrides the tiny CPU default (e.g. the 0.5B's)."""
    from transformers import Qwen2Config

    tiny = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
            "tie_word_embeddings": True}  # fmt: skip
    ids = {"bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    return Qwen2Config(**tiny | shape | ids)


def write_example(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(root / "model")
    build_model_config(tokenizer).save_pretrained(root / "model")
    for name, n, seed in [("train.jsonl", 512, 0), ("test.jsonl", 64, 1)]:
        with open(root / name, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in make_problems(n, seed))


if __name__ == "__main__":
    write_example(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/calculator"))
