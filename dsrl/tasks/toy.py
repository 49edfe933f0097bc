"""The built-in toy tasks: copy a short digit string, or look a key's value up with a tool and answer it.

A prompt is 1-3 digits followed by "=", e.g. ``"394="``; the right response is the same digits,
``"394"``, then end-of-sequence. One token per character. A random policy scores about 0.07; a tiny model trained with
GRPO on CPU reaches 0.9+ within minutes. Everything (tokenizer, model config, data) is built here,
so nothing is downloaded. ``python -m dsrl.tasks.toy <dir>`` writes the files shipped in examples/toy/.

The agent task (`KeyLookupEnv`, `configs/toy_cpu_agent.yaml`) reads the same prompts as keys: only the
`lookup` tool knows a key's value. The model calls it by ending a turn with "+" after the key ("394+"),
reads the value it returns ("512+"), then answers it ("512"): ``394=`` ``394+`` ``512+`` ``512``. After
"=" a turn copies and calls; after "+" it copies and answers.
"""

import json
import random
import sys
from pathlib import Path

from dsrl.rollout.agents import Environment, Step

VOCAB = ["<pad>", "<eos>", *"0123456789", "=", "+"]


def build_tokenizer(vocab_size: int = len(VOCAB)):
    """The toy tokenizer; a larger `vocab_size` pads it with unused tokens to match a bigger model."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = VOCAB + [f"<unused_{i}>" for i in range(vocab_size - len(VOCAB))]
    core = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(vocab)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


SHAPE = {"vocab_size": len(VOCAB), "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": True, "bos_token_id": None,
         "eos_token_id": VOCAB.index("<eos>"), "pad_token_id": VOCAB.index("<pad>"),
         "torch_dtype": "float32"}  # fmt: skip
"""What the toy model's dense and mixture-of-experts configs share."""


def build_model_config():
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPE, num_hidden_layers=2)


def build_moe_config():
    """The toy model as a mixture of experts (`configs/toy_cpu_moe.yaml`): Qwen3-MoE's architecture, 4 layers of 8
    experts, each token routed to 2 (renormalised over them, as Qwen3-30B-A3B). (`intermediate_size` is a dense
    layer's: none here.)"""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**SHAPE, num_hidden_layers=4, head_dim=16, moe_intermediate_size=64, num_experts=8,
                          num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = [str(rng.randrange(10)) for _ in range(rng.randint(1, 3))]
        rows.append({"prompt": "".join(digits) + "=", "answer": "".join(digits)})
    return rows


def reward(prompt: str, response: str, answer: str) -> float:
    """Fraction of positions right; extra or missing digits count as wrong (whitespace is ignored)."""
    got, want = "".join(response.split()), answer
    hits = sum(g == w for g, w in zip(got, want))
    return hits / max(len(got), len(want), 1)


def write_example(root: Path) -> None:
    model_dir = root / "model"
    build_tokenizer().save_pretrained(model_dir)
    build_model_config().save_pretrained(model_dir)
    build_tokenizer().save_pretrained(root / "moe")
    build_moe_config().save_pretrained(root / "moe")
    for name, n, seed in [("train.jsonl", 4096, 0), ("test.jsonl", 256, 1)]:
        with open(root / name, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in make_rows(n, seed))


def lookup(key: str) -> str:
    """The value of a key, known only to this tool: 1-3 digits."""
    return str((int(key) * 7919 + 17) % 1000) if key.isdigit() else ""


class KeyLookupEnv(Environment):
    """The toy agent task, a `dsrl.Environment` in a few lines (with no chat template, an observation is
    plain text). Reward: the last tool call's key (its fraction of right digits) times (1 + the answer's
    fraction of right digits) / 2: an answer without a tool call, or after a call without the key, is
    worth nothing, and a guessed answer no more than the call that led to it."""

    in_process = True  # a few string operations of dsrl's own: no worker process needed

    def __init__(self, row: dict, **options):
        self.key = str(row["answer"])
        self.call_score: float | None = None

    def step(self, response: str) -> Step:
        text = "".join(response.split())
        if "+" in text:  # a tool call: the key before the "+"
            asked = text.split("+")[0]
            self.call_score = reward("", asked, self.key)
            return Step(observation=lookup(asked) + "+")
        if self.call_score is None:
            return Step(reward=0.0, done=True)
        return Step(reward=self.call_score * (0.5 + 0.5 * reward("", text, lookup(self.key))), done=True)


if __name__ == "__main__":
    write_example(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/toy"))
