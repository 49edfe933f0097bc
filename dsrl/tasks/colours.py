"""The vision-language toy: name the colour of the big square in a 56-pixel picture, in one token.

Each picture (drawn with Pillow) is a grey background, a big square of one of four colours and a small square of
another; the prompt is the picture and "colour?", the answer one of red, green, blue, yellow. A random policy scores
about 1/13 (the vocabulary), one that names a colour 1/4, one that reads the picture 1. The model is a tiny
Qwen2.5-VL (or, `arch="qwen3_vl"`, a Qwen3-VL) built from its config, with a tokenizer of whole words and an image
processor built here, so nothing is downloaded. ``python -m dsrl.tasks.colours <dir>`` writes the files of
examples/toy_vl: the model's config, tokenizer and image processor, train.parquet (images as bytes) and test.jsonl
(images as files beside it).
"""

import io
import json
import random
import re
import sys
from pathlib import Path

SPECIAL = ["<pad>", "<eos>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
COLOURS = {"red": (215, 45, 40), "green": (40, 170, 60), "blue": (45, 75, 215), "yellow": (225, 205, 45)}
WORDS = [*COLOURS, "colour", "?", "="]
TEMPLATE = (
    "{%- for m in messages -%}{%- if m.content is string -%}{{ m.content }}{%- else -%}{%- for c in m.content -%}"
    "{%- if c.type == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>{%- else -%}{{ c.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}={%- endif -%}"
)
"""Each image's placeholder where the prompt has it, the text as it is, then "=" for the answer."""
SIDE = 56


def build_tokenizer(words: list[str] = WORDS, vocab_size: int | None = None):
    """`words` (and Qwen's vision tokens) one token each, decoded without spaces; a larger `vocab_size` pads it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = SPECIAL + list(words)
    vocab += [f"<unused_{i}>" for i in range((vocab_size or len(vocab)) - len(vocab))]
    core = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(vocab)}, unk_token="<pad>"))
    pattern = "|".join(map(re.escape, sorted(words, key=len, reverse=True))) + r"|\S"
    core.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   extra_special_tokens=SPECIAL[2:], chat_template=TEMPLATE)  # fmt: skip


def build_model_config(tokenizer, arch: str = "qwen2_5_vl", **text):
    """A tiny model (2 layers of 64, a vision tower of 2 blocks of 32) of `arch`; `text` overrides the language model's
    shape, `vision` (in `text`) the tower's."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    ids = tokenizer.convert_tokens_to_ids
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              **text.pop("vision", {})}  # fmt: skip
    text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
            "bos_token_id": None, "eos_token_id": ids("<eos>"), "pad_token_id": ids("<pad>"),
            "tie_word_embeddings": True, **text}  # fmt: skip
    half = text["hidden_size"] // text["num_attention_heads"] // 2  # mrope: the rotary half split over t, h, w
    sections = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    if arch == "qwen3_vl":
        text.setdefault("head_dim", text["hidden_size"] // text["num_attention_heads"])
        text["rope_scaling"] = {"rope_type": "default", "mrope_section": sections, "mrope_interleaved": True}
        vision = {"deepstack_visual_indexes": [0], "num_position_embeddings": 64, "patch_size": 16, **vision}
        config = Qwen3VLConfig
    else:
        text["rope_scaling"] = {"type": "mrope", "mrope_section": sections}
        vision = {"fullatt_block_indexes": [vision["depth"] - 1], "window_size": 112, **vision}
        config = Qwen2_5_VLConfig
    tokens = {f"{kind}_token_id": ids(f"<|{name}|>") for kind, name in
              (("image", "image_pad"), ("video", "video_pad"), ("vision_start", "vision_start"),
               ("vision_end", "vision_end"))}  # fmt: skip
    return config(text_config=text, vision_config=vision, tie_word_embeddings=True, torch_dtype="float32", **tokens)


def build_image_processor(arch: str = "qwen2_5_vl", side: int = SIDE, largest: int | None = None):
    """The model's image processor (Qwen's, on PIL): pictures of `side` pixels (up to `largest`) kept as they are."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    qwen3 = {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3} if arch == "qwen3_vl" else {}
    return Qwen2VLImageProcessorPil(min_pixels=side * side, max_pixels=(largest or side) ** 2, **qwen3)


def draw(colour: str, rng: random.Random, side: int = SIDE):
    """A grey picture with a big square of `colour` and a small one of another."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (side, side), (rng.randint(60, 190),) * 3)
    pen = ImageDraw.Draw(image)
    for name, size in ((colour, rng.randint(side // 2, side * 3 // 4)), (None, rng.randint(side // 8, side // 5))):
        name = name or rng.choice([c for c in COLOURS if c != colour])
        fill = tuple(min(255, max(0, v + rng.randint(-25, 25))) for v in COLOURS[name])
        x, y = rng.randint(0, side - size), rng.randint(0, side - size)
        pen.rectangle([x, y, x + size - 1, y + size - 1], fill=fill)
    return image


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def make_rows(n: int, seed: int) -> list[dict]:
    """verl's layout: the prompt's "<image>" where the picture goes, the pictures under `images`."""
    rng = random.Random(seed)
    colours = [rng.choice(list(COLOURS)) for _ in range(n)]
    return [{"prompt": "<image>colour?", "images": [{"bytes": png(draw(c, rng))}], "answer": c} for c in colours]


def reward(prompt: str, response: str, answer: str) -> float:
    return float(response.strip() == answer)


def write_example(root: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(root / "model")
    build_model_config(tokenizer).save_pretrained(root / "model")
    build_image_processor().save_pretrained(root / "model")
    pq.write_table(pa.Table.from_pylist(make_rows(2048, 0)), root / "train.parquet")
    (root / "test").mkdir(parents=True, exist_ok=True)
    with open(root / "test.jsonl", "w") as f:
        for i, row in enumerate(make_rows(128, 1)):
            (root / "test" / f"{i:03d}.png").write_bytes(row["images"][0]["bytes"])
            f.write(json.dumps({**row, "images": [f"test/{i:03d}.png"]}) + "\n")


if __name__ == "__main__":
    write_example(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/toy_vl"))
