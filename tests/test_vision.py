"""Vision-language models (dsrl/vision.py): rows with images, the trainer's logprobs against the embedded engine's, the
probe of the vision tower, `dsrl train` on the VL toy (Qwen2.5-VL colocated; Qwen3-VL async with partial rollout)."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from dsrl.config import DataConfig, RolloutConfig
from dsrl.data import DatasetError, PromptDataset
from dsrl.rollout.rollouts import generate
from dsrl.serving.client import RolloutClient, ServerError
from dsrl.serving.fleet import start_fleet
from dsrl.sync.base import SyncError
from dsrl.sync.verify import probe_reference, probe_servers
from dsrl.tasks import colours
from dsrl.vision import image_probe, saved_names
from dsrl.zero import varlen
from dsrl.zero.actor import forward_logprobs, per_token
from dsrl.zero.batches import MicroBatch
from dsrl.zero.lora import lora_config
from tests.conftest import ROOT

VL_MODEL = ROOT / "examples/toy_vl/model"


def build(out, arch: str):
    """A tiny VL model of `arch` with seeded random weights, its tokenizer and image processor (up to 84 pixels)."""
    tokenizer = colours.build_tokenizer()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(colours.build_model_config(tokenizer, arch)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    side = 64 if arch == "qwen3_vl" else 56
    colours.build_image_processor(arch, side, largest=side * 2).save_pretrained(out)
    return out


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_trainer_logprobs_of_vl_samples_match_the_embedded_engines(arch, tmp_path):
    """The trainer's forward (pixel values, mrope positions per sequence; right-padded rows and packed ones) gives the
    embedded engine's sampling logprobs, for prompts of one and two images of two sizes: |diff| <= 1e-5 (fp32 both
    sides; seen <= 4.8e-7)."""
    import random

    model_dir = build(tmp_path / "model", arch)
    side, rng = (64 if arch == "qwen3_vl" else 56), random.Random(0)
    rows = []
    for i, colour in enumerate(["red", "blue", "green", "yellow"]):
        images = [colours.png(colours.draw(colour, rng, side)) for _ in range(1 + i % 2)]
        if i == 3:  # one picture of 1.5 x the side: other image tokens
            images = [colours.png(colours.draw(colour, rng, side).resize((side * 3 // 2, side)))]
        rows.append({"prompt": "<image>" * len(images) + "colour?", "images": [{"bytes": b} for b in images]})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = PromptDataset(DataConfig(str(tmp_path / "rows.parquet")), tokenizer).prompts
    assert len({len(p.prompt_ids) for p in prompts}) > 1  # (images of other sizes and counts: packing packs)
    fleet = start_fleet(RolloutConfig(num_servers=1), str(model_dir), tmp_path / "run", 0, "embedded")
    client = RolloutClient(fleet.urls, timeout_s=60)
    try:
        client.call_all("/update_weight_version", {"new_version": "0"})
        samples = client.run(generate(client, prompts, RolloutConfig(n_samples=2, max_new_tokens=6), seed=0))
    finally:
        client.close()
        fleet.stop()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for packed in (False, True):
        model.set_attn_implementation(varlen.NAME if packed else "sdpa")
        mb = MicroBatch.build(samples, 0, torch.device("cpu"), packed)
        assert mb.packed == packed
        with torch.no_grad():
            logprobs, _ = forward_logprobs(model, mb, 1.0, False)
        diff = ((logprobs - per_token(mb, "engine_logprobs")).abs() * mb.mask).max().item()
        assert diff <= 1e-5, f"packed={packed}: the trainer's logprobs differ from the engine's by up to {diff:.3g}"


def test_bad_rows_are_named_with_their_file(tmp_path):
    import random

    good = colours.png(colours.draw("red", random.Random(0)))
    (tmp_path / "ok.png").write_bytes(good)
    (tmp_path / "broken.png").write_bytes(b"not a picture")
    data = write_rows(tmp_path / "rows.jsonl", [
        {"prompt": "<image>colour?", "images": ["ok.png"]},
        {"prompt": "<image>colour?", "images": ["missing.png"]},
        {"prompt": "<image>colour?", "images": ["broken.png"]},
        {"prompt": "<image>colour?", "images": ["ok.png", "ok.png"]},
    ])  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(VL_MODEL)
    with pytest.raises(DatasetError) as e:
        PromptDataset(DataConfig(str(data)), tokenizer)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("3 bad rows")
    assert lines[1].strip() == f"{data}, row 1: image 0 (missing.png): no such file {tmp_path / 'missing.png'}"
    assert lines[2].strip().startswith(f"{data}, row 2: image 0 (broken.png): cannot read it as an image")
    assert lines[3].strip() == f"{data}, row 3: 2 images but 1 '<image>' placeholders in the prompt: one each"
    parquet = tmp_path / "rows.parquet"  # (bytes in parquet: datasets' images)
    pq.write_table(pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": "colour?"}], "images": [{"bytes": good}]},
        {"prompt": [{"role": "user", "content": "<image><image>colour?"}], "images": [{"bytes": good}]},
        {"prompt": [{"role": "user", "content": "<image>colour?"}], "images": [{"bytes": good[:40]}]},
    ]), parquet)  # fmt: skip
    with pytest.raises(DatasetError) as e:
        PromptDataset(DataConfig(str(parquet)), tokenizer)
    assert f"{parquet}, row 0: 1 images but 0 '<image>' placeholders" in str(e.value)
    assert f"{parquet}, row 1: 1 images but 2 '<image>' placeholders" in str(e.value)
    assert f"{parquet}, row 2: image 0: cannot read it as an image" in str(e.value)
    one = str(write_rows(tmp_path / "one.jsonl", [{"prompt": "<image>colour?", "images": ["ok.png"]}]))
    with pytest.raises(DatasetError, match="row 0: 'prompt' holds images, but the tokenizer has no chat template"):
        PromptDataset(DataConfig(one), AutoTokenizer.from_pretrained(ROOT / "examples/toy/model"))
    tokenizer.save_pretrained(tmp_path / "text_only")  # (no image processor beside it)
    with pytest.raises(DatasetError, match=r"row 0: a row with images, but the model at .* has no image processor"):
        PromptDataset(DataConfig(one), AutoTokenizer.from_pretrained(tmp_path / "text_only"))
    nested = tmp_path / "nested"  # (transformers 5's processor file: the image processor inside processor_config.json)
    tokenizer.save_pretrained(nested)
    (nested / "config.json").write_bytes((VL_MODEL / "config.json").read_bytes())
    image_processor = json.loads((VL_MODEL / "preprocessor_config.json").read_text())
    (nested / "processor_config.json").write_text(json.dumps({"image_processor": image_processor}))
    assert PromptDataset(DataConfig(one), AutoTokenizer.from_pretrained(nested)).prompts[0].images is not None
    ok = PromptDataset(DataConfig(one), tokenizer).prompts[0]
    assert ok.images.request_ids == tokenizer("<|vision_start|><|image_pad|><|vision_end|>colour?=")["input_ids"]
    assert ok.prompt_ids.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 4  # (56 px: 4 x 4 patches, merged)


def test_the_probe_checks_the_vision_tower(tmp_path):
    """A server whose vision tower differs from the trainer's passes the text probe and fails the image probe."""
    model_dir = build(tmp_path / "model", "qwen2_5_vl")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids, reference = probe_reference(model, model.config.get_text_config().vocab_size)
    image = image_probe(model)
    fleet = start_fleet(RolloutConfig(num_servers=1), str(model_dir), tmp_path / "run", 0, "embedded")
    client = RolloutClient(fleet.urls, timeout_s=60)
    try:
        assert client.run(probe_servers(client, ids, reference, 1e-5, image=image)) < 1e-5
        unexpanded = {"input_ids": image[0]["input_ids"], "sampling_params": {"max_new_tokens": 1}}  # (no image_data)
        with pytest.raises(ServerError, match="HTTP 400: input_ids hold an image placeholder but the request has no"):
            client.run(client.request(fleet.urls[0], "/generate", unexpanded))
        name = "model.visual.blocks.1.mlp.down_proj.weight"
        (tmp_path / "other").mkdir()
        other = {saved_names(model, [name])[name]: model.get_parameter(name).detach() * 1.5}
        save_file(other, tmp_path / "other/model.safetensors")
        client.call_all("/update_weights_from_disk", {"model_path": str(tmp_path / "other")})
        assert client.run(probe_servers(client, ids, reference, 1e-5)) < 1e-5  # (text alone: no vision tower)
        with pytest.raises(SyncError, match="logprobs of the probe tokens differ"):
            client.run(probe_servers(client, ids, reference, 1e-5, image=image))
    finally:
        client.close()
        fleet.stop()


def test_lora_adapts_the_language_model_alone(tmp_path):
    from peft import get_peft_model

    from dsrl.config import ModelConfig

    model = AutoModelForCausalLM.from_config(colours.build_model_config(colours.build_tokenizer()))
    for targets in ("all-linear", ["q_proj", "down_proj"]):
        lora = ModelConfig(str(VL_MODEL), lora_rank=4, lora_target_modules=targets)
        adapted = get_peft_model(model, lora_config(lora, model))
        names = [n for n, _ in adapted.named_parameters() if ".lora_A." in n]
        assert names and all(".language_model." in n for n in names), names
        model = adapted.unload()


def run_toy(tmp_path, *flags) -> tuple[str, EventAccumulator]:
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs/toy_cpu_vl.yaml"), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    return proc.stdout + proc.stderr, events


@pytest.mark.slow
def test_the_vl_toy_syncs_every_weight_checkpoints_and_exports(tmp_path):
    """Qwen2.5-VL colocated on 2 ZeRO-3 ranks: every sync's weights compared parameter by parameter, the vision tower's
    too (under the names SGLang loads), a checkpoint, the export loaded back by transformers; with
    --model.freeze_vision_tower the language model trains and the tower stays as it began."""
    flags = ["--logging.run_dir", str(tmp_path), "--sync.verify", "weights", "--logging.save_every", "4",
             "--eval.path", "null", "--rollout.prompts_per_step", "16", "--trainer.total_steps", "4",
             "--model.freeze_vision_tower", "true"]  # fmt: skip
    log, events = run_toy(tmp_path, *flags)
    leaves = next(line for line in log.splitlines() if "ZeRO-3 gathers" in line)  # (the vision blocks are leaves)
    assert "4 layers" in leaves and "Qwen2_5_VLVisionBlock" in leaves and "Qwen2_5_VLDecoderLayer" in leaves, leaves
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3, 4]
    assert max(e.value for e in events.Scalars("mismatch/logprob_abs_diff")) < 1e-5
    assert (tmp_path / "checkpoints/step_4").is_dir()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    init = AutoModelForCausalLM.from_pretrained(tmp_path / "init_model")
    for name, param in init.named_parameters():
        assert torch.equal(param, exported.get_parameter(name)) == name.startswith("model.visual."), name
    assert (tmp_path / "hf/preprocessor_config.json").is_file()


@pytest.mark.slow
def test_qwen3_vl_async_partial_rollout_resumes_with_its_images(tmp_path):
    """Qwen3-VL disaggregated, 2 versions ahead, the requests in flight at each update aborted and resumed from their
    tokens so far. The weights barely move (lr 1e-12: every version the same), so the engine's logprobs equal the
    trainer's only if each resumed request carried its prompt's image; the probe with an image passes too."""
    model_dir = build(tmp_path / "model", "qwen3_vl")
    flags = ["--logging.run_dir", str(tmp_path / "run"), "--model.path", str(model_dir), "--model.init_from_config",
             "false", "--rollout.placement", "disaggregate", "--rollout.max_staleness", "2", "--rollout.interrupt",
             "partial", "--rollout.max_new_tokens", "6", "--rollout.server_args", '{"decode_delay_ms": 20}',
             "--trainer.total_steps", "5", "--trainer.lr", "1e-12", "--eval.path", "null", "--sync.verify", "probe",
             "--sync.probe_tolerance", "1e-4", "--logging.export_hf", "false"]  # fmt: skip
    _, events = run_toy(tmp_path / "run", *flags)
    assert sum(e.value for e in events.Scalars("rollout/resumed")) > 0
    assert max(e.value for e in events.Scalars("mismatch/logprob_abs_diff")) < 1e-5
    assert max(e.value for e in events.Scalars("sync/probe_logprob_diff")) < 1e-4
