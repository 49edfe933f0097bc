"""Mixture of experts on CPU without servers: the experts under the checkpoint's names, routing replay in packed and
padded micro-batches, the embedded engine's routed experts, and --algorithm.routing_replay's choice per model."""

import asyncio
import base64

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dsrl.config import Config, DataConfig, ModelConfig
from dsrl.data import Prompt, Sample
from dsrl.moe import RoutingReplay, moe_blocks, routing_replay, split_experts
from dsrl.tasks import toy
from dsrl.zero import varlen
from dsrl.zero.actor import forward_logprobs
from dsrl.zero.batches import MicroBatch
from tests.test_reliability import TIMING, run_to_end, scalars, train_cmd

LAYERS, TOP_K = 4, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """The toy MoE with random weights, saved as transformers saves it (one tensor per expert)."""
    out = tmp_path_factory.mktemp("moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(toy.build_moe_config())
    for p in model.parameters():  # routers with a spread: their top 2 are not near ties
        p.data.normal_(std=0.3)
    model.save_pretrained(out)
    toy.build_tokenizer().save_pretrained(out)
    return out


def own_routing(model, ids: list[int]) -> torch.Tensor:
    """The experts `model` routes each token of `ids` to, alone: int32 [tokens, layers, top k]."""
    seen, blocks = {}, moe_blocks(model)
    hooks = [b.gate.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2])) for i, b in blocks]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack([seen[i] for i in range(LAYERS)], 1).to(torch.int32)


def test_fused_experts_go_under_the_names_transformers_saves(moe_dir):
    """transformers holds each layer's experts fused; `split_experts` gives the per-expert tensors its checkpoint
    (and SGLang's loader) has, as views."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    assert any(name.endswith("experts.gate_up_proj") for name, _ in model.named_parameters())
    saved = load_file(moe_dir / "model.safetensors")
    split = dict(split_experts(model.named_parameters()))
    assert set(split) == set(saved) - {"lm_head.weight"}  # (tied to the embedding)
    assert all(torch.equal(split[name], saved[name]) for name in split)
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj
    assert split["model.layers.1.mlp.experts.5.up_proj.weight"].data_ptr() == gate_up[5, 64:].data_ptr()


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_replay_aligns_each_samples_routing_with_its_tokens(moe_dir, monkeypatch, layout):
    """Each sample's routed experts (of its tokens but the last, as SGLang returns them) replayed in a micro-batch of
    samples of other lengths: its own routing changes nothing and differs nowhere; another sample's routing moved
    onto one sample changes that sample's logprobs alone."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    if layout == "packed":
        monkeypatch.setattr(model.config, "_attn_implementation", varlen.NAME)
    model.routing_replay = replay = RoutingReplay(model, moe_blocks(model))
    batch = []
    for i, (prompt, n) in enumerate([(3, 4), (2, 1), (4, 6)]):
        p = Prompt(i, [5 + i + j for j in range(prompt)], "", None)
        batch.append(Sample(p, [(3 * i + j) % 12 + 2 for j in range(n)], [0.0] * n, "stop", 0))
    mb = MicroBatch.build(batch, 0, torch.device("cpu"), packed=layout == "packed")
    assert mb.packed == (layout == "packed")
    plain, _ = forward_logprobs(model, mb, 1.0)
    for s in batch:
        s.routed_experts = own_routing(model, s.prompt.prompt_ids + s.response_ids)[:-1].reshape(-1)
    replayed, _ = forward_logprobs(model, mb, 1.0)
    torch.testing.assert_close(replayed, plain, atol=1e-5, rtol=0)
    assert replay.decisions == LAYERS * TOP_K * sum(len(s.prompt.prompt_ids) + len(s.response_ids) - 1 for s in batch)
    assert replay.metrics() == {"moe/routing_mismatch_frac": 0.0}
    batch[2].routed_experts = (batch[2].routed_experts + 1) % 8  # every expert another one
    moved, _ = forward_logprobs(model, mb, 1.0)
    assert replay.metrics()["moe/routing_mismatch_frac"] > 0.3
    torch.testing.assert_close(moved[:2], plain[:2], atol=1e-5, rtol=0)
    assert (moved[2] - plain[2]).abs().max() > 1e-3


def test_the_embedded_engine_returns_each_tokens_routed_experts(moe_dir):
    """`return_routed_experts`: base64 int32 [prompt + output - 1, layers, top k], the routing of a plain forward of the
    whole sequence, for requests of several lengths stepped together; per-expert names load into the fused experts,
    in place; a server without --enable-return-routed-experts returns none, as SGLang's."""
    from dsrl.serving.embedded import Engine

    engine = Engine(str(moe_dir), return_routed_experts=True)
    prompts = [[5, 11, 6, 12], [7, 12], [2, 3, 4, 5, 12]]

    async def generate(routed: list[bool]):
        loop = asyncio.get_running_loop()
        reqs = [engine.make_request(p, {"max_new_tokens": 5}, f"r{i}", loop, None, r) for i, (p, r) in
                enumerate(zip(prompts, routed))]  # fmt: skip
        for req in reqs:
            engine.submit(req)
        return await asyncio.gather(*(req.done for req in reqs))

    try:
        outs = asyncio.run(generate([True, False, True]))
        assert "routed_experts" not in outs[1]["meta_info"]
        for prompt, out in zip(prompts[::2], outs[::2]):
            ids = prompt + out["output_ids"]
            raw = base64.b64decode(out["meta_info"]["routed_experts"])
            routed = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(-1, LAYERS, TOP_K)
            assert routed.shape[0] == len(ids) - 1
            assert torch.equal(routed, own_routing(engine.model, ids)[:-1])
        new = torch.randn(64, 64)
        name = "model.layers.2.mlp.experts.6.up_proj.weight"
        assert engine._storage_slice([name], [torch.float32], [new.numel() * 4]) is not None  # received in place
        engine.load_weights([(name, new)])
        assert torch.equal(engine.model.model.layers[2].mlp.experts.gate_up_proj[6, 64:], new)
    finally:
        engine.stop()
    plain, loop = Engine(str(moe_dir)), asyncio.new_event_loop()
    try:
        assert plain.make_request(prompts[0], {"max_new_tokens": 5}, "r", loop, None, True).routed is None
    finally:
        plain.stop()
        loop.close()


def test_a_request_aborted_before_any_token_comes_back_without_routed_experts():
    """A partial rollout's abort can answer a request before its first forward: SGLang and the embedded engine then
    send an empty routing ("" in base64), which must not end the rollout (it did, in async + partial runs)."""
    from dsrl.rollout.rollouts import parse_generation

    meta = {"finish_reason": {"type": "abort"}, "weight_version": 3, "routed_experts": ""}
    out = parse_generation({"output_ids": [], "meta_info": meta})
    assert out.routed_experts is None and out.output_ids == [] and out.finish_reason == "abort"
    rows = torch.arange(2 * LAYERS * TOP_K, dtype=torch.int32)
    meta["routed_experts"] = base64.b64encode(rows.numpy().tobytes()).decode()
    assert torch.equal(parse_generation({"output_ids": [9], "meta_info": meta}).routed_experts, rows)


def test_routing_replay_is_on_for_a_mixture_of_experts_and_an_error_on_a_dense_model():
    cfg = Config(model=ModelConfig(path="m"), data=DataConfig(train_path="d.jsonl"))
    moe, dense = toy.build_moe_config(), toy.build_model_config()
    assert routing_replay(cfg, moe) and not routing_replay(cfg, dense)
    cfg.algorithm.routing_replay = False
    assert not routing_replay(cfg, moe)
    cfg.algorithm.routing_replay = True
    assert routing_replay(cfg, moe)
    with pytest.raises(ValueError, match="--algorithm.routing_replay true: m \\(qwen2\\)"):
        routing_replay(cfg, dense)


STEPS = 3


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """configs/toy_cpu_moe.yaml for a few steps, with and without routing replay: 2 ZeRO-3 ranks, the embedded engine
    in bfloat16, the old logprobs from a pass of their own. The runs share their seeds, hence their first batch."""
    root = tmp_path_factory.mktemp("moe_runs")
    args = ["--trainer.total_steps", str(STEPS), "--eval.path", "null", "--trainer.old_logprobs", "recompute"]
    log = run_to_end(train_cmd("toy_cpu_moe.yaml", root / "on", *args, "--logging.export_hf", "true"))
    run_to_end(train_cmd("toy_cpu_moe.yaml", root / "off", *args, "--algorithm.routing_replay", "false"))
    return root / "on", log, scalars(root / "on"), scalars(root / "off")


@pytest.mark.slow
def test_moe_trains_with_routing_replay_end_to_end(moe_runs):
    """The probe after every sync finds the servers' weights the trainer's, to bfloat16's error (the experts loaded by
    their per-expert names); the replayed routing differs from the trainer's own in a few decisions, and with it the
    largest logprob mismatch of a batch falls; the exported model holds its experts as transformers saves them."""
    run_dir, log, on, off = moe_runs
    assert "--enable-return-routed-experts" in log
    assert len(on["sync/probe_logprob_diff"]) == STEPS and max(on["sync/probe_logprob_diff"].values()) < 0.01
    assert 0 < sum(on["moe/routing_mismatch_frac"].values()) / STEPS < 0.05 and "moe/routing_mismatch_frac" not in off
    worst, mean = "mismatch/logprob_max_abs_diff", "mismatch/logprob_abs_diff"
    assert sum(on[worst].values()) < 0.6 * sum(off[worst].values()), (on[worst], off[worst])
    assert sum(on[mean].values()) <= sum(off[mean].values()), (on[mean], off[mean])
    exported = load_file(run_dir / "hf/model.safetensors")
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in exported and not any("gate_up" in k for k in exported)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    assert torch.isfinite(model(torch.tensor([[5, 11, 6, 12]])).logits).all()


@pytest.mark.slow
def test_moe_with_lora_adapters_resumes_bit_for_bit(tmp_path):
    """LoRA on the MoE's attention (the experts frozen, routing replay on, the adapter served on its own): a run
    started again from the first run's step-2 checkpoint logs steps 3 and 4 as the first run did (weights, adapters,
    their optimizer states, RNG and data position restored; each step's routing replayed from its own rollout, which
    the engine's batch-invariant mode makes the same in both runs)."""
    args = ["--trainer.total_steps", "4", "--eval.path", "null", "--model.lora_rank", "8", "--trainer.lr", "1e-2"]
    args += ["--rollout.server_args", '{"dtype": "bfloat16", "enable_deterministic_inference": true}']
    args += ["--rollout.prompts_per_step", "8", "--rollout.n_samples", "4"]  # one forward a request: keep them few
    first, again = tmp_path / "first", tmp_path / "again"
    saved = ["--logging.save_every", "2", "--logging.keep_last", "0"]
    log = run_to_end(train_cmd("toy_cpu_moe.yaml", first, *args, *saved))
    assert "sync.lora adapter" in log and "--enable-lora" in log
    log = run_to_end(train_cmd("toy_cpu_moe.yaml", again, *args, "--logging.resume", str(first / "checkpoints/step_2")))
    assert "at step 2" in log
    a, b = scalars(first), scalars(again)
    compared = [tag for tag in a if not tag.startswith(TIMING)]
    assert {"reward/mean", "actor/grad_norm", "moe/routing_mismatch_frac"} <= set(compared)
    assert sorted(b["reward/mean"]) == [3, 4]
    for tag in compared:
        assert {step: a[tag][step] for step in (3, 4)} == b[tag], f"{tag} differs after resume"
