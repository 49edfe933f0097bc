"""LoRA adapters on the ZeRO-3 actor (`--model.lora_rank`), and what the servers get of them.

The actor is a PEFT model: the base frozen (no gradients, no optimizer states), the adapters trained. The
reference policy is the same engine with the adapters off (`reference_off`). Two ways to serve it
(`--sync.lora`):

    adapter  the base once (and to every server that joins), then the adapter alone at each update,
             under PEFT's names (`gathered_adapter`, `adapter_config`); the servers apply it as the
             trainer does, unmerged, to the requests that name it (the client names it in every one)
    merged   every base weight with its adapter merged in, W + s B A, computed into the transport's
             buffer in fp32 (`ServedWeights`): any engine, any layer

Either way the trainer's own base weights are never modified, so they cannot drift by bf16 rounding
from merge to unmerge.
"""

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import deepspeed
import torch

from dsrl.config import ModelConfig
from dsrl.moe import is_moe
from dsrl.vision import is_vision, language_targets, saved_names

ADAPTER = "default"


def add_adapters(model: torch.nn.Module, m: ModelConfig) -> torch.nn.Module:
    """`model` wrapped in LoRA adapters (PEFT), its base frozen. The adapters take the base's dtype (PEFT would
    make them fp32: fp32 GEMMs and casts beside every bf16 layer, measured 2x the step at 3B); DeepSpeed keeps
    their fp32 master copy as it does the base's. ZeRO-3 gathers them with their decoder layer
    (`engine.gather_per_layer`)."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(m, model), autocast_adapter_dtype=False)


def lora_config(m: ModelConfig, model: torch.nn.Module | None = None):
    """PEFT's LoraConfig from --model.lora_*. On a mixture of experts "all-linear" means its linear layers (the
    attention's): PEFT would also adapt its fused experts and routers (`target_parameters`), whose adapters dsrl
    neither merges into the served weights nor serves."""
    from peft import LoraConfig

    targets = m.lora_target_modules
    if model is not None and is_vision(model.config):  # the language model's layers: not the vision tower's
        targets = language_targets(model, targets)
    elif targets == "all-linear" and model is not None and is_moe(model.config):
        head = model.get_output_embeddings()
        targets = sorted({name.rsplit(".", 1)[-1] for name, layer in model.named_modules()
                          if isinstance(layer, torch.nn.Linear) and layer is not head})  # fmt: skip
    return LoraConfig(
        r=m.lora_rank,
        lora_alpha=m.lora_alpha or 2 * m.lora_rank,
        target_modules=targets,
        lora_dropout=m.lora_dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )


def add_in_place(model: torch.nn.Module) -> int:
    """Every adapted linear layer of `model` adds its adapter in one GEMM: the rank-r activations are scaled (not
    the layer's d_out-wide output) and B's product is added to the base's output by one `addmm`, where PEFT
    reads and writes that output twice more (a multiply, then an add): a fifth of a LoRA layer's GPU time at 3B.
    Out of place: an in-place `addmm_` on a view of the output has autograd clone the output's gradient and copy
    it back (CopySlices), four activation-sized copies a layer in every backward. The same function, so the same
    gradients. Only with whole-layer gathering (`engine.gather_per_layer`): B's weight is read here, outside its
    module's own ZeRO-3 hooks. Returns how many layers were switched."""
    from peft.tuners.lora import Linear
    from peft.tuners.lora.layer import LoraVariant

    class AddInPlace(LoraVariant):
        @staticmethod
        def forward(module: Linear, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **_) -> torch.Tensor:
            a, b = module.lora_A[active_adapter], module.lora_B[active_adapter]
            low = a(module.lora_dropout[active_adapter](x)) * module.scaling[active_adapter]
            flat = torch.addmm(result.view(-1, result.shape[-1]), low.view(-1, low.shape[-1]), b.weight.t())
            return flat.view(result.shape)

    layers = [layer for layer in model.modules() if isinstance(layer, Linear)]
    for layer in layers:
        for name in layer.lora_A:
            layer.lora_variant.setdefault(name, AddInPlace())
    return len(layers)


def is_lora(module: torch.nn.Module) -> bool:
    return hasattr(module, "peft_config")


def reference_off(module: torch.nn.Module):
    """A context in which `module` is the reference policy: the base, its adapters off (nothing for a full model)."""
    return module.disable_adapter() if is_lora(module) else contextlib.nullcontext()


class ServedWeights:
    """The weights as the servers name and hold them: for a full model its parameters; for a LoRA model
    the base model's parameters under their base names ("...q_proj.weight", not "...q_proj.base_layer.weight"),
    each with its adapter to merge in, `deltas[name]` = (A, B, scale) for W + scale * B @ A, or (`merge=False`: the
    adapter is served on its own) none."""

    def __init__(self, module: torch.nn.Module, merge: bool = True):
        if not is_lora(module):
            self.named, self.deltas = list(module.named_parameters()), {}
            self._as_saved(module)
            return
        from peft.tuners.lora import LoraLayer

        base = module.get_base_model()
        self.named, self.deltas = [], {}
        for name, param in base.named_parameters():
            if ".lora_" not in name:
                self.named.append((name.replace(".base_layer.", "."), param))
        for prefix, layer in base.named_modules():
            if merge and isinstance(layer, LoraLayer) and ADAPTER in layer.lora_A:
                a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
                self.deltas[f"{prefix}.weight"] = (a, b, layer.scaling[ADAPTER])
        self._as_saved(base)

    def _as_saved(self, model: torch.nn.Module) -> None:
        """A vision-language model's weights under the names it is saved with, which the servers load
        (`dsrl.vision.saved_names`)."""
        saved = saved_names(model, [name for name, _ in self.named])
        self.named = [(saved.get(name, name), p) for name, p in self.named]
        self.deltas = {saved.get(name, name): d for name, d in self.deltas.items()}

    def adapters(self) -> list[torch.nn.Parameter]:
        return [p for a, b, _ in self.deltas.values() for p in (a, b)]

    def gathered_adapters(self):
        """Every rank holds the full adapters (small: a collective, every rank joins) while inside; nothing
        to gather for a full model."""
        if not self.deltas:
            return contextlib.nullcontext()
        return deepspeed.zero.GatheredParameters(self.adapters(), modifier_rank=None)

    def merge_into(self, name: str, weight: torch.Tensor) -> None:
        """Add `name`'s adapter to its full base `weight` in place (inside `gathered_adapters`)."""
        if name in self.deltas:
            a, b, scale = self.deltas[name]
            weight.copy_(merged(weight, a.data, b.data, scale))


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A, computed in fp32, in `weight`'s dtype and on its device."""
    delta = scale * (b.float() @ a.float())
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)


@contextlib.contextmanager
def gathered_adapter(module: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """The adapter's full tensors under PEFT's file names ("base_model.model....q_proj.lora_A.weight"), on
    their device, valid inside (every rank joins the gather)."""
    from peft.utils import get_peft_model_state_dict

    served = ServedWeights(module)
    with served.gathered_adapters():
        names = {id(p): n for n, p in module.named_parameters()}
        yield get_peft_model_state_dict(module, state_dict={names[id(p)]: p.data for p in served.adapters()})


def adapter_config(module: torch.nn.Module) -> dict:
    """The adapter's adapter_config.json as a dict (what SGLang's load_lora_adapter_from_tensors takes)."""
    config = module.peft_config[ADAPTER].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def target_modules(module: torch.nn.Module) -> list[str]:
    """The adapted layers' names, as the servers' launch flags want them: "q_proj", ... (PEFT resolves
    'all-linear' to every such layer's full path)."""
    return sorted({name.rsplit(".", 1)[-1] for name in module.peft_config[ADAPTER].target_modules})


def save_adapter(module: torch.nn.Module, out_dir: Path, rank0: bool) -> int:
    """The adapter as PEFT writes it (adapter_config.json, adapter_model.safetensors): loadable with
    `PeftModel.from_pretrained(base, out_dir)`, and by SGLang's /load_lora_adapter. Every rank joins;
    returns the tensors' bytes (rank 0)."""
    with gathered_adapter(module) as state:
        return write_adapter(module, state, out_dir) if rank0 else 0


def write_adapter(module: torch.nn.Module, state: dict[str, torch.Tensor], out_dir: Path) -> int:
    """Write `state` (`gathered_adapter`'s) with `module`'s adapter config into `out_dir`, whole or not at all."""
    from safetensors.torch import save_file

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    module.peft_config[ADAPTER].save_pretrained(str(tmp))
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return sum(t.numel() * t.element_size() for t in tensors.values())
