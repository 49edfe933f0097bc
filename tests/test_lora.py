"""LoRA (`--model.lora_rank`): adapters trained on the ZeRO-3 actor, the base frozen and the reference; the
servers get the base once and then the adapter alone, which every request names (`--sync.lora adapter`),
or the base with the adapters merged (`merged`). Real DeepSpeed (2 ranks), the real embedded engine."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from dsrl.serving.client import RolloutClient, ServedAdapter
from dsrl.serving.embedded import BadRequest, Engine
from dsrl.serving.servers import free_port
from dsrl.tasks.toy import build_model_config, build_tokenizer
from dsrl.zero.lora import ServedWeights, add_adapters, add_in_place, reference_off
from tests.conftest import ROOT, run_ranks
from tests.test_reliability import run_to_end, scalars, train_cmd

STEPS = 40
"""The LoRA run's steps: here its last ten steps' reward was 0.31 over the first ten's (0.42 at 60); asked: 0.1."""


def lora_base(out: Path) -> Path:
    """A random toy base whose logits are not flat (initializer_range 0.15): LoRA trains on a frozen base, and
    the toy's default init (0.02) leaves its tied embeddings too small for any adapter to peak a distribution."""
    config = build_model_config()
    config.initializer_range = 0.15
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def lora_model(base: Path, rank: int = 4):
    from dsrl.config import ModelConfig

    torch.manual_seed(1)
    model = add_adapters(AutoModelForCausalLM.from_pretrained(base), ModelConfig(path=str(base), lora_rank=rank))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at 0 (the adapter does nothing): give it a value
            p.data.normal_(0, 0.2)
    return model


def test_reference_is_the_base_and_served_weights_are_the_merged_model(tmp_path):
    base = lora_base(tmp_path / "base")
    model, plain = lora_model(base), AutoModelForCausalLM.from_pretrained(base)
    ids = torch.randint(2, 13, (3, 7))
    with torch.no_grad(), reference_off(model):
        torch.testing.assert_close(model(ids).logits, plain(ids).logits)
    with torch.no_grad():
        assert (model(ids).logits - plain(ids).logits).abs().max() > 0.1, "the adapters change the policy"
    served = ServedWeights(model)
    weights = {}
    for name, param in served.named:
        weights[name] = param.data.clone()
        served.merge_into(name, weights[name])
    merged = lora_model(base).merge_and_unload().state_dict()
    assert set(weights) == set(plain.state_dict()) - {"lm_head.weight"}, "the base model's names, tied head aside"
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, merged[name], msg=name)


def test_adapters_added_in_one_gemm_are_peft_and_copy_no_output_gradient(tmp_path):
    """`lora.add_in_place` against PEFT's own forward: the same logits and gradients, and a backward with no
    CopySlices (an in-place add into a view of the base's output had autograd clone that output's gradient and copy
    it back at every adapted layer: on GPU, 0.3 s of a 3B LoRA update)."""
    base, ids = lora_base(tmp_path / "base"), torch.randint(2, 13, (3, 7))
    runs = []
    for one_gemm in (False, True):
        model = lora_model(base)
        if one_gemm:
            assert add_in_place(model) == 14, "every linear layer of the 2 decoder layers"
        loss = model(ids).logits.float().pow(2).mean()
        nodes, seen = [loss.grad_fn], set()
        while nodes:
            node = nodes.pop()
            if node is not None and node not in seen:
                seen.add(node)
                nodes += [next_fn for next_fn, _ in node.next_functions]
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        runs.append((loss, grads, {type(node).__name__ for node in seen}))
    (peft_loss, peft_grads, _), (loss, grads, nodes) = runs
    assert "CopySlices" not in nodes and "AddmmBackward0" in nodes
    torch.testing.assert_close(loss, peft_loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, peft_grads[name], msg=name)


def test_the_embedded_engine_serves_an_adapter_to_the_requests_that_name_it_and_to_no_other(tmp_path):
    """The engine applies a PEFT adapter unmerged, as PEFT does in the trainer; a request without the adapter's
    name gets the base; once the client serves an adapter, every /generate it sends names it, and so does the probe."""
    base = lora_base(tmp_path / "base")
    model = lora_model(base)
    model.save_pretrained(tmp_path / "adapter")
    engine = Engine(str(base), lora=(4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    engine.adapters.load("v1", str(tmp_path / "adapter"))
    ids = torch.randint(2, 13, (9,)).tolist()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1).gather(
            -1, torch.tensor(ids[1:])[:, None]
        )
        with reference_off(model):
            base_lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)
    got = [lp for lp, _, _ in engine.prompt_logprobs(ids, 1, engine.adapters.named("v1"))]
    torch.testing.assert_close(torch.tensor(got), want[:, 0], atol=1e-6, rtol=0)
    bare = [lp for lp, _, _ in engine.prompt_logprobs(ids, 1)]
    torch.testing.assert_close(torch.tensor(bare), base_lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
    with pytest.raises(BadRequest, match="not loaded: v2"):
        engine.adapters.named("v2")
    engine.stop()

    from aiohttp import web

    from dsrl.serving.embedded import build_app
    from dsrl.sync.verify import probe_servers

    server = Engine(str(base), lora=(4, None))
    server.adapters.load("dsrl-v1", str(tmp_path / "adapter"))
    port, runner = free_port(), None
    client = RolloutClient([f"http://127.0.0.1:{port}"])

    async def start():
        nonlocal runner
        runner = web.AppRunner(build_app(server))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    client.run(start())
    try:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "return_logprob": True,
                "logprob_start_len": 0}  # fmt: skip
        plain = client.run(client.generate(body))
        client.adapter = ServedAdapter("dsrl-v1", 1)
        named = client.run(client.generate(body))
        served = torch.tensor([[lp for lp, _, _ in named["meta_info"]["input_token_logprobs"][1:]]])
        worst = client.run(probe_servers(client, [ids], served, tolerance=1e-6, flush=False))  # (the bare base: ~1)
    finally:
        client.run(runner.cleanup())
        client.close()
        server.stop()
    logprobs = [[lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]] for out in (plain, named)]
    torch.testing.assert_close(torch.tensor(logprobs[0]), torch.tensor(bare))
    torch.testing.assert_close(torch.tensor(logprobs[1]), want[:, 0], atol=1e-6, rtol=0)
    assert worst == 0.0, "the probe names the adapter too"
    assert named["adapter_version"] == 1 and "adapter_version" not in plain


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base, run_dir = lora_base(root / "base"), root / "run"
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs/toy_cpu.yaml"),
           "--model.path", str(base), "--model.init_from_config", "false", "--model.lora_rank", "8",
           "--trainer.lr", "1e-2", "--algorithm.kl_coef", "0.001", "--trainer.total_steps", str(STEPS),
           "--logging.save_every", str(STEPS), "--eval.path", "null", "--logging.run_dir", str(run_dir)]  # fmt: skip
    return base, run_dir, run_to_end(cmd)


def test_lora_trains_only_the_adapters_and_the_servers_match_the_trainer(lora_run):
    _, run_dir, log = lora_run
    trained = re.search(r"LoRA rank 8: ([\d,]+) trained parameters of ([\d,]+)", log)
    assert trained, "the adapters' share is logged"
    adapters = sum(t.numel() for t in load_adapter(run_dir / "adapter").values())
    assert int(trained[1].replace(",", "")) == adapters < int(trained[2].replace(",", "")) / 4
    final = json.loads((run_dir / "final_metrics.json").read_text())
    # After each sync the server's sampled-token logprobs are the trainer's with the adapters on:
    assert final["mismatch/logprob_max_abs_diff"] < 1e-4
    assert final["sync/bytes"] == 4 * adapters, "an update sends the adapter alone (fp32: 4 bytes each)"
    assert [p.name for p in (run_dir / "weights").iterdir()] == [f"dsrl-v{STEPS}"], "old adapters are unloaded"
    assert final["kl/old_ref_k1"] > 0, "the reference is the base: the trained adapters move away from it"
    rewards = [float(r) for r in re.findall(r"step \d+/\d+ \| reward ([\d.]+)", log)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, f"reward {first:.3f} -> {last:.3f}: the toy task learns with LoRA"


def load_adapter(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "adapter_model.safetensors")


def test_exported_adapter_loads_with_peft_and_equals_the_merged_exports(lora_run, tmp_path):
    base, run_dir, _ = lora_run
    ids = torch.randint(2, 13, (4, 6))
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run_dir / "adapter")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf")(ids).logits
    torch.testing.assert_close(merged, peft, atol=1e-4, rtol=1e-4)
    out = tmp_path / "exported"
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS}"
    subprocess.run([sys.executable, "-m", "dsrl.cli", "export", "--checkpoint", str(checkpoint), "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(out)(ids).logits
        from_checkpoint = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out / "adapter")
        torch.testing.assert_close(exported, merged, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(from_checkpoint(ids).logits, merged, atol=1e-4, rtol=1e-4)


def test_merged_lora_leaves_the_servers_with_the_trainers_weights(tmp_path):
    """--sync.verify weights compares every server weight with the trainer's after each sync (the merged weights),
    and the probe the served policy: both pass, and the server's sampled-token logprobs are the trainer's. (The
    adapter served alone: `lora_run` on a replicated base, and on a partitioned one
    `test_ppo_with_critic_adapters_on_one_base_learns`.)"""
    base = lora_base(tmp_path / "base")
    args = ["--model.path", str(base), "--model.init_from_config", "false", "--model.lora_rank", "4"]
    args += ["--model.lora_base", "replicated"]
    args += ["--sync.lora", "merged", "--sync.verify", "weights", "--trainer.lr", "1e-2", "--trainer.total_steps", "3"]
    log = run_to_end(train_cmd("toy_cpu.yaml", tmp_path / "run", *args, "--eval.path", "null"))
    a = scalars(tmp_path / "run")
    assert max(a["mismatch/logprob_max_abs_diff"].values()) < 1e-4
    full = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(base).parameters())
    assert a["sync/bytes"][3] == full, (a["sync/bytes"][3], full)
    assert "step 3/3" in log
    assert "the frozen base whole on every rank" in log


@pytest.mark.parametrize("ranks", [2, 1])
def test_adapters_get_a_plain_peft_models_gradients_on_either_base(ranks, tmp_path):
    """On a base partitioned by ZeRO-3, which gathers each decoder layer whole, adapters included
    (`gather_per_layer`), and on a base every rank holds whole (`--model.lora_base replicated`, ZeRO-2 adapters),
    for the actor and for the actor and critic adapters on one base (two backward passes, gradient checkpointing):
    every adapter's gradient equals a plain PEFT model's, reduced over the ranks; the policy is its policy and the
    reference its base."""
    base, out = lora_base(tmp_path / "base"), tmp_path / "results.json"
    run_ranks(ranks, ROOT / "tests/_lora_worker.py", base, out)
    results = json.loads(out.read_text())
    assert results["world"] == ranks
    for case in ("actor_partitioned", "critic_partitioned", "actor_replicated", "critic_replicated"):
        r, partitioned = results[case], case.endswith("_partitioned")
        assert r["zero3"] == partitioned, f"{case}: the base is {'not ' if partitioned else ''}in ZeRO-3"
        assert r["leaves"] == (2 if partitioned else 0) and r["layers"] == 2, f"{case}: layers gathered whole or none"
        assert r["missing"] == [] and r["grad_min_norm"] > 1e-3, f"{case}: every adapter has a gradient"
        assert r["grad_diff"] < 1e-5, f"{case}: adapters' gradients differ from PEFT's by {r['grad_diff']}"
        assert r["policy_diff"] < 1e-5 and r["reference_diff"] < 1e-5 < 0.1 < r["adapters_change_policy"], r
    for base in ("partitioned", "replicated"):
        actor, critic = results[f"actor_{base}"]["trained"], results[f"critic_{base}"]["trained"]
        assert len(critic) == 2 * len(actor) + 2, "two adapters and a head"


def policy_and_value(base: Path, checkpointing: bool):
    from dsrl.config import ModelConfig
    from dsrl.zero.engine import add_lora

    torch.manual_seed(1)
    m = ModelConfig(path=str(base), lora_rank=4, gradient_checkpointing=checkpointing)
    model = add_lora(AutoModelForCausalLM.from_pretrained(base), m, critic=True, checkpointing=checkpointing)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    return model.train()


def test_the_critic_is_a_second_adapter_and_a_head_on_the_actors_base(tmp_path):
    """PPO with LoRA has one base: the policy is the base with the actor's adapter, the values the base with
    the critic's adapter and a scalar head, the reference the base alone. Each loss trains its own adapter
    alone, and gradient checkpointing (which recomputes each layer during the backward pass, when the
    actor's adapter is on again) gives the same gradients."""
    from dsrl.zero.critic import CRITIC

    base = lora_base(tmp_path / "base")
    model, plain = policy_and_value(base, False), AutoModelForCausalLM.from_pretrained(base)
    ids = torch.randint(2, 13, (3, 7))

    def adapter_alone(name: str):  # one of the two adapters as a PEFT model of its own
        alone, weights = lora_model(base), dict(model.named_parameters())
        for n, p in alone.named_parameters():
            if ".lora_" in n:
                p.data.copy_(weights[n.replace(".default.", f".{name}.")])
        return alone

    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, adapter_alone("default")(ids).logits)
        with reference_off(model):
            torch.testing.assert_close(model(ids).logits, plain(ids).logits)
        critic_only = adapter_alone(CRITIC)
        hidden = critic_only.get_base_model().model(ids).last_hidden_state
        torch.testing.assert_close(model(ids, values=True).logits, model.value_head(hidden))

    def grads(model, which: str) -> dict[str, torch.Tensor]:
        model.zero_grad()
        loss = model(ids).logits.logsumexp(-1).mean() if which != "critic" else 0
        if which != "actor":
            loss = loss + model(ids, values=True).logits.square().mean()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    joint = grads(model, "both")
    assert {n for n in joint if ".lora_" in n} == {n for n, p in model.named_parameters() if ".lora_" in n}
    actor, critic = grads(model, "actor"), grads(model, "critic")
    assert all(".default." in n for n in actor) and all(".default." not in n for n in critic)
    for name, g in joint.items():
        torch.testing.assert_close(g, (actor | critic)[name], msg=name)
    checkpointed = grads(policy_and_value(base, True), "both")
    assert checkpointed.keys() == joint.keys()
    for name, g in checkpointed.items():
        torch.testing.assert_close(g, joint[name], msg=name)


def test_ppo_with_critic_adapters_on_one_base_learns(tmp_path):
    """PPO with a critic, all LoRA: the actor's adapter, the critic's adapter and value head, and the reference
    share one frozen base in one engine. The toy task learns (0.03 -> 0.23 in 32 steps, first/last five; asked a
    rise of 0.1; 0.31 at 40), the critic tracks the returns, and what is exported is the actor's adapter alone.
    Packed micro-batches; the base partitioned by ZeRO-3 (`lora_run` and the resume test in test_ppo.py:
    replicated, the default on a small one)."""
    base, run_dir = lora_base(tmp_path / "base"), tmp_path / "run"
    args = ["--model.path", str(base), "--model.init_from_config", "false", "--model.lora_rank", "8"]
    args += ["--model.lora_base", "partitioned"]
    args += ["--trainer.lr", "1e-2", "--critic.lr", "2e-2", "--trainer.total_steps", "32", "--eval.path", "null"]
    args += ["--logging.save_every", "32", "--logging.export_hf", "true", "--trainer.pack_sequences", "true"]
    log = run_to_end(train_cmd("toy_cpu_ppo.yaml", run_dir, *args))
    assert "the critic is a second LoRA adapter and a value head on the actor's base" in log
    assert "ZeRO-3 gathers 2 layers (Qwen2DecoderLayer) whole" in log
    assert "packed micro-batches, no padding" in log  # (the values' forward passes the boundaries through PEFT)
    a = scalars(run_dir)
    reward, value_loss = list(a["reward/mean"].values()), list(a["critic/value_loss"].values())
    assert sum(reward[-5:]) / 5 > sum(reward[:5]) / 5 + 0.1, reward
    assert sum(value_loss[:3]) / 3 > 2 * sum(value_loss[8:16]) / 8, value_loss
    assert (a["actor/lr"][32], a["critic/lr"][32]) == pytest.approx((1e-2, 2e-2)), "one engine, two learning rates"
    out = tmp_path / "exported"  # from the checkpoint, which holds both adapters and the head
    subprocess.run([sys.executable, "-m", "dsrl.cli", "export", "--checkpoint", str(run_dir / "checkpoints/step_32"),
                    "--out", str(out)], cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    actor = sum(p.numel() for n, p in lora_model(base, rank=8).named_parameters() if ".lora_" in n)
    ids = torch.randint(2, 13, (4, 6))
    for adapter in (run_dir / "adapter", out / "adapter"):
        assert sum(t.numel() for t in load_adapter(adapter).values()) == actor, "the actor's adapter alone"
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf")(ids).logits
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out)(ids).logits, merged, atol=1e-5, rtol=0)
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out / "adapter")(ids).logits
        torch.testing.assert_close(peft, merged, atol=1e-4, rtol=1e-4)
