"""What the update keeps on the GPU as its micro-batches go by: one rank, DeepSpeed ZeRO-3, synthetic long-tail samples
(tools/bench_trainer.py's), the update as `dsrl train` runs it (old log-probs from its own forward pass, checkpointing
auto), at several batch sizes. Prints per batch size the update's peak, the micro-batches (their count and largest
tokens), the memory allocated after each micro-batch, and the largest CUDA tensors still alive at the end (issue 60:
the peak should be set by the micro-batch, not the batch).

    python tools/update_memory.py --model /tmp/models/1.5b --samples 64 256      # one GPU
"""

import argparse
import gc
import os
from collections import Counter

import torch

from dsrl.auto import make_plan, use_cuda
from dsrl.config import Config, DataConfig, ModelConfig
from dsrl.zero.actor import trainer_micro_batches, update_actor
from dsrl.zero.engine import init_distributed, load_engine
from tools.bench_trainer import synthetic


def live_cuda_tensors(top: int = 8) -> list[str]:
    """The largest CUDA tensors the Python heap still references (shape, dtype, how many, GB)."""
    seen = Counter()
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.is_cuda and obj.numel() > 1 << 20:
            seen[(tuple(obj.shape), obj.dtype, obj.element_size())] += 1
    sizes = sorted(((n * torch.Size(s).numel() * width, s, d, n) for (s, d, width), n in seen.items()), reverse=True)
    return [f"{list(s)} {d} x{n} = {b / 1e9:.2f} GB" for b, s, d, n in sizes[:top]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--samples", type=int, nargs="+", default=[64, 256, 64], help="(the first allocates Adam's states)")
    p.add_argument("--max-len", type=int, default=1024, help="Longest response (the tail workload's cap).")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--budget", type=int, default=16384, help="--trainer.max_tokens_per_micro_batch")
    args = p.parse_args()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29535")
    cfg = Config(model=ModelConfig(path=args.model), data=DataConfig(train_path="unused.jsonl"))
    cfg.trainer.max_tokens_per_micro_batch, cfg.trainer.lr = args.budget, 1e-6
    cfg.rollout.max_new_tokens, cfg.rollout.n_samples = args.max_len, 1
    init_distributed(use_cuda(cfg))
    engine = load_engine(cfg, args.model, 1, train=True, plan=make_plan(cfg, args.model, 1))
    vocab = engine.module.config.vocab_size
    steps = []
    original_step = engine.step

    def step():  # after each micro-batch's backward pass
        original_step()
        torch.cuda.synchronize()
        steps.append(torch.cuda.memory_allocated() / 1e9)

    engine.step = step
    for n in args.samples:
        cfg.rollout.prompts_per_step = n
        samples = synthetic(n, "longtail", args.max_len, vocab, args.prompt_len, seed=n)
        chunks = trainer_micro_batches(engine, samples, cfg)
        largest = max(sum(len(s.prompt.prompt_ids) + len(s.response_ids) for s in c) for c in chunks)
        steps.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 1e9
        update_actor(engine, samples, cfg, pad_id=0, kl_coef=0.0)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 1e9
        print(
            f"samples {n}: update peak {peak:.2f} GB, allocated before {before:.2f} GB, {len(chunks)} micro-batches "
            f"(largest {largest} tokens); allocated after each: {', '.join(f'{a:.2f}' for a in steps)}",
            flush=True,
        )
        del samples
        gc.collect()
        print(f"  alive after it: {torch.cuda.memory_allocated() / 1e9:.2f} GB; largest tensors: "
              f"{'; '.join(live_cuda_tensors()) or 'none over 1M elements'}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
