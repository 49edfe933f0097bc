"""The harness beside verl (tools/peers), what of it runs without a GPU: the data and reward both frameworks get,
and the table's reading of each framework's own metrics, from a harness run on an H200 (tests/data/peers, 1.5B,
64 x 8 x 512): verl's console lines as its console logger printed them (one step: the call's time ran out in its
second), the same step in its file logger's JSON-line format, and dsrl's per-step metrics as the harness kept them."""

import json
import math
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from transformers import AutoTokenizer

from dsrl.config import DataConfig
from dsrl.data import PromptDataset
from dsrl.rewards.pool import call_reward
from dsrl.tasks import toy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools/peers"))
DATA = ROOT / "tests/data/peers"

import peers  # noqa: E402
import report  # noqa: E402
import verl_reward  # noqa: E402


def test_both_frameworks_get_the_same_tokens_answers_and_rewards(tmp_path):
    rows = toy.make_rows(6, seed=2)
    path = peers.write_parquet(rows, tmp_path / "train.parquet")
    tokenizer = AutoTokenizer.from_pretrained(peers.chat_model(ROOT / "examples/toy/model", tmp_path / "model"))
    verl_row = pq.read_table(path).to_pylist()[0]
    # verl: its dataset hands the row's messages to its agent loop, which applies the chat template
    verl_ids = tokenizer.apply_chat_template(verl_row["prompt"], add_generation_prompt=True, tokenize=True)
    verl_ids = verl_ids if isinstance(verl_ids, list) else verl_ids["input_ids"]  # (a dict in transformers 5)
    prompt = PromptDataset(DataConfig(train_path=str(path), answer_key="reward_model.ground_truth"), tokenizer).prompts[
        0
    ]
    assert prompt.prompt_ids == verl_ids == tokenizer(rows[0]["prompt"])["input_ids"]
    assert prompt.answer == verl_row["reward_model"]["ground_truth"] == rows[0]["answer"]
    for response in (rows[0]["answer"], rows[0]["answer"][:-1] + "x"):
        verl_args = {k: verl_row[k] for k in ("data_source", "extra_info")}
        by_verl = verl_reward.compute_score(solution_str=response, ground_truth=prompt.answer, **verl_args)
        by_dsrl = call_reward(verl_reward.compute_score, prompt.text, response, prompt.answer, prompt.row)
        assert by_verl == by_dsrl == toy.reward(prompt.text, response, rows[0]["answer"])


def test_verl_metrics_from_its_file_and_console_loggers():
    from_file = report.verl_steps(DATA / "verl_metrics.jsonl")
    from_console = report.verl_steps(None, (DATA / "verl_console.log").read_text())
    assert len(from_file) == len(from_console) == 1 and from_file == from_console
    assert from_file[0]["timing_s/step"] == 129.692468648 and "training/global_step" not in from_file[0]
    step = report.phases("verl", from_file[-1])
    parts = sum(step[p] for p in (*report.PHASES, "other"))
    assert math.isclose(parts, step["step"]) and step["generate"] == from_file[-1]["timing_s/gen"]


def test_dsrl_metrics_from_tensorboard(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    logged = json.loads((DATA / "dsrl_steps.json").read_text())
    writer = SummaryWriter(str(tmp_path / "tensorboard"))
    for i, metrics in enumerate(logged, 1):
        for key, value in metrics.items():
            writer.add_scalar(key, value, i)
    writer.close()
    steps = report.dsrl_steps(tmp_path)
    assert len(steps) == len(logged) and math.isclose(steps[-1]["timing/step"], logged[-1]["timing/step"], rel_tol=1e-6)
    step = report.phases("dsrl", steps[-1])
    assert math.isclose(step["generate"], steps[-1]["timing/generate"] + steps[-1]["timing/release"])


def test_the_table_puts_both_on_the_same_phases():
    verl = report.verl_steps(DATA / "verl_metrics.jsonl")
    dsrl = json.loads((DATA / "dsrl_steps.json").read_text())
    same = {"workload": "step model_1.5b", "samples": 512, "gpu_peak_gb": 100.0, "host_peak_gb": 20.0}
    record = {"runs": {"verl 1.5b": {"framework": "verl", "steps": verl, **same},
                       "dsrl 1.5b": {"framework": "dsrl", "steps": dsrl, **same}}}  # fmt: skip
    text = report.table(record)
    # verl logged one step, dsrl two: the ratio is of the first steps, each run's steady mean where it has one
    ratio = report.steady("dsrl", dsrl, first=True)["step"] / report.steady("verl", verl)["step"]
    assert f"dsrl step / verl step = {ratio:.2f} (first steps; beside verl 1.5b, on another or unrecorded GPU)" in text
    assert text.count("| verl 1.5b | verl |") == 1 and text.count("| dsrl 1.5b | dsrl |") == 2
    assert "| 1 after the first | **17.15** |" in text and "failed" not in text
    header, rule = text.splitlines()[:2]
    assert rule.count("|---") == header.count("|") - 1  # a column of the rule for each of the header's


def test_the_ratio_is_taken_beside_verl_on_the_same_gpu():
    """Step times differ by up to 25% between hosts: a dsrl run's ratio is over the verl run on its GPU (the records'
    nvidia-smi UUID), wherever that run is in the record, and says so; without one, over the first verl run."""
    verl = report.verl_steps(DATA / "verl_metrics.jsonl")
    dsrl = json.loads((DATA / "dsrl_steps.json").read_text())
    faster = [{k: v / 2 if k.startswith("timing_s/") else v for k, v in s.items()} for s in verl]
    same = {"workload": "step model_1.5b", "samples": 512}
    record = {"runs": {"verl elsewhere": {"framework": "verl", "steps": faster, "gpu": "GPU-a", **same},
                       "verl here": {"framework": "verl", "steps": verl, "gpu": "GPU-b", **same},
                       "dsrl here": {"framework": "dsrl", "steps": dsrl, "gpu": "GPU-b", **same},
                       "dsrl unknown": {"framework": "dsrl", "steps": dsrl, **same}}}  # fmt: skip
    text = report.table(record)
    mine, theirs = report.steady("dsrl", dsrl, first=True)["step"], report.steady("verl", verl)["step"]
    assert f"dsrl here: dsrl step / verl step = {mine / theirs:.2f} (first steps; on one GPU, beside verl here)" in text
    assert f"dsrl unknown: dsrl step / verl step = {2 * mine / theirs:.2f} (first steps; beside verl elsewhere" in text


def test_runs_from_separate_calls_make_one_table(tmp_path):
    """verl and dsrl in a call each (verl's start-up does not leave room for both): their records merge, the same
    run name from two calls is kept twice, a run cut off before its first step gives way to its rerun, and the
    ratio is drawn across them."""
    verl = report.verl_steps(DATA / "verl_metrics.jsonl")
    dsrl = json.loads((DATA / "dsrl_steps.json").read_text())
    same = {"workload": "step model_1.5b", "samples": 512}
    cut = {"framework": "dsrl", "steps": [], "rc": "timeout", **same}
    for call, runs in (("call1", {"verl 1.5b": {"framework": "verl", "steps": verl, **same}, "dsrl 1.5b": cut}),
                       ("call2", {"dsrl 1.5b": {"framework": "dsrl", "steps": dsrl, **same}}),
                       ("call3", {"dsrl 1.5b": {"framework": "dsrl", "steps": dsrl[:1], **same}})):  # fmt: skip
        (tmp_path / call).mkdir()
        (tmp_path / call / "peers.json").write_text(json.dumps({"runs": runs}))
    record = report.merged([tmp_path / c for c in ("call1", "call2", "call3")])
    assert list(record["runs"]) == ["verl 1.5b", "dsrl 1.5b", "dsrl 1.5b (call3)"]
    assert record["runs"]["dsrl 1.5b"]["steps"] == dsrl
    assert report.table(record).count("dsrl step / verl step") == 2 and "failed" not in report.table(record)


def test_a_verl_run_without_a_record_is_read_from_its_console_log(tmp_path):
    """A call that ended before the harness wrote verl's record leaves its log: it joins the table by its name."""
    log = tmp_path / "verl_step_s1.log"
    log.write_text((DATA / "verl_console.log").read_text())
    dsrl = json.loads((DATA / "dsrl_steps.json").read_text())
    (tmp_path / "call").mkdir()
    runs = {"dsrl 1.5b": {"framework": "dsrl", "workload": "step", "samples": 512, "steps": dsrl}}
    (tmp_path / "call" / "peers.json").write_text(json.dumps({"runs": runs}))
    record = report.merged([tmp_path / "call", log])
    verl = record["runs"]["verl step seed 1"]
    assert verl["steps"] == report.verl_steps(DATA / "verl_metrics.jsonl") and verl["samples"] == 512
    assert "dsrl step / verl step" in report.table(record)
    (tmp_path / "again").mkdir()  # the same run's log from another call is kept too, named by its folder
    (tmp_path / "again" / log.name).write_text(log.read_text())
    assert "verl step seed 1 (again)" in report.merged([log, tmp_path / "again" / log.name])["runs"]


def test_a_run_is_cut_to_what_is_left_of_the_budget_less_the_time_to_stop_it():
    """The toy's second GPU call: dsrl then verl under a 575 s stage, verl asked for 370 s. Killed from outside, the
    harness wrote no record of verl's 22 steps; cut to the budget, verl stops first and its steps are kept."""
    budget = 575 - 20
    assert peers.run_limit(170, budget, now=20) == 170
    assert peers.run_limit(370, budget, now=210) == budget - 210 - peers.STOP_S < 370
    assert peers.run_limit(370, float("inf"), now=1e6) == 370


def test_the_toy_tokenizer_gets_the_tokens_verls_qwen2_agent_loop_needs(tmp_path):
    """verl's agent loop for a Qwen2 model asks for a one-token newline and <|im_end|> (the GPU run failed without):
    two unused slots of the padded toy tokenizer take them, so every id stays in the model's vocabulary."""
    src = tmp_path / "src"
    toy.build_tokenizer(16).save_pretrained(src)
    (src / "config.json").write_text((ROOT / "examples/toy/model/config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(peers.chat_model(src, tmp_path / "model"))
    assert tokenizer.encode("\n", add_special_tokens=False) == [14]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 15
    assert tokenizer("394=")["input_ids"] == toy.build_tokenizer(16)("394=")["input_ids"]


def test_a_detached_job_outlives_its_call_and_wait_brings_back_what_it_wrote(tmp_path):
    """tools/gpu_detach.sh, as the GPU calls use it: `start` returns at once, the job writes into its OUT, `wait`
    brings that back into the calling command's OUT as one archive (a call returns at most 8 files), prints the
    summaries and reports the exit status; with no job, `wait` says so at once."""
    env = dict(os.environ, DETACHED_DIR=str(tmp_path / "job"), OUT=str(tmp_path / "call"))
    tool, tree = ["bash", str(ROOT / "tools" / "gpu_detach.sh")], tmp_path / "tree"
    tree.mkdir()
    gone = subprocess.run([*tool, "wait", "30"], env=env, capture_output=True, text=True, timeout=10)
    assert gone.returncode == 3 and "no detached job" in gone.stdout
    job = "sleep 1; mkdir $OUT/a; echo done > $OUT/a/result.txt; echo 'step 3: 16.94 s' > $OUT/a/summary.txt"
    started = subprocess.run([*tool, "start", job], env=env, cwd=tree, capture_output=True, text=True, timeout=10)
    assert started.returncode == 0 and not (tmp_path / "job" / "out" / "a").exists()
    (tmp_path / "call").mkdir()
    waited = subprocess.run([*tool, "wait", "30"], env=env, capture_output=True, text=True, timeout=40)
    assert "done rc=0" in waited.stdout and "== a/summary.txt\nstep 3: 16.94 s" in waited.stdout
    with tarfile.open(tmp_path / "call" / "detached_out.tar.gz") as archive:
        assert archive.extractfile("./a/result.txt").read() == b"done\n"


def test_verl_overrides_replace_a_setting_or_add_one_and_each_key_is_given_once():
    """verl's paths this image may not run (remove-padding) are tried by override; hydra refuses a key given twice,
    so an override replaces the harness's value, and the record says where it came from."""
    over = ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.use_fused_kernels=false"]
    settings = peers.verl_settings(peers.WORKLOADS["step"], Path("m"), Path("d"), Path("w"), 3, 0, overrides=over)
    argv = peers.verl_command(settings)
    keys = [a.split("=", 1)[0] for a in argv[3:]]
    assert len(keys) == len(set(keys))
    assert over[0] in argv and over[1] in argv and "actor_rollout_ref.model.use_fused_kernels=true" not in argv
    assert {s.why for s in settings if s.key in (over[0].split("=")[0], over[1].split("=")[0])} == {"--verl-overrides"}


def test_a_run_that_logged_its_end_but_hangs_is_stopped_after_a_grace_the_rest_at_exit_or_deadline(
    tmp_path, monkeypatch
):
    """verl's last step logged, its process sat in a Ray call until the harness's limit: the harness stops it
    EXIT_GRACE_S after its end shows in the log, so the device time goes to the next run."""
    monkeypatch.setattr(peers, "EXIT_GRACE_S", 1)
    log = tmp_path / "run.log"

    def outcome(code: str, limit: float = 30) -> tuple:
        start = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT)
        rc = peers.wait_for(proc, log, start + limit, peers.VERL_DONE)
        proc.kill()
        proc.wait()
        return rc, time.monotonic() - start

    hang = f"import time; print({peers.VERL_DONE!r} + ': None', flush=True); time.sleep(60)"
    rc, took = outcome(hang)
    assert rc == "finished" and took < 10
    assert outcome("import sys; sys.exit(3)")[0] == 3
    assert outcome("import time; time.sleep(60)", limit=2)[0] == "timeout"


def test_each_dsrl_run_is_a_config_dsrl_reads_differing_from_the_defaults_in_its_one_setting():
    from dsrl.config import build_parser, to_config

    configs = {}
    for name in peers.DSRL_VARIANTS:
        argv = peers.dsrl_command(peers.WORKLOADS["step"], Path("m"), Path("d"), Path("r"), 3, 0, name)
        parser = build_parser()
        configs[name] = to_config(parser, parser.parse_args([str(a) for a in argv[4:]]))
    assert configs["dsrl"].trainer.old_logprobs == "auto" and configs["dsrl"].trainer.pack_sequences == "auto"
    assert configs["dsrl-recompute"].trainer.old_logprobs == "recompute"
    assert configs["dsrl-padded"].trainer.pack_sequences is False
    assert configs["dsrl-padded"].rollout == configs["dsrl-recompute"].rollout == configs["dsrl"].rollout


def test_the_7b_workload_offloads_in_both_frameworks():
    """7B full-parameter on one GPU: verl with its FSDP optimizer offload and gradient checkpointing (the parameters
    on the GPU: offloading them too ran the host out of memory), dsrl with ZeRO-Offload of 60% of the optimizer's
    states, one-step-off colocated, or synchronous as verl is (dsrl-sync); the same batch in both."""
    from dsrl.config import build_parser, to_config, validate

    w = peers.WORKLOADS["7b"]
    verl = _verl(w)
    assert verl["actor_rollout_ref.actor.fsdp_config.param_offload"] == "false"
    assert verl["actor_rollout_ref.actor.fsdp_config.optimizer_offload"] == "true"
    assert verl["actor_rollout_ref.model.enable_gradient_checkpointing"] == "true"
    assert (verl["data.train_batch_size"], verl["actor_rollout_ref.rollout.n"]) == ("16", "4")
    argv = peers.dsrl_command(w, Path("m"), Path("d.parquet"), Path("r"), 3, 0)
    parser = build_parser()
    cfg = to_config(parser, parser.parse_args([str(a) for a in argv[4:]]))
    validate(cfg, 1, check_paths=False)  # one-step-off colocated with TIS: a schedule dsrl accepts on one GPU
    assert cfg.trainer.offload_optimizer and cfg.trainer.offload_optimizer_ratio == 0.6
    assert cfg.rollout.max_staleness == 1 and cfg.algorithm.off_policy == "tis"
    argv = peers.dsrl_command(w, Path("m"), Path("d.parquet"), Path("r"), 3, 0, "dsrl-sync")
    sync = to_config(parser, parser.parse_args([str(a) for a in argv[4:]]))
    validate(sync, 1, check_paths=False)
    assert sync.rollout.max_staleness == 0 and sync.algorithm.off_policy == "none"
    assert sync.trainer.offload_optimizer and sync.trainer.offload_optimizer_ratio == 0.6
    assert (cfg.rollout.prompts_per_step, cfg.rollout.n_samples, cfg.rollout.max_new_tokens) == (16, 4, 256)
    argv = peers.dsrl_command(w, Path("m"), Path("d.parquet"), Path("r"), 3, 0, "dsrl-moments")
    moments = to_config(parser, parser.parse_args([str(a) for a in argv[4:]]))
    validate(moments, 1, check_paths=False)  # Adam on the GPU: no ZeRO-Offload, its moments off while generating
    assert not moments.trainer.offload_optimizer and moments.trainer.offload_states == "moments"
    assert moments.rollout.max_staleness == 0 and moments.model.gradient_checkpointing is True


# -- issue 53: matched pairs, repeats in alternating order, verl at its best, N GPUs, the realistic workload --------


def _verl(w: dict, model: Path = Path("m"), gpus: int = 1, pair: str | None = None, **kw) -> dict[str, str]:
    """verl's argv for `w` as {key: value}."""
    p = peers.PAIRS[pair] if pair else None
    argv = peers.verl_command(peers.verl_settings(w, model, Path("d"), Path("w"), 11, 0, gpus, p, **kw))
    return dict(a.split("=", 1) for a in argv[3:])


def _dsrl(w: dict, gpus: int = 1, pair: str | None = None, name: str = "dsrl"):
    """dsrl's config for `w`, as dsrl parses and checks it (for `gpus` GPUs: the trainer's ranks)."""
    from dsrl.config import build_parser, to_config, validate

    p = peers.PAIRS[pair] if pair else None
    argv = peers.dsrl_command(w, Path("m"), Path("d.parquet"), Path("r"), 11, 0, name, gpus, p)
    parser = build_parser()
    cfg = to_config(parser, parser.parse_args([str(a) for a in argv[4:]]))
    validate(cfg, cfg.trainer.num_ranks, check_paths=False)
    return cfg, argv


def test_pairs_run_their_repeats_back_to_back_and_alternate_which_side_goes_first():
    """Each repeat is verl and dsrl back to back on one host; which one goes first alternates over the repeats and
    over the pairs, so neither side always runs first (verl always did before issue 53); a later call's share
    (--repeat-from) continues the same order."""
    order = peers.schedule(["auto", "recompute"], 3)
    assert order[:6] == [("auto", "verl", 0), ("auto", "dsrl", 0), ("auto", "dsrl", 1), ("auto", "verl", 1),
                         ("auto", "verl", 2), ("auto", "dsrl", 2)]  # fmt: skip
    assert order[6:8] == [("recompute", "dsrl", 0), ("recompute", "verl", 0)]
    assert sorted(order) == sorted((p, s, r) for p in ("auto", "recompute") for s in ("verl", "dsrl") for r in range(3))
    firsts = [order[i][1] for i in range(0, len(order), 2)]
    assert firsts.count("verl") == firsts.count("dsrl") == 3
    assert peers.schedule(["auto"], 2) + peers.schedule(["auto"], 1, start=2) == order[:6]


def test_each_pair_does_the_same_algorithmic_work_on_both_sides():
    """auto: neither side runs a pass for the old log-probs (dsrl's update forward gives them, verl's bypass_mode
    takes the rollout's); recompute: both do (verl's default); offpolicy: one-step-off in both (verl's own
    colocated async trainer). Synchronous unless the pair says otherwise, the same prompts in each step."""
    w = peers.WORKLOADS["tail"]
    auto, _ = _dsrl(w, pair="auto")
    assert auto.trainer.old_logprobs == "auto" and auto.rollout.max_staleness == 0 and not auto.data.shuffle
    verl = _verl(w, pair="auto")
    assert verl["algorithm.rollout_correction.bypass_mode"] == "true" and "trainer.v1.trainer_mode" not in verl
    assert verl["trainer.v1.sampler.custom_sampler.name"] == "QuickPollReplayBuffer" and verl["data.shuffle"] == "false"
    recompute, _ = _dsrl(w, pair="recompute")
    assert recompute.trainer.old_logprobs == "recompute" and recompute.rollout.max_staleness == 0
    assert "algorithm.rollout_correction.bypass_mode" not in _verl(w, pair="recompute")
    off, _ = _dsrl(w, pair="offpolicy")
    assert off.rollout.max_staleness == 1 and off.algorithm.off_policy == "tis" and off.rollout.placement == "colocate"
    verl = _verl(w, pair="offpolicy")
    assert verl["trainer.v1.trainer_mode"] == "colocate_async"
    assert verl["trainer.v1.sampler.custom_sampler.name"] == "QuickPollReplayBufferAsync"
    # the rest of the work is the same in every pair
    rest = {k: v for k, v in _verl(w, pair="auto").items() if not k.startswith(("algorithm.rollout", "trainer.v1"))}
    assert rest == {k: v for k, v in _verl(w, pair="recompute").items() if not k.startswith("trainer.v1")}
    assert (auto.rollout.prompts_per_step, auto.rollout.n_samples) == (32, 8) == (
        int(verl["data.train_batch_size"]), int(verl["actor_rollout_ref.rollout.n"]))  # fmt: skip
    rows = int(verl["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"])  # padded rows: the same positions
    assert abs(rows * (peers.PROMPT_LENGTH + w["new_tokens"]) / auto.trainer.max_tokens_per_micro_batch - 1) < 0.05


def test_verl_runs_at_its_best_and_every_setting_says_why(tmp_path):
    """FSDP2, fused kernels on every workload (the toy's too), dynamic batch sizes, its replay buffer's poll at
    0.05 s through its custom-sampler hook (2 s when asked), no remove-padding (no flash-attn for torch 2.11);
    gradient checkpointing off where the activations fit, its default (on) at 7B and on 80 GB GPUs. Each setting
    carries a reason."""
    for name in ("step", "tail", "toy", "7b"):
        settings = peers.verl_settings(peers.WORKLOADS[name], Path("m"), Path("d"), Path("w"), 11, 0)
        verl = {s.key: peers._hydra(s.value) for s in settings}
        assert verl["actor_rollout_ref.actor.strategy"] == "fsdp2"
        assert verl["actor_rollout_ref.model.use_fused_kernels"] == "true"
        # by tokens, except on rows of varying length: it counts real tokens, and runs padded rows (no flash-attn)
        assert verl["actor_rollout_ref.actor.use_dynamic_bsz"] == ("false" if name == "tail" else "true")
        assert verl["actor_rollout_ref.model.use_remove_padding"] == "false"
        assert verl["trainer.v1.sampler.custom_sampler.path"] == str(peers.SAMPLER)
        assert verl["+trainer.v1.sampler.sampler_kwargs.poll_interval"] == "0.05"
        assert all(len(s.why) > 8 for s in settings) and len({s.key for s in settings}) == len(settings)
    tail = _verl(peers.WORKLOADS["tail"])  # 16 rows of 16 + 1024 positions: about dsrl's 16,384 tokens
    assert tail["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == "16"
    assert tail["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"] == "32"
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu" not in tail
    assert _verl(peers.WORKLOADS["step"], poll=2.0)["+trainer.v1.sampler.sampler_kwargs.poll_interval"] == "2.0"
    for size, hidden, layers, inter, on in (("1.5b", 1536, 28, 8960, "false"), ("7b", 3584, 28, 18944, "true")):
        model = tmp_path / size
        model.mkdir()
        config = {"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": inter,
                  "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936}  # fmt: skip
        (model / "config.json").write_text(json.dumps(config))
        assert _verl(peers.WORKLOADS["step"], model)["actor_rollout_ref.model.enable_gradient_checkpointing"] == on
        # on an 80 GB H100 its default stays at every size: without it its 1.5B update ran out of memory there
        h100 = _verl(peers.WORKLOADS["tail"], model, gpu_gb=85.5)
        assert h100["actor_rollout_ref.model.enable_gradient_checkpointing"] == "true"
    assert 1.4e9 < peers.model_params(tmp_path / "1.5b") < 1.8e9 and 7e9 < peers.model_params(tmp_path / "7b") < 8e9


def test_both_run_on_n_gpus_of_one_host_dsrl_at_its_placement_for_n():
    """--gpus 4: dsrl's 4 colocated ranks and 4 servers against verl's 4 FSDP ranks and 4 SGLang replicas (TP 1);
    7B offloads nothing there; the split pair puts the trainer on 2 GPUs and the servers on the other 2 on both."""
    w = peers.WORKLOADS["7b"]
    cfg, _ = _dsrl(w, gpus=4, pair="auto")
    assert (cfg.trainer.num_ranks, cfg.rollout.num_servers, cfg.rollout.placement) == (4, 4, "colocate")
    assert not cfg.trainer.offload_optimizer
    verl = _verl(w, gpus=4, pair="auto")
    assert (
        verl["trainer.n_gpus_per_node"] == "4" and verl["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "1"
    )
    assert "actor_rollout_ref.actor.fsdp_config.optimizer_offload" not in verl
    assert verl["actor_rollout_ref.model.enable_gradient_checkpointing"] == "false"  # (a 7B model dir: on, above)
    split, argv = _dsrl(w, gpus=4, pair="offpolicy-split")
    assert (split.trainer.num_ranks, split.rollout.num_servers, split.rollout.first_gpu) == (2, 2, 2)
    assert split.rollout.placement == "disaggregate" and split.rollout.max_staleness == 1
    verl = _verl(w, gpus=4, pair="offpolicy-split")
    assert (verl["trainer.n_gpus_per_node"], verl["actor_rollout_ref.rollout.n_gpus_per_node"]) == ("2", "2")
    assert "actor_rollout_ref.hybrid_engine" not in verl and verl["trainer.v1.trainer_mode"] == "separate_async"
    assert verl["actor_rollout_ref.rollout.checkpoint_engine.backend"] == "nccl"
    assert verl["actor_rollout_ref.rollout.gpu_memory_utilization"] == str(split.rollout.mem_fraction_static)
    best, _ = _dsrl(w, gpus=4, pair="best-split")
    assert (best.trainer.num_ranks, best.rollout.num_servers, best.rollout.placement) == (2, 2, "disaggregate")
    assert (best.rollout.max_staleness, best.rollout.interrupt, best.algorithm.off_policy) == (2, "partial", "tis")
    verl = _verl(w, gpus=4, pair="best-split")
    assert verl["trainer.v1.trainer_mode"] == "separate_async" and "actor_rollout_ref.hybrid_engine" not in verl
    assert verl["trainer.v1.separate_async.num_warmup_batches"] == "2"
    one, _ = _dsrl(w, gpus=1)
    assert one.trainer.offload_optimizer and "--trainer.num_ranks" not in peers.dsrl_command(
        w, Path("m"), Path("d"), Path("r"), 3, 0)  # fmt: skip


def test_the_tail_workload_gives_both_the_same_long_tail_and_a_reward_with_a_spread(tmp_path):
    """Each row its own max_new_tokens (ignore_eos): dsrl reads them from its file's `sampling_params`, verl from
    extra_info (its agent loop: verl_agent.py); every step's prompts hold the same caps; the `graded` reward
    differs between responses, so a group's advantages are not all 0, and both frameworks' calls agree."""
    rows = peers.tail_rows(toy.make_rows(256, seed=0))
    paths = {fw: peers.write_parquet(rows, tmp_path / f"{fw}.parquet", "graded", fw) for fw in ("verl", "dsrl")}
    verl_rows = pq.read_table(paths["verl"]).to_pylist()
    assert "sampling_params" not in verl_rows[0]  # it would collide with verl's agent-loop argument
    tokenizer = AutoTokenizer.from_pretrained(peers.chat_model(ROOT / "examples/toy/model", tmp_path / "model"))
    cfg = DataConfig(train_path=str(paths["dsrl"]), answer_key="reward_model.ground_truth")
    prompts = PromptDataset(cfg, tokenizer).prompts
    caps = [p.sampling["max_new_tokens"] for p in prompts]
    assert caps == [r["extra_info"]["sampling_params"]["max_new_tokens"] for r in verl_rows]
    assert all(p.sampling["ignore_eos"] for p in prompts) and max(caps) == peers.WORKLOADS["tail"]["new_tokens"]
    step = peers.WORKLOADS["tail"]["prompts"]
    batches = [sorted(caps[i : i + step]) for i in range(0, len(caps), step)]
    assert all(b == batches[0] for b in batches) and 200 < sum(caps) / len(caps) < 260
    responses = ["<unused_24> <unused_7> 8", "<unused_35>", "<unused_80> <unused_4>", ""]
    scores = [call_reward(verl_reward.compute_score, "", r, "1", {"data_source": "graded"}) for r in responses]
    direct = [verl_reward.compute_score("graded", r, "1") for r in responses]
    assert scores == direct == [0.75, 0.0, 1.0, 0.0]
    assert verl_reward.compute_score("toy", "12", "12") == 1.0  # the old workloads keep the toy's reward


def _stub(monkeypatch, module: str, **attrs) -> None:
    """A stand-in for a verl module (verl is not installed here): its classes as given."""
    import types

    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    for k, v in attrs.items():
        setattr(sys.modules[module], k, v)


def test_verls_agent_loop_takes_each_rows_own_sampling_parameters(monkeypatch):
    import asyncio

    import numpy as np

    class SingleTurnAgentLoop:
        async def run(self, sampling_params, **kwargs):
            return sampling_params

    _stub(monkeypatch, "verl.experimental.agent_loop.single_turn_agent_loop", SingleTurnAgentLoop=SingleTurnAgentLoop)
    monkeypatch.delitem(sys.modules, "verl_agent", raising=False)
    import verl_agent

    batch = {"temperature": 1.0, "logprobs": True}
    extra = {"index": 3, "sampling_params": {"max_new_tokens": np.int64(512), "ignore_eos": np.bool_(True)}}
    got = asyncio.run(verl_agent.RowSamplingAgentLoop().run(batch, extra_info=extra, raw_prompt=[]))
    assert got == {"temperature": 1.0, "logprobs": True, "max_new_tokens": 512, "ignore_eos": True}
    assert type(got["max_new_tokens"]) is int and type(got["ignore_eos"]) is bool
    assert batch == {"temperature": 1.0, "logprobs": True}  # the batch's own parameters untouched
    assert asyncio.run(verl_agent.RowSamplingAgentLoop().run(batch, extra_info={"index": 0})) == batch
    loops = (ROOT / "tools/peers/verl_agent_loops.yaml").read_text()
    assert "name: row_sampling_agent" in loops and "_target_: verl_agent.RowSamplingAgentLoop" in loops


def test_verls_agent_loop_traces_each_sample_and_the_report_places_them_in_its_steps(monkeypatch, tmp_path):
    import asyncio
    import types

    import numpy as np

    class SingleTurnAgentLoop:  # verl's returns an AgentLoopOutput: its tokens, and its request's seconds
        async def run(self, sampling_params, **kwargs):
            cap = sampling_params.get("max_new_tokens", 64)
            await asyncio.sleep(0.01 * cap / 64)
            tokens = [0] * cap
            return types.SimpleNamespace(response_ids=tokens, metrics=types.SimpleNamespace(generate_sequences=0.25))

    _stub(monkeypatch, "verl.experimental.agent_loop.single_turn_agent_loop", SingleTurnAgentLoop=SingleTurnAgentLoop)
    monkeypatch.delitem(sys.modules, "verl_agent", raising=False)
    import verl_agent

    trace = tmp_path / peers.TRACE
    assert peers.verl_env({}, tmp_path, tmp_path)[verl_agent.TRACE] == str(trace)
    loop = verl_agent.RowSamplingAgentLoop()
    asyncio.run(loop.run({}, extra_info={"index": 0}, global_steps=np.int64(1)))  # untraced: no variable
    assert not trace.exists()
    monkeypatch.setenv(verl_agent.TRACE, str(trace))

    async def step(number: int, caps: list[int]):
        rows = [{"sampling_params": {"max_new_tokens": np.int64(cap)}} for cap in caps]
        await asyncio.gather(*(loop.run({}, extra_info=row, global_steps=np.int64(number)) for row in rows))

    asyncio.run(step(1, [64, 256]))
    asyncio.run(step(2, [64]))
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert sorted((x["step"], x["cap"], x["tokens"], x["request_s"]) for x in lines) == [
        (1, 64, 64, 0.25), (1, 256, 256, 0.25), (2, 64, 64, 0.25)]  # fmt: skip
    traced = report.trace_steps(trace)
    assert sorted(traced) == [1, 2] and traced[1]["trace/longest_request_s"] == 0.25
    assert traced[1]["trace/span_s"] >= traced[1]["trace/longest_sample_s"] >= 0.04  # the 256-token row's sleep
    assert traced[1]["trace/start_spread_s"] < traced[1]["trace/longest_sample_s"]  # started together
    # merged into verl's own step (its file logger's step 1), and kept in the run's record
    (verl,) = report.verl_steps(DATA / "verl_metrics.jsonl", trace=trace)
    assert verl["trace/span_s"] == traced[1]["trace/span_s"] and verl["timing_s/gen"] > 0
    assert report.verl_steps(DATA / "verl_metrics.jsonl", trace=tmp_path / "none.jsonl") == report.verl_steps(
        DATA / "verl_metrics.jsonl"
    )


def test_verls_replay_buffers_poll_at_the_interval_given_instead_of_2_s(monkeypatch):
    class ReplayBuffer:  # verl's: poll_interval 2.0 unless given; sampler_kwargs kept as they came
        def __init__(self, trainer_mode, trainer_config, max_off_policy_threshold, max_off_policy_strategy,
                     sampler_kwargs, poll_interval=2.0, refill_fn=None):  # fmt: skip
            self.sampler_kwargs, self.poll_interval = sampler_kwargs, poll_interval

    _stub(monkeypatch, "verl.trainer.ppo.v1.replay_buffer", ReplayBuffer=ReplayBuffer,
          ReplayBufferAsync=type("ReplayBufferAsync", (ReplayBuffer,), {}))  # fmt: skip
    monkeypatch.delitem(sys.modules, "verl_sampler", raising=False)
    import verl_sampler

    # the keyword arguments verl 0.9.1 gives a custom sampler (trainer_base._build_replay_buffer)
    kwargs = {"trainer_mode": "sync", "trainer_config": {}, "max_off_policy_threshold": 8,
              "max_off_policy_strategy": "drop", "refill_fn": None}  # fmt: skip
    assert verl_sampler.QuickPollReplayBuffer(**kwargs, sampler_kwargs={"poll_interval": 0.1}).poll_interval == 0.1
    assert verl_sampler.QuickPollReplayBufferAsync(**kwargs, sampler_kwargs={}).poll_interval == verl_sampler.POLL_S
    verls = sys.modules["verl.trainer.ppo.v1.replay_buffer"]
    assert issubclass(verl_sampler.QuickPollReplayBufferAsync, verls.ReplayBufferAsync)


def _pair_runs(verl_s: list[float], dsrl_s: list[float], steps: int = 11) -> dict:
    """A record of the `auto` pair: one verl and one dsrl run a repeat, each `steps` steps of the given steady
    seconds (the first step 3x), alternating which runs first, on one host and GPU."""
    runs, k = {}, 0
    for r, (v, d) in enumerate(zip(verl_s, dsrl_s)):
        sides = [("verl", v), ("dsrl", d)] if r % 2 == 0 else [("dsrl", d), ("verl", v)]
        for fw, secs in sides:
            prefix, gen = ("timing_s/", "gen") if fw == "verl" else ("timing/", "generate")
            metrics = [{prefix + "step": secs * (3 if i == 0 else 1 + 0.01 * i), prefix + gen: secs / 2}
                       for i in range(steps)]  # fmt: skip
            runs[f"auto {fw} 1.5b r{r}"] = {"framework": fw, "pair": "auto", "repeat": r, "order": k, "steps": metrics,
                                            "host": "h1", "gpu": "GPU-a", "workload": "tail model_1.5b", "samples": 512,
                                            "settings": [["actor_rollout_ref.actor.strategy", "fsdp2", "its guide"],
                                                         ["data.train_batch_size", "64", "the workload: same"]]
                                            if fw == "verl" else []}  # fmt: skip
            k += 1
    return {"runs": runs}


def test_each_pairs_ratio_is_the_median_of_its_repeats_with_their_min_max():
    record = _pair_runs([20.0, 22.0, 21.0], [10.0, 12.1, 12.6])
    p = report.pair_ratios(record)["auto"]
    assert [round(p["ratios"][i], 3) for i in range(3)] == [0.5, 0.55, 0.6]
    assert (round(p["median"], 3), round(p["min"], 3), round(p["max"], 3)) == (0.55, 0.5, 0.6)
    assert p["hosts"] == ["h1"] and p["few_steps"] == [] and math.isclose(p["phases"]["generate"], 0.55, rel_tol=1e-9)
    text = report.pair_table(record)
    assert "auto: dsrl / verl = 0.550 (median of 3 repeats, min–max 0.500–0.600; one host)" in text
    assert "| auto | 1 | dsrl | 23.21 (22.22–24.20) | 12.77 (12.22–13.31) | 0.550 |" in text  # mean (min–max)
    assert "dsrl step / verl step" not in report.table(record)  # a pair's ratio is its own repeat's, not any verl's
    # a run with fewer than 10 steady steps is named; a repeat missing a side has no ratio; another host is said
    short = _pair_runs([20.0, 22.0], [10.0, 11.0], steps=6)
    del short["runs"]["auto dsrl 1.5b r1"]
    short["runs"]["auto verl 1.5b r0"]["host"] = "h2"
    text = report.pair_table(short)
    assert "median of 1 repeats" in text and "fewer than 10 steady steps: auto dsrl 1.5b r0, auto verl 1.5b r0" in text
    assert "hosts ['h1', 'h2']" in text


def test_verls_settings_are_listed_once_with_their_reasons():
    text = report.settings_text(_pair_runs([20.0, 22.0, 21.0], [10.0, 11.0, 12.0]))
    assert text.count("actor_rollout_ref.actor.strategy=fsdp2: its guide") == 1
    assert "- the same on both sides: data.train_batch_size=64" in text


def test_each_run_names_its_host_and_gpus(monkeypatch):
    import socket

    monkeypatch.setattr(peers, "gpu_query", lambda field: "GPU-a\nGPU-b\nGPU-c\nGPU-d" if field == "uuid" else "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    one = peers.where(1)
    assert one.pop("host_gb") > 1 and one == {"host": socket.gethostname(), "gpu": "GPU-a"}
    assert peers.where(4)["gpu"] == "GPU-a,GPU-b,GPU-c,GPU-d"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert peers.where(2)["gpu"] == "GPU-c,GPU-d"


def test_verl_on_its_own_stack_leaves_the_dsrl_site_off_its_path(tmp_path):
    env = {"PYTHONPATH": "/tmp/site", "PATH": "/usr/bin"}
    own, layered = tmp_path / "verlstack", tmp_path / "verlsite"
    (own / "sglang").mkdir(parents=True)
    layered.mkdir()
    path = peers.verl_env(env, own, tmp_path)["PYTHONPATH"].split(os.pathsep)
    assert path == [str(own), str(peers.ROOT), str(peers.PEERS)]
    assert peers.verl_env(env, own, tmp_path)["FLASHINFER_WORKSPACE_BASE"] == "/tmp/jitcache_verl/fi"
    assert peers.verl_env(env, layered, tmp_path)["PYTHONPATH"].split(os.pathsep)[-1] == "/tmp/site"
    assert peers.verl_env(env, own, tmp_path)["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "metrics.jsonl")
    # its SGLang 0.5.12 gets the same server settings in its own words (it has no cuda_graph_backend_prefill)
    assert peers.own_stack(own) and not peers.own_stack(layered)
    verl = _verl(peers.WORKLOADS["tail"], server=peers.SERVER_0512)
    sglang = {k.rsplit(".", 1)[1]: v for k, v in verl.items() if ".engine_kwargs.sglang." in k}
    assert sglang == {
        "attention_backend": "triton",
        "sampling_backend": "pytorch",
        "disable_piecewise_cuda_graph": "true",
    }
    assert {k.rsplit(".", 1)[1] for k in _verl(peers.WORKLOADS["tail"]) if ".sglang." in k} == set(peers.SERVER)


def test_the_runs_logs_are_kept_in_one_compressed_archive(tmp_path):
    logs = [tmp_path / "auto_verl_r0_tail_s0.log", tmp_path / "auto_dsrl_r0_tail_s0.log"]
    for log in logs:
        log.write_text("step:1 - timing_s/step:3.0\n" * 1000)
    path = peers.archive_logs(tmp_path, [*logs, tmp_path / "never_written.log"], "logs_tail.tar.gz")
    with tarfile.open(path) as tar:
        assert sorted(tar.getnames()) == sorted(log.name for log in logs)
    assert not any(log.exists() for log in logs) and path.stat().st_size < 2000


def test_verls_reward_workers_load_the_reward_without_dsrls_requirements():
    """verl loads tools/peers/verl_reward.py by path in its reward workers, on its own stack, which has none of
    dsrl's requirements (jsonargparse, DeepSpeed): the toy reward it imports must not pull in dsrl's config."""
    path = ROOT / "tools/peers/verl_reward.py"
    code = (
        "import sys, importlib.util\n"
        "for name in ('jsonargparse', 'deepspeed'): sys.modules[name] = None  # (absent: importing them fails)\n"
        f"spec = importlib.util.spec_from_file_location('custom_module', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "print(module.compute_score('graded', '2 4 5', ''), module.compute_score('toy', 'x', '7'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(2 / 3), "0.0"]
