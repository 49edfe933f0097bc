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
    """verl's fast paths this image may run (its fused log-prob kernels) are tried by override; hydra refuses a key
    given twice, so an override replaces the harness's value."""
    over = ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.use_fused_kernels=true"]
    argv = peers.verl_command(peers.WORKLOADS["step"], Path("m"), Path("d"), Path("w"), 3, 0, over)
    keys = [a.split("=", 1)[0] for a in argv[3:]]
    assert len(keys) == len(set(keys))
    assert "actor_rollout_ref.model.use_remove_padding=true" in argv and over[1] in argv


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
    verl = dict(a.split("=", 1) for a in peers.verl_command(w, Path("m"), Path("d"), Path("w"), 3, 0)[3:])
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
