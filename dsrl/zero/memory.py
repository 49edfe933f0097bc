"""The memory plan: who holds what on a trainer's device, decided in one place and logged once at start-up.

Colocated on a GPU, the trainers and the rollout servers take turns (`dsrl.lending`):

    servers generate     the trainers' states that stay (all, or less Adam's moments, or none: `offload`)
                         + the servers' static share (mem_fraction_static: weights and KV cache) + margin
    trainers update      the trainers' states + ZeRO-3's buffers + the activations of the largest micro-batch (its
                         tokens, not the batch's: nothing of a micro-batch outlives it) + what the sleeping servers
                         keep + margin

`plan_memory` decides trainer.offload_states and states both sums for the batch configured; `AutoCheckpointing`
decides the layers' checkpointing per update, from that update's largest micro-batch.
"""

import logging
import math
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist

from dsrl.config import Config, beside_rollouts, critic_of_its_own
from dsrl.moe import is_moe
from dsrl.nodes import local_ranks
from dsrl.plan import Plan
from dsrl.zero.actor import LOGPROB_CHUNK
from dsrl.zero.batches import largest_micro_batch

log = logging.getLogger(__name__)

GB = 1e9


def margin(total: float) -> float:
    """What a device keeps free beyond the plan's sums: the servers' activations and CUDA graphs, the allocator's
    slack, the sleeping servers' remains (5% of the device and 4 GiB)."""
    return 0.05 * total + (4 << 30)


def state_bytes(cfg: Config, plan: Plan, weights: int, trained: int) -> float:
    """Bytes of an engine's states on the device: its weights; the trained ones' grads and, unless ZeRO-Offload keeps
    them on the host, their fp32 master copy and Adam's two moments."""
    width = plan.weight_bytes
    on_gpu = 1 - cfg.trainer.offload_optimizer_ratio if cfg.trainer.offload_optimizer else 1
    return weights * width + trained * (width + on_gpu * (4 + 8))


ACTIVATION_BYTES = 11
"""Bytes a decoder layer keeps for its backward pass per token and per unit of its width (hidden + intermediate
size), bf16, without checkpointing. Fitted on one H200, 3B packed at 8192 tokens, update peak 95.3 GB = states 49.4
+ logits 4.0 (`activation_bytes`) + 41.8 (and, before the log-probs' gradient went over the logits in 512-position
chunks, 103.2 GB with 11.2 GB of logits: the same 11 bytes)."""

LIGER_ACTIVATION_BYTES = 8
"""The same with liger-kernel's fused RMSNorm, SwiGLU and RoPE (--model.liger_kernel), which keep less. Fitted on one
H200, 3B packed: update peaks 99.7 GB at 12,288 tokens and 115.5 GB at 16,384 (tools/bench_trainer.py), 84.3 GB at
8,256 tokens in the realistic step: 7.8, 7.7 and 7.9 bytes."""


def activation_bytes(config, tokens: int, checkpointing: bool, width: int = 2, liger: bool = False) -> float:
    """What a forward and backward pass of `tokens` tokens keeps on the device beyond the states: every layer's
    activations, or with checkpointing each layer's input and one layer's activations at a time; the logits (their
    gradient is written over them) and the log-probs' fp32 chunks (about five of LOGPROB_CHUNK positions at once).
    `width`: bytes per value (2 in bf16, 4 in fp32); `liger`: the layers run liger-kernel's fused kernels."""
    per_width, config = LIGER_ACTIVATION_BYTES if liger else ACTIVATION_BYTES, config.get_text_config()
    mlp = config.intermediate_size
    if is_moe(config):  # a MoE block keeps each token's copy for every expert it routes
        mlp = config.num_experts_per_tok * (config.moe_intermediate_size + config.hidden_size)  # to (fitted: 1 run)
    layer, layers = per_width * (config.hidden_size + mlp), config.num_hidden_layers
    kept = layers * 2 * config.hidden_size + layer if checkpointing else layers * layer
    return tokens * (kept * width / 2 + config.vocab_size * width) + 5 * LOGPROB_CHUNK * config.vocab_size * 4


def trainers_state_bytes(cfg: Config, plan: Plan, model: torch.nn.Module, critic: bool) -> float:
    """Device bytes of every trainer engine's states, counted from the one being built: its own, the reference model's
    weights (KL without LoRA), and a critic as large as the actor (gae without LoRA)."""
    weights = sum(getattr(p, "ds_tensor", p).numel() for p in model.parameters())  # (this rank's ZeRO-3 partitions)
    states = state_bytes(cfg, plan, weights, trained=0 if cfg.model.lora_rank > 0 and not critic else weights)
    if cfg.algorithm.kl_coef > 0 and cfg.model.lora_rank == 0:
        states += state_bytes(cfg, plan, weights, trained=0)
    if critic_of_its_own(cfg):
        states *= 2
    return states


HOST_BYTES_PER_PARAM = 16
"""ZeRO-Offload's host memory per trained parameter: the fp32 master copy, Adam's two moments, fp32 grads."""

GPU_PROCESS_HOST_BYTES = 10 << 30
"""Host memory each GPU process of the node (a trainer rank, a server's TP worker) holds beside ZeRO-Offload's
buffers. Measured on 4 x H200, 32B colocated (4 ranks, 2 TP-2 servers; docs/gpu_runs/colo32b_ratio070_nov27): 70%
offloaded, the host's memory in use peaked at 498.1 GB, 366.9 GB of states and 65.5 GB of grad partitions beside
65.7 GB for the 8 processes; at 85% the first update ran the 540.9 GB host out (colo32b_hostoom_nov27)."""


def local_server_gpus(cfg: Config) -> int:
    """The GPUs of rollout servers this node's run starts (none where Ray places them or they are the user's)."""
    return 0 if cfg.rollout.fleet_kind in ("ray", "external") else cfg.rollout.num_servers * cfg.rollout.tp_size


def check_offload_room(cfg: Config, moved: float, offload: str) -> None:
    """The states `plan_memory` moves off the GPU go to pinned host memory, each rank of the node its own: refuse to
    start, naming the numbers, where the host cannot hold them beside the servers' processes, which start next (the
    kernel would kill a rank at the first generation, and the launcher say only "status 247"). It runs once the engines
    are built, so what the ranks hold is already out of `available` (check_host_memory, before them, counts them)."""
    local, memory = local_ranks(), psutil.virtual_memory()
    spare = local_server_gpus(cfg) * GPU_PROCESS_HOST_BYTES + (8 << 30)
    if moved * local + spare > memory.available:
        raise MemoryError(
            f"trainer.offload_states {offload}: the {local} rank(s) of this node would move {moved * local / GB:.1f} "
            f"GB of their states to host memory while the servers generate, and {memory.available / GB:.1f} GB are "
            f"available ({spare / GB:.1f} GB kept for the servers' processes): keep part of Adam on the host for good "
            "(--trainer.offload_optimizer true: the start-up names the share), or train on more nodes"
        )


def check_host_memory(cfg: Config, plan: Plan, world: int) -> None:
    """With --trainer.offload_optimizer the optimizer states live in this node's host memory (pinned on GPUs):
    refuse to start, naming the numbers, when they cannot fit, rather than be killed by the kernel minutes in
    (a rank's "return code = -9" said nothing). Counted from the config, before any weight is loaded."""
    if not cfg.trainer.offload_optimizer:
        return
    params = plan.params
    # the critic is as large, and trained too (with LoRA it is an adapter on the actor's base)
    trainers = 2 if critic_of_its_own(cfg) else 1
    local = local_ranks(default=world)
    whole = params * trainers * HOST_BYTES_PER_PARAM * local / world
    ratio = cfg.trainer.offload_optimizer_ratio
    memory = psutil.virtual_memory()
    # DeepSpeed keeps every parameter's grad partition on the host with ZeRO-Offload (in the weights' dtype), whatever
    # the ratio; the share offloaded has its fp32 grads beside them
    grads = params * trainers * plan.weight_bytes * local / world
    processes = (local + local_server_gpus(cfg)) * GPU_PROCESS_HOST_BYTES if plan.cuda else 0
    spare = max(0.1 * memory.total, processes) + (8 << 30)  # the GPU processes, the servers' host side, page cache
    if whole * ratio + grads + spare > memory.available:
        fits = int(max(0.0, memory.available - grads - spare) / whole * 20) / 20  # rounded down to 0.05
        hint = f"--trainer.offload_optimizer_ratio {fits:.2f} (the rest on the GPUs)" if fits > 0 else "more nodes"
        raise MemoryError(
            f"--trainer.offload_optimizer: {ratio:.0%} of the optimizer states of {params * trainers / 1e9:.2f}B "
            f"trained parameters need {whole * ratio / 1e9:.1f} GB of this node's host memory ({HOST_BYTES_PER_PARAM} "
            f"bytes each: fp32 weights, Adam's two moments, fp32 grads; {local} of {world} ranks here) + "
            f"{grads / 1e9:.1f} GB of every parameter's grads + {spare / 1e9:.1f} GB margin, and "
            f"{memory.available / 1e9:.1f} GB of {memory.total / 1e9:.1f} GB are available. Fits: {hint}; or train "
            "on more nodes (the states split over ranks), or a smaller model"
        )
    log.info("ZeRO-Offload: %.1f GB of optimizer states on the host (%.0f%%) and %.1f GB of grads, %.1f GB available",
             whole * ratio / 1e9, 100 * ratio, grads / 1e9, memory.available / 1e9)  # fmt: skip


def servers_bytes(cfg: Config, total: float) -> tuple[float, float]:
    """What the colocated servers take of a GPU of `total` bytes while they generate: the rollout servers' share with
    the reward model's and the teacher's beside it (the third and fourth tenants), and those two's alone."""
    side = sum(m.mem_fraction_static * total for m in (cfg.reward_model, cfg.distill) if beside_rollouts(cfg, m))
    return cfg.rollout.mem_fraction_static * total + side, side


def check_device_memory(cfg: Config, plan: Plan, model_dir: str, world: int) -> None:
    """On GPUs: refuse to start, naming the numbers and the share of ZeRO-Offload that fits, when this rank's share of
    the trainers' states (`trainers_state_bytes`' count), the margin and, with a token budget, a checkpointed
    micro-batch exceed its GPU: the first update would run out of memory after the servers' start and a generation.
    Colocated with ZeRO-Offload (or a staleness of 1) the states stay on the GPU beside the generating servers too
    (`plan_memory`), so the share named fits beside their mem_fraction_static: 32B on 4 x H200 with two TP-2 servers
    at 0.4 needs 0.55 on the host, where the update alone needs 0.20. Counted from the config, before weights load."""
    if not plan.cuda or cfg.model.lora_rank > 0:
        return
    params, total = plan.params / world, plan.device_memory
    trained = params * (2 if critic_of_its_own(cfg) else 1)
    weights = trained + (params if cfg.algorithm.kl_coef > 0 else 0)  # (the reference model's)
    width, room = plan.weight_bytes, total - margin(total)
    ratio = cfg.trainer.offload_optimizer_ratio if cfg.trainer.offload_optimizer else 0.0
    states = state_bytes(cfg, plan, weights, trained)
    fixed = states - trained * 12 * (1 - ratio)  # all but the fp32 master copy and Adam's moments: weights, grads
    t, acts, tokens = cfg.trainer, 0.0, ""  # with a token budget, a checkpointed micro-batch must fit too
    if isinstance(t.max_tokens_per_micro_batch, int):
        from transformers import AutoConfig

        longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
        n = largest_micro_batch(t.max_tokens_per_micro_batch, t.micro_batch_size, longest)
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
        acts = activation_bytes(config, n, True, width)
        tokens = f" and a micro-batch of {n} tokens checkpointed ({acts / GB:.1f} GB)"
    beside = servers_bytes(cfg, total)[0] if plan.colocated else 0.0  # (states stay beside it)
    stays = beside if cfg.trainer.offload_optimizer or cfg.rollout.max_staleness > 0 else 0.0
    if states + max(acts, stays) <= room:
        return
    need = max(acts, beside)  # (the share named keeps the states on the GPU: it must fit beside the servers too)
    fits = math.ceil((1 - (room - need - fixed) / (trained * 12)) * 20) / 20  # the host's share, up to 0.05
    hint = f"--trainer.offload_optimizer true --trainer.offload_optimizer_ratio {fits:.2f}" if fits <= 1 else (
        "more GPUs (ZeRO-3 splits the states over the ranks)")  # fmt: skip
    servers, what = ("", "the first update cannot fit") if acts >= stays else (
        f", beside the servers' {beside / GB:.1f} GB (rollout.mem_fraction_static; ZeRO-Offload keeps the states on "
        "the GPU while they generate)", "the servers cannot generate beside them")  # fmt: skip
    raise MemoryError(
        f"this rank's share of the trainers' states is {states / GB:.1f} GB ({trained * world / 1e9:.2f}B trained "
        f"parameters over {world} rank(s): weights and grads, and {1 - ratio:.0%} of the fp32 master weights and "
        f"Adam's moments){tokens}{servers}, and with the margin {margin(total) / GB:.1f} GB they exceed "
        f"the GPU's {total / GB:.1f} GB: {what}. Fits: {hint}; or "
        f"{'a smaller --trainer.max_tokens_per_micro_batch, ' if acts else ''}"
        f"{'a smaller --rollout.mem_fraction_static, ' if beside > acts else ''}a smaller model"
    )


def whole_numel(model: torch.nn.Module) -> int:
    """The model's parameters, whole (ZeRO-3's partitions counted as the tensors they split)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def server_weight_bytes(cfg: Config, model: torch.nn.Module) -> float:
    """This GPU's share of a colocated server's copy of `model`: bf16, or about a byte a weight with --rollout.precision
    fp8 (its linear layers' weights; the embeddings and norms stay bf16)."""
    width = 1 if cfg.rollout.precision == "fp8" else 2
    return whole_numel(model) * width / cfg.rollout.tp_size


def awake_server_bytes(cfg: Config, plan: Plan, model: torch.nn.Module) -> float:
    """Device bytes the colocated servers keep through an update: their weights, when they generate ahead (one-step-off;
    else they release them)."""
    if not plan.colocated or cfg.rollout.max_staleness == 0 or not plan.cuda:
        return 0.0
    return server_weight_bytes(cfg, model)


@dataclass
class AutoCheckpointing:
    """--model.gradient_checkpointing auto: before each update, the decoder layers' checkpointing is turned on when
    the trainers' states (with the servers' weights kept awake, `awake_server_bytes`) and the update's largest
    micro-batch's activations (`activation_bytes`) would not fit the device (`Plan.device_memory`) with the `margin`,
    and off when they fit. Decided per update because only then is the largest micro-batch known (the budget, or
    micro_batch_size x the batch's longest sample): the config's bound, its longest possible prompt and response,
    would checkpoint runs whose prompts are short. Changes are logged."""

    config: Any
    """The model's config (its widths, depth and vocabulary)."""
    states: float
    total: float
    where: str
    """The device's memory and its name (`Plan.device_memory`, `Plan.device_name`)."""
    width: int = 2
    """Bytes per activation value."""
    liger: bool = False
    """The layers run liger-kernel's fused kernels (`LIGER_ACTIVATION_BYTES`)."""
    on: bool | None = None

    def needs(self, tokens: int) -> tuple[bool, float]:
        """Whether a micro-batch of `tokens` needs checkpointing, and its activations' bytes then."""
        acts = activation_bytes(self.config, tokens, checkpointing=False, width=self.width, liger=self.liger)
        if self.states + acts + margin(self.total) <= self.total:
            return False, acts
        return True, activation_bytes(self.config, tokens, checkpointing=True, width=self.width, liger=self.liger)

    def apply(self, model: torch.nn.Module, tokens: int) -> None:
        on = self.needs(tokens)[0]
        if on == self.on:
            return
        self.switch(model, on)
        self.on = on
        acts = activation_bytes(self.config, tokens, checkpointing=False, width=self.width, liger=self.liger)
        spare, verdict = margin(self.total), "exceed" if on else "fit in"
        log.info("gradient checkpointing %s: states %.1f GB + activations of %d tokens %.1f GB + margin %.1f GB %s "
                 "%s %.1f GB (--model.gradient_checkpointing auto)", "on" if on else "off", self.states / GB, tokens,
                 acts / GB, spare / GB, verdict, self.where, self.total / GB)  # fmt: skip

    def switch(self, model: torch.nn.Module, on: bool) -> None:
        """The decoder layers' checkpointing on or off (transformers reads each layer's flag at every call)."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        for module in model.modules():
            if isinstance(module, GradientCheckpointingLayer):
                module.gradient_checkpointing = on


ZERO3_LIVE, ZERO3_REDUCE = 1_000_000_000, 500_000_000
"""DeepSpeed's defaults for stage3_max_live_parameters and reduce_bucket_size (dsrl sets neither)."""


def zero3_buffer_bytes(params: int, width: int, world: int) -> float:
    """What ZeRO-3 holds in an update beyond the states, on several ranks: the parameters gathered for the layers in
    flight (up to stage3_max_live_parameters) and a bucket of gradients being reduced (one rank gathers and reduces
    nothing). Measured at 1.5B: the update's peak 74.7 GB on 2 ranks and 68.5 GB on 4, each 2.8-2.9 GB over the
    estimate without them (these are 3.0)."""
    return 0.0 if world == 1 else width * (min(ZERO3_LIVE, params) + min(ZERO3_REDUCE, params))


def update_peak(cfg: Config, plan: Plan, engine) -> tuple[float, int, bool]:
    """The update's peak for the batch configured: this rank's states, ZeRO-3's buffers and the activations of the
    largest micro-batch its longest prompt and response can make (bytes, its tokens, whether the layers are
    checkpointed for it)."""
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    t, width = cfg.trainer, plan.weight_bytes
    tokens = largest_micro_batch(t.max_tokens_per_micro_batch, t.micro_batch_size, longest)
    world = dist.get_world_size() if dist.is_initialized() else 1
    buffers = zero3_buffer_bytes(whole_numel(engine.module), width, world)
    auto = getattr(engine, "auto_checkpointing", None)
    if auto is not None:
        on, acts = auto.needs(tokens)
        return auto.states + buffers + acts, tokens, on
    on = cfg.model.gradient_checkpointing is True
    states = trainers_state_bytes(cfg, plan, engine.module, critic=False)
    return states + buffers + activation_bytes(engine.module.config, tokens, on, width), tokens, on


@dataclass
class MemoryPlan:
    offload: str | None = None
    """What of the trainers' states leaves the GPU while the servers generate (None: nothing; "moments": Adam's two
    moments; "all")."""
    line: str | None = None
    """The plan for the log (None: not colocated on GPUs, nothing to plan)."""
    peak: float = 0.0
    """The update's peak on a rank, as `update_peak` estimates it (bytes; 0: not colocated on GPUs)."""
    share: float = 1.0
    """With "moments": the share of them that leaves (what the servers need, or all)."""


PEAK_SLACK = 1.3
"""What the device holds at the update's peak, over `update_peak`'s estimate, before a step has measured it: the
allocator's cache and what the estimate leaves out (1.5B, 2 ranks on 2 x H200: 93 GB in use against 71.8)."""


def replacement_room(total: float, peak: float, weights: float) -> float:
    """Bytes a dead server's replacement has for its KV cache beside a trainer rank at its update's peak `peak` (what
    the device holds then), its `weights` and the margin."""
    return total - peak - margin(total) - weights


def replacement_fits(room: float, kv: float) -> bool:
    """Whether a dead server's replacement starts beside the update: at least half a server's KV cache `kv` fits in the
    `room` left there (tokens or bytes alike). Else it starts as the others did, and the trainers wait for it."""
    return room >= kv / 2


def replacement_line(room: float, kv: float) -> str:
    """The plan line's words on a dead server's replacement (`replacement_fits`)."""
    if replacement_fits(room, kv):
        return f"starts beside it with a KV cache of at most {room / GB:.1f} GB"
    return f"would have {max(room, 0) / GB:.1f} GB beside it, under half a server's KV cache: the trainers wait for it"


def plan_memory(cfg: Config, plan: Plan, engines: list, resumed: bool = False) -> MemoryPlan:
    """trainer.offload_states, colocated on GPUs, and whether a replacement server fits beside the update
    (`MemoryPlan`). auto keeps the states when this rank's (parameters, fp32 master copy, Adam's two moments,
    gradients) plus the servers' share and the margin fit in the GPU's memory; else moves the moments alone when that
    is enough; else all. Moving them costs seconds per step at 7B, so the least that fits moves (a `resumed` run's
    moments all move once, at start-up). The line states the update's peak beside it (`update_peak`)."""
    choice = cfg.trainer.offload_states
    if not plan.colocated or not plan.cuda:
        return MemoryPlan()
    params = [p for engine in engines for p in engine.module.parameters()]
    weights = sum(getattr(p, "ds_tensor", p).numel() for p in params)  # (this rank's ZeRO-3 partitions)
    trained = sum(getattr(p, "ds_tensor", p).numel() for p in params if p.requires_grad)  # (LoRA: the adapters)
    states, total = state_bytes(cfg, plan, weights, trained), plan.device_memory
    (servers, reward), spare = servers_bytes(cfg, total), margin(total)
    keep = states + servers + spare < total
    if not keep and cfg.rollout.max_staleness > 0:
        raise MemoryError(
            f"--rollout.max_staleness 1 (colocated): the servers generate beside the optimizer step, so the trainers' "
            f"states stay on the GPU, and states {states / GB:.1f} GB + servers {servers / GB:.1f} GB "
            f"(mem_fraction_static {cfg.rollout.mem_fraction_static:.2f}) + margin {spare / GB:.1f} GB exceed the "
            f"GPU's {total / GB:.1f} GB: lower --rollout.mem_fraction_static, keep the optimizer on the host "
            "(--trainer.offload_optimizer), or use --rollout.max_staleness 0"
        )
    peak, tokens, checkpointed = update_peak(cfg, plan, engines[0])
    server_weights = server_weight_bytes(cfg, engines[0].module)
    room = replacement_room(total, PEAK_SLACK * peak, server_weights)
    kv = cfg.rollout.mem_fraction_static * total - server_weights  # (a server's KV cache, as `size_replacements`)
    why = (
        f"generating: trainers' states {states / GB:.1f} GB + servers {servers / GB:.1f} GB (reward model and teacher "
        f"{reward / GB:.1f}) + margin {spare / GB:.1f} GB {'fit in' if keep else 'exceed'} the GPU's "
        f"{total / GB:.1f} GB; updating: at most {peak / GB:.1f} GB (states and a micro-batch of {tokens} tokens, "
        f"layers {'checkpointed' if checkpointed else 'not checkpointed'}); a dead server's replacement "
        f"{replacement_line(room, kv)} (measured from the second step)"
    )
    moments = 8 * trained  # (fp32 exp_avg and exp_avg_sq)
    over = states + servers + spare - total  # what must leave for the servers
    share = min(1.0, over / moments) if over > 0 else 1.0  # (moments: the least that makes room, or all if given)
    moved = f"{share * moments / GB:.1f} of Adam's {moments / GB:.1f} GB of moments"
    first = moments if resumed else share * moments  # (the host holds the most at the first move)

    def decided(offload: str | None, line: str) -> MemoryPlan:
        if offload:  # Adam's moments; or all but the bf16 weights: grads, fp32 master copy, moments
            check_offload_room(cfg, first if offload == "moments" else states - weights * plan.weight_bytes, offload)
        return MemoryPlan(offload, f"memory plan: {line}", peak, share if offload == "moments" else 1.0)

    if choice != "auto":
        offload = {"always": "all", "moments": "moments", "never": None}[choice]
        given = f"given, {moved}" if offload == "moments" else "given"
        return decided(offload, f"trainer.offload_states {choice} ({given}); {why}")
    if cfg.trainer.offload_optimizer:  # DeepSpeed moves states between phases for FusedAdam only, not CPU Adam
        hint = "" if keep else ": raise --trainer.offload_optimizer_ratio or lower mem_fraction_static"
        return decided(None, f"trainer.offload_states never, with ZeRO-Offload ({why}{hint})")
    if keep:
        return decided(None, f"trainer.offload_states never, the states stay on the GPU ({why})")
    if states - moments + servers + spare < total:
        return decided("moments", f"trainer.offload_states moments, {moved} leave the GPU while the servers generate, "
                                  f"the rest stays ({why})")  # fmt: skip
    return decided("all", f"trainer.offload_states always, the states leave the GPU while the servers generate ({why})")
