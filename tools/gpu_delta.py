"""How much of a model's bf16 words a real optimizer step changes, and what --sync.delta's encode costs on the GPU
(issue 86): a random-init model of a tools/gpu_models.py shape on one GPU, bf16 weights from fp32 masters, AdamW at
dsrl's defaults (lr 1e-6, betas 0.9/0.999, no weight decay), next-token loss on random tokens; after every step the
shard transport's own `_encode` (dsrl/sync/shards.py: the diff against the pinned host snapshot, the positions and
values, the checksum) runs over every bucket, timed, as one trainer rank holding the whole model would.

    python tools/gpu_delta.py --model 1.5b 7b --steps 10     # one line a step, then a summary line a model

The first step's encode is the full send (the snapshot's copy); the rest are deltas. Adam's per-element steps stay near
lr early on, so the fraction depends on lr and on the steps taken; the moments here start at zero as in a run's start.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from gpu_models import SHAPES  # noqa: E402

from dsrl.config import SyncConfig  # noqa: E402
from dsrl.sync.shards import ShardTransport  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: to try it here, slowly)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def measure(size: str, steps: int, lr: float, batch: int, length: int) -> dict:
    hidden, inter, layers, heads, kv = SHAPES[size]
    config = Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(DEVICE):  # (initialised there: 7B's random init on the host took minutes)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float() for p in params]
    moments = [(torch.zeros_like(m), torch.zeros_like(m)) for m in masters]
    sender = ShardTransport.__new__(ShardTransport)  # (only its plan and encode: no servers, no groups)
    bucket = 1 << 30 if DEVICE == "cuda" else 256 << 20  # (auto's bucket_bytes)
    sender.cfg, sender.bucket_bytes, sender.sums = SyncConfig(delta=True, senders="all", bucket_bytes=bucket), None, {}
    sender._plan(model)
    rows = []
    for step in range(steps + 1):
        if step:  # one AdamW step from the fp32 masters (moment by moment: no second copy of the gradients)
            tokens = torch.randint(0, config.vocab_size, (batch, length), device=DEVICE)
            model(input_ids=tokens, labels=tokens).loss.backward()
            b1, b2 = 0.9, 0.999
            for p, m, (avg, sq) in zip(params, masters, moments):
                g = p.grad.float()
                p.grad = None
                avg.mul_(b1).add_(g, alpha=1 - b1)
                sq.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (sq / (1 - b2**step)).sqrt_().add_(1e-8)
                m.addcdiv_(avg, denom, value=-lr / (1 - b1**step))
                p.data.copy_(m)
                del g, denom
        sync()
        start, changed, words, sent = time.perf_counter(), 0, 0, 0
        for i in range(len(sender.words)):
            tensors, k, n = sender._encode(i, full=step == 0)
            changed, words, sent = changed + k, words + n, sent + sum(t.numel() * t.element_size() for t in tensors)
        sync()
        row = {"model": size, "step": step, "full": step == 0, "changed_frac": changed / words,
               "encode_s": time.perf_counter() - start, "sent_gb": sent / 1e9, "full_gb": 2 * words / 1e9}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    deltas = rows[1:]
    summary = {
        "model": size, "words": words, "buckets": len(sender.words), "steps": steps, "lr": lr,
        "changed_frac": [round(r["changed_frac"], 5) for r in deltas],
        "encode_s_full": round(rows[0]["encode_s"], 3),
        "encode_s_delta_median": round(sorted(r["encode_s"] for r in deltas)[len(deltas) // 2], 3),
        "sent_gb_delta_median": round(sorted(r["sent_gb"] for r in deltas)[len(deltas) // 2], 4),
        "full_gb": round(rows[0]["full_gb"], 3),
        "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if DEVICE == "cuda" else None,
    }  # fmt: skip
    print("summary", json.dumps(summary), flush=True)
    del model, params, masters, moments, sender
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    store = tempfile.NamedTemporaryFile()
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)  # (_plan asks the rank)
    results = []
    for size in args.model:
        try:
            results.append(measure(size, args.steps, args.lr, args.batch, args.length))
        except torch.OutOfMemoryError as e:
            print(f"{size}: out of GPU memory ({str(e).splitlines()[0]})", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
