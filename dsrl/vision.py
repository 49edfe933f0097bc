"""Vision-language models (Qwen2.5-VL, Qwen3-VL): a row's images, the trainer's pixel inputs, the names the servers
load the weights by, and the probe's image.

A row's images come in verl's layout (its geo3k files): a list under `data.image_key`, each a path (relative to the
dataset file) or {"bytes": ...} (parquet; {"path"} or {"image"} name a file), one "<image>" per image in the prompt's
text. The chat template places each image's placeholder (Qwen's <|vision_start|><|image_pad|><|vision_end|>); the
image processor turns the image into patches, for which the placeholder stands as patches / merge_size^2 image tokens.
The trainer's `prompt_ids` hold them all (the token budgets count them); a request to the servers one placeholder per
image beside the image (`image_data`), which SGLang expands the same way, as the embedded engine does."""

import base64
import functools
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoModelForCausalLM

from dsrl.config import DatasetError

try:  # (transformers >= 4.57; the API dsrl uses: 5.12 and 5.23 tested)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig  # noqa: I001
    from transformers import Qwen3VLForConditionalGeneration as Qwen3VL

    for _config, _model in ((Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration), (Qwen3VLConfig, Qwen3VL)):
        AutoModelForCausalLM.register(_config, _model, exist_ok=True)  # (dsrl builds every policy as a causal LM)
except ImportError:
    pass

PLACEHOLDER = "<image>"
CACHED = 512
"""Pixel values (and data URLs) kept, of the prompts used last (at 448 px: 4.8 MB of pixel values a prompt)."""
PROBE_SIDE = 224
"""The probe image's side: a multiple of 28 and 32 (Qwen2.5-VL's and Qwen3-VL's patch x merge), resized by no one."""


def is_vision(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def vision_tokens(config) -> set[int]:
    """A vision-language model's image and video tokens (none for a text model)."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return {getattr(config, n) for n in names} - {None} if is_vision(config) else set()


@functools.cache
def image_processor(model_dir: str):
    """The model's image processor and config; None where the model has none."""
    from transformers import AutoConfig, AutoImageProcessor

    nested = Path(model_dir) / "processor_config.json"  # (transformers 5 saves a processor's image processor in it)
    if not (Path(model_dir) / "preprocessor_config.json").is_file() and not (
        nested.is_file() and "image_processor" in json.loads(nested.read_text())
    ):
        return None
    return AutoImageProcessor.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir)


def text_only(ids: list[int], config) -> list[int]:
    """A response's image and video tokens (a model may sample them) as the padding token: as an input they would take
    an image's place (in the trainer's forward, the embedded engine's) or be an image's placeholder (a server resuming
    the response). Their own logprobs are kept. A text model's response as it is."""
    if not is_vision(config):
        return ids
    pad, avoid = config.get_text_config().pad_token_id or 0, {config.image_token_id, config.video_token_id}
    return [pad if t in avoid else t for t in ids]


def copy_processor(model_dir: str, out: Path) -> None:
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json"):
        if (Path(model_dir) / name).is_file():
            (out / name).write_bytes((Path(model_dir) / name).read_bytes())


@dataclass(eq=False)
class Images:
    """A prompt's images, decoded when asked for."""

    files: list[bytes]
    """Each image's file as read (PNG, JPEG, ...)."""
    request_ids: list[int]
    """The prompt's token ids with one placeholder per image: a request to the servers."""
    processor: Any = field(repr=False)
    config: Any = field(repr=False)
    """The model's."""

    def request(self, response_ids: list[int]) -> list[int]:
        """The ids of a request continuing the prompt with `response_ids` (`text_only`)."""
        return self.request_ids + text_only(response_ids, self.config)

    def decoded(self) -> list[Image.Image]:
        return [Image.open(io.BytesIO(f)).convert("RGB") for f in self.files]

    @functools.lru_cache(CACHED)  # noqa: B019 (it keeps the CACHED prompts used last alive: that is its purpose)
    def image_data(self) -> list[str]:
        """SGLang's `image_data`: PNG data URLs (lossless: a server decodes the pixels the trainer's processor has)."""
        return [png_url(image) for image in self.decoded()]

    @functools.lru_cache(CACHED)  # noqa: B019
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, image_grid_thw), as the model's image processor gives them."""
        out = self.processor(images=self.decoded(), return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]


def png_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def decode_url(data: str) -> Image.Image:
    """An image of SGLang's `image_data`: a data URL or base64."""
    return Image.open(io.BytesIO(base64.b64decode(data.split(",", 1)[-1]))).convert("RGB")


def read_images(entries, dataset: str, where: str) -> list[bytes]:
    """The files of a row's images, each checked to decode; a missing or unreadable one fails the row, named."""
    files = []
    for n, entry in enumerate(entries if isinstance(entries, list) else [entries]):
        given = isinstance(entry, dict)
        data, path = (entry.get("bytes"), entry.get("path") or entry.get("image")) if given else (None, entry)
        name = f"image {n}" + (f" ({path})" if isinstance(path, str) else "")
        try:
            if data is None:
                if not isinstance(path, str):
                    raise ValueError(f"not a path or {{'bytes': ...}}: {entry!r:.80}")
                file = Path(path) if Path(path).is_absolute() else Path(dataset).parent / path
                data = file.read_bytes()
            with Image.open(io.BytesIO(data)) as image:
                image.load()
        except FileNotFoundError:
            raise DatasetError(f"{where}: {name}: no such file {file}") from None
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise DatasetError(f"{where}: {name}: cannot read it as an image ({e})") from None
        files.append(bytes(data))
    return files


def place_images(messages: list[dict], count: int, where: str) -> list[dict]:
    """The messages with each "<image>" of their text an image item of the chat template's, one per image."""
    out, found = [], 0
    for m in messages:
        if isinstance(m["content"], str) and PLACEHOLDER in m["content"]:
            parts = m["content"].split(PLACEHOLDER)
            found += len(parts) - 1
            items = [{"type": "text", "text": parts[0]}] + [
                item for part in parts[1:] for item in ({"type": "image"}, {"type": "text", "text": part})
            ]
            m = {**m, "content": [item for item in items if item.get("text") != ""]}
        out.append(m)
    if found != count:
        raise DatasetError(f"{where}: {count} images but {found} {PLACEHOLDER!r} placeholders in the prompt: one each")
    return out


def expand_ids(ids: list[int], token: int, counts: list[int]) -> list[int]:
    """`ids` with the i-th image placeholder `token` repeated counts[i] times (SGLang's `_expand_input_ids`)."""
    placed = ids.count(token)
    if placed != len(counts):
        raise ValueError(f"prompt has {placed} image placeholder token(s) but {len(counts)} image(s) were provided")
    out, each = [], iter(counts)
    for t in ids:
        out += [t] * next(each) if t == token else [t]
    return out


def prompt_images(ids: list[int], files: list[bytes], model_dir: str, where: str) -> tuple[list[int], Images]:
    """The trainer's prompt ids of a templated prompt's `ids` (each image's tokens in its placeholder), its images."""
    found = image_processor(model_dir)
    if found is None:
        raise DatasetError(f"{where}: a row with images, but the model at {model_dir} has no image processor "
                           "(preprocessor_config.json, or processor_config.json's image_processor)")  # fmt: skip
    processor, config = found
    sizes = [Image.open(io.BytesIO(f)).size for f in files]
    counts = [processor.get_number_of_image_patches(h, w, {}) // processor.merge_size**2 for w, h in sizes]
    try:
        return expand_ids(ids, config.image_token_id, counts), Images(files, list(ids), processor, config)
    except ValueError as e:
        raise DatasetError(f"{where}: the chat template's {e}") from None


def request_inputs(image_data: list[str], ids: list[int], model_dir: str) -> tuple[list[int], tuple]:
    """A request's images as a server takes them (data URLs or base64), processed, and its ids expanded."""
    processor, config = image_processor(model_dir)
    out = processor(images=[decode_url(data) for data in image_data], return_tensors="pt")
    counts = (out["image_grid_thw"].prod(-1) // processor.merge_size**2).tolist()
    return expand_ids(ids, config.image_token_id, counts), (out["pixel_values"], out["image_grid_thw"])


def forward_inputs(model, seqs: list[list[int]], pixels: list[tuple | None], packed: bool, width: int, device) -> dict:
    """A forward's pixel inputs: each sequence's images' pixel values and grids (`pixels`, None: no image), in order,
    and the mrope positions the model would compute, per sequence (its responses `text_only`): padded rows
    [3, rows, width]; packed, one after the other behind their text positions (transformers' [4, 1, tokens])."""
    rope = next(m.get_rope_index for m in model.modules() if hasattr(m, "get_rope_index"))
    token, positions = model.config.image_token_id, []
    for seq, images in zip(seqs, pixels):
        ids = torch.tensor([seq])
        positions.append(rope(ids, (ids == token).int(), image_grid_thw=images and images[1])[0][:, 0])
    if packed:
        text = torch.cat([torch.arange(len(seq)) for seq in seqs])
        position_ids = torch.cat([text[None], torch.cat(positions, 1)])[:, None]
    else:
        position_ids = torch.zeros(3, len(seqs), width, dtype=torch.long)
        for i, p in enumerate(positions):
            position_ids[:, i, : p.shape[1]] = p
    given = [p for p in pixels if p is not None]
    return {"pixel_values": torch.cat([p for p, _ in given]).to(device), "position_ids": position_ids.to(device),
            "image_grid_thw": torch.cat([g for _, g in given]).to(device)}  # fmt: skip


def pixel_inputs(engine, mb) -> dict:
    """A vision-language model's inputs of micro-batch `mb` (for a DeepSpeed engine or a model): its `input_ids`, their
    responses `text_only`, and its images' (`forward_inputs`); none for a text model."""
    model, images = getattr(engine, "module", engine), [s.prompt.images for s in mb.samples]
    if not is_vision(model.config):  # (a text model's inputs are the micro-batch's own)
        return {}
    seqs = [s.prompt.prompt_ids + text_only(s.response_ids, model.config) for s in mb.samples]
    ids, offset = mb.input_ids.clone(), 0  # (the same layout, the responses' image tokens padding)
    for i, seq in enumerate(seqs):
        row, start = (0, offset) if mb.packed else (i, 0)
        ids[row, start : start + len(seq)] = torch.tensor(seq)
        offset += len(seq)
    if not any(images):
        return {"input_ids": ids}
    pixels = [None if i is None else i.inputs() for i in images]
    inputs = forward_inputs(model, seqs, pixels, mb.packed, mb.input_ids.shape[1], mb.input_ids.device)
    return {**inputs, "input_ids": ids}


def check_ranks_agree(model: torch.nn.Module, samples) -> None:
    """ZeRO-3's ranks gather a vision-language model's vision tower together: on several ranks, every row of the batch
    has images, or none does (a rank that skipped the tower would leave the others waiting in its gathers)."""
    import torch.distributed as dist

    from dsrl.collectives import all_ranks

    if not is_vision(model.config) or dist.get_world_size() == 1:
        return
    if not (all_ranks(all(s.prompt.images for s in samples)) or all_ranks(not any(s.prompt.images for s in samples))):
        raise ValueError("the trainer ranks' rows mix images and none: a vision-language model on several ranks takes "
                         "rows that each carry an image, or none does")  # fmt: skip


def prepare(model: torch.nn.Module, freeze: bool) -> None:
    """--model.freeze_vision_tower: the vision tower takes no gradient (and no optimizer states)."""
    if not freeze:
        return
    if not is_vision(model.config):
        raise ValueError(f"--model.freeze_vision_tower: {model.config.model_type} has no vision tower")
    next(m for name, m in model.named_modules() if name.endswith("visual")).requires_grad_(False)


def language_targets(model: torch.nn.Module, targets):
    """LoRA's `targets` ("all-linear": every linear layer) within a vision-language model's language model alone, as
    PEFT's regular expression; a regular expression given is kept."""
    if isinstance(targets, str) and targets != "all-linear":
        return targets
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                    and ".language_model." in f".{n}"}) if targets == "all-linear" else targets  # fmt: skip
    return rf".*language_model\..*\.({'|'.join(map(re.escape, names))})"


def saved_names(model: torch.nn.Module, names: list[str]) -> dict[str, str]:
    """Parameter `names` of a vision-language `model` under the names it is saved with (transformers' `save_pretrained`:
    Qwen2.5-VL's `visual.*` and `model.layers.*`), which SGLang's loader takes; {} for other models."""
    if not is_vision(model.config):
        return {}
    from transformers.core_model_loading import revert_weight_conversion

    tensors = {name: torch.empty(0) for name in names}
    by_id = {id(t): name for name, t in tensors.items()}
    # transformers' own mapping, not the one its loading kept (under ZeRO-3's zero.Init, legacy renamings too, which
    # revert "model.language_model.layers" to "model.model.layers")
    loaded = model.__dict__.pop("_weight_conversions", None)
    try:
        reverted = revert_weight_conversion(model, dict(tensors))
    finally:
        if loaded is not None:
            model._weight_conversions = loaded
    return {by_id[id(t)]: new for new, t in reverted.items() if id(t) in by_id}


@torch.no_grad()
def image_probe(engine) -> tuple[dict, torch.Tensor] | None:
    """The probe's image (None for a text model): the request of a fixed image before fixed text (`input_ids`,
    `image_data`), and the trainer's logprobs of that text (call on every rank: a ZeRO-3 forward)."""
    model = getattr(engine, "module", engine)
    c, generator = model.config, torch.Generator().manual_seed(1234)
    if not is_vision(c):
        return None
    tail = torch.randint(0, c.get_text_config().vocab_size, (32,), generator=generator).tolist()
    tail = [t for t in tail if t not in vision_tokens(c)]
    pixels = torch.randint(0, 256, (PROBE_SIDE, PROBE_SIDE, 3), generator=generator, dtype=torch.uint8).numpy()
    request = {"input_ids": [c.vision_start_token_id, c.image_token_id, c.vision_end_token_id, *tail],
               "image_data": [png_url(Image.fromarray(pixels))]}  # fmt: skip
    ids, image = request_inputs(request["image_data"], request["input_ids"], c._name_or_path)  # (as a server has it)
    tokens = torch.tensor([ids], device=engine.device)
    logits = engine(input_ids=tokens, **forward_inputs(model, [ids], [image], False, len(ids), engine.device)).logits
    logprobs = torch.log_softmax(logits[0, -len(tail) - 1 : -1].float(), -1)
    return request, logprobs.gather(-1, tokens[0, -len(tail) :, None])[:, 0].cpu()
