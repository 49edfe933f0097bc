"""Mixture-of-experts models (Qwen3-MoE and its kin): their experts under the names checkpoints and SGLang take, each
MoE block a ZeRO-3 leaf module, and routing replay ("R3", as verl and slime do it).

Routing replay: the rollout engine returns, per token, the experts each MoE layer routed it to (SGLang's
`routed_experts`: int32, tokens x layers x top k, for the prompt and the response but the last token). In the
trainer's forward passes (log-probs and update) every router then takes those experts in place of its own top k;
its softmax still weighs them (renormalised over the top k where the model does), so the router keeps its
gradient: slime's R3 gathers its router's scores at the replayed experts the same way. The experts that differ
between the two are counted (`moe/routing_mismatch_frac`)."""

import logging
from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from dsrl.config import Config

log = logging.getLogger(__name__)


def is_moe(config) -> bool:
    """Whether a transformers model config is a mixture of experts (its tokens routed to `num_experts_per_tok`)."""
    return bool(getattr(config, "num_experts_per_tok", 0))


def routing_replay(cfg: Config, config) -> bool:
    """--algorithm.routing_replay for the model of `config`: on by default for a mixture of experts, off (and an
    error when asked for) for a dense model."""
    if is_moe(config):
        return cfg.algorithm.routing_replay is not False
    if cfg.algorithm.routing_replay:
        raise ValueError(
            f"--algorithm.routing_replay true: {cfg.model.path} ({config.model_type}) routes no tokens to experts; "
            "routing replay is for mixture-of-experts models (leave it unset: on for those, off for the rest)"
        )
    return False


def with_routed_experts(cfg: Config) -> Config:
    """The rollout servers started to return each request's routed experts (`return_routed_experts`)."""
    args = {"enable_return_routed_experts": True} | cfg.rollout.server_args
    return replace(cfg, rollout=replace(cfg.rollout, server_args=args))


def moe_blocks(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, block) of every sparse MoE block (transformers' `*SparseMoeBlock`: a router `gate`
    and its `experts`)."""
    return [
        (int(name.split(".")[-2]), m)
        for name, m in model.named_modules()
        if type(m).__name__.endswith("SparseMoeBlock")
    ]


def expert_tensors(name: str, shape) -> list[tuple[str, list[int]]]:
    """The checkpoint's names and shapes of a parameter. transformers 5 holds a layer's experts fused:
    `experts.gate_up_proj` [experts, 2 x intermediate, hidden] (gate rows, then up rows) and `experts.down_proj`
    [experts, hidden, intermediate]; checkpoints and SGLang's Qwen3-MoE loader take one tensor per expert,
    `experts.{e}.gate_proj.weight` ... (SGLang skips a name it does not know: the fused ones would load nothing).
    The per-expert tensors are the fused one's bytes in order, so this renames and reshapes, and copies nothing."""
    stem, _, leaf = name.rpartition(".experts.")
    if not stem or len(shape) != 3 or leaf not in ("gate_up_proj", "down_proj"):
        return [(name, list(shape))]
    experts, rows, cols = shape
    if leaf == "down_proj":
        return [(f"{stem}.experts.{e}.down_proj.weight", [rows, cols]) for e in range(experts)]
    return [
        (f"{stem}.experts.{e}.{p}.weight", [rows // 2, cols]) for e in range(experts) for p in ("gate_proj", "up_proj")
    ]


def split_experts(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` with each fused expert tensor as `expert_tensors`' per-expert views of it (it is contiguous)."""
    for name, tensor in named:
        pieces = expert_tensors(name, tensor.shape)
        if len(pieces) == 1:
            yield name, tensor
            continue
        flat, size = tensor.view(-1), tensor.numel() // len(pieces)
        yield from ((piece, flat[i * size : (i + 1) * size].view(shape)) for i, (piece, shape) in enumerate(pieces))


class RoutingReplay:
    """Routing replay in one model: a forward given `routed_experts` (the micro-batch's, `positions`) replays them in
    every MoE block, and in the recomputation of a checkpointed layer during the backward pass; a forward without
    (the probe's) routes on its own."""

    def __init__(self, model: torch.nn.Module, blocks: list[tuple[int, torch.nn.Module]]):
        self.layers, self.top_k = model.config.num_hidden_layers, model.config.num_experts_per_tok
        self.routed: torch.Tensor | None = None
        """[positions, layers, top k] of the forward running (-1: no replay there); None: nothing replayed."""
        self.decisions = self.differed = 0
        self.warned = False
        model.base_model.register_forward_pre_hook(self.take, with_kwargs=True)
        for layer, block in blocks:
            block.gate.register_forward_hook(self.replay(layer))

    def take(self, module, args, kwargs):
        self.routed = kwargs.pop("routed_experts", None)
        return args, kwargs

    def replay(self, layer: int):
        def hook(router, args, out):
            if self.routed is None:
                return out
            logits, _, own = out
            given = self.routed[:, layer].long()
            there = given[:, 0] >= 0
            chosen = torch.where(there[:, None], given, own)
            weights = torch.softmax(logits.float(), -1).gather(-1, chosen)
            if getattr(router, "norm_topk_prob", False):
                weights = weights / weights.sum(-1, keepdim=True)
            if torch.is_grad_enabled():  # the update's passes: not the reference's (with LoRA, the same model)
                differs = (chosen[:, :, None] != own[:, None, :]).all(-1)
                self.differed += int(differs[there].sum())
                self.decisions += int(there.sum()) * self.top_k
            return logits, weights.to(logits.dtype), chosen

        return hook

    def positions(self, mb) -> torch.Tensor | None:
        """The micro-batch's routed experts at its input positions, [positions, layers, top k]: each sample's from its
        first token on, -1 past them (the last token, an environment's last tokens, padding) and where a sample has
        none; None when none has any."""
        if all(s.routed_experts is None for s in mb.samples):
            return None
        out = torch.full((*mb.input_ids.shape, self.layers, self.top_k), -1, dtype=torch.int32)
        offset = 0  # where a packed row's sequence starts
        for i, s in enumerate(mb.samples):
            length = len(s.prompt.prompt_ids) + len(s.response_ids)
            if s.routed_experts is not None:
                routed = s.routed_experts.view(-1, self.layers, self.top_k)
                if len(routed) > length:
                    raise ValueError(f"row {s.prompt.index}: routed experts of {len(routed)} tokens, {length} tokens")
                row, start = (0, offset) if mb.packed else (i, 0)
                out[row, start : start + len(routed)] = routed
            offset += length
        return out.view(-1, self.layers, self.top_k).to(mb.input_ids.device)

    def metrics(self) -> dict[str, float]:
        """The share of replayed experts the trainer's own routers would not have chosen in the update's forward
        passes since the last call."""
        if not self.decisions and not self.warned:  # (SGLang without its flag answers, with no routed experts)
            self.warned = True
            log.warning("routing replay is on, but no sample of this update came with routed experts: serve the "
                        "model with --enable-return-routed-experts, or --algorithm.routing_replay false")  # fmt: skip
        out = {"moe/routing_mismatch_frac": self.differed / self.decisions} if self.decisions else {}
        self.decisions = self.differed = 0
        return out


def prepare(model: torch.nn.Module, cfg: Config) -> None:
    """Each MoE block a ZeRO-3 leaf module, its experts gathered together (experts held as modules of their own would
    be gathered as each is called: ranks whose tokens reach different ones would hang), and routing replay
    (`model.routing_replay`) when it is on."""
    blocks = moe_blocks(model)
    if not blocks:
        return
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, list({type(block) for _, block in blocks}))
    if routing_replay(cfg, model.config):
        model.routing_replay = RoutingReplay(model, blocks)


def replay_inputs(engine, mb) -> dict:
    """The forward's `routed_experts` keyword for micro-batch `mb` (none without routing replay), for a DeepSpeed
    engine or a model."""
    replay = getattr(getattr(engine, "module", engine), "routing_replay", None)
    routed = replay.positions(mb) if replay is not None else None
    return {} if routed is None else {"routed_experts": routed}
