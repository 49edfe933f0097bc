"""DeepSpeed checkpoints during training and the final Hugging Face export."""

import logging
import shutil
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoTokenizer

from dsrl.zero.buckets import gathered_buckets

log = logging.getLogger(__name__)


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(engine, run_dir: Path, step: int, client_state: dict) -> Path:
    """DeepSpeed checkpoint at <run_dir>/checkpoints/step_<step> (every rank writes its partition)."""
    tag = f"step_{step}"
    engine.save_checkpoint(str(checkpoint_dir(run_dir)), tag=tag, client_state=client_state)
    return checkpoint_dir(run_dir) / tag


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
