"""Checkpoints during training (DeepSpeed states + dsrl's own), resume, and the final Hugging Face export.

Layout: <run_dir>/checkpoints/step_<N>/ holds DeepSpeed's files, `dsrl_state.json` (step, weight
version, ...), `dsrl_rank<r>.pt` (each rank's RNG and rollout-stream state) and `manifest.json`
(every file's size and SHA-256, written last). A checkpoint is written under a temporary name and
renamed once every rank has finished, and `latest` is replaced atomically, so a crash or a full
disk mid-save never damages the last good one; a file damaged later is found by the manifest at
resume, which then takes the newest complete checkpoint.
"""

import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from dsrl.collectives import reduce_device
from dsrl.config import Config, critic_of_its_own
from dsrl.moe import split_experts
from dsrl.plan import Plan
from dsrl.rundir import (
    WriteError,
    check_export_target,
    free_bytes,
    publish_export,
    report_writes,
    staging_dir,
    write_error,
)
from dsrl.vision import copy_processor
from dsrl.zero.buckets import gathered_buckets
from dsrl.zero.lora import ADAPTER, is_lora, merged

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def save_checkpoint(engine, run_dir: Path, state: dict, rank_state: dict, keep_last: int, critic=None) -> Path:
    """Write step_<state['step']> on every rank (each its partition and `rank_state`; the critic's states
    under critic/), then its manifest, then publish it. A write that fails names its path and cause."""
    root, rank = run_dir / "checkpoints", dist.get_rank()
    final, tmp = root / f"step_{state['step']}", root / f".tmp_step_{state['step']}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash mid-save
    check_space(tmp, [e for e in (engine, critic) if e is not None])
    with report_writes(tmp if rank == 0 else None, f"checkpoint {final}", final):
        try:
            engine.save_checkpoint(str(root), tag=tmp.name, save_latest=False)
            if critic is not None:
                critic.save_checkpoint(str(tmp), tag="critic", save_latest=False)
            rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
            torch.save({**rank_state, "rng": rng}, tmp / f"dsrl_rank{rank}.pt")
            if rank == 0:
                (tmp / "dsrl_state.json").write_text(json.dumps(state))
                if is_lora(engine.module):  # what `dsrl export` needs to merge the adapter: its rank and alpha
                    engine.module.peft_config[ADAPTER].save_pretrained(str(tmp))
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as "basic_ios::clear: iostream error"
            raise write_error(tmp, e) from e
        dist.barrier()
        write_manifest(tmp)
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            latest = root / "latest.tmp"
            latest.write_text(final.name)
            os.replace(latest, root / "latest")
            for old in checkpoints(root)[keep_last:] if keep_last > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
    return final


def check_space(tmp: Path, engines: list) -> None:
    """The checkpoint's room (`check_room`): the optimizer's fp32 master weights and Adam's two moments (12 bytes per
    trained parameter) are nearly all of it. A replicated LoRA base (`engine.replicated_base`) is written whole by
    rank 0, its ZeRO-2 adapters' states split over the ranks."""
    world, params = dist.get_world_size(), [p for e in engines for p in e.module.parameters()]
    mine = 12 * sum(
        p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() / world for p in params if p.requires_grad
    )
    if dist.get_rank() == 0:
        mine += sum(p.numel() * p.element_size() for p in params if not hasattr(p, "ds_tensor"))
    check_room(tmp, mine, "the checkpoint")


def check_room(path: Path, mine: float, what: str) -> None:
    """Fail on every rank, before anything is written, when the disk under `path` cannot hold `what`, the sum of
    every rank's `mine` bytes: one rank failing mid-write would leave the others waiting in a collective. Every rank
    raises the same message, with rank 0's view of the disk."""
    free = (free_bytes(path) or 0) if dist.get_rank() == 0 else 0  # (the sum over ranks: rank 0's)
    sums = torch.tensor([float(mine), float(free)], dtype=torch.float64, device=reduce_device())
    dist.all_reduce(sums)
    need, free = sums[0].item() * 1.05 + (1 << 20), sums[1].item()
    if free < need:
        raise WriteError(
            f"cannot write {path}: no space left on the device ({free / 1e6:.1f} MB free, {what} needs "
            f"about {need / 1e6:.1f} MB)",
            errno.ENOSPC,
        )


def warn_disk_room(cfg: Config, plan: Plan) -> None:
    """At start-up (rank 0): a warning when the run directory's disk cannot hold what the run will write there, its
    checkpoints (`check_space`'s count; `keep_last` of them, and the next while it is written) and the final export,
    so that a full disk is known before the training, not at its end (a 7B run's export met one after its last step)."""
    if dist.get_rank() != 0:
        return
    logs, steps, params = cfg.logging, cfg.trainer.total_steps, plan.params
    trained = 0 if cfg.model.lora_rank > 0 else params * (2 if critic_of_its_own(cfg) else 1)  # (LoRA: adapters)
    saved = steps // logs.save_every if logs.save_every else 0
    at_once = min(saved, logs.keep_last + 1) if logs.keep_last else saved
    checkpoint, export = 12 * trained * 1.05, params * plan.weight_bytes if logs.export_hf else 0
    need, free = at_once * checkpoint + export, free_bytes(Path(logs.run_dir))
    if free is None or need <= free:
        return
    log.warning(
        "the run directory's disk (%s) has %.1f GB free, and this run writes about %.1f GB there: %d checkpoint(s) of "
        "%.1f GB on it at once (logging.save_every, logging.keep_last) and the final export, %.1f GB "
        "(logging.export_hf). A full disk stops the run at that write: free space, or set logging.run_dir on a "
        "larger disk", logs.run_dir, free / 1e9, need / 1e9, at_once, checkpoint / 1e9, export / 1e9,
    )  # fmt: skip


def checkpoints(root: Path) -> list[Path]:
    """The published checkpoints under `root`, newest first."""
    return sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: -int(p.name.split("_")[1]))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(tmp: Path) -> None:
    """Every file's size and SHA-256, written last (the ranks hash a share of the files each)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [None]
    if rank == 0:
        box = [sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file() and p.name != MANIFEST)]
    dist.broadcast_object_list(box, src=0)
    mine = {f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in box[0][rank::world]}
    shares = [None] * world
    dist.all_gather_object(shares, mine)
    if rank == 0:
        entries = {f: e for share in shares for f, e in share.items()}
        try:
            (tmp / MANIFEST).write_text(json.dumps({"files": dict(sorted(entries.items()))}, indent=1))
        except OSError as e:
            raise write_error(tmp / MANIFEST, e) from e


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be used (a file missing, short or changed since it was written),
    or None; every rank checks a share of its files and they agree. A checkpoint written before manifests
    existed is taken as it is."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problem = None
    if not (path / "dsrl_state.json").is_file():
        problem = "no dsrl_state.json"
    elif (path / MANIFEST).is_file():
        try:
            manifest = json.loads((path / MANIFEST).read_text())["files"]
        except (ValueError, KeyError) as e:
            manifest, problem = {}, f"its {MANIFEST} is unreadable ({e})"
        for name in sorted(manifest)[rank::world]:
            file, want = path / name, manifest[name]
            if not file.is_file():
                problem = f"{name} is missing"
            elif file.stat().st_size != want["bytes"]:
                problem = f"{name} has {file.stat().st_size} bytes, {want['bytes']} when it was written"
            elif _sha256(file) != want["sha256"]:
                problem = f"{name} has changed since it was written (its checksum differs)"
            if problem:
                break
    problems = [None] * world
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def find_checkpoint(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint to resume from, verified against its manifest (every rank joins): `auto` = the latest
    under <run_dir>/checkpoints, or, when it is damaged, the newest complete one (with a warning naming
    both); `never`; or a path, which must be complete."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / "dsrl_state.json").is_file():
            raise FileNotFoundError(f"--logging.resume={resume!r}: not a dsrl checkpoint (no dsrl_state.json)")
        problem = checkpoint_problem(path)
        if problem:
            raise CheckpointError(f"--logging.resume={resume!r}: the checkpoint is damaged: {problem}")
        return path
    root = run_dir / "checkpoints"
    latest_file = root / "latest"
    if not latest_file.is_file():
        return None
    latest = root / latest_file.read_text().strip()
    damaged = []
    for path in [latest] + [p for p in checkpoints(root) if p != latest]:
        problem = checkpoint_problem(path) if path.is_dir() else "it is missing"
        if problem is None:
            if damaged:
                log.warning("the latest checkpoint %s cannot be used (%s): resuming from %s instead",
                            latest, damaged[0][1], path)  # fmt: skip
            return path
        damaged.append((path, problem))
    raise CheckpointError(
        "no checkpoint to resume from is complete: "
        + "; ".join(f"{p}: {why}" for p, why in damaged)
        + " (--logging.resume never starts over, leaving them as they are)"
    )


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected."""


def load_checkpoint(engine, path: Path, critic=None) -> tuple[dict, dict]:
    """Restore DeepSpeed states (the critic's too) and this rank's RNG; return (the run state, this rank's state)."""
    for name, eng, root, tag in [("actor", engine, path.parent, path.name), ("critic", critic, path, "critic")]:
        if eng is None:
            continue
        if name == "critic" and not (path / "critic").is_dir():
            raise RuntimeError(f"{path} holds no critic: it was written by a run without one (--algorithm.advantage)")
        load_path, _ = eng.load_checkpoint(
            str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load the {name} from the checkpoint in {path}")
    rank_state = torch.load(path / f"dsrl_rank{dist.get_rank()}.pt", weights_only=False)
    torch.set_rng_state(rank_state["rng"]["torch"])
    random.setstate(rank_state["rng"]["python"])
    return json.loads((path / "dsrl_state.json").read_text()), rank_state


class ShardWriter:
    """A Hugging Face model directory written shard by shard (safetensors, `shard_bytes` each, with an
    index), so no process holds the whole model: tensors are added as they are gathered or read. It
    is built in a staging directory beside `out` and published when complete: `out` may be new, empty
    or a previous dsrl export (with `overwrite`), never anything else (`rundir.check_export_target`).
    As a context, an export that fails deletes its staging directory (it is this writer's own)."""

    def __init__(self, out: Path, shard_bytes: int = 2 << 30, overwrite: bool = False, source: str = ""):
        check_export_target(out, overwrite)  # before any work: refused at once, not after the gather
        self.out, self.tmp, self.shard_bytes = out, staging_dir(out), shard_bytes
        self.overwrite, self.source = overwrite, source
        self.tmp.mkdir(parents=True)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.files: list[str] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue a tensor; a full shard is written (a failed write names its file: `rundir.write_error`)."""
        self.pending[name] = tensor.detach().contiguous().cpu().clone()
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            file = f"model-{len(self.files) + 1:05d}.safetensors"
            try:
                save_file(self.pending, self.tmp / file, metadata={"format": "pt"})
            except (OSError, RuntimeError, SafetensorError) as e:  # (a full disk: "I/O error: No space left")
                raise write_error(self.tmp / file, e) from e
            self.files.append(file)
            self.weight_map.update(dict.fromkeys(self.pending, file))
            self.total += self.pending_bytes
            self.pending, self.pending_bytes = {}, 0

    def close(self, model_dir: str, config=None) -> None:
        """Write the last shard, the index (or one model.safetensors), config and tokenizer; publish."""
        self._flush()
        if len(self.files) == 1:
            (self.tmp / self.files[0]).rename(self.tmp / "model.safetensors")
        else:
            index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
            (self.tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        (config or AutoConfig.from_pretrained(model_dir)).save_pretrained(self.tmp)
        with contextlib.suppress(OSError):
            GenerationConfig.from_pretrained(model_dir).save_pretrained(self.tmp)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(self.tmp)
        copy_processor(model_dir, self.tmp)  # (a vision-language model's image processor)
        publish_export(self.tmp, self.out, self.source, self.overwrite)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, failed, *_) -> None:
        if failed is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def export_hf(module, tokenizer_dir: str, out_dir: Path, bucket_bytes: int) -> None:
    """Gather the weights bucket by bucket and write a transformers- and SGLang-loadable model directory;
    rank 0 writes each shard once it is full, so it never holds the whole model. Every rank joins. The
    run's own export: it replaces a previous dsrl export there (a resumed run's), nothing else."""
    size = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in module.parameters())
    check_room(out_dir.parent, size if dist.get_rank() == 0 else 0, "the export")  # rank 0 writes it all
    writer = ShardWriter(out_dir, overwrite=True, source="the run's final weights") if dist.get_rank() == 0 else None
    with writer or contextlib.nullcontext(), report_writes(writer and writer.tmp, f"export to {out_dir}", out_dir):
        for bucket in gathered_buckets(module, bucket_bytes):
            for name, tensor in bucket if writer is not None else []:
                writer.add(name, tensor)
        if writer is not None:
            writer.close(tokenizer_dir, module.config)
    dist.barrier()


def export_checkpoint(
    checkpoint: Path, model_dir: str, out: Path, shard_bytes: int = 2 << 30, overwrite: bool = False
) -> None:
    """A training checkpoint (any number of ranks) as a Hugging Face model directory, in the model's dtype.
    DeepSpeed's partitions are read lazily, a parameter at a time (`zero_to_fp32`'s lazy mode), and
    written in shards."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    config = AutoConfig.from_pretrained(model_dir)
    dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with ShardWriter(out, shard_bytes, overwrite, source=str(checkpoint)) as writer:
        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name, lazy_mode=True)
        lora = checkpoint / "adapter_config.json"
        if lora.is_file():
            tensors = merged_adapters(state, json.loads(lora.read_text()), writer.tmp / "adapter")
        else:
            tensors = state.items()
        with report_writes(writer.tmp, f"export of {checkpoint} to {out}", out):
            for name, tensor in split_experts((name, tensor.contiguous()) for name, tensor in tensors):
                writer.add(name, tensor.to(dtype))
            writer.close(model_dir, config)


def merged_adapters(state, adapter: dict, adapter_dir: Path):
    """A LoRA checkpoint's fp32 state (PEFT's names) as the base model's weights with the adapters merged,
    W + alpha / r * B @ A, under the base names; the adapter itself is written to `adapter_dir` as PEFT
    saves it (loadable with `PeftModel.from_pretrained`)."""
    prefix, scale = "base_model.model.", adapter["lora_alpha"] / adapter["r"]
    # (lazy: read them) the actor's adapter; a critic's adapter and value head (`PolicyAndValue`) are not exported
    lora = {name: state[name].contiguous() for name in state.keys() if ".lora_" in name and f".{ADAPTER}." in name}
    adapter_dir.mkdir(parents=True)
    (adapter_dir / "adapter_config.json").write_text(json.dumps(adapter, indent=2))
    peft_names = {name.replace(f".{ADAPTER}.", "."): tensor for name, tensor in lora.items()}
    save_file(peft_names, adapter_dir / "adapter_model.safetensors")
    for name in state.keys():
        if ".lora_" in name or not name.startswith(prefix):  # adapters (written above), a critic's value head
            continue
        tensor = state[name].contiguous()
        if ".base_layer." in name:
            layer = name.split(".base_layer.")[0]
            a, b = f"{layer}.lora_A.{ADAPTER}.weight", f"{layer}.lora_B.{ADAPTER}.weight"
            if name.endswith(".weight") and a in lora:
                tensor = merged(tensor, lora[a], lora[b], scale)
            name = name.replace(".base_layer.", ".")
        yield name.removeprefix(prefix), tensor
