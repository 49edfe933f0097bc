"""Attention for packed rows: each sequence attends within itself, and no mask is built.

A packed micro-batch (`MicroBatch`, `trainer.pack_sequences`) is one row of several sequences, positions
restarting at each one. With sdpa transformers builds a dense block-causal mask over the whole row, so
attention grows with the square of the row's length. This module registers an attention implementation
with transformers, `dsrl_varlen`, that has no mask function. Transformers then builds no mask, and each
layer's attention gets the sequences' boundaries: `cu_seq_lens_q` and `max_length_q`, which the model's
forward passes down to every attention call.

- On CUDA in bf16/fp16, the boundaries go to torch's flash-attention varlen kernel
  (`torch.nn.attention.varlen`), forward and backward: no padding, no mask, no quadratic memory.
- Elsewhere (CPU, fp32, a torch without that kernel) each sequence runs through sdpa on its own: the
  same result, one call per sequence.
- Without boundaries (right-padded rows, the sync's probe), a causal sdpa without a mask. The real tokens
  of a right-padded row attend only to real tokens, so they need no padding mask; the padded positions'
  outputs are garbage that nothing reads. dsrl builds right-padded rows only.
"""

import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "dsrl_varlen"
"""The attention implementation's name (`attn_implementation=NAME` in `from_pretrained`)."""

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None
_PARAMS = set(inspect.signature(varlen_attn).parameters) if varlen_attn else set()


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float):
    """Causal attention of [tokens, heads, dim] q, k, v over the sequences that `cu` bounds: torch's flash
    varlen kernel. Its signature moved between torch releases (causality as a flag or as a window; GQA and
    the scale as options); this takes what the installed one has."""
    kwargs = {"is_causal": True} if "is_causal" in _PARAMS else {"window_size": (-1, 0)}
    if "enable_gqa" in _PARAMS:
        kwargs["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:  # grouped-query attention: one key/value head per group of query heads
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if "scale" in _PARAMS:
        kwargs["scale"] = scale
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)


def use_flash(query: torch.Tensor, scale: float) -> bool:
    """Whether the flash kernel can run this: CUDA, half precision, and a scale it takes."""
    scaled = "scale" in _PARAMS or abs(scale - query.shape[-1] ** -0.5) < 1e-12
    return varlen_attn is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and scaled


def describe(dtype: torch.dtype, cuda: bool) -> str:
    """Which kernel packed rows run on, for the start-up log."""
    if varlen_attn is not None and cuda and dtype in (torch.bfloat16, torch.float16):
        return "torch's flash-attention varlen kernel"
    return "sdpa, one call per sequence (no flash varlen kernel " + ("in this torch)" if cuda else "on CPU)")


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: [batch, heads, tokens, dim] in, [batch, tokens, heads, dim] out."""
    if sliding_window is not None or softcap is not None or dropout:
        raise ValueError(
            f"{type(module).__name__} uses sliding-window attention, logit soft-capping or attention dropout, which "
            "packed sequences do not support: run with --trainer.pack_sequences false"
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    gqa = key.shape[1] != query.shape[1]
    causal = getattr(module, "is_causal", True)  # (a vision tower's attention is not; its caller splits the images)
    if cu_seq_lens_q is None or not causal:  # right-padded rows (see the module's docstring)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2), None
    if query.shape[0] != 1:
        raise ValueError(f"packed sequences are one row; got {query.shape[0]} rows with cu_seq_lens_q")
    if use_flash(query, scale):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
        return flash_varlen(q, k, v, cu_seq_lens_q, int(max_length_q), scale)[None], None
    bounds = cu_seq_lens_q.tolist()
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scale, enable_gqa=gqa
        )
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(parts, dim=2).transpose(1, 2), None


AttentionInterface.register(NAME, attention)
