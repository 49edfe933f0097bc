"""LoRA (`--model.lora_rank`): adapters trained on the ZeRO-3 actor, the base frozen and the reference; the
servers get the base with the adapters merged. Real DeepSpeed (2 ranks), the real embedded engine."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from dsrl.toy import build_model_config, build_tokenizer
from dsrl.zero.lora import ServedWeights, add_adapters, reference_off
from tests.conftest import ROOT

STEPS = 60


def lora_base(out: Path) -> Path:
    """A random toy base whose logits are not flat (initializer_range 0.15): LoRA trains on a frozen base, and
    the toy's default init (0.02) leaves its tied embeddings too small for any adapter to peak a distribution."""
    config = build_model_config()
    config.initializer_range = 0.15
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def lora_model(base: Path, rank: int = 4):
    from dsrl.config import ModelConfig

    torch.manual_seed(1)
    model = add_adapters(AutoModelForCausalLM.from_pretrained(base), ModelConfig(path=str(base), lora_rank=rank))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at 0 (the adapter does nothing): give it a value
            p.data.normal_(0, 0.2)
    return model


def test_reference_is_the_base_and_served_weights_are_the_merged_model(tmp_path):
    base = lora_base(tmp_path / "base")
    model, plain = lora_model(base), AutoModelForCausalLM.from_pretrained(base)
    ids = torch.randint(2, 13, (3, 7))
    with torch.no_grad(), reference_off(model):
        torch.testing.assert_close(model(ids).logits, plain(ids).logits)
    with torch.no_grad():
        assert (model(ids).logits - plain(ids).logits).abs().max() > 0.1, "the adapters change the policy"
    served = ServedWeights(model)
    weights = {}
    for name, param in served.named:
        weights[name] = param.data.clone()
        served.merge_into(name, weights[name])
    merged = lora_model(base).merge_and_unload().state_dict()
    assert set(weights) == set(plain.state_dict()) - {"lm_head.weight"}, "the base model's names, tied head aside"
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, merged[name], msg=name)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base, run_dir = lora_base(root / "base"), root / "run"
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs/toy_cpu.yaml"),
           "--model.path", str(base), "--model.init_from_config", "false", "--model.lora_rank", "8",
           "--trainer.lr", "1e-2", "--algorithm.kl_coef", "0.001", "--trainer.total_steps", str(STEPS),
           "--logging.save_every", str(STEPS), "--eval.path", "null", "--logging.run_dir", str(run_dir)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return base, run_dir, proc.stderr


def test_lora_trains_only_the_adapters_and_the_servers_match_the_trainer(lora_run):
    _, run_dir, log = lora_run
    trained = re.search(r"LoRA rank 8: ([\d,]+) trained parameters of ([\d,]+)", log)
    assert trained, "the adapters' share is logged"
    adapters = sum(t.numel() for t in load_adapter(run_dir / "adapter").values())
    assert int(trained[1].replace(",", "")) == adapters < int(trained[2].replace(",", "")) / 4
    final = json.loads((run_dir / "final_metrics.json").read_text())
    # After each sync the server's sampled-token logprobs are the trainer's with the adapters on:
    assert final["mismatch/logprob_max_abs_diff"] < 1e-4
    assert final["kl/old_ref_k1"] > 0, "the reference is the base: the trained adapters move away from it"
    rewards = [float(r) for r in re.findall(r"step \d+/\d+ \| reward ([\d.]+)", log)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, f"reward {first:.3f} -> {last:.3f}: the toy task learns with LoRA"


def load_adapter(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "adapter_model.safetensors")


def test_exported_adapter_loads_with_peft_and_equals_the_merged_exports(lora_run, tmp_path):
    base, run_dir, _ = lora_run
    ids = torch.randint(2, 13, (4, 6))
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run_dir / "adapter")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf")(ids).logits
    torch.testing.assert_close(merged, peft, atol=1e-4, rtol=1e-4)
    out = tmp_path / "exported"
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS}"
    subprocess.run([sys.executable, "-m", "dsrl.cli", "export", "--checkpoint", str(checkpoint), "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(out)(ids).logits
        from_checkpoint = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out / "adapter")
        torch.testing.assert_close(exported, merged, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(from_checkpoint(ids).logits, merged, atol=1e-4, rtol=1e-4)
