"""Correctness gates: one batch gives one update on any layout of the trainer (`tests/_parity_worker.py`); a sync
restores a server's corrupted weights, every transport and mode (`tests/_restore_worker.py`)."""

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, run_ranks

WORLDS = (1, 2, 4)
LR = 1e-3
"""The worker's trainer.lr (and critic.lr)."""


@pytest.fixture(scope="module")
def layouts(toy_weights, tmp_path_factory):
    """{world: {(family, estimator, rows, token budget, checkpointing): figures}}, one process group per world."""
    out = tmp_path_factory.mktemp("parity")
    results = {}
    for world in WORLDS:
        run_ranks(world, ROOT / "tests/_parity_worker.py", toy_weights, out / f"{world}.pt")
        saved = torch.load(out / f"{world}.pt", weights_only=False)
        assert saved["world"] == world
        results[world] = saved["results"]
    return results


@pytest.mark.slow
@pytest.mark.parametrize("family", ["full", "lora"])
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_layout_parity_one_update_is_the_same_on_any_ranks_rows_budget_and_checkpointing(layouts, family, estimator):
    """13 layouts of one update (1 and 2 ZeRO-3 ranks x padded, packed x token budget 160 without gradient
    checkpointing, 24 without, 24 with; 4 ranks, packed (grpo) or padded (gae), 24 with), each against 1 rank, padded,
    160 without. Its batch has long-tail lengths, two agent episodes with masked environment tokens, unequal token
    totals per rank, and (gae) a critic of its own or, with LoRA, a second adapter. Bounds, about 2x the largest seen
    over the 72 layouts of 1, 2 and 4 ranks (every row layout, budget and checkpointing on each), CPU, fp32:

    - the loss (actor/pg_loss, critic/value_loss as the run logs them, ~0.1): |diff| <= 1e-7 (seen 4.3e-8);
    - the grad norm (actor's, critic's, DeepSpeed's global one): relative diff <= 2e-7 (seen 8.7e-8);
    - each gradient, reduced, before the optimizer step: |diff| <= 5e-6 x the tensor's largest (seen 2.3e-6: the sums
      over tokens and ranks come in another order; fp32's epsilon is 1.2e-7);
    - the updated weights, where the reference gradient is >= 1e-4: |diff| <= 4 fp32 ulps of max(|w|, lr) (seen
      2.9). Adam's first step is lr g / (|g| + eps), eps 1e-8, which multiplies a gradient's rounding by
      eps / (|g| + eps)^2: where |g| < 1e-4 the weights agree within 1% of lr (seen 0.49%)."""
    ref = layouts[1][(family, estimator, "padded", 160, False)]
    assert all(g.abs().max() > 0 for g in ref["grads"].values())  # every trained tensor has a gradient to compare
    ulp = torch.finfo(torch.float32).eps
    seen = 0
    for world, results in layouts.items():
        for key, got in results.items():
            if key[:2] != (family, estimator):
                continue
            seen += 1
            where = f"{world} ranks, {key}"
            assert got["metrics"].keys() == ref["metrics"].keys()
            for name, value in got["metrics"].items():
                want = ref["metrics"][name]
                if name.endswith("_loss"):
                    assert abs(value - want) <= 1e-7, (where, name, value, want)
                else:
                    assert abs(value - want) <= 2e-7 * want, (where, name, value, want)
            assert got["grads"].keys() == ref["grads"].keys() == got["weights"].keys()
            for name, grad in got["grads"].items():
                want = ref["grads"][name]
                assert (grad - want).abs().max() <= 5e-6 * want.abs().max(), (where, name)
            for name, weight in got["weights"].items():
                want, sign_like = ref["weights"][name], ref["grads"][name].abs() >= 1e-4
                diff = (weight - want).abs()
                assert (diff[sign_like] <= 4 * ulp * want.abs().clamp(min=LR)[sign_like]).all(), (where, name)
                assert (diff[~sign_like] <= 0.01 * LR).all(), (where, name)
    assert seen == 13


@pytest.fixture(scope="module")
def restored(toy_weights, tmp_path_factory):
    """`tests/_restore_worker.py` on 2 ranks: every CPU transport and mode, corrupted, then synced."""
    from transformers import AutoModelForCausalLM

    from dsrl.tasks import toy

    root = tmp_path_factory.mktemp("restore")
    torch.manual_seed(0)
    moe = AutoModelForCausalLM.from_config(toy.build_moe_config())
    for p in moe.parameters():
        p.data.normal_(std=0.3)
    moe.save_pretrained(root / "moe")
    toy.build_tokenizer().save_pretrained(root / "moe")
    run_ranks(2, ROOT / "tests/_restore_worker.py", toy_weights, root / "moe", root / "out.json")
    return json.loads((root / "out.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["broadcast", "disk", "lora_merged", "moe", "fp8_broadcast", "fp8_disk"])
def test_corrupt_then_restore_every_weight_the_server_holds(restored, case):
    """Every weight a server holds (each name of the checkpoint it started from, a mixture of experts' per-expert
    tensors included) overwritten in place with random values; after the next sync (2 ZeRO-3 ranks) the server holds
    the trainer's new weights: exactly (--sync.verify weights passed, and each parameter read back equals the
    trainer's), or for FP8 servers exactly the trainer's weight through FP8 and back, within FP8's stated error (< 3%
    of a tensor's norm, `test_round_trip_error_is_e4m3s_per_block`; seen 2.7%). (CUDA IPC has no CPU path.)"""
    got = restored[case]
    assert restored["world"] == 2
    assert got["error"] is None
    assert got["unsent"] == []  # the trainer sends every name the server holds
    assert got["corrupted"] == got["params"] > 0  # and every one differed before the sync
    assert got["differ"] == []
    if case == "moe":
        assert got["experts"] == 4 * 8 * 3  # layers x experts x (gate, up, down)
    if case.startswith("fp8"):
        assert got["quantized"] == 14 and 0 < got["fp8_rel_error"] < 0.03  # 2 layers x 7 projections


@pytest.mark.slow
def test_corrupt_then_restore_a_served_adapter(restored):
    """LoRA served as an adapter: an adapter replaced in place under the served name (the probe sees it) is the
    trainer's after the next sync, which loads the next version's (probe: the same logprobs, fp32 on both sides), and
    the base is untouched. The base is sent once, so a base changed behind dsrl's back stays changed (until the fleet
    changes): --sync.verify weights names it and the update fails, rather than training on it."""
    got = restored["lora_adapter"]
    assert got["probe_corrupted"] > 1e-3 and got["probe_restored"] <= 1e-6
    assert got["base_differ"] == []
    assert "differs from the trainer's" in got["base_corrupted_error"]


# -- the GPU gate's checker (tools/baselines.py), on records of GPU runs and on canned ones ----------------------------

TAIL_RECORDS = [f"docs/peers_runs/issue62/{d}/peers.json" for d in
                ("h200x2_tail_1.5b_auto_r0", "h200_tail_1.5b_auto_r1", "h200x2_tail_1.5b_auto_r2")]  # fmt: skip


def gate(*args) -> tuple[int, str]:
    import contextlib
    import io
    import runpy

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = runpy.run_path(str(ROOT / "tools/baselines.py"))["main"]([str(a) for a in args])
    return code, printed.getvalue()


def test_the_gate_holds_its_baselines_runs_and_names_a_step_15_percent_slower_and_a_peak_1_percent_higher(tmp_path):
    baseline = ROOT / "tools/baselines/gate_tail_1.5b.json"
    for record in TAIL_RECORDS:
        code, out = gate("check", baseline, ROOT / record)
        assert code == 0 and "held: 7 figures" in out, out
    run = json.loads((ROOT / TAIL_RECORDS[1]).read_text())["runs"]["auto dsrl 1.5b r1"]
    entry = json.loads(baseline.read_text())["entries"]["1.5b bf16 tail, 1 GPU"]
    figures = {f: s["value"] for f, s in entry["figures"].items()}

    def record(**scale) -> Path:  # every step at the baseline's figures x scale
        steps = [{f: v * scale.get(f.split("/")[1], 1.0) for f, v in figures.items()} for _ in range(11)]
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps({"runs": {"dsrl-auto 1.5b": {**run, "steps": steps}}}))
        return path

    code, out = gate("check", baseline, record(step=1.14, update=1.149, update_peak_gb=1.009, gb_per_s=1 / 1.149))
    assert code == 0 and "held: 7 figures" in out, out
    code, out = gate("check", baseline, record(step=1.16, update_peak_gb=1.011, gb_per_s=1 / 1.16, logprob_abs_diff=2))
    flagged = out.split("FLAGGED: ")[1]
    assert code == 1 and "timing/step 6.352 against 5.476 (more than 15% slower)" in flagged, out
    assert "memory/update_peak_gb 83.53 against 82.62 (more than 1% higher)" in flagged
    assert "sync/gb_per_s" in flagged and "mismatch/logprob_abs_diff" in flagged and "timing/update" not in flagged
    code, out = gate("check", baseline, ROOT / "docs/gpu_runs/gpu_dec02/gate_peers.json")  # cut after 3 of 11 steps
    assert code == 1 and "dsrl-auto 1.5b: ended rc=timeout after 3 steps" in out.split("FLAGGED: ")[1], out
    code, out = gate("check", baseline, ROOT / "docs/gpu_runs/moe_nov27/soak.json")  # no run of the gate's
    assert code == 1 and "nothing was checked" in out


def test_the_mismatch_bounds_flag_the_run_that_lost_its_kv_cache_scales_and_moe_without_replay(tmp_path):
    """The bounds (tools/baselines/mismatch.json) against runs they were not made from: FP8 7B with its KV cache in FP8
    before the scales' fix (docs/gpu_runs/fp8_levers_7b_nov28: 1.80, the fix's 0.64), and a soak record of the MoE
    whose replayed run had the mismatch of one without replay."""
    bounds = ROOT / "tools/baselines/mismatch.json"
    code, out = gate("check", bounds, ROOT / "docs/gpu_runs/fp8_levers_7b_nov28/fp8_7b_peers.json")
    assert code == 1 and out.split("FLAGGED: ")[1].strip() == (
        "dsrl-moments-fp8kv 7b: mismatch/logprob_abs_diff 1.805 against 0.77 (above its bound)"
    )
    soak = json.loads((ROOT / "docs/gpu_runs/moe_nov27/soak.json").read_text())
    soak[0]["medians"]["mismatch/logprob_abs_diff"] = soak[1]["medians"]["mismatch/logprob_abs_diff"]  # 0.01
    (tmp_path / "soak.json").write_text(json.dumps(soak))
    code, out = gate("check", bounds, tmp_path / "soak.json")
    assert code == 1 and "FLAGGED: moe4: mismatch/logprob_abs_diff 0.01 against 0.006" in out, out


@pytest.mark.parametrize("name", ["gate_tail_1.5b.json", "mismatch.json"])
def test_a_committed_baseline_is_what_its_records_give(name, tmp_path, monkeypatch):
    """Each baseline file says which records made it (`about`: the command); `make` gives its values again."""
    import shlex

    committed = json.loads((ROOT / "tools/baselines" / name).read_text())
    argv = shlex.split(committed["about"].split("Regenerate: ")[1])
    assert argv[:4] == ["python3", "tools/baselines.py", "make", f"tools/baselines/{name}"]
    copy = tmp_path / name
    copy.write_text(json.dumps(committed))
    monkeypatch.chdir(ROOT)  # (the records by the paths the command gives)
    assert gate("make", copy, *argv[4:])[0] == 0
    assert json.loads(copy.read_text()) == committed


def test_the_gates_run_is_its_baselines_command():
    """tools/gpu_run.sh `gate` runs peers.py's dsrl-auto: the command of the baseline's runs (pair `auto`'s dsrl side),
    but for the machine's paths."""
    import re
    import sys

    sys.path.insert(0, str(ROOT / "tools/peers"))
    import peers

    def flags(words: list[str]) -> dict[str, str]:
        return {w.split(" ", 1)[0]: w.split(" ", 1)[1] for w in words if w.startswith("--")}

    paths = {"--config", "--model.path", "--data.train_path", "--logging.run_dir"}
    gate_run = peers.dsrl_command(peers.WORKLOADS["tail"], Path("m"), Path("d"), Path("r"), 11, 0, "dsrl-auto")
    gate_run = flags([f"{k} {v}" for k, v in zip(gate_run[4::2], gate_run[5::2])])
    recorded = json.loads((ROOT / TAIL_RECORDS[0]).read_text())["runs"]["auto dsrl 1.5b r0"]["command"]
    recorded = flags(re.split(r" (?=--[a-z])", recorded))
    assert {k: v for k, v in gate_run.items() if k not in paths} == {
        k: v for k, v in recorded.items() if k not in paths
    }
