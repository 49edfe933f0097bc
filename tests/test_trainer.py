"""The trainer's batches: micro-batches by tokens, packed without padding, log-probs in chunks. Each is held
to the computation it replaced (right-padded rows, the full fp32 log-softmax): values and gradients equal
to fp32 rounding. The ZeRO-3 gradient over two ranks with unequal micro-batch counts is in test_sync.py."""

import json
import logging
import math
import os
import random
import subprocess
import sys
from dataclasses import astuple
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from dsrl.data import Prompt, Sample
from dsrl.plan import Plan
from dsrl.tasks import toy
from dsrl.zero import actor, varlen
from dsrl.zero.actor import forward_logprobs
from dsrl.zero.batches import MICRO_BATCH_COST, MicroBatch, micro_batches, plan, plan_rows, split_to
from tests.conftest import ROOT


def gpu_plan(memory: float = 0, params: float = 0, colocated: bool = True, cuda: bool = True) -> Plan:
    """A run's plan on a GPU of `memory` bytes (fake: there is none here), for a model of `params` parameters."""
    return Plan(cuda=cuda, bf16=cuda, packs=cuda, old_from_update=False, engine="sglang", fleet="local",
                colocated=colocated, servers_first=False, params=int(params), device_memory=int(memory),
                device_name="the GPU's", replicated_base=False)  # fmt: skip


def samples(seed: int, n: int = 6) -> list[Sample]:
    """Long-tail lengths: most responses short, a few long; prompts of 2-4 tokens (toy vocabulary)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(2, 13) for _ in range(rng.randint(2, 4))]
        length = rng.choice([1, 2, 3, 3, 5, 20])
        out.append(Sample(Prompt(i, prompt, "", None), [rng.randrange(2, 13) for _ in range(length)], [], "stop", 0))
    return out


def padded_reference(model, batch: list[Sample], temperature: float):
    """The old computation: right-padded rows, the full fp32 log-softmax, response-aligned afterwards."""
    seqs = [s.prompt.prompt_ids + s.response_ids for s in batch]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)], attention[i, : len(seq)] = torch.tensor(seq), 1
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    token = logp.gather(-1, ids[:, 1:, None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    longest = max(len(s.response_ids) for s in batch)
    out_lp, out_ent = torch.zeros(len(batch), longest), torch.zeros(len(batch), longest)
    for i, s in enumerate(batch):
        start, n = len(s.prompt.prompt_ids) - 1, len(s.response_ids)
        out_lp[i, :n], out_ent[i, :n] = token[i, start : start + n], entropy[i, start : start + n]
    return out_lp, out_ent


def test_entropy_of_uniform_logits():
    _, entropy = actor.token_logprobs(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), 1.0)
    assert entropy.tolist() == pytest.approx([math.log(8)] * 2)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(toy.build_model_config())
    for p in m.parameters():  # logits with some spread: entropies and gradients worth comparing
        p.data.normal_(std=0.3)
    return m


@pytest.mark.parametrize("layout", ["varlen", "packed", "padded", "padded-varlen"])
def test_chunked_logprobs_equal_the_full_log_softmax_values_and_gradients(model, monkeypatch, layout):
    """Packed rows (positions restarting per sample) and only the response positions' logits, their fp32
    log-softmax three positions at a time, recomputed in the backward pass: the same logprobs, entropies
    and parameter gradients as the padded full [B, T, V] computation. varlen: packed under dsrl's attention
    (`dsrl/zero/varlen.py`), the sequences' boundaries passed down, no mask: on CPU each sequence through sdpa
    alone, one call per sequence and layer; packed: under sdpa, with transformers' block-causal mask;
    padded-varlen: right-padded rows under dsrl's attention, causal with no padding mask (the sync's probe)."""
    monkeypatch.setattr(actor, "LOGPROB_CHUNK", 3)
    packed = not layout.startswith("padded")
    batch, temperature = samples(0), 0.7
    weights = torch.randn(len(batch), max(len(s.response_ids) for s in batch))
    want_lp, want_ent = padded_reference(model, batch, temperature)
    mask = torch.zeros_like(want_lp)
    for i, s in enumerate(batch):
        mask[i, : len(s.response_ids)] = 1
    model.zero_grad()
    ((want_lp * weights * mask).sum() + (want_ent * mask).sum()).backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    mb = MicroBatch.build(batch, 0, torch.device("cpu"), packed=packed)
    assert torch.equal(mb.mask, mask)
    if packed:
        assert mb.input_ids.shape == (1, sum(len(s.prompt.prompt_ids) + len(s.response_ids) for s in batch))
    model.zero_grad()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k)
    )
    if layout.endswith("varlen"):
        monkeypatch.setattr(model.config, "_attn_implementation", varlen.NAME)
    got_lp, got_ent = forward_logprobs(model, mb, temperature)
    per_call = len(batch) if layout == "varlen" else 1
    assert len(calls) == model.config.num_hidden_layers * per_call
    ((got_lp * weights * mask).sum() + (got_ent * mask).sum()).backward()
    torch.testing.assert_close(got_lp * mask, want_lp * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent * mask, want_ent * mask, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_micro_batch_of_equal_lengths_to_pack_goes_as_rows():
    """Samples of one length (the uniform-length case, where sdpa's kernel beat the varlen one) go as rows without
    padding; a long tail is packed."""
    uniform = [Sample(Prompt(i, [2, 3, 4], "", None), [5] * 8, [], "stop", 0) for i in range(4)]
    rows = MicroBatch.build(uniform, 0, torch.device("cpu"), packed=True)
    assert not rows.packed and rows.input_ids.shape == (4, 11) and bool(rows.attention_mask.all())
    longtail = MicroBatch.build(samples(0), 0, torch.device("cpu"), packed=True)
    assert longtail.packed and longtail.input_ids.shape[0] == 1


def test_micro_batches_by_tokens_stay_within_the_budget_and_split_to_a_common_count():
    rng = random.Random(1)
    lengths = [int(min(4096, max(32, rng.lognormvariate(5.5, 1.0)))) for _ in range(64)]
    bins = plan(lengths, 4096)
    assert sorted(i for b in bins for i in b) == list(range(64))
    assert all(sum(lengths[i] for i in b) <= 4096 or len(b) == 1 for b in bins)
    assert len(bins) <= sum(lengths) // 4096 + 3, "first-fit decreasing packs nearly full bins"
    rows = plan_rows(lengths, 4096)  # padded rows: each costs rows x its longest; sorted, little is padding
    assert sorted(i for b in rows for i in b) == list(range(64))
    assert all(len(b) * max(lengths[i] for i in b) <= 4096 or len(b) == 1 for b in rows)

    def cost(runs):  # what plan_rows minimises: the tokens run on, padding included, and each run's fixed cost
        return sum(len(b) * max(lengths[i] for i in b) for b in runs) + MICRO_BATCH_COST * 4096 * len(runs)

    in_order, run = [], []  # the greedy alternative: batch order, a new run when the next would not fit
    for i in range(64):
        if run and (len(run) + 1) * max(lengths[j] for j in run + [i]) > 4096:
            in_order.append(run)
            run = []
        run.append(i)
    assert cost(rows) <= cost(in_order + [run]) and len(rows) <= len(in_order) + 1
    padded = sum(len(b) * max(lengths[i] for i in b) for b in rows)
    assert 1 - sum(lengths) / padded < 0.2, "rows of similar lengths: little padding on a long tail"
    more = split_to(bins, len(bins) + 5, lengths)
    assert len(more) == len(bins) + 5 and sorted(i for b in more for i in b) == list(range(64))
    assert split_to([[0, 1]], 2, [5, 7]) == [[0], [1]]


def test_auto_budget_keeps_equal_lengths_as_micro_batch_size_rows_and_merges_a_long_tail():
    def batch(lengths):
        return [Sample(Prompt(i, [1, 2], "", None), [3] * n, [], "stop", 0) for i, n in enumerate(lengths)]

    equal = micro_batches(batch([10] * 32), "auto", 8)  # 8 rows of the longest: what fits today, fits
    assert [len(mb) for mb in equal] == [8, 8, 8, 8]
    tail = [200] + [5] * 31
    grouped = micro_batches(batch(tail), "auto", 8)
    assert sorted(s.prompt.index for mb in grouped for s in mb) == list(range(32))
    assert all(len(mb) * max(len(s.response_ids) + 2 for s in mb) <= 8 * 202 for mb in grouped)
    assert len(grouped) == 2, "the long sample alone, the 31 short ones together: not 4 padded micro-batches"


def test_zero_offload_preflight_names_the_host_share_that_fits(monkeypatch):
    """--trainer.offload_optimizer on a host too small for all the optimizer states: refused before any weight is
    loaded, naming the numbers and the --trainer.offload_optimizer_ratio that fits; which then starts."""
    import psutil
    from accelerate import init_empty_weights

    from dsrl.config import Config, DataConfig, ModelConfig
    from dsrl.zero.memory import HOST_BYTES_PER_PARAM, check_host_memory

    path = str(ROOT / "examples/toy/model")
    with init_empty_weights():
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(toy.build_model_config()).parameters())
    total = 10 << 30
    margin = 0.1 * total + (8 << 30) + 4 * n  # (and the fp32 grads of every parameter, which DeepSpeed keeps there)
    memory = SimpleNamespace(total=total, available=margin + 0.42 * n * HOST_BYTES_PER_PARAM)  # a fake host
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = Config(model=ModelConfig(path=path), data=DataConfig(train_path="unused.jsonl"))
    cfg.trainer.offload_optimizer = True
    on_cpu = gpu_plan(params=n, cuda=False)
    with pytest.raises(
        MemoryError, match=r"100% of the optimizer states .* Fits: --trainer.offload_optimizer_ratio 0.40"
    ):
        check_host_memory(cfg, on_cpu, world=1)
    cfg.trainer.offload_optimizer_ratio = 0.4
    check_host_memory(cfg, on_cpu, world=1)


def test_the_host_check_counts_each_gpu_process_of_the_node(monkeypatch):
    """The 32B runs on 4 x H200 (540.9 GB host; 4 ranks and 2 TP-2 servers): 85% of its 524.2 GB of optimizer states
    passed the old check and ran the host out in its first update; 70% ran, its host peaking at 498.1 GB. Now 85% and
    75% are refused, naming the 70% that counts DeepSpeed's bf16 grads of every parameter on the host (65.5 GB) and
    10 GiB for each of the 8 GPU processes; on CPU the margin is the 10% it was."""
    import psutil

    from dsrl.config import Config, DataConfig, ModelConfig
    from dsrl.zero import memory

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=540.9e9, available=532.7e9))  # fake
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cfg = Config(model=ModelConfig(path="unused"), data=DataConfig(train_path="unused.jsonl"))
    cfg.trainer.offload_optimizer, h200s = True, gpu_plan(150.1e9, params=32.76e9)
    cfg.rollout.num_servers, cfg.rollout.tp_size = 2, 2
    for ratio in (0.85, 0.75):
        cfg.trainer.offload_optimizer_ratio = ratio
        refused = r"\+ 65.5 GB of every parameter's grads \+ 94.5 GB margin.* Fits: .*_ratio 0.70"
        with pytest.raises(MemoryError, match=refused):
            memory.check_host_memory(cfg, h200s, world=4)
    cfg.trainer.offload_optimizer_ratio = 0.7
    memory.check_host_memory(cfg, h200s, world=4)
    cfg.trainer.offload_optimizer_ratio = 0.6  # (CPU processes are small: the old 10%; fp32 grads, 131 GB: 10 GiB
    memory.check_host_memory(cfg, gpu_plan(params=32.76e9, cuda=False), world=4)  # a process would refuse it)


def test_a_model_whose_states_cannot_fit_the_gpu_is_refused_naming_the_offload_that_fits(monkeypatch):
    """On a GPU (a fake one: trainer.device cuda, and its memory) too small for a rank's share of the states (bf16
    weights and grads, 4 bytes; fp32 master weights and Adam's moments, 12): refused before any weight is loaded,
    naming the ZeRO-Offload share that fits, room for a checkpointed micro-batch included when the budget is set;
    that share then starts. Where even the weights and grads exceed it, more GPUs."""
    from accelerate import init_empty_weights

    from dsrl.config import Config, DataConfig, ModelConfig
    from dsrl.zero.memory import activation_bytes, check_device_memory

    path = str(ROOT / "examples/toy/model")
    with init_empty_weights():
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(toy.build_model_config()).parameters())
    cfg = Config(model=ModelConfig(path=path), data=DataConfig(train_path="unused.jsonl"))
    cfg.algorithm.kl_coef, cfg.trainer.max_tokens_per_micro_batch = 0.0, None

    def gpu(room):  # a GPU whose room beside the margin (5% + 4 GiB) is `room` bytes (fake); the servers on GPUs
        return gpu_plan((room + (4 << 30)) / 0.95, params=n, colocated=False)  # of their own: the update alone

    small = gpu(4 * n + 12 * n * 0.57)  # the states fit with 43% of the optimizer's 12 bytes on the host: 45% offered
    with pytest.raises(MemoryError, match=r"share of the trainers' states is .* Fits: --trainer.offload_optimizer "
                                          r"true --trainer.offload_optimizer_ratio 0.45; or a smaller"):  # fmt: skip
        check_device_memory(cfg, small, path, world=1)
    cfg.trainer.offload_optimizer, cfg.trainer.offload_optimizer_ratio = True, 0.45
    check_device_memory(cfg, small, path, world=1)
    cfg.trainer.offload_optimizer, cfg.trainer.max_tokens_per_micro_batch = False, 16
    cfg.data.max_prompt_tokens = cfg.rollout.max_new_tokens = 8
    acts = activation_bytes(AutoModelForCausalLM.from_config(toy.build_model_config()).config, 16, True, 2)
    budget = r"moments\) and a micro-batch of 16 tokens checkpointed .*_ratio 0.45; or a smaller --trainer.max_tok"
    with pytest.raises(MemoryError, match=budget):  # room for the micro-batch too: the same share
        check_device_memory(cfg, gpu(4 * n + 12 * n * 0.57 + acts), path, world=1)
    cfg.trainer.offload_optimizer, cfg.trainer.offload_optimizer_ratio = True, 0.2
    with pytest.raises(MemoryError, match=r"80% of the fp32 master weights .* Fits: more GPUs"):
        check_device_memory(cfg, gpu(3 * n), path, world=1)
    # (CPU runs: the host's share is checked by check_host_memory)
    check_device_memory(cfg, gpu_plan(params=n, cuda=False), path, world=1)


def test_colocated_zero_offload_names_the_share_that_fits_beside_the_servers(monkeypatch):
    """Colocated with ZeRO-Offload the states stay on the GPU while the servers generate: 32B on 4 x H200 (150.1 GB)
    with two TP-2 servers at mem_fraction_static 0.4 and 20% of Adam on the host fits the update (the ratio the
    update alone needs) but not beside the servers' 60 GB: refused before any weight loads, naming 0.55, which starts.
    Without ZeRO-Offload the plan moves the states off instead, and nothing is refused for the servers' sake."""
    from dsrl.config import Config, DataConfig, ModelConfig
    from dsrl.zero import memory

    colocated = gpu_plan(150.1e9, params=32.76e9)  # (a fake H200)
    cfg = Config(model=ModelConfig(path="unused"), data=DataConfig(train_path="unused.jsonl"))
    cfg.algorithm.kl_coef, cfg.trainer.max_tokens_per_micro_batch = 0.0, None
    cfg.rollout.num_servers, cfg.rollout.tp_size, cfg.rollout.mem_fraction_static = 2, 2, 0.4
    cfg.trainer.offload_optimizer, cfg.trainer.offload_optimizer_ratio = True, 0.2
    disaggregated = gpu_plan(150.1e9, params=32.76e9, colocated=False)
    memory.check_device_memory(cfg, disaggregated, "unused", world=4)  # the update alone fits at 0.2
    beside = r"beside the servers' 60.0 GB \(rollout.mem_fraction_static.* cannot generate .* Fits: .*_ratio 0.55"
    with pytest.raises(MemoryError, match=beside):
        memory.check_device_memory(cfg, colocated, "unused", world=4)
    cfg.trainer.offload_optimizer_ratio = 0.55
    memory.check_device_memory(cfg, colocated, "unused", world=4)
    cfg.trainer.offload_optimizer = False  # 131 GB of states fit the update; the plan moves them off to generate
    memory.check_device_memory(cfg, colocated, "unused", world=4)


def test_gradient_checkpointing_auto_turns_on_for_an_update_whose_micro_batch_would_not_fit(caplog):
    """--model.gradient_checkpointing auto (`AutoCheckpointing`, here with a 10 GiB device's size given):
    before each update the decoder layers' checkpointing is on when the states and its largest micro-batch's
    activations would not fit, off when they fit. The activation estimate is held to the figure it was fitted
    on (3B packed, 8,192 tokens, one H200: the update's peak 95.3 GB, states 49.4 GB; with liger-kernel 99.7 GB at
    12,288 tokens and 115.5 GB at 16,384)."""
    import logging

    from transformers.modeling_layers import GradientCheckpointingLayer

    from dsrl.zero import engine, memory
    from dsrl.zero.batches import largest_micro_batch

    config = toy.build_model_config()
    config.update({"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "vocab_size": 151936})
    assert 3.09e9 * 16 + memory.activation_bytes(config, 8192, False) == pytest.approx(95.3e9, rel=0.03)
    assert memory.activation_bytes(config, 8192, True) < memory.activation_bytes(config, 8192, False) / 4
    for tokens, peak in [(12288, 99.7e9), (16384, 115.5e9)]:  # liger-kernel's layers keep less
        assert 3.09e9 * 16 + memory.activation_bytes(config, tokens, False, liger=True) == pytest.approx(peak, rel=0.03)
    # A mixture of experts keeps a copy of each token for every expert it routes to: the 4-layer Qwen3-30B-A3B shape
    # peaked at 71.7 GB (states 49.8 GB) at 16,384 tokens on one H200 (docs/benchmarks/moe.md)
    shape = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128}
    moe = Qwen3MoeConfig(**shape, num_experts_per_tok=8, num_hidden_layers=4, vocab_size=151936)
    assert 49.8e9 + memory.activation_bytes(moe, 16384, False) == pytest.approx(71.7e9, rel=0.05)

    model = AutoModelForCausalLM.from_config(toy.build_model_config())
    engine.checkpoint_layers(model)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    total, states = 10 << 30, 1e6
    auto = memory.AutoCheckpointing(model.config, states, total, "the GPU's")
    fixed = memory.activation_bytes(model.config, 0, False)  # (the log-probs' chunks)
    fits = int((total * 0.95 - (4 << 30) - states - fixed) // (memory.activation_bytes(model.config, 1, False) - fixed))
    with caplog.at_level(logging.INFO, logger="dsrl.zero.memory"):
        auto.apply(model, largest_micro_batch("auto", 8, fits // 16))  # short samples this step
        assert not any(layer.gradient_checkpointing for layer in layers)
        auto.apply(model, largest_micro_batch("auto", 8, fits // 4))  # a long one: 2x what fits
        assert all(layer.gradient_checkpointing for layer in layers)
    assert f"gradient checkpointing on: states 0.0 GB + activations of {fits // 4 * 8} tokens" in caplog.text
    assert largest_micro_batch(4096, 8, 5000) == 5000, "a sample longer than the budget goes alone"


def test_colocated_planner_moves_the_least_of_the_states_that_lets_the_servers_fit(monkeypatch):
    """--trainer.offload_states auto on a GPU (a fake one: trainer.device cuda, and its memory): the states (16 bytes
    per trained bf16 parameter) stay when they, the servers' share and the margin fit; else as much of Adam's two
    moments (8 of the 16 bytes) as makes room leaves while the servers generate, when that can; else all the states.
    With ZeRO-Offload they always stay (DeepSpeed moves CPU Adam's states between phases for no one), and the message
    says which knob to turn."""
    import psutil
    from accelerate import init_empty_weights

    from dsrl.config import Config, DataConfig, ModelConfig
    from dsrl.zero.memory import GPU_PROCESS_HOST_BYTES, plan_memory

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(toy.build_model_config()).to(torch.bfloat16)
    states = 16 * sum(p.numel() for p in model.parameters())
    cfg = Config(model=ModelConfig(path="unused"), data=DataConfig(train_path="unused.jsonl"))
    cfg.rollout.mem_fraction_static = 0.5
    engines = [SimpleNamespace(module=model)]

    def host(available):  # a host with `available` bytes free (fake); one rank on it, beside one server's GPU
        monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=available, available=available))

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    host(1e12)

    on = gpu_plan(int(((4 << 30) + states * 1.01) / 0.45))  # servers 50%, margin 5% + 4 GiB: the states just fit
    assert plan_memory(cfg, on, engines).offload is None
    on = gpu_plan(int(((4 << 30) + states * 0.9) / 0.45))  # a fifth of the moments (a tenth of the states) off
    offload, why, _, share = astuple(plan_memory(cfg, on, engines))
    assert offload == "moments" and share == pytest.approx(0.2, rel=0.01)
    assert f"{states / 10 / 1e9:.1f} of Adam's {states / 2 / 1e9:.1f} GB of moments leave the GPU" in why
    host(GPU_PROCESS_HOST_BYTES + (8 << 30) + states / 2 * 0.5)  # the host holds that fifth, not all the moments,
    plan_memory(cfg, on, engines)  # which a resumed run moves at start-up (they exist then: Adam made them)
    with pytest.raises(MemoryError, match=r"offload_states moments: the 1 rank\(s\) of this node would move"):
        plan_memory(cfg, on, engines, resumed=True)
    host(1e12)
    on = gpu_plan(int(((4 << 30) + states * 0.49) / 0.45))  # not even half fits beside the servers
    offload, why, _, _ = astuple(plan_memory(cfg, on, engines))
    assert offload == "all" and f"trainers' states {states / 1e9:.1f} GB" in why and "leave the GPU" in why
    cfg.trainer.offload_states = "moments"  # given: as given, whatever fits (all the moments: they are not enough)
    assert astuple(plan_memory(cfg, on, engines))[::3] == ("moments", 1.0)
    host(GPU_PROCESS_HOST_BYTES + (8 << 30) + states / 2 * 0.9)  # the moments: not beside the server
    with pytest.raises(MemoryError, match=r"offload_states moments: the 1 rank\(s\) of this node would move .* host "
                                          r"memory .*--trainer.offload_optimizer true"):  # fmt: skip
        plan_memory(cfg, on, engines)
    host(GPU_PROCESS_HOST_BYTES + (8 << 30) + states / 2 * 1.5)  # one rank's moments fit, two ranks' do not
    plan_memory(cfg, on, engines)
    monkeypatch.setenv("LOCAL_SIZE", "2")  # (two ranks here, as DeepSpeed's launcher says: it sets no LOCAL_WORLD_SIZE)
    with pytest.raises(MemoryError, match=r"the 2 rank\(s\) of this node would move"):
        plan_memory(cfg, on, engines)
    monkeypatch.delenv("LOCAL_SIZE")
    host(1e12)
    cfg.trainer.offload_states = "auto"
    cfg.rollout.max_staleness = 1  # one-step-off: the states cannot leave while the optimizer steps
    with pytest.raises(MemoryError, match=r"--rollout.max_staleness 1 \(colocated\).*lower --rollout.mem_fr"):
        plan_memory(cfg, on, engines)
    cfg.rollout.max_staleness = 0
    cfg.trainer.offload_optimizer = True  # 4 of the 16 bytes stay: weights and grads
    offload, why, _, _ = astuple(plan_memory(cfg, on, engines))
    assert offload is None and f"trainers' states {states / 4 / 1e9:.1f} GB" in why and "ZeRO-Offload" in why


def test_the_moments_that_leave_are_whole_tensors_from_the_first_until_the_planned_share():
    """offload_states moments moves the share of Adam's moments the plan needs gone: whole flat tensors (one per
    moment and ZeRO-3 sub-group), the first that hold at least the share, so the room made is never less than
    planned and at most one tensor more."""
    from dsrl.zero.engine import first_share

    moments = [torch.zeros(n) for n in (4, 4, 8, 4)]  # 80 bytes

    def chosen(share):
        picked = first_share(moments, share)
        assert all(a is b for a, b in zip(picked, moments))
        return [t.numel() for t in picked]

    assert chosen(1.0) == [4, 4, 8, 4] and chosen(0.0) == []
    assert chosen(0.2) == [4] and chosen(0.21) == [4, 4] and chosen(0.5) == [4, 4, 8]


def test_a_resumed_runs_moments_all_leave_at_start_up_and_all_come_back_though_its_first_sync_moves_a_share(
    monkeypatch,
):
    """A resumed run's moments exist at start-up, and all of them leave before the servers start; its first sync then
    asks for the plan's share alone, before any came back. Every moment must still come back for the update: on an
    H200 the reload brought back the share, and FusedAdam's step found the rest on the host ("A tensor was not on the
    same device"). The moments' values survive the moves. (No GPU here: CPU tensors play the GPU's, and what
    `reload_states` brings back is the engine's list of moved moments.)"""
    from dsrl.zero.engine import offload_states

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    exp_avg, exp_avg_sq = torch.full((8,), 0.5), torch.full((8,), 2.0)
    engine = SimpleNamespace(
        optimizer=SimpleNamespace(optimizer=SimpleNamespace(state={0: {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}})),
        empty_partition_cache=lambda: None,
    )  # fmt: skip
    on_gpu = [exp_avg.data, exp_avg_sq.data]
    offload_states(engine, "moments", params=False, share=1.0)  # start-up, resumed: all of them
    offload_states(engine, "moments", params=False, share=0.3)  # the first sync: the share (exp_avg alone)
    assert all(m.data_ptr() != g.data_ptr() and torch.equal(m, g) for m, g in zip((exp_avg, exp_avg_sq), on_gpu))
    assert [id(m) for m, _ in engine.dsrl_moved] == [id(exp_avg), id(exp_avg_sq)], "a moment would stay on the host"


def test_a_dead_servers_replacement_starts_beside_the_update_with_its_kv_cache_capped_at_the_room_left(monkeypatch):
    """Colocated on a GPU, a replacement that starts while the trainers update would size its KV cache from the memory
    it finds free, which the trainers change: it starts with its cache capped at what the update's peak leaves (on a
    2 x H200 run the plan's 71.8 GB peak was 93 GB held, and an uncapped replacement beside it ended the run out of
    memory). Before a step measured the peak, the plan's estimate (with PEAK_SLACK) counts; where the room is less than
    half the others' cache, it starts as they did and the trainers wait for it."""
    import psutil
    from accelerate import init_empty_weights

    from dsrl.config import Config, DataConfig, ModelConfig
    from dsrl.lending import GpuLending
    from dsrl.serving.servers import ServerFleet
    from dsrl.zero.memory import margin, plan_memory, server_weight_bytes, update_peak

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(toy.build_model_config()).to(torch.bfloat16)
    cfg = Config(model=ModelConfig(path="unused"), data=DataConfig(train_path="unused.jsonl"))
    cfg.rollout.mem_fraction_static = 0.4
    engines = [SimpleNamespace(module=model)]
    total, weights = 150e9, server_weight_bytes(cfg, model)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=1e12, available=1e12))  # (a host)
    plan = plan_memory(cfg, gpu_plan(total), engines)
    peak = update_peak(cfg, gpu_plan(total), engines[0])[0]
    assert plan.peak == peak and "a dead server's replacement starts beside it" in plan.line
    gpu = GpuLending.__new__(GpuLending)  # (rank 0's sizing alone: no servers to ask, no ranks to reduce over)
    gpu.fleet, gpu.weight_bytes, gpu.total, gpu.share = ServerFleet(urls=[]), weights, total, 0.4 * total
    gpu.kv_tokens = 1_000_000
    cell = (0.4 * total - weights) / 1_000_000
    capped = int((total - 93e9 - margin(total) - weights) / cell)
    for held, tokens in ((60e9, 1_000_000), (93e9, capped), (120e9, None)):
        gpu.peak = held
        gpu.size_replacements()
        args = gpu.fleet.replacement_args
        if tokens is None:  # less than half the others' cache fits: it starts as they did, and the trainers wait
            assert args is None
        else:  # SGLang's profile (0.95 of what is free at its start, less its weights) is above the cap: it binds
            assert args == {"mem_fraction_static": 0.95, "max_total_tokens": tokens}
            assert held + weights + tokens * cell + margin(total) <= total
            assert 0.95 * (total - held) - weights >= tokens * cell
    line = plan_memory(cfg, gpu_plan(5e9), engines).line  # the margin alone leaves 0.5 GB
    assert "replacement would have 0." in line and "the trainers wait for it" in line and "starts beside" not in line


def test_the_memory_plans_update_peak_is_set_by_the_micro_batch_not_the_batch():
    """The plan's update peak for 64 samples a rank and for 256 (4 ranks x 128 prompts x 8, issue 60's run): the same,
    the states and one micro-batch of the token budget (measured on one H200 at 1.5B: 82.11 and 82.23 GB,
    tools/update_memory.py); without a budget, micro_batch_size rows of the longest sample."""
    from accelerate import init_empty_weights

    from dsrl.config import Config, DataConfig, ModelConfig
    from dsrl.zero.memory import activation_bytes, trainers_state_bytes, update_peak, zero3_buffer_bytes

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(toy.build_model_config())
    engine = SimpleNamespace(module=model)
    cfg = Config(model=ModelConfig(path="unused", gradient_checkpointing=False), data=DataConfig(train_path="u.jsonl"))
    cfg.trainer.max_tokens_per_micro_batch, cfg.rollout.n_samples = 16384, 8
    peaks, on_cpu = [], gpu_plan(cuda=False)  # (fp32)
    for prompts in (32, 128):  # 64 and 256 samples a rank on 4 ranks
        cfg.rollout.prompts_per_step = prompts
        peaks.append(update_peak(cfg, on_cpu, engine))
    states = trainers_state_bytes(cfg, on_cpu, model, critic=False)
    assert peaks[0] == peaks[1] == (states + activation_bytes(model.config, 16384, False, width=4), 16384, False)
    cfg.trainer.max_tokens_per_micro_batch, cfg.trainer.micro_batch_size = None, 4
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    assert update_peak(cfg, on_cpu, engine)[1] == 4 * longest
    # on several ranks ZeRO-3's gathered layers and reduce bucket too: 3.0 GB at 1.5B in bf16 (measured 2.8-2.9 GB
    # over the estimate without them, on 2 and 4 ranks); one rank gathers nothing; a toy holds itself, twice
    assert zero3_buffer_bytes(1_543_714_304, 2, 2) == zero3_buffer_bytes(1_543_714_304, 2, 4) == 3e9
    assert zero3_buffer_bytes(1_543_714_304, 2, 1) == 0 and zero3_buffer_bytes(1000, 4, 2) == 8000


def test_checkpointing_is_turned_on_by_the_name_the_gpu_pins_have():
    """constraints-gpu.txt pins transformers 5.12.1 (SGLang's), which has no `activation_checkpointing_enable`
    (5.13's name, which CPU runs use): calling that name alone made every dsrl train on the GPU image die at load."""
    from dsrl.zero import engine

    calls = []

    class Transformers512:  # the old name only
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(gradient_checkpointing_kwargs)

    engine.checkpoint_layers(Transformers512(), {"use_reentrant": False})
    assert calls == [{"use_reentrant": False}]
    model = AutoModelForCausalLM.from_config(toy.build_model_config())
    engine.checkpoint_layers(model)  # the new name, where it exists
    assert model.is_activation_checkpointing


REDUCE_ON_TWO_RANKS = """
import json, os, torch.distributed as dist
from dsrl.metrics import reduce_across_ranks
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=rank, world_size=2)
values = {"response/length_max": [1024, 576][rank], "response/length_min": [3, 64][rank],
          "reward/mean": [0.2, 0.4][rank], "rollout/filtered": [1, 2][rank],
          "memory/update_peak_gb": [40.0, 44.0][rank]}
print(json.dumps(reduce_across_ranks(values)))
"""


def test_metrics_over_ranks_keep_maxima_minima_and_each_ranks_peak():
    """Two gloo ranks: a maximum is the ranks' largest (4 ranks averaged a 1,024-token longest response to 576), a
    minimum the smallest, a counter the sum, the rest the mean; the update's memory peak also per rank."""
    from dsrl.serving.servers import free_port

    env = dict(os.environ, PORT=str(free_port()), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", REDUCE_ON_TWO_RANKS], env=env | {"RANK": str(r)}, text=True,
                              stdout=subprocess.PIPE) for r in (0, 1)]  # fmt: skip
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert outs[0] == outs[1] == {
        "response/length_max": 1024, "response/length_min": 3, "reward/mean": pytest.approx(0.3), "rollout/filtered": 3,
        "memory/update_peak_gb": 44.0, "memory/update_peak_gb/rank_0": 40.0, "memory/update_peak_gb/rank_1": 44.0,
    }  # fmt: skip


@pytest.fixture
def fake_gpu_lending(monkeypatch):
    """A GpuLending colocated on a fake GPU (its free memory in `gpu`, stubbed into torch.cuda) with one fake server
    as its tenant, releasing and taking back memory as SGLang's memory saver does (50 GB, 3 of them its weights),
    and fake trainer states: with `plan` "moments", moving a share of 30 GB of Adam's moments frees that share.
    Yields `make(plan)`, which returns the lending, its server and `gpu` (with "moved": the shares moved)."""
    import torch.distributed as dist
    from accelerate import init_empty_weights

    import dsrl.lending
    from dsrl.config import Config, DataConfig, ModelConfig
    from dsrl.lending import GpuLending
    from dsrl.serving.servers import free_port

    gpu = {"free": 40e9, "moved": [], "off": 0.0}

    class SleepingServer:  # (fake: SGLang on a GPU)
        woken: list[str] = []

        def release(self, tags):
            gpu["free"] += 50e9

        def resume(self, tag):
            gpu["free"] -= 3e9 if tag == "weights" else 47e9
            self.woken.append(tag)

    def offload_states(engine, what, params, share):  # (fake: DeepSpeed's moments on a GPU)
        gpu["moved"].append(share)
        gpu["free"] += 30e9 * share - gpu["off"]
        gpu["off"] = 30e9 * share

    def reload_states(engine):
        gpu["free"] -= gpu["off"]
        gpu["off"] = 0.0

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (gpu["free"], 141e9))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 141e9 - gpu["free"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (free_cached_memory: nothing to free)
    monkeypatch.setattr(dsrl.lending, "offload_states", offload_states)
    monkeypatch.setattr(dsrl.lending, "reload_states", reload_states)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(toy.build_model_config())
    cfg = Config(model=ModelConfig(path="unused"), data=DataConfig(train_path="unused.jsonl"))
    cfg.rollout.placement, cfg.trainer.device = "colocate", "cuda"

    def make(plan=None):
        lending = GpuLending(cfg, None, [SimpleNamespace(module=model)], gpu_plan(141e9), memory=plan)
        lending.servers, lending.weight_bytes = [SleepingServer()], 3e9
        return lending, lending.servers[0], gpu

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield make
    finally:
        dist.destroy_process_group()


def test_a_wake_the_gpu_has_no_room_for_stops_the_run_with_the_numbers_before_the_server_is_asked(fake_gpu_lending):
    """Colocated on a GPU (a fake one), every rank measures what the servers released on its GPU; when the trainer
    then holds so much that the KV cache would not fit, the wake fails with the numbers and the server is never asked
    (SGLang's scheduler dies of such a wake, and its server with it). With room, it wakes."""
    lending, server, gpu = fake_gpu_lending()
    lending.to_trainers()
    assert lending.asleep == 50e9
    gpu["free"] -= 60e9  # the update's activations, kept
    lending.wake("weights")
    with pytest.raises(MemoryError, match=r"the rollout servers' kv_cache needs 47.0 GB on GPU 0 .* 27.0 GB are"):
        lending.wake("kv_cache")
    assert server.woken == ["weights"], "the server was asked to wake with no room"
    lending.to_trainers()
    lending.wake("weights")
    lending.wake("kv_cache")  # (the trainer let go of its activations)
    assert server.woken == ["weights", "weights", "kv_cache"]


def test_a_wake_short_of_room_by_the_plans_share_of_the_moments_moves_the_rest_and_wakes(fake_gpu_lending, caplog):
    """The plan moves a third of Adam's moments for the servers; where a wake then finds less room than the plan's
    sums promised (the update still holding more than they counted), the rest of the moments leave too, with a
    warning, and the servers wake; the steps after move every moment."""
    from dsrl.metrics import Timer
    from dsrl.zero.memory import MemoryPlan

    lending, server, gpu = fake_gpu_lending(MemoryPlan(offload="moments", share=1 / 3))
    for held in (10e9, 60e9):  # what the update still holds at the wake: 10 GB, then 60 (a longer batch)
        lending.to_trainers()  # (the moments come back)
        gpu["free"] -= held
        lending.offload_trainers(params=False)  # what `for_update` does, but for measuring the peak (a real GPU's)
        lending.wake("weights")
        with caplog.at_level(logging.WARNING, logger="dsrl.lending"):
            lending.to_servers(Timer())  # the KV cache needs 47 GB: 87 GB free, then 37 + the rest of the moments' 20
        gpu["free"] += held
    assert "the rest of Adam's moments leave the GPU too, from now on" in caplog.text
    assert gpu["moved"] == [1 / 3, 1 / 3, 1.0] and lending.moments_share == 1.0
    assert server.woken == ["weights", "kv_cache", "weights", "kv_cache"]
