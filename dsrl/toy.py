"""The built-in toy task: copy a short digit string.

A prompt is 1-3 digits followed by "=", e.g. ``"394="``; the right response is the same digits,
``"394"``, then end-of-sequence. One token per character. A random policy scores about 0.07; a tiny model trained with
GRPO on CPU reaches 0.9+ within minutes. Everything (tokenizer, model config, data) is built here,
so nothing is downloaded. ``python -m dsrl.toy <dir>`` writes the files shipped in examples/toy/.
"""

import json
import random
import sys
from pathlib import Path

VOCAB = ["<pad>", "<eos>", *"0123456789", "=", "+"]


def build_tokenizer(vocab_size: int = len(VOCAB)):
    """The toy tokenizer; a larger `vocab_size` pads it with unused tokens to match a bigger model."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = VOCAB + [f"<unused_{i}>" for i in range(vocab_size - len(VOCAB))]
    core = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(vocab)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def build_model_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=VOCAB.index("<eos>"),
        pad_token_id=VOCAB.index("<pad>"),
        torch_dtype="float32",
    )


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
    for name, n, seed in [("train.jsonl", 4096, 0), ("test.jsonl", 256, 1)]:
        with open(root / name, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in make_rows(n, seed))


if __name__ == "__main__":
    write_example(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/toy"))
