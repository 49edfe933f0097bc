"""Disk transport: write the gathered weights as safetensors, then /update_weights_from_disk.

The fallback when no broadcast group can form (servers on other machines without a reachable
port). The directory must be readable by every server at the same path.
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsrl.config import SyncConfig
from dsrl.serving.client import RolloutClient
from dsrl.sync.base import Transport
from dsrl.zero.buckets import gathered_buckets


class DiskTransport(Transport):
    def __init__(self, cfg: SyncConfig, client: RolloutClient, root: Path):
        super().__init__(cfg, client, root)
        self.previous: Path | None = None

    def send(self, module: torch.nn.Module, weight_version: int, flush_cache: bool) -> int:
        if not self.rank0:
            for _ in gathered_buckets(module, self.cfg.bucket_bytes, self.merge):  # join the gathers
                pass
            return 0
        out = self.root / f"version_{weight_version}"
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        sent, index = 0, {}
        for i, bucket in enumerate(gathered_buckets(module, self.cfg.bucket_bytes, self.merge, self.fp8)):
            file = f"model-{i:05d}.safetensors"
            tensors = {name: t.detach().contiguous().cpu() for name, t in bucket}
            save_file(tensors, tmp / file, metadata={"format": "pt"})
            index.update(dict.fromkeys(tensors, file))
            sent += sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)  # servers never see a half-written version
        payload = {"model_path": str(out.resolve()), "weight_version": str(weight_version), "flush_cache": flush_cache}
        self.client.run(self.client.all_servers("/update_weights_from_disk", payload))
        if self.previous is not None and self.previous != out:
            shutil.rmtree(self.previous, ignore_errors=True)
        self.previous = out
        return sent
