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
from transformers import AutoTokenizer

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


def export_hf(module, tokenizer_dir: str, out_dir: Path, bucket_bytes: int) -> None:
    """Gather the full weights and write a transformers-loadable model (safetensors + config + tokenizer).

    Every rank joins the gathers; rank 0 writes, to a temporary directory renamed at the end.
    """
    state = {}
    for bucket in gathered_buckets(module, bucket_bytes):
        if dist.get_rank() == 0:
            state.update({name: t.detach().cpu().clone() for name, t in bucket})
    if dist.get_rank() == 0:
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        module.config.save_pretrained(tmp)
        if module.generation_config is not None:
            module.generation_config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
        log.info("exported the trained model to %s", out_dir)
    dist.barrier()
