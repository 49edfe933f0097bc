"""LoRA adapters on the ZeRO-3 actor (`--model.lora_rank`), and the merged weights the servers get.

The actor is a PEFT model: the base frozen (no gradients, no optimizer states), the adapters trained. The
reference policy is the same engine with the adapters off (`reference_off`). The servers serve the base
model's architecture and names: a sync sends every base weight with its adapter merged in, W + s B A,
computed into the transport's buffer in fp32 (`ServedWeights`); the trainer's own base weights are never
modified, so they cannot drift by bf16 rounding from merge to unmerge.
"""

import contextlib
from dataclasses import dataclass

import deepspeed
import torch

from dsrl.config import ModelConfig

ADAPTER = "default"


def add_adapters(model: torch.nn.Module, m: ModelConfig) -> torch.nn.Module:
    """`model` wrapped in LoRA adapters (PEFT), its base frozen. The adapters take the base's dtype (PEFT would
    make them fp32: fp32 GEMMs and casts beside every bf16 layer, measured 2x the step at 3B); DeepSpeed keeps
    their fp32 master copy as it does the base's. (Marking each adapted layer a ZeRO-3 leaf, to run one set of
    hooks instead of one per submodule, breaks the backward pass in DeepSpeed 0.19.8: the adapters read back
    empty.)"""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=m.lora_rank,
        lora_alpha=m.lora_alpha or 2 * m.lora_rank,
        target_modules=m.lora_target_modules,
        lora_dropout=m.lora_dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config, autocast_adapter_dtype=False)


def is_lora(module: torch.nn.Module) -> bool:
    return hasattr(module, "peft_config")


def reference_off(module: torch.nn.Module):
    """A context in which `module` is the reference policy: the base, its adapters off (nothing for a full model)."""
    return module.disable_adapter() if is_lora(module) else contextlib.nullcontext()


@dataclass
class Delta:
    """The adapter of one base weight: W + scale * B @ A."""

    a: torch.nn.Parameter
    b: torch.nn.Parameter
    scale: float


class ServedWeights:
    """The weights as the servers name and hold them: for a full model its parameters; for a LoRA model
    the base model's parameters under their base names ("...q_proj.weight", not "...q_proj.base_layer.weight"),
    each with its adapter's `Delta` to merge in."""

    def __init__(self, module: torch.nn.Module):
        if not is_lora(module):
            self.named, self.deltas = list(module.named_parameters()), {}
            return
        from peft.tuners.lora import LoraLayer

        base = module.get_base_model()
        self.named, self.deltas = [], {}
        for name, param in base.named_parameters():
            if ".lora_" not in name:
                self.named.append((name.replace(".base_layer.", "."), param))
        for prefix, layer in base.named_modules():
            if isinstance(layer, LoraLayer) and ADAPTER in layer.lora_A:
                self.deltas[f"{prefix}.weight"] = Delta(
                    layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight, layer.scaling[ADAPTER]
                )

    def adapters(self) -> list[torch.nn.Parameter]:
        return [p for d in self.deltas.values() for p in (d.a, d.b)]

    @contextlib.contextmanager
    def gathered_adapters(self):
        """Every rank holds the full adapters (small: a collective, every rank joins) while inside; nothing
        to gather for a full model."""
        if not self.deltas:
            yield
            return
        with deepspeed.zero.GatheredParameters(self.adapters(), modifier_rank=None):
            yield

    def merge_into(self, name: str, weight: torch.Tensor) -> None:
        """Add `name`'s adapter to its full base `weight` in place (inside `gathered_adapters`)."""
        d = self.deltas.get(name)
        if d is not None:
            weight.copy_(merged(weight, d.a.data, d.b.data, d.scale))


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A, computed in fp32, in `weight`'s dtype and on its device."""
    delta = scale * (b.float() @ a.float())
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)


def adapter_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' full tensors under PEFT's saved names (every rank joins; a CPU copy on each)."""
    from peft.utils import get_peft_model_state_dict

    served = ServedWeights(module)
    with served.gathered_adapters():
        names = {id(p): n for n, p in module.named_parameters()}
        state = {names[id(p)]: p.data.detach().cpu().clone() for p in served.adapters()}
    return get_peft_model_state_dict(module, state_dict=state)


def save_adapter(module: torch.nn.Module, out_dir, rank0: bool) -> None:
    """The adapter as PEFT writes it (adapter_config.json, adapter_model.safetensors): loadable with
    `PeftModel.from_pretrained(base, out_dir)`. Every rank joins."""
    from safetensors.torch import save_file

    state = adapter_state(module)
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        module.peft_config[ADAPTER].save_pretrained(str(out_dir))
        save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "adapter_model.safetensors"))
