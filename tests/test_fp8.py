"""FP8 rollout (--rollout.precision fp8): the block-wise quantizer, the servers' FP8 checkpoint, the embedded engine's
emulation, the config's checks and defaults, and a short CPU run whose sync carries FP8 weights."""

import json
import os
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from dsrl.auto import resolve
from dsrl.config import PROBE_TOLERANCE, ConfigError, build_parser, to_config, validate
from dsrl.fp8 import (
    BLOCK,
    FP8,
    KV_SCALES,
    SCALE,
    dequantize,
    kv_scales,
    quantize,
    quantize_flat,
    quantize_named,
    unflatten,
    write_checkpoint,
)
from dsrl.serving.embedded import BadRequest, Engine
from dsrl.tasks.toy import build_model_config
from dsrl.zero.buckets import gathered_buckets
from tests.conftest import ROOT

TOY = ["--config", str(ROOT / "configs/toy_cpu.yaml")]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEAR


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_e4m3s_per_block(dtype):
    """Each value comes back within half an e4m3 step: 2^-4 of itself (3 mantissa bits), or below e4m3's smallest
    normal 2^-10 of its block's scale; shapes that are not multiples of 128 get partial blocks."""
    torch.manual_seed(0)
    w = (torch.randn(300, 200) * torch.logspace(-3, 0, 200)).to(dtype)  # columns over three decades
    w[:128, :128] = 0  # a block of zeros stays zeros
    q, scale = quantize(w)
    assert q.dtype == FP8 and list(q.shape) == [300, 200]
    assert scale.dtype == torch.float32 and list(scale.shape) == [3, 2]
    back, w = dequantize(q, scale), w.float()
    per_value = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:300, :200]
    assert ((back - w).abs() <= 2**-4 * w.abs() + 2**-10 * per_value + 1e-12).all()
    assert (back[:128, :128] == 0).all()
    assert ((back - w).norm() / w.norm()).item() < 0.03  # ~2.5% for Gaussian blocks
    assert (q.float().abs().amax() == 448).item()  # each block's largest value maps to e4m3's largest


def test_only_the_decoder_projections_are_quantized():
    model = AutoModelForCausalLM.from_config(build_model_config())
    named = quantize_named(list(model.state_dict().items()))
    scales = {n.removesuffix(SCALE) for n, _ in named if n.endswith(SCALE)}
    want = {n for n in model.state_dict() if linear(n)}
    assert scales == want and len(want) == 2 * len(LINEAR)
    for name, t in named:
        assert (t.dtype == FP8) == (name in want), name  # embeddings, norms, biases, lm_head as they were
    # and each attention layer's KV-cache scales at 1.0, under the names SGLang's loaders take
    kv = {n: t for n, t in named if n.endswith(KV_SCALES)}
    assert sorted(kv) == [f"model.layers.{i}.self_attn.attn.{s}_scale" for i in (0, 1) for s in "kv"]
    assert all(t.dtype == torch.float32 and t.item() == 1.0 for t in kv.values())
    # Llama's and Qwen3's loaders add the ".attn" themselves (maybe_remap_kv_scale_name): they take the shorter name
    o_proj = [("model.layers.5.self_attn.o_proj.weight", torch.randn(8, 8))]
    assert [n for n, _ in kv_scales(o_proj, "llama")] == [f"model.layers.5.self_attn.{s}_scale" for s in "kv"]
    assert [n for n, _ in kv_scales(o_proj, "qwen2")] == [f"model.layers.5.self_attn.attn.{s}_scale" for s in "kv"]
    assert kv_scales(o_proj, "qwen3") == kv_scales(o_proj, "qwen3_moe") == []  # (their attention has none)


def test_a_flat_bucket_holds_the_scales_first_and_the_fp8_weights_last():
    """The layout SGLang's flattened bucket reads: every tensor viewable at its offset, odd FP8 sizes last."""
    named = [("model.layers.0.mlp.down_proj.weight", torch.randn(129, 33)), ("model.norm.weight", torch.randn(7)),
             ("model.layers.0.self_attn.q_proj.bias", torch.randn(5))]  # fmt: skip
    entries, flat = quantize_flat(named)
    assert [(n, d) for n, d, _ in entries] == [
        ("model.layers.0.mlp.down_proj.weight_scale_inv", torch.float32),
        ("model.norm.weight", torch.float32),
        ("model.layers.0.self_attn.q_proj.bias", torch.float32),
        ("model.layers.0.mlp.down_proj.weight", FP8),
    ]
    assert flat.numel() == 2 * 1 * 4 + 7 * 4 + 5 * 4 + 129 * 33
    views = dict(zip([n for n, _, _ in entries], unflatten(flat, entries)))
    q, scale = quantize(named[0][1])
    assert torch.equal(views[named[0][0]].float(), q.float()) and torch.equal(views[named[0][0] + SCALE], scale)
    assert torch.equal(views["model.norm.weight"], named[1][1])
    # an attention layer's bucket carries its KV-cache scales, float32 among the scales (a colocated server's come
    # back from a release without their contents: dsrl.fp8.kv_scales)
    entries, flat = quantize_flat([("model.layers.3.self_attn.o_proj.weight", torch.randn(16, 16)), *named[1:]])
    assert [n for n, _, _ in entries][:3] == ["model.layers.3.self_attn.o_proj.weight_scale_inv",
                                              "model.layers.3.self_attn.attn.k_scale",
                                              "model.layers.3.self_attn.attn.v_scale"]  # fmt: skip
    assert [v.item() for v in unflatten(flat, entries)[1:3]] == [1.0, 1.0]


def test_the_embedded_engine_serves_an_fp8_checkpoint_as_sglang_would(toy_weights, tmp_path):
    """Started from the FP8 copy, the engine holds the dequantized weights and rounds each linear layer's input; an
    update in FP8 with its scales is dequantized on arrival, and one that leaves a layer's scale out is refused."""
    write_checkpoint(toy_weights, tmp_path / "fp8", multiples_of_block=False)
    quant = json.loads((tmp_path / "fp8/config.json").read_text())["quantization_config"]
    assert quant == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    with pytest.raises(ValueError, match="128-row blocks"):  # SGLang's merged q/k/v layer needs multiples of 128
        write_checkpoint(toy_weights, tmp_path / "sglang", multiples_of_block=True)
    model = AutoModelForCausalLM.from_pretrained(toy_weights)
    fp8, plain = Engine(str(tmp_path / "fp8")), Engine(str(toy_weights))
    try:
        name = "model.layers.0.self_attn.q_proj.weight"
        weight = model.get_parameter(name).detach()
        assert torch.equal(fp8.params[name], dequantize(*quantize(weight)))
        ids = torch.randint(0, 14, (40,), generator=torch.Generator().manual_seed(0)).tolist()
        got, want = ([r[0] for r in e.prompt_logprobs(ids, 1)] for e in (fp8, plain))
        diff = (torch.tensor(got) - torch.tensor(want)).abs().mean().item()
        assert 1e-4 < diff < PROBE_TOLERANCE["fp8"], diff  # FP8's rounding shows, within the probe's tolerance
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        # the disk transport's buckets (GatheredParameters does nothing to parameters outside ZeRO-3)
        fp8.load_weights([t for bucket in gathered_buckets(model, 1 << 12, fp8=True) for t in bucket])
        for n, p in model.named_parameters():
            want = dequantize(*quantize(p.detach())) if linear(n) else p.detach()
            assert torch.equal(fp8.params[n], want), n
        with pytest.raises(BadRequest, match="is an FP8 layer"):
            fp8.load_weights([(name, weight)])
        with pytest.raises(BadRequest, match="not an FP8 layer"):
            plain.load_weights(quantize_named([(name, weight)]))
    finally:
        fp8.stop()
        plain.stop()


def test_fp8_turns_the_correction_on_and_refuses_what_cannot_work():
    parser = build_parser()

    def resolved(*argv):
        cfg = to_config(parser, parser.parse_args([*TOY, *argv]))
        validate(cfg, check_paths=False)
        return resolve(cfg, str(ROOT / "examples/toy/model"))[0]

    fp8 = resolved("--rollout.precision", "fp8", "--model.lora_rank", "8")
    assert fp8.algorithm.off_policy == "tis" and fp8.sync.probe_tolerance == PROBE_TOLERANCE["fp8"]
    assert fp8.sync.lora == "merged"  # (bf16: the adapter on its own over broadcast)
    bf16 = resolved("--model.lora_rank", "8")
    assert bf16.algorithm.off_policy == "none" and bf16.sync.probe_tolerance == 0.05 and bf16.sync.lora == "adapter"
    user = resolved("--rollout.precision", "fp8", "--algorithm.off_policy", "none", "--sync.probe_tolerance", "0.5")
    assert user.algorithm.off_policy == "none" and user.sync.probe_tolerance == 0.5  # what the user set stays
    assert resolved("--rollout.precision", "fp8", "--algorithm.policy_loss", "gspo").algorithm.off_policy == "none"
    argv = [*TOY, "--rollout.precision", "fp8", "--sync.verify", "weights", "--model.lora_rank", "8"]
    with pytest.raises(ConfigError) as info:
        validate(to_config(parser, parser.parse_args([*argv, "--sync.lora", "adapter"])), check_paths=False)
    assert [e.split(":")[0] for e in info.value.errors] == ["--sync.verify='weights'", "--sync.lora='adapter'"]
    assert "FP8 servers hold rounded weights" in str(info.value)


def test_fp8_on_a_loader_that_cannot_take_block_scales_is_refused_before_the_launcher(tmp_path):
    """SGLang 0.5.17's Llama loader renames weight_scale_inv to weight_scale: a Llama served in FP8 sampled from NaN
    and died at its first request on a GPU. `dsrl train` refuses it for SGLang, before any rank starts; the embedded
    engine (dsrl's own loader) and Qwen2 on SGLang go on."""
    from dsrl.fp8 import check_servers_load_fp8

    config = json.loads((ROOT / "examples/toy/model/config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "llama", "architectures": ["Llama"]}))
    llama = to_config(build_parser(), build_parser().parse_args([*TOY, "--rollout.precision", "fp8"]))
    llama.model.path = str(tmp_path)
    with pytest.raises(ValueError, match=r"precision fp8: SGLang 0.5.17's loader for llama models renames"):
        check_servers_load_fp8(llama, "sglang")
    check_servers_load_fp8(llama, "embedded")
    llama.model.path = str(ROOT / "examples/toy/model")  # (Qwen2)
    check_servers_load_fp8(llama, "sglang")


STEPS = 4


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fp8_run")
    cmd = [sys.executable, "-m", "dsrl.cli", "train", *TOY, "--trainer.total_steps", str(STEPS), "--eval.path", "null"]
    cmd += ["--rollout.precision", "fp8", "--sync.verify", "probe", "--logging.run_dir", str(run_dir)]
    cmd += ["--logging.export_hf", "false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return run_dir, {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}, proc.stderr


@pytest.mark.slow
def test_an_fp8_run_syncs_fp8_weights_and_passes_its_probe(fp8_run):
    """A few steps of the toy (learning over 200: docs/benchmarks/fp8.md)."""
    run_dir, metrics, log = fp8_run
    model = AutoModelForCausalLM.from_config(build_model_config())
    weights = [p.detach() for n, p in model.named_parameters() if linear(n)]
    quantized, scales = sum(w.numel() for w in weights), sum(quantize(w)[1].numel() for w in weights)
    rest = sum(p.numel() for p in model.parameters()) - quantized
    kv_scales = 2 * model.config.num_hidden_layers  # (each attention layer's K and V cache scales)
    # the linear weights in 1 byte each (bf16: 2, the CPU trainer's fp32: 4), a float32 scale per block, the rest fp32
    assert set(metrics["sync/bytes"]) == {quantized + 4 * scales + 4 * kv_scales + 4 * rest}
    assert (metrics["sync/bytes"][0] - 4 * rest) / (2 * quantized) < 0.52  # about half the linear weights' bf16 bytes
    probe = metrics["sync/probe_logprob_diff"]
    assert len(probe) == STEPS and 1e-4 < max(probe) < PROBE_TOLERANCE["fp8"]  # rounded, and accepted
    assert f"sync.probe_tolerance {PROBE_TOLERANCE['fp8']}: allows FP8's rounding" in log
    assert "algorithm.off_policy tis (rollout.precision fp8)" in log
    assert min(metrics["mismatch/logprob_abs_diff"]) > 1e-4 and "actor/is_weight_mean" in metrics  # TIS corrects it
    assert (run_dir / "fp8_model/config.json").is_file()
