"""Block-wise FP8 for the rollout servers (--rollout.precision fp8), in DeepSeek's and SGLang's format.

A linear layer's weight [N, K] becomes float8_e4m3fn of the same shape and a float32 `weight_scale_inv` of
[ceil(N/128), ceil(K/128)], one per 128 x 128 block: dequantized = fp8 * the scale of its block. SGLang 0.5.17 gives
every linear layer of a checkpoint whose config.json carries `QUANTIZATION_CONFIG` its Fp8LinearMethod (these two
parameters; activations quantized per token in groups of 128 at run time), and its loaders take both by their
checkpoint names (q_proj.weight_scale_inv into qkv_proj's) at start-up and in every weight update. Embeddings, norms,
biases and the output head are not linear layers to SGLang: they stay as they are.
"""

import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dsrl.collectives import agreed

if TYPE_CHECKING:  # (the embedded engine imports this module, not the config's parser)
    from dsrl.config import Config

log = logging.getLogger(__name__)

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE = "_scale_inv"
"""The suffix of a weight's scale: q_proj.weight -> q_proj.weight_scale_inv."""
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip

NamedTensors = list[tuple[str, torch.Tensor]]


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """A decoder layer's attention or MLP projection (q/k/v/o_proj, gate/up/down_proj, fused qkv_proj and
    gate_up_proj, an expert's): the weights of the layers SGLang builds as linear layers."""
    return tensor.dim() == 2 and ".layers." in name and name.endswith("_proj.weight")


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] as float8_e4m3fn and its float32 scales [ceil(N/128), ceil(K/128)], on its device: each block's
    largest |value| maps to 448 (e4m3's largest); a block of zeros keeps a tiny scale rather than a 0 to divide by."""
    n, k = weight.shape
    rows, cols = -(-n // BLOCK), -(-k // BLOCK)
    w = F.pad(weight.float(), (0, cols * BLOCK - k, 0, rows * BLOCK - n)).view(rows, BLOCK, cols, BLOCK)
    scale = w.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows * BLOCK, cols * BLOCK)[:n, :k].contiguous(), scale.view(rows, cols)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The float32 weight an FP8 weight and its block scales stand for."""
    n, k = q.shape
    return q.float() * scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]


def round_trip_activations(x: torch.Tensor) -> torch.Tensor:
    """`x` through SGLang's dynamic activation quantization (per_token_group_quant_fp8: each token's values in groups
    of 128, each group's largest |value| at 448) and back: what an FP8 linear layer multiplies its weight by."""
    k = x.shape[-1]
    groups = F.pad(x.float(), (0, -k % BLOCK)).unflatten(-1, (-1, BLOCK))
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    out = (groups / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
    return out.flatten(-2)[..., :k].to(x.dtype)


KV_SCALES = (".k_scale", ".v_scale")
"""SGLang's per-layer FP8 KV-cache scales under an FP8 checkpoint (`Fp8KVCacheMethod`: self_attn.attn.k_scale)."""
RENAMES_KV_SCALES = frozenset({"llama", "mistral", "gemma2", "gemma3_text"})
"""Model types whose SGLang 0.5.17 loader renames `.k_scale` to `.attn.k_scale` (`maybe_remap_kv_scale_name`) before
it looks the name up: they take `self_attn.k_scale`. The others (Qwen2, Qwen2-MoE, ...) look up the parameter's own
name, `self_attn.attn.k_scale`, and skip names they lack. Qwen2's ran on a GPU (7B)."""
NO_KV_SCALES = frozenset({"qwen3", "qwen3_moe"})
"""Model types whose SGLang 0.5.17 attention takes no quantization config, so has no KV-cache scales (its FP8 cache
uses 1.0) and nothing for a release to lose: scales sent to them earn a warning a layer. On a GPU, Qwen3's FP8 KV cache
kept its mismatch flat through 15 updates."""


RENAMES_BLOCK_SCALES = frozenset({"llama", "mistral"})
"""Model types whose SGLang 0.5.17 loader (LlamaForCausalLM's, which Mistral's extends) renames `.weight_scale_inv`
to ModelOpt's per-tensor `.weight_scale`, which block-wise FP8 layers lack: no scale loads ("Parameter ...weight_scale
not found in params_dict", at start-up and every update), and the GPU toy served as Llama sampled NaN and died."""


def check_servers_load_fp8(cfg: "Config", engine: str) -> None:
    """--rollout.precision fp8 on SGLang refused, before any rank starts, for a model whose loader cannot take
    block-wise FP8 scales (`RENAMES_BLOCK_SCALES`)."""
    if cfg.rollout.precision != "fp8" or engine != "sglang":
        return
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code).model_type
    if model_type in RENAMES_BLOCK_SCALES:
        raise ValueError(
            f"--rollout.precision fp8: SGLang 0.5.17's loader for {model_type} models renames block-wise FP8 scales "
            "(weight_scale_inv) to per-tensor ones (weight_scale), so the servers would generate with unloaded "
            "scales (NaN) and die at their first request: serve this model in bf16 (--rollout.precision bf16)"
        )


def kv_scales(named: NamedTensors, model_type: str = "") -> NamedTensors:
    """SGLang's KV-cache scales of each attention layer in `named` (found by its o_proj), at 1.0: the value SGLang
    gives a checkpoint that has none, under the name the loader of `model_type` takes. They are parameters in the
    weights' memory, so a colocated server that releases its weights gets them back without their contents, and
    nothing restores them but an update that sends them. An FP8 KV cache was then written with a junk scale and read
    back with 1.0 (at 7B on Qwen2 the mismatch went from 0.64 to 1.80 after the first update, and stays at 0.64 with
    them: docs/benchmarks.md "FP8 rollout"). A bf16 KV cache never reads them."""
    if model_type in NO_KV_SCALES:
        return []
    attn = "" if model_type in RENAMES_KV_SCALES else ".attn"
    return [
        (f"{name.removesuffix('.o_proj.weight')}{attn}{suffix}", torch.ones((), dtype=torch.float32, device=t.device))
        for name, t in named
        if name.endswith("self_attn.o_proj.weight")
        for suffix in KV_SCALES
    ]


def quantize_named(named: NamedTensors, model_type: str = "") -> NamedTensors:
    """`named` with each linear weight replaced by its FP8 weight and, right after it, its scale; each attention
    layer's KV-cache scales (`kv_scales`) last."""
    out = []
    for name, tensor in named:
        if is_quantized(name, tensor):
            q, scale = quantize(tensor)
            out += [(name, q), (name + SCALE, scale)]
        else:
            out.append((name, tensor))
    return out + kv_scales(named, model_type)


def quantize_flat(
    named: NamedTensors, model_type: str = ""
) -> tuple[list[tuple[str, torch.dtype, list[int]]], torch.Tensor]:
    """`named` as one uint8 buffer in SGLang's flattened-bucket layout, each linear weight in FP8 beside its scale:
    (name, dtype, shape) of each tensor in the buffer's order, and the buffer (on the tensors' device). The scales
    come first (the KV cache's too, `kv_scales`), then the tensors kept as they are, the FP8 weights last: every tensor
    starts at an offset its dtype can be viewed at (an FP8 weight of odd size would misalign the tensors after it).
    Written in place, one weight at a time: a whole model's bucket (one trainer rank over CUDA IPC) needs no second
    copy of its FP8 weights."""
    quantized = [(n, t) for n, t in named if is_quantized(n, t)]
    kept = kv_scales(named, model_type) + [(n, t) for n, t in named if not is_quantized(n, t)]
    entries = [(n + SCALE, torch.float32, [-(-t.shape[0] // BLOCK), -(-t.shape[1] // BLOCK)]) for n, t in quantized]
    entries += [(n, t.dtype, list(t.shape)) for n, t in kept] + [(n, FP8, list(t.shape)) for n, t in quantized]
    nbytes = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in entries)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=named[0][1].device)
    views = dict(zip((name for name, _, _ in entries), unflatten(flat, entries)))
    for name, tensor in kept:
        views[name].copy_(tensor)
    for name, tensor in quantized:
        q, scale = quantize(tensor)
        views[name].copy_(q)
        views[name + SCALE].copy_(scale)
    return entries, flat


def unflatten(flat: torch.Tensor, entries) -> list[torch.Tensor]:
    """Views of the tensors a flattened bucket holds back to back: (name, dtype, shape) each."""
    out, offset = [], 0
    for _, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        out.append(flat[offset : offset + size].view(dtype).view(shape))
        offset += size
    return out


def write_checkpoint(src: Path, out: Path, multiples_of_block: bool) -> None:
    """A block-wise FP8 copy of the Hugging Face model directory `src` in `out`: its safetensors shards with the linear
    weights quantized (`quantize_named`), its config.json with `QUANTIZATION_CONFIG`, its other files (tokenizer,
    generation config) as they are. `multiples_of_block`: refuse a layer SGLang cannot split into blocks (its merged
    q/k/v and gate/up layers need every output size a multiple of 128)."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--rollout.precision fp8: {src} holds no *.safetensors weights to quantize")
    from safetensors.torch import load_file, save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map, device = {}, "cuda" if torch.cuda.is_available() else "cpu"  # (a 7B on one CPU thread: ~80 s)
    config = json.loads((src / "config.json").read_text())
    kind = config.get("model_type", "")  # (names the KV-cache scales: `kv_scales`)
    for file in files:
        named = load_file(file)
        odd = [f"{n} {list(t.shape)}" for n, t in named.items() if is_quantized(n, t) and t.shape[0] % BLOCK]
        if multiples_of_block and odd:
            raise ValueError(f"--rollout.precision fp8: SGLang's FP8 layers split weights into {BLOCK}-row blocks, and "
                             f"{src} has weights of other sizes: {', '.join(odd[:3])}")  # fmt: skip
        named = [(n, q.cpu()) for name, t in named.items() for n, q in quantize_named([(name, t.to(device))], kind)]
        save_file(dict(named), tmp / file.name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys((n for n, _ in named), file.name)
    for other in src.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name != "model.safetensors.index.json":
            shutil.copy2(other, tmp / other.name)
    (tmp / "config.json").write_text(json.dumps(config | {"quantization_config": QUANTIZATION_CONFIG}, indent=2))
    if len(files) > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def servers_model_dir(cfg: "Config", model_dir: str, run_dir: Path) -> str:
    """The model the rollout servers start from: `model_dir`, or with --rollout.precision fp8 (servers dsrl starts)
    its FP8 copy, <run_dir>/fp8_model, written by trainer rank 0 unless a resumed run's is there (call on every rank).
    Its weights only have SGLang build FP8 layers: the first weight update gives the servers the trainer's."""
    r = cfg.rollout
    if r.precision != "fp8" or r.fleet_kind == "external":
        return model_dir
    out = run_dir / "fp8_model"
    with agreed("writing the servers' FP8 model", (ValueError, OSError)):
        if dist.get_rank() == 0 and not (out / "config.json").is_file():
            start = time.perf_counter()
            write_checkpoint(Path(model_dir), out, multiples_of_block=r.engine == "sglang")
            log.info("FP8 model for the servers written to %s in %.1f s", out, time.perf_counter() - start)
    return str(out)
