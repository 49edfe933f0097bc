"""Run by test_parity.py under the deepspeed launcher (1, 2 and 4 CPU ranks): one fixed batch, one update, every layout.

The batch (`batch`) is 8 groups of 2 samples with long-tail lengths (1 to 40 response tokens), two of them agent
episodes whose environment tokens are masked out of the loss. It goes through `Trainer.logprobs` and `Trainer.update`
as a run's batch does, each rank holding its share of whole groups (unequal token totals). For each family (the full
model, LoRA) and estimator (GRPO; GAE with a critic), one trainer per row layout (padded, packed) runs the update three
times (`LAYOUTS`: two token budgets, gradient checkpointing off and on), restored to its first state before each
(`Restorer`); on 4 ranks (slow on 2 cores), one trainer per family and estimator (GRPO packed, GAE padded) runs the
last. Rank 0 writes, per layout: the loss and the grad norm as the run's metrics give them
(`reduce_across_ranks`), and every trained parameter and its gradient (before the optimizer's step), gathered."""

import itertools
import sys
import zlib

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad, safe_set_full_fp32_param
from transformers.modeling_layers import GradientCheckpointingLayer

from dsrl.auto import make_plan, use_cuda
from dsrl.config import AlgorithmConfig, Config, DataConfig, ModelConfig, RolloutConfig
from dsrl.data import Prompt, Sample
from dsrl.metrics import reduce_across_ranks
from dsrl.tasks.toy import build_tokenizer
from dsrl.zero.engine import init_distributed
from dsrl.zero.trainer import Trainer

RESPONSES = [1, 40, 2, 3, 24, 2, 5, 1, 3, 16, 4, 11, 8, 4, 6, 3]
"""Response lengths, a long tail, in batch order (pairs are groups): on 2 ranks 78 and 55 tokens, on 4 ranks 46, 32,
34 and 21 (fewer to the loss: the episodes' environment tokens)."""
EPISODES = {1: [(9, 17), (25, 29)], 9: [(4, 8)]}
"""Samples that are agent episodes: the spans of the environment's tokens in the response (masked out of the loss)."""
BUDGETS = (24, 160)
"""trainer.max_tokens_per_micro_batch: one below the longest sample, which goes alone (one rank's batch takes 8
micro-batches packed, 10 padded), and one that holds a rank's share in 1 to 3."""
LAYOUTS = ((BUDGETS[1], False), (BUDGETS[0], False), (BUDGETS[0], True))
"""(token budget, gradient checkpointing) of the updates each trainer runs: the first is the reference."""
METRICS = ("actor/pg_loss", "actor/grad_norm", "critic/value_loss", "critic/grad_norm")


def batch() -> list[Sample]:
    gen = torch.Generator().manual_seed(7)
    samples = []
    for i, n in enumerate(RESPONSES):
        prompt = Prompt(i // 2, torch.randint(2, 12, (2 + i // 2 % 4,), generator=gen).tolist() + [12], "", None)
        ids = torch.randint(2, 14, (n,), generator=gen).tolist()
        mask = [int(not any(a <= t < b for a, b in EPISODES[i])) for t in range(n)] if i in EPISODES else None
        logprobs = [-0.5 * m for m in mask or [1] * n]  # (the engine's: 0 where the environment wrote)
        samples.append(Sample(prompt, ids, logprobs, "stop", 0, round(i * 0.37 % 1, 2), mask, spans=[(0, 0)]))
    return samples


def config(model_dir: str, lora: bool, advantage: str, packed: bool) -> Config:
    cfg = Config(
        model=ModelConfig(path=model_dir, lora_rank=4 if lora else 0, gradient_checkpointing=True),
        data=DataConfig(train_path="unused"),
        rollout=RolloutConfig(prompts_per_step=8, n_samples=2, max_new_tokens=40),
        algorithm=AlgorithmConfig(advantage=advantage),
    )
    cfg.trainer.pack_sequences, cfg.trainer.lr, cfg.critic.lr = packed, 1e-3, 1e-3
    return cfg


def trained(engine) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def gathered(engine) -> dict[str, torch.Tensor]:
    """Every trained parameter whole (a collective)."""
    named = trained(engine)
    with deepspeed.zero.GatheredParameters([p for _, p in named if hasattr(p, "ds_id")], modifier_rank=None):
        return {n: p.detach().clone() for n, p in named}


class Restorer:
    """An engine put back to a state after each update: its trained parameters (the model's copy and the optimizer's
    fp32 one), Adam's moments and step, and the learning rate. The parameters the checkpoint has not (LoRA's
    adapters, the critic's head) are first set from their names, the same on any number of ranks."""

    def __init__(self, engine):
        self.engine = engine
        start = gathered(engine)
        for name, value in start.items():
            if "lora_" in name or "value_head" in name or name.startswith("score"):
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                start[name] = torch.randn(value.shape, generator=gen) * 0.1  # (LoRA's B is 0: its A would get none)
        self.start = start
        self.set_weights()
        inner = engine.optimizer.optimizer
        self.state = {key: {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
                      for key, state in inner.state.items()}  # fmt: skip
        self.lrs = [g["lr"] for g in engine.optimizer.param_groups]
        self.schedule = engine.lr_scheduler.state_dict()

    def set_weights(self) -> None:
        for name, p in trained(self.engine):
            with deepspeed.zero.GatheredParameters([p] if hasattr(p, "ds_id") else [], modifier_rank=0):
                p.data.copy_(self.start[name])
            if not hasattr(p, "ds_id"):
                safe_set_full_fp32_param(p, self.start[name])
                continue
            # ZeRO-3's own setter fails on a padded partition: this rank's share of the optimizer's fp32 copy
            part, _ = self.engine.optimizer._get_fp32_opt_state_partition(p, release_swap_buffers=False)
            value = torch.nn.functional.pad(self.start[name].flatten(), (0, part.numel() * dist.get_world_size()))
            part.data.copy_(value[dist.get_rank() * part.numel() :][: part.numel()])

    def __call__(self) -> None:
        self.set_weights()
        inner = self.engine.optimizer.optimizer
        for key in list(inner.state):
            if key not in self.state:
                del inner.state[key]
        for key, saved in self.state.items():
            for s, v in saved.items():
                if torch.is_tensor(v):
                    inner.state[key][s].copy_(v)
                else:
                    inner.state[key][s] = v
        for group, lr in zip(self.engine.optimizer.param_groups, self.lrs):
            group["lr"] = lr
        self.engine.lr_scheduler.load_state_dict(self.schedule)


def update_once(trainer: Trainer, rank: int, world: int) -> dict:
    """`batch`'s update on this rank's share; rank 0 gets the layout's figures."""
    samples = batch()
    mine = samples[rank * len(samples) // world : (rank + 1) * len(samples) // world]
    grads = {}
    for i, engine in enumerate(trainer.engines):  # each engine's gradients, reduced, before its optimizer step

        def step(engine=engine, i=i, step=engine.step):
            if engine.is_gradient_accumulation_boundary():
                grads.update({f"{i}:{n}": safe_get_full_grad(p) for n, p in trained(engine)})
            step()

        engine.step = step
    stats = trainer.update(mine, step=0, finite=trainer.logprobs(mine, step=0))
    for engine in trainer.engines:
        del engine.step
    stats = reduce_across_ranks({k: stats[k] for k in METRICS if k in stats})
    weights = {f"{i}:{n}": t for i, e in enumerate(trainer.engines) for n, t in gathered(e).items()}
    return {"metrics": stats, "weights": weights, "grads": grads} if rank == 0 else {}


def main(model_dir: str, out: str) -> None:
    init_distributed(use_cuda(config(model_dir, False, "grpo", False)))
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = build_tokenizer()
    results = {}
    for lora, advantage, packed in itertools.product((False, True), ("grpo", "gae"), (False, True)):
        if world == 4 and packed != (advantage == "grpo"):  # (4 ranks on 2 cores are slow: one trainer, one update)
            continue
        cfg = config(model_dir, lora, advantage, packed)
        trainer = Trainer(cfg, make_plan(cfg, model_dir, world), model_dir, world, tokenizer)
        restore = [Restorer(e) for e in trainer.engines]
        for budget, checkpointing in LAYOUTS[-1:] if world == 4 else LAYOUTS:
            for r in restore:
                r()
            for layer in (m for e in trainer.engines for m in e.module.modules()):
                if isinstance(layer, GradientCheckpointingLayer):  # (as `AutoCheckpointing.switch`)
                    layer.gradient_checkpointing = checkpointing
            cfg.trainer.max_tokens_per_micro_batch = budget
            key = ("lora" if lora else "full", advantage, "packed" if packed else "padded", budget, checkpointing)
            results[key] = update_once(trainer, rank, world)
        del trainer, restore
    if rank == 0:
        torch.save({"world": world, "results": results}, out)
    dist.destroy_process_group()  # (joins gloo's threads: _lora_worker.py)


if __name__ == "__main__":
    main(*sys.argv[1:])
