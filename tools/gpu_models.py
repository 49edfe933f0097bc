"""Random-init Qwen2-architecture models of the 0.5B, 1.5B, 3B, 7B, 14B and 32B shapes, bf16, for GPU runs; `<size>-rm`
(e.g. 1.5b-rm) is a reward model of that shape, a Qwen2ForSequenceClassification with one label; `moe-<layers>`
(e.g. moe-8) is a Qwen3-MoE of Qwen3-30B-A3B's layer shape (128 experts, 8 a token) with that many layers; `vl-3b` is
Qwen2.5-VL-3B's shape, and `vl-data` its geo3k-like rows (docs/vision-language.md).

Nothing can be downloaded on the GPU machine, so the models are built from their configs (on the
GPU, which is fast) with a tokenizer of the matching vocabulary (the toy tokenizer, padded).

    python tools/gpu_models.py /tmp/models 0.5b 1.5b 3b
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsrl.tasks.toy import VOCAB, build_tokenizer  # noqa: E402

SHAPES = {  # hidden, intermediate, layers, heads, kv heads (Qwen2.5 shapes)
    "0.5b": (896, 4864, 24, 14, 2),
    "1.5b": (1536, 8960, 28, 12, 2),
    "3b": (2048, 11008, 36, 16, 2),
    "7b": (3584, 18944, 28, 28, 4),
    "14b": (5120, 13824, 48, 40, 8),
    "32b": (5120, 27648, 64, 40, 8),
}


def build(out: Path, size: str, vocab: int = 151936) -> Path:
    """`size` of SHAPES, with the toy tokenizer padded to `vocab`; `<size>-chat` (e.g. 0.5b-chat): that shape
    with the Qwen2-style tokenizer and Qwen2.5 chat template of examples/calculator/model (agent runs)."""
    if (out / "config.json").is_file():
        return out
    if size.endswith("-chat"):
        return build_chat(out, size.removesuffix("-chat"))
    if size.startswith("moe-"):
        return build_moe(out, int(size.removeprefix("moe-")), vocab)
    if size == "vl-3b":
        return build_vl(out, vocab)
    if size == "vl-data":
        return write_vl_data(out)
    reward_model = size.endswith("-rm")  # the policy's tokenizer: dsrl sends it the policy's token ids
    hidden, inter, layers, heads, kv = SHAPES[size.removesuffix("-rm")]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=VOCAB.index("<eos>"),
        pad_token_id=VOCAB.index("<pad>"),
        bos_token_id=None,
        **({"num_labels": 1} if reward_model else {}),
    )
    return save_random(out, config, vocab, AutoModelForSequenceClassification if reward_model else AutoModelForCausalLM)


def save_random(out: Path, config, vocab: int, auto=AutoModelForCausalLM, tokenizer=None) -> Path:
    """A model of `config` with seeded random bf16 weights, and `tokenizer` (the toy's padded to `vocab`), saved in
    `out`: built on the GPU (fast), or on the host where it does not fit (32B's 65 GB on an H100)."""
    with torch.device("meta"):
        size = sum(p.numel() for p in auto.from_config(config).parameters()) * 2
    fits = torch.cuda.is_available() and size < 0.8 * torch.cuda.mem_get_info()[0]
    torch.manual_seed(0)
    with torch.device("cuda" if fits else "cpu"):
        model = auto.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    (tokenizer or build_tokenizer(vocab)).save_pretrained(out)
    return out


def build_moe(out: Path, layers: int, vocab: int) -> Path:
    """Qwen3-30B-A3B's layers (hidden 2048, 128 experts of 768, 8 a token, 32 query and 4 key-value heads of 128),
    `layers` of them: per layer 0.60B parameters of experts, 0.04B of them active a token, and 0.02B of attention."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=VOCAB.index("<eos>"), pad_token_id=VOCAB.index("<pad>"), bos_token_id=None,
    )  # fmt: skip
    return save_random(out, config, vocab)


def build_vl(out: Path, vocab: int) -> Path:
    """Qwen2.5-VL-3B's shape (its 3B language model, as SHAPES["3b"], and a vision tower of 32 blocks of 1280, windows
    of 112 px with full attention every 8th block), random bf16; the toy's digits as the words of a tokenizer with
    Qwen's vision tokens (dsrl/tasks/colours.py), padded to `vocab`; Qwen2.5-VL's processor with its defaults (patch 14,
    merge 2), built with torchvision where it imports (SGLang loads the whole processor), else its image processor."""
    import dsrl.vision  # noqa: F401 -- (AutoModelForCausalLM builds a vision-language model after it)
    from dsrl.tasks import colours

    tokenizer = colours.build_tokenizer(VOCAB[2:], vocab)
    hidden, inter, layers, heads, kv = SHAPES["3b"]
    vision = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": hidden,
              "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2}  # fmt: skip
    shape = {"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
             "num_attention_heads": heads, "num_key_value_heads": kv, "max_position_embeddings": 32768,
             "rope_theta": 1e6}  # fmt: skip
    config = colours.build_model_config(tokenizer, vision=vision, **shape)
    config.torch_dtype = config.text_config.torch_dtype = "bfloat16"
    save_random(out, config, vocab, tokenizer=tokenizer)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    try:
        from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

        Qwen2_5_VLProcessor(Qwen2VLImageProcessor(), tokenizer, Qwen2VLVideoProcessor(), chat_template=colours.TEMPLATE
                            ).save_pretrained(out)  # fmt: skip
        Qwen2VLImageProcessor().save_pretrained(out)  # (transformers 5's processor file nests it: dsrl reads this one)
    except (ImportError, TypeError, AttributeError):  # (no torchvision)
        Qwen2VLImageProcessorPil().save_pretrained(out)
    return out


def write_vl_data(out: Path, rows: int = 1024, seed: int = 0) -> Path:
    """geo3k-like rows (verl's layout): the toy's prompt after one picture of 224-448 px a side (multiples of 28: no
    resize, 64-256 image tokens), as bytes in out/train.parquet; the same prompts without the picture in
    out/train.jsonl, for the text-only twin."""
    import json
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dsrl.tasks import colours, toy

    out.mkdir(parents=True, exist_ok=True)
    rng, prompts = random.Random(seed), toy.make_rows(rows, seed)
    sides = [28 * rng.randint(8, 16) for _ in prompts]
    pictures = [colours.png(colours.draw(rng.choice(list(colours.COLOURS)), rng, side)) for side in sides]
    vl = [{"prompt": [{"role": "user", "content": "<image>" + p["prompt"].rstrip("=")}], "images": [{"bytes": b}],
           "answer": p["answer"]} for p, b in zip(prompts, pictures)]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(vl), out / "train.parquet")
    (out / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return out


def build_chat(out: Path, size: str) -> Path:
    from transformers import AutoTokenizer

    from dsrl.tasks.calculator import build_model_config

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "examples/calculator/model")
    hidden, inter, layers, heads, kv = SHAPES[size]
    shape = {"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
             "num_attention_heads": heads, "num_key_value_heads": kv, "max_position_embeddings": 4096}  # fmt: skip
    config = build_model_config(tokenizer, **shape)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="the models go to ROOT/<size>")
    sizes = f"of {', '.join(SHAPES)}, each with -chat or -rm if wanted; or moe-<layers>"
    p.add_argument("sizes", nargs="+", help=sizes)
    args = p.parse_args()
    for size in args.sizes:
        print(build(args.root / size, size), flush=True)


if __name__ == "__main__":
    main()
