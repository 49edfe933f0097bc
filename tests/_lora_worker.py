"""Run by test_lora.py under the deepspeed launcher (2 CPU ranks, and 1): the LoRA actor, and the actor and critic
adapters on one base (PPO), as `load_engine` builds them (the base partitioned by ZeRO-3 with its decoder layers
gathered whole, and the base replicated with ZeRO-2 adapters), against a plain PEFT model with the same adapters.
Each rank trains on its own batch; the plain model's loss is the mean of the ranks'. Writes, per case, the largest
differences of the adapters' gradients, the policy and the reference (adapters off)."""

import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import get_z3_leaf_modules, safe_get_full_grad
from transformers import AutoModelForCausalLM
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from dsrl.auto import make_plan, use_cuda
from dsrl.config import AlgorithmConfig, Config, DataConfig, ModelConfig
from dsrl.zero.engine import add_lora, init_distributed, load_engine
from dsrl.zero.lora import reference_off


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def losses(model, ids: torch.Tensor, critic: bool):
    """The critic's loss, then the policy's (as `update_actor_and_critic`: one backward pass each)."""
    if critic:
        yield model(input_ids=ids, values=True).logits.square().mean()
    yield -token_logprobs(model(input_ids=ids).logits, ids).mean()


def run_case(base: str, critic: bool, lora_base: str) -> dict:
    m = ModelConfig(path=base, lora_rank=4, gradient_checkpointing=critic, lora_base=lora_base)  # (critic: replayed)
    cfg = Config(model=m, data=DataConfig(train_path="unused"), algorithm=AlgorithmConfig(advantage="gae"))
    if not critic:
        cfg.algorithm.advantage = "grpo"
    world, rank = dist.get_world_size(), dist.get_rank()
    engine = load_engine(cfg, base, world, train=True, plan=make_plan(cfg, base, world))
    named = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(named.values()), modifier_rank=0):
        torch.manual_seed(1)  # PEFT starts B at 0 (no gradient reaches A): give it values
        for name, p in named.items():
            if "lora_B" in name and (rank == 0 or not hasattr(p, "ds_id")):  # (replicated: every rank sets its own)
                p.data.normal_(0, 0.2)
    unset_hf_deepspeed_config()
    plain = AutoModelForCausalLM.from_pretrained(base)
    plain = add_lora(plain, m, critic, checkpointing=critic).train()
    with deepspeed.zero.GatheredParameters(list(named.values())):
        for name, p in plain.named_parameters():
            p.data.copy_(named[name].data)
    batches = torch.randint(2, 13, (world, 3, 9), generator=torch.Generator().manual_seed(2))
    engine.train()
    for i, loss in enumerate(losses(engine, batches[rank], critic)):
        engine.set_gradient_accumulation_boundary(i == int(critic))  # the last backward pass ends the accumulation
        engine.backward(loss, scale_wrt_gas=False)
    sum(loss for ids in batches for loss in losses(plain, ids, critic)).div(world).backward()
    grads = {n: safe_get_full_grad(named[n]) for n, p in plain.named_parameters() if p.requires_grad}
    engine.eval()
    with torch.no_grad():
        policy = token_logprobs(engine(input_ids=batches[0]).logits, batches[0])
        with reference_off(engine.module):
            reference = token_logprobs(engine(input_ids=batches[0]).logits, batches[0])
        want_policy = token_logprobs(plain(input_ids=batches[0]).logits, batches[0])
        bare = AutoModelForCausalLM.from_pretrained(base)
        want_reference = token_logprobs(bare(input_ids=batches[0]).logits, batches[0])
    plain_grads = dict(plain.named_parameters())
    return {
        "zero3": all(hasattr(p, "ds_id") for p in named.values()),
        "leaves": len(get_z3_leaf_modules(engine.module)),
        "layers": plain.config.num_hidden_layers,
        "trained": sorted(grads),
        "missing": sorted(n for n, g in grads.items() if g is None),
        "grad_diff": max((g - plain_grads[n].grad).abs().max().item() for n, g in grads.items() if g is not None),
        "grad_min_norm": min(plain_grads[n].grad.norm().item() for n in grads),
        "policy_diff": (policy - want_policy).abs().max().item(),
        "reference_diff": (reference - want_reference).abs().max().item(),
        "adapters_change_policy": (policy - reference).abs().max().item(),
    }


def main(base: str, out: str) -> None:
    init_distributed(use_cuda(Config(model=ModelConfig(path=base), data=DataConfig(train_path="unused"))))
    results = {"world": dist.get_world_size()}
    for lora_base in ("partitioned", "replicated"):
        results[f"actor_{lora_base}"] = run_case(base, critic=False, lora_base=lora_base)
        results[f"critic_{lora_base}"] = run_case(base, critic=True, lora_base=lora_base)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()  # (joins gloo's threads: one left to the exit aborted a rank once, in CI's run)


if __name__ == "__main__":
    main(*sys.argv[1:])
