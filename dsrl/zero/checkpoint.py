"""Checkpoints during training (DeepSpeed states + dsrl's own), resume, and the final Hugging Face export.

Layout: <run_dir>/checkpoints/step_<N>/ holds DeepSpeed's files, `dsrl_state.json` (step, weight
version, ...) and `dsrl_rank<r>.pt` (each rank's RNG and rollout-stream state). A checkpoint is
written under a temporary name and renamed once every rank has finished, and `latest` is
replaced atomically, so a crash or a full disk mid-save never damages the last good one.
"""

import json
import logging
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from dsrl.zero.buckets import gathered_buckets

log = logging.getLogger(__name__)


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(engine, run_dir: Path, state: dict, rank_state: dict, keep_last: int, critic=None) -> Path:
    """Write step_<state['step']> on every rank (each its partition and `rank_state`; the critic's states
    under critic/), then publish it."""
    root, rank = checkpoint_dir(run_dir), dist.get_rank()
    final, tmp = root / f"step_{state['step']}", root / f".tmp_step_{state['step']}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash mid-save
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tmp.name, save_latest=False)
    if critic is not None:
        critic.save_checkpoint(str(tmp), tag="critic", save_latest=False)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    torch.save({**rank_state, "rng": rng}, tmp / f"dsrl_rank{rank}.pt")
    if rank == 0:
        (tmp / "dsrl_state.json").write_text(json.dumps(state))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        latest = root / "latest.tmp"
        latest.write_text(final.name)
        os.replace(latest, root / "latest")
        steps = sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))
        for old in steps[: max(0, len(steps) - keep_last)] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def find_checkpoint(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint to resume from: `auto` = <run_dir>/checkpoints/latest if any, `never`, or a path."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / "dsrl_state.json").is_file():
            raise FileNotFoundError(f"--logging.resume={resume!r}: not a dsrl checkpoint (no dsrl_state.json)")
        return path
    latest = checkpoint_dir(run_dir) / "latest"
    if not latest.is_file():
        return None
    path = checkpoint_dir(run_dir) / latest.read_text().strip()
    return path if (path / "dsrl_state.json").is_file() else None


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
    is built under <out>.tmp and renamed when complete."""

    def __init__(self, out: Path, shard_bytes: int = 2 << 30):
        self.out, self.tmp, self.shard_bytes = out, out.with_name(out.name + ".tmp"), shard_bytes
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.files: list[str] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor.detach().contiguous().cpu().clone()
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            file = f"model-{len(self.files) + 1:05d}.safetensors"
            save_file(self.pending, self.tmp / file, metadata={"format": "pt"})
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
        try:
            GenerationConfig.from_pretrained(model_dir).save_pretrained(self.tmp)
        except OSError:
            pass
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(self.tmp)
        shutil.rmtree(self.out, ignore_errors=True)
        self.tmp.rename(self.out)


def export_hf(module, tokenizer_dir: str, out_dir: Path, bucket_bytes: int) -> None:
    """Gather the weights bucket by bucket and write a transformers- and SGLang-loadable model directory;
    rank 0 writes each shard once it is full, so it never holds the whole model. Every rank joins."""
    writer = ShardWriter(out_dir) if dist.get_rank() == 0 else None
    for bucket in gathered_buckets(module, bucket_bytes):
        for name, tensor in bucket if writer is not None else []:
            writer.add(name, tensor)
    if writer is not None:
        writer.close(tokenizer_dir, module.config)
        log.info("exported the trained model to %s", out_dir)
    dist.barrier()


def export_checkpoint(checkpoint: Path, model_dir: str, out: Path, shard_bytes: int = 2 << 30) -> None:
    """A training checkpoint (any number of ranks) as a Hugging Face model directory, in the model's dtype.
    DeepSpeed's partitions are read lazily, a parameter at a time (`zero_to_fp32`'s lazy mode), and
    written in shards."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    config = AutoConfig.from_pretrained(model_dir)
    dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name, lazy_mode=True)
    writer = ShardWriter(out, shard_bytes)
    for name, tensor in state.items():
        writer.add(name, tensor.contiguous().to(dtype))
    writer.close(model_dir, config)
