"""Every "auto" setting, decided here: its rule, what it measures, and the pass that decides them all once at a run's
start (`resolve`), logged as one block (`log_decisions`), and the `Plan` the rooms read (`make_plan`); a piece built
alone (a tool, a test, `dsrl eval`) gets the same answers. Decided elsewhere, where what they depend on first exists:
trainer.offload_states (the memory plan, once the trainers exist: `zero.memory.plan_memory`),
model.gradient_checkpointing (each update: `zero.memory.AutoCheckpointing`), trainer.max_tokens_per_micro_batch (each
batch: `zero.batches.micro_batches`), reward_model.input (its tokenizer: `rewards.models.sends_token_ids`),
logging.resume (the latest checkpoint). Imports no torch: the CLI asks it before the launcher starts."""

import functools
import logging
from collections.abc import Callable
from dataclasses import replace

import psutil

from dsrl.config import PROBE_TOLERANCE, Config, ConfigError, SyncConfig, TrainerConfig
from dsrl.nodes import local_ranks
from dsrl.plan import Plan

log = logging.getLogger(__name__)

SHARD_LOADER = "dsrl.serving.shard_loader.load"
"""The servers' weight loader for --sync.senders all (`dsrl.serving.shard_loader.LOADER`, which imports torch)."""


def trainer_on_cuda(t: TrainerConfig, cuda_available: Callable[[], bool]) -> bool:
    """trainer.device: cuda, or auto where `cuda_available()` (asked only then)."""
    return t.device == "cuda" or (t.device == "auto" and cuda_available())


def use_cuda(cfg: Config) -> bool:
    """Whether the trainer runs on CUDA: trainer.device, auto where torch sees a GPU."""
    import torch

    return trainer_on_cuda(cfg.trainer, torch.cuda.is_available)


def rollout_engine(cfg: Config, cuda: bool) -> str:
    """rollout.engine: auto = SGLang where the trainer runs on CUDA (`cuda`), the embedded engine elsewhere."""
    return cfg.rollout.engine if cfg.rollout.engine != "auto" else ("sglang" if cuda else "embedded")


def bf16(cfg: Config) -> bool:
    """trainer.precision: auto = bf16 on GPU, fp32 on CPU."""
    return cfg.trainer.precision == "bf16" or (cfg.trainer.precision == "auto" and use_cuda(cfg))


def old_from_update(cfg: Config) -> bool:
    """trainer.old_logprobs: `Plan.old_from_update`."""
    t, a = cfg.trainer, cfg.algorithm
    # (not with bypass_mode, whose old logprobs are the engine's, nor with optimal_token_baseline, which reads them)
    its_own = a.policy_loss != "bypass_mode" and a.advantage != "optimal_token_baseline"
    return t.old_logprobs == "auto" and t.updates_per_step == t.ppo_epochs == 1 and not a.kl_in_reward and its_own


def resolve_sync(cfg: Config) -> SyncConfig:
    """sync.bucket_bytes (None: 1 GiB on GPUs, 256 MiB on CPU), sync.type (auto = ipc when colocated on GPUs, else
    broadcast), sync.senders (auto = all with sync.delta, else rank0), sync.lora (auto = the adapter alone where dsrl
    starts the servers and they read its files, merged over CUDA IPC or to FP8 servers: docs/benchmarks.md "LoRA")
    and sync.probe_tolerance (its default for --rollout.precision)."""
    s = cfg.sync
    if s.bucket_bytes is None:
        s = replace(s, bucket_bytes=1 << 30 if use_cuda(cfg) else 256 << 20)
    if s.probe_tolerance is None:
        s = replace(s, probe_tolerance=PROBE_TOLERANCE[cfg.rollout.precision])
    if s.type == "auto":
        ipc = cfg.rollout.placement == "colocate" and use_cuda(cfg) and not cfg.trainer.hostfile  # (one node's GPUs)
        s = replace(s, type="ipc" if ipc else "broadcast")
    if s.senders == "auto":
        s = replace(s, senders="all" if s.delta else "rank0")
    if s.senders == "all" and s.type != "broadcast":
        raise ConfigError([f"--sync.senders all (or --sync.delta) sends over broadcast: not colocated on GPUs "
                           f"(sync.type {s.type})"])  # fmt: skip
    if s.lora == "auto":
        external = cfg.rollout.fleet_kind == "external"  # started by someone else: dsrl cannot enable LoRA
        remote = s.type == "broadcast" and (bool(cfg.trainer.hostfile) or cfg.rollout.fleet_kind == "ray")
        adapter = cfg.model.lora_rank > 0 and s.type != "ipc" and not external and not remote
        adapter = adapter and cfg.rollout.precision != "fp8"
        s = replace(s, lora="adapter" if adapter else "merged")
    return s


def lora_servers(cfg: Config, target_modules: list[str]) -> Config:
    """sync.lora adapter: the servers start with LoRA support for the actor's adapter (the user's keys win)."""
    lora = {"enable_lora": True, "max_lora_rank": cfg.model.lora_rank, "lora_target_modules": target_modules}
    return replace(cfg, rollout=replace(cfg.rollout, server_args=lora | cfg.rollout.server_args))


GRAPH_ARGS = ("cuda_graph_max_bs_decode", "cuda_graph_max_bs", "cuda_graph_bs_decode", "cuda_graph_config",
              "disable_cuda_graph")  # fmt: skip
"""SGLang's settings of the decode batches it captures CUDA graphs for: given one, `decode_graphs` leaves them be."""


def decode_graphs(cfg: Config, world: int) -> tuple[Config, list[str]]:
    """SGLang decodes a batch of more requests than its CUDA graphs were captured for without them, several times
    slower, and captures up to 256 on one H100 or H200 (512 from TP 4). Every rank sends up to
    rollout.max_concurrency, a prompt's group to one server: with one of four servers dead, four ranks sent 352 to
    each of the three (docs/benchmarks.md "Soak"). Where that bound, at most 512, passes SGLang's, the servers
    capture graphs for it (the user's own setting wins)."""
    r = cfg.rollout
    if r.engine != "sglang" or r.fleet == "external" or {k.replace("-", "_") for k in r.server_args} & set(GRAPH_ARGS):
        return cfg, []
    live = max(r.num_servers - 1, 1)
    per_rank = min(r.max_concurrency, -(-r.max_concurrency // live) + r.n_samples)  # (a group is not split)
    bound = min(512, world * per_rank)
    if bound <= (512 if r.tp_size >= 4 else 256):
        return cfg, []
    rollout = replace(r, server_args={"cuda_graph_max_bs_decode": bound} | r.server_args)
    line = (f"rollout.server_args cuda_graph_max_bs_decode {bound}: the most requests a server may run with one "
            f"server down ({world} ranks x {r.max_concurrency} over {live}); SGLang decodes more "
            "than its CUDA graphs hold without them")  # fmt: skip
    return replace(cfg, rollout=rollout), [line]


@functools.cache
def count_params(model_dir: str, trust_remote_code: bool) -> int:
    """The model's parameters, counted from its config (nothing is allocated; once a model: seconds at 32B)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    import dsrl.vision  # noqa: F401 -- a vision-language model is a causal LM too

    with init_empty_weights():
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def device_memory(cfg: Config) -> tuple[int, str]:
    """The memory a trainer rank's states and activations live in, and its name: its GPU's, or on CPU its share of
    the host's."""
    if use_cuda(cfg):
        import torch

        return torch.cuda.mem_get_info()[1], "the GPU's"
    return psutil.virtual_memory().total // local_ranks(), "this rank's share of RAM,"


def replicated_base(cfg: Config, model_dir: str) -> tuple[bool, str]:
    """model.lora_base: whether LoRA's frozen base is held whole by every rank, outside ZeRO-3: no gathers, no
    per-layer hooks, only the adapters partitioned (faster: docs/benchmarks.md "LoRA against full"). auto: where the
    base takes at most a third of the device's memory. And why, for the log."""
    replicated, why = cfg.model.lora_base == "replicated", "given"
    if cfg.model.lora_base == "auto":
        base = count_params(model_dir, cfg.model.trust_remote_code) * (2 if bf16(cfg) else 4)  # (a weight's bytes)
        total, name = device_memory(cfg)
        replicated = base <= total / 3
        why = f"{base / 1e9:.1f} GB, {'within' if replicated else 'over'} a third of {name} {total / 1e9:.1f} GB"
    where = (
        "replicated: the frozen base whole on every rank" if replicated else "partitioned: the frozen base in ZeRO-3"
    )
    return replicated, f"model.lora_base {where} ({why})"


def resolve(cfg: Config, model_dir: str) -> tuple[Config, list[str]]:
    """The config with every auto that start-up decides decided (all but trainer.offload_states, which needs the
    trainers: `zero.memory.plan_memory`), and a line per decision for `log_decisions`."""
    t, r, (cuda, in_bf16, packs, engine, fleet) = cfg.trainer, cfg.rollout, _decided(cfg)
    trainer = replace(t, device="cuda" if cuda else "cpu", precision="bf16" if in_bf16 else "fp32",
                      pack_sequences=packs)  # fmt: skip
    rollout = replace(r, engine=engine, fleet=fleet)
    out = replace(cfg, trainer=trainer, rollout=rollout, sync=resolve_sync(cfg))
    lines = [f"{flag} {new}" for flag, old, new in (
        ("trainer.device", t.device, trainer.device), ("trainer.precision", t.precision, trainer.precision),
        ("trainer.pack_sequences", t.pack_sequences, str(trainer.pack_sequences).lower()),
        ("rollout.engine", r.engine, rollout.engine), ("rollout.fleet", r.fleet, rollout.fleet),
        ("sync.type", cfg.sync.type, out.sync.type), ("sync.lora", cfg.sync.lora, out.sync.lora),
        ("sync.senders", cfg.sync.senders, out.sync.senders),
    ) if old == "auto"]  # fmt: skip
    if out.sync.senders == "all" and rollout.fleet != "external":  # (external servers: started with it by their owner)
        args = {"custom_weight_loader": [SHARD_LOADER]} | rollout.server_args
        out = replace(out, rollout=replace(rollout, server_args=args))
    if cfg.sync.bucket_bytes is None:
        lines.append(f"sync.bucket_bytes {out.sync.bucket_bytes >> 20} MiB")
    if t.old_logprobs == "auto":
        one_step = old_from_update(cfg)
        own = "from the update's own forward pass" if one_step else "recomputed before the update"
        lines.append(f"trainer.old_logprobs {own} (one optimizer step a batch: {one_step})")
    a, fp8 = cfg.algorithm, r.precision == "fp8"
    if a.off_policy == "auto":  # FP8 rollouts are off-policy by construction; the correction weights PPO's loss
        tis = fp8 and a.policy_loss == "ppo" and not a.rollout_correction.enabled()  # (which replaces it)
        out = replace(out, algorithm=replace(a, off_policy="tis" if tis else "none"))
        lines.append(f"algorithm.off_policy {out.algorithm.off_policy} (rollout.precision {r.precision})")
    if fp8 and cfg.sync.probe_tolerance is None and cfg.sync.verify == "probe":
        lines.append(f"sync.probe_tolerance {out.sync.probe_tolerance}: allows FP8's rounding (servers FP8, trainer "
                     f"{trainer.precision})")  # fmt: skip
    if cfg.model.lora_rank > 0:
        replicated, why = replicated_base(out, model_dir)
        out = replace(out, model=replace(cfg.model, lora_base="replicated" if replicated else "partitioned"))
        lines.append(why)
    return out, lines


def _decided(cfg: Config) -> tuple[bool, bool, bool, str, str]:
    """The plan's fields that `resolve` writes into the config: cuda, bf16, packs, engine, fleet (none of the costly
    ones: the parameter count, the device's memory)."""
    cuda = use_cuda(cfg)
    packs = p if isinstance(p := cfg.trainer.pack_sequences, bool) else cuda
    return cuda, bf16(cfg), packs, rollout_engine(cfg, cuda), cfg.rollout.fleet_kind


def make_plan(cfg: Config, model_dir: str, world: int = 1) -> Plan:
    """The run's `Plan` from `cfg` and this machine: what the rooms read (a piece built alone gets it here too); its
    fields' docstrings say each rule. `train` makes it from the config `resolve` returns (sync.lora decided)."""
    r, (cuda, in_bf16, packs, engine, fleet), (memory, name) = cfg.rollout, _decided(cfg), device_memory(cfg)
    shared = cuda and r.first_gpu < local_ranks(default=world)  # (a GPU the trainers' too)
    local = fleet == "local" and not cfg.trainer.hostfile  # (with a hostfile each node starts its own: node_fleet.py)
    first = r.placement == "disaggregate" and local and cfg.sync.lora != "adapter" and not shared
    return Plan(cuda=cuda, bf16=in_bf16, packs=packs, old_from_update=old_from_update(cfg),
                engine=engine, fleet=fleet, colocated=r.placement == "colocate", servers_first=first,
                params=count_params(model_dir, cfg.model.trust_remote_code), device_memory=memory, device_name=name,
                replicated_base=cfg.model.lora_rank > 0 and replicated_base(cfg, model_dir)[0])  # fmt: skip


def log_decisions(lines: list[str]) -> None:
    log.info(
        "auto settings, decided at start-up:\n  %s\n  decided later: model.gradient_checkpointing (before each "
        "update), trainer.max_tokens_per_micro_batch (each batch), reward_model.input (with its tokenizer)",
        "\n  ".join(lines) or "none",
    )
