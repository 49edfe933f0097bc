"""Kill and resume the trainer, kill a rollout server mid-step: nothing lost, nothing trained twice.

Select with `-k resume` or `-k crash`. Real processes throughout: `dsrl train`, the deepspeed
launcher, 2 ZeRO-3 ranks and embedded servers; the kills are real SIGKILLs.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dsrl.config import DataConfig
from dsrl.data import PromptDataset
from dsrl.rollout.manager import PromptStream
from dsrl.serving.servers import log_tail
from dsrl.tasks import toy
from tests.conftest import ROOT, run_processes

pytestmark = pytest.mark.slow  # each test a `dsrl train` run or two: tests/conftest.py runs them first

# Wall-clock figures differ between any two runs; everything else must match bit for bit.
TIMING = ("timing/", "memory/", "sync/seconds", "sync/gb_per_s", "sync/probe_seconds", "rollout/trainer_idle_s",
          "rollout/gen_idle_s", "rollout/tokens_per_s", "actor/optimizer_seconds",
          "critic/optimizer_seconds")  # fmt: skip
"""Wall-clock figures: a resumed run repeats everything else exactly."""


def train_cmd(config: str, run_dir: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs" / config)]
    return cmd + ["--logging.run_dir", str(run_dir), "--logging.export_hf", "false", *extra]


def run_to_end(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:  # the servers' side of a failure is in their logs
        logs = Path(cmd[cmd.index("--logging.run_dir") + 1]) / "logs"
        servers = "".join(f"\n--- {p.name}:\n{log_tail(p)}" for p in sorted(logs.glob("server_*.log")))
        raise AssertionError(proc.stdout[-2000:] + proc.stderr[-8000:] + servers)
    return proc.stderr


def run_and_kill(cmd: list[str], at_step: int, total: int, on_line: Callable[[str], None] | None = None) -> list[str]:
    """Start a run and SIGKILL the whole trainer (`dsrl train`, the launcher, the ranks, their servers) once it logs
    step `at_step`; `on_line` sees each line before. Every process at once: the launcher has a session of its own,
    and ranks left to notice their owner gone (within a second, tests/test_nothing_lost.py) could finish another step
    and its checkpoint first. Returns the lines the run wrote."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    log = []
    try:
        for line in proc.stderr:
            log.append(line)
            if on_line is not None:
                on_line(line)
            if f"step {at_step}/{total} |" in line:
                for p in run_processes(proc.pid):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.kill()
                break
        else:
            raise AssertionError(f"the run ended before step {at_step}:\n" + "".join(log[-60:]))
    finally:
        proc.wait(60)
    return log


def run_watching(cmd: list[str], on_line: Callable[[str], None], limit_s: float = 400) -> tuple[int, list[str]]:
    """Run to its end, `on_line` seeing each line of its log as it comes (to kill a server at a step); returns its
    exit code and the lines it wrote. Past `limit_s` `dsrl train` is killed (its ranks follow it: they watch it), and
    the lines end with one saying so: a run that hangs fails the test with its log, in minutes."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    timer = threading.Timer(limit_s, proc.kill)
    timer.start()
    log = []
    try:
        for line in proc.stderr:
            log.append(line)
            on_line(line)
        code = proc.wait(60)
    finally:
        timer.cancel()
    if code == -signal.SIGKILL:
        log.append(f"(the test killed the run after {limit_s:.0f} s)\n")
    return code, log


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value; for steps logged twice (before a kill and after the resume), the later one."""
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in events.Tags()["scalars"]:
        for e in sorted(events.Scalars(tag), key=lambda e: e.wall_time):
            out.setdefault(tag, {})[e.step] = e.value
    return out


def trace(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]


# A run killed mid-way and resumed repeats the uninterrupted run bit for bit: tests/test_ppo.py
# (test_ppo_resumes_bit_for_bit, the actor, reference and critic engines, and LoRA's adapters; one run of GRPO's
# engines less than PPO's was the same test at 2.5 minutes of CI).


def test_resume_after_kill_in_colocated_one_step_off_mode_loses_no_prompt(tmp_path):
    """The kill comes while the next batch is generated alongside the optimizer step. A checkpoint keeps no batch
    generated ahead: the resumed run generates step 4's again, with the checkpoint's weights (staleness 0)."""
    args = ["--trainer.total_steps", "8", "--logging.save_every", "4", "--rollout.prompts_per_step", "16"]
    args += ["--rollout.max_staleness", "1", "--algorithm.off_policy", "tis"]
    run_dir = tmp_path / "ahead"
    run_and_kill(train_cmd("toy_cpu.yaml", run_dir, *args), at_step=6, total=8)
    log = run_to_end(train_cmd("toy_cpu.yaml", run_dir, *args))
    assert "step_4 at step 4" in log

    records = trace(run_dir)
    assert [r["step"] for r in records] == list(range(8))
    rows = [row for r in records for row in r["rows"]]
    assert len(rows) == len(set(rows)) == 8 * 16, "a prompt was lost or trained twice"
    staleness = scalars(run_dir)["rollout/staleness_max"]
    assert [staleness[step] for step in sorted(staleness)] == [0, 1, 1, 1, 0, 1, 1, 1]


AGENT = ["--rollout.env", "dsrl.tasks.toy:KeyLookupEnv", "--agent.max_turns", "3", "--agent.max_episode_tokens", "24"]
"""The toy agent task: multi-turn episodes, some in the middle of a turn or between turns at the kill."""


@pytest.mark.parametrize("extra", [[], AGENT], ids=["responses", "episodes"])
def test_resume_after_kill_in_async_mode_loses_no_prompt(tmp_path, extra):
    """k=2 with partial rollout, 2 servers. Server 1 is killed at step 2: its requests go to the other, and the run
    goes on while its replacement starts. The whole trainer is killed at step 7, and the same command resumes it:
    every prompt is trained once or still waiting in the final checkpoint."""
    k = 2
    args = ["--trainer.total_steps", "12", "--logging.save_every", "4", "--rollout.max_staleness", str(k), *extra]
    args += ["--rollout.num_servers", "2", "--rollout.server_args", json.dumps({"decode_delay_ms": 10})]
    run_dir = tmp_path / "async"  # (the delay: requests in flight at each kill)

    def kill_server_1(line: str) -> None:
        if "step 2/12 |" in line:
            server_log = (run_dir / "logs" / "server_1.log").read_text()
            os.kill(int(re.search(r"\(pid (\d+)\)", server_log).group(1)), signal.SIGKILL)

    log = run_and_kill(train_cmd("toy_cpu_async.yaml", run_dir, *args), at_step=7, total=12, on_line=kill_server_1)
    assert_run_went_on_without_waiting(log)
    run_to_end(train_cmd("toy_cpu_async.yaml", run_dir, *args))

    records = trace(run_dir)
    assert [r["step"] for r in records] == list(range(12))
    assert_every_prompt_accounted_for(run_dir, "step_12")
    assert max(scalars(run_dir)["rollout/staleness_max"].values()) <= k


def assert_every_prompt_accounted_for(run_dir: Path, checkpoint: str) -> None:
    """No prompt trained twice; every prompt handed out by either rank (toy_cpu_async.yaml: 32 a step,
    2 ranks) is trained, or still waiting in the final checkpoint."""
    trained = [row for r in trace(run_dir) for row in r["rows"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    dataset = PromptDataset(DataConfig(train_path=str(ROOT / "examples/toy/train.jsonl")), toy.build_tokenizer())
    handed_out, waiting = [], []
    for rank in range(2):
        state = torch.load(run_dir / "checkpoints" / checkpoint / f"dsrl_rank{rank}.pt", weights_only=False)
        stream = PromptStream(dataset, 32, rank, 2)
        handed_out += [stream.next().index for _ in range(state["rollouts"]["position"])]
        waiting += state["rollouts"]["outstanding"]
    assert Counter(trained + waiting) == Counter(handed_out), "a prompt was lost"


def test_crash_of_a_rollout_server_in_async_mode_loses_nothing(tmp_path):
    """k=4 with requests paused through updates, 2 servers; one is killed mid-run: its requests go to the other, the
    run goes on while its replacement starts, and every prompt is trained once or still waiting. (With partial
    rollout: test_resume_after_kill_in_async_mode_loses_no_prompt, whose server 1 dies at step 2.)"""
    run_dir = tmp_path / "async_crash"
    args = ["--trainer.total_steps", "6", "--logging.save_every", "6", "--rollout.num_servers", "2"]
    args += ["--rollout.interrupt", "pause"]
    args += ["--rollout.server_args", json.dumps({"decode_delay_ms": 10})]  # requests in flight at the kill

    def kill_server_1(line: str) -> None:
        if "step 2/6 |" in line:
            os.kill(server_pid(run_dir, 1), signal.SIGKILL)

    code, log = run_watching(train_cmd("toy_cpu_async.yaml", run_dir, *args), kill_server_1)
    assert code == 0, "".join(log[-60:])
    assert_run_went_on_without_waiting(log)
    assert [r["step"] for r in trace(run_dir)] == list(range(6))
    assert_every_prompt_accounted_for(run_dir, "step_6")
    started = [line for line in log if "starting rollout server 0" in line or "ZeRO-3 gathers" in line]
    assert "starting rollout server 0" in started[0], "disaggregated, the servers start before the trainer loads"


def test_crash_of_a_rollout_server_mid_step_loses_nothing(tmp_path):
    rows = toy.make_rows(64, seed=9)
    data = tmp_path / "epoch.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "crash"
    args = ["--data.train_path", str(data), "--rollout.prompts_per_step", "16", "--trainer.total_steps", "4"]
    args += ["--rollout.num_servers", "2", "--rollout.server_args", json.dumps({"decode_delay_ms": 20})]
    args += ["--trainer.micro_batch_size", "64", "--sync.verify", "weights"]
    proc = subprocess.Popen(train_cmd("toy_cpu.yaml", run_dir, *args), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    log = []
    for line in proc.stderr:
        log.append(line)
        if "step 1/4 |" in line:  # step 2 is generating now: kill server 1 in the middle of it
            time.sleep(0.1)
            server_log = (run_dir / "logs" / "server_1.log").read_text()
            os.kill(int(re.search(r"\(pid (\d+)\)", server_log).group(1)), signal.SIGKILL)
    assert proc.wait(600) == 0, "".join(log[-60:])
    assert_run_went_on_without_waiting(log)
    trained = [row for r in trace(run_dir) for row in r["rows"]]
    assert sorted(trained) == list(range(64)), "every prompt of the epoch, exactly once"
    assert scalars(run_dir)["fleet/server_deaths"][4] == 1


def assert_run_went_on_without_waiting(log: list[str]) -> None:
    """The death was seen, and the next step ran before the replacement joined (it starts in the background);
    colocated, the trainers did not wait for it to start either (it starts beside them)."""
    assert not [line for line in log if "waiting for" in line and "replacement" in line], "".join(log[-60:])
    death = next(i for i, line in enumerate(log) if "starting its replacement" in line)
    after = [line for line in log[death:] if re.search(r"step \d+/\d+ \||restarted at", line)]
    assert after and "restarted at" not in after[0], "the update waited for the replacement:\n" + "".join(after)


@pytest.mark.parametrize("marker_says, delta", [("", False), ("fail", False), ("", True)],
                         ids=["dies", "fails", "dies_delta"])  # fmt: skip
def test_crash_of_a_rollout_server_during_a_weight_sync_loses_nothing(tmp_path, marker_says, delta):
    """A server dies mid-sync (after taking its update request, before receiving): the sync fails,
    the server's replacement starts, the sync is redone, and the run trains every prompt once. Or the server
    lives and fails that update and every later one with an error (HTTP 500): after its second failure it is
    replaced as a dead one is, and the third try syncs without it. With --sync.delta (every rank sends its part,
    the survivor and the replacement get everything in full after the death) the weights compared still match."""
    rows = toy.make_rows(64, seed=9)
    data = tmp_path / "epoch.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir, marker = tmp_path / "sync_crash", tmp_path / "crash_now"
    args = ["--data.train_path", str(data), "--rollout.prompts_per_step", "16", "--trainer.total_steps", "4"]
    args += ["--rollout.num_servers", "2", "--rollout.server_args", json.dumps({"crash_marker": str(marker)})]
    args += ["--trainer.micro_batch_size", "64", "--sync.verify", "weights", "--sync.timeout_s", "30"]
    args += ["--sync.delta", "true", "--rollout.placement", "disaggregate"] if delta else []
    proc = subprocess.Popen(train_cmd("toy_cpu.yaml", run_dir, *args), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    log = []
    for line in proc.stderr:
        log.append(line)
        if "step 1/4 |" in line:
            written = marker.with_suffix(".new")  # (whole before it appears: a server takes it by its name)
            written.write_text(marker_says)
            written.rename(marker)  # the next weight update kills (or sickens) the server that takes it
    assert proc.wait(600) == 0, "".join(log[-60:])
    text = "".join(log)
    assert not marker.exists(), "no server took the crash marker"
    assert "weight sync to version" in text and "starting its replacement" in text  # (it joins once it answers)
    if marker_says == "fail":
        assert "said fail: this server fails every weight update" in text
        assert "failed the retried weight update: replacing it" in text
        assert "(stopped): starting its replacement" in text
    assert scalars(run_dir)["fleet/server_deaths"][4] == 1
    if delta:  # in full at the first sync and after the death, as deltas between
        sent_as_delta, metrics = set(scalars(run_dir)["sync/delta"].values()), scalars(run_dir)
        assert "sync.senders all" in text and sent_as_delta == {0.0, 1.0}, sent_as_delta
        assert set(metrics["sync/delta_checksum_failed"].values()) == {0.0} and "failed the checksum" not in text
    trained = [row for r in trace(run_dir) for row in r["rows"]]
    assert sorted(trained) == list(range(64)), "every prompt of the epoch, exactly once"


def server_pid(run_dir: Path, number: int = 0) -> int:
    """The pid of rollout server `number`'s latest process (a restarted server appends to its log)."""
    return int(re.findall(r"\(pid (\d+)\)", (run_dir / "logs" / f"server_{number}.log").read_text())[-1])


def test_a_lone_server_killed_mid_generate_and_mid_sync_three_times_the_run_finishes(tmp_path):
    """The README's setup, one server: killed in a step's rollout, in a weight sync, and in a rollout again. Each time
    the requests wait for its replacement (started at once), which gets the current weights first; the run ends with
    every prompt trained exactly once, the last weights verified on the server, and every death counted. Before the
    lone server's replacement was waited for, the first kill ended the run: `NoServerLeft: every rollout server is
    down`."""
    steps, per_step = 10, 16
    rows = toy.make_rows(steps * per_step, seed=9)
    data = tmp_path / "epoch.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir, marker = tmp_path / "lone", tmp_path / "crash_now"
    args = ["--data.train_path", str(data), "--rollout.prompts_per_step", str(per_step), "--trainer.total_steps"]
    args += [str(steps), "--trainer.micro_batch_size", "64", "--sync.verify", "weights", "--sync.timeout_s", "60"]
    args += ["--rollout.server_args", json.dumps({"decode_delay_ms": 20, "crash_marker": str(marker)})]

    def kill(line: str) -> None:
        if f"step 2/{steps} |" in line or f"step 7/{steps} |" in line:  # the next step's rollout is under way
            time.sleep(0.1)
            os.kill(server_pid(run_dir), signal.SIGKILL)
        if f"step 4/{steps} |" in line:  # the server that takes it dies in the next weight sync
            written = marker.with_suffix(".new")
            written.write_text("")
            written.rename(marker)

    code, log = run_watching(train_cmd("toy_cpu.yaml", run_dir, *args), kill)
    assert code == 0, "".join(log[-60:])
    text = "".join(log)
    assert not marker.exists(), "no server took the crash marker"
    assert text.count("the rollout waits for a replacement") >= 2, text[-6000:]
    assert "NoServerLeft" not in text
    assert scalars(run_dir)["fleet/server_deaths"][steps] == 3
    assert scalars(run_dir)["fleet/restarts"][steps] == 3
    trained = [row for r in trace(run_dir) for row in r["rows"]]
    assert sorted(trained) == list(range(steps * per_step)), "every prompt of the epoch, exactly once"


def test_a_lone_server_killed_in_async_mode_loses_nothing(tmp_path):
    """Disaggregated, k=4 with partial rollout and one server, killed with requests in flight: they wait for its
    replacement, which gets the trainer's weights first, and every prompt is trained once or still waiting."""
    run_dir = tmp_path / "lone_async"
    args = ["--trainer.total_steps", "6", "--logging.save_every", "6"]
    args += ["--rollout.server_args", json.dumps({"decode_delay_ms": 10})]  # requests in flight at the kill

    def kill(line: str) -> None:
        if "step 2/6 |" in line:
            os.kill(server_pid(run_dir), signal.SIGKILL)

    code, log = run_watching(train_cmd("toy_cpu_async.yaml", run_dir, *args), kill)
    assert code == 0, "".join(log[-60:])
    assert "the rollout waits for a replacement" in "".join(log)
    assert [r["step"] for r in trace(run_dir)] == list(range(6))
    assert_every_prompt_accounted_for(run_dir, "step_6")
    assert scalars(run_dir)["fleet/server_deaths"][6] == 1


def test_a_lone_server_that_cannot_start_again_stops_the_run_with_a_checkpoint(tmp_path):
    """The lone server dies and its model directory is gone: its replacement fails --rollout.max_restarts times, and
    the run stops with one line naming the server and its log's end, after a checkpoint of the last step trained."""
    run_dir = tmp_path / "lost"
    args = ["--trainer.total_steps", "8", "--rollout.prompts_per_step", "16", "--rollout.max_restarts", "2"]
    args += ["--rollout.server_args", json.dumps({"decode_delay_ms": 20}), "--eval.path", "null"]

    def kill(line: str) -> None:
        if "step 2/8 |" in line:
            shutil.rmtree(run_dir / "init_model")  # what the servers load
            os.kill(server_pid(run_dir), signal.SIGKILL)

    code, log = run_watching(train_cmd("toy_cpu.yaml", run_dir, *args), kill)
    assert code == 1, "".join(log[-60:])
    error = [line for line in log if "error:" in line]
    assert len(error) == 1 and "no rollout server left: rollout server 0 did not start in 2 tries" in error[0], log
    assert "exited with code 1 while starting; end of" in error[0] and "server_0.log: OSError" in error[0]
    assert "Traceback" not in "".join(log)
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_2"
    assert [r["step"] for r in trace(run_dir)] == [0, 1]


ASYNC_PARTIAL = ["--rollout.placement", "disaggregate", "--rollout.max_staleness", "2", "--rollout.interrupt"]
ASYNC_PARTIAL += ["partial"]


@pytest.mark.parametrize("schedule", [[], ASYNC_PARTIAL], ids=["colocated", "async"])
def test_a_lone_server_that_dies_each_time_it_serves_stops_the_run_with_a_checkpoint(tmp_path, schedule):
    """A crash loop: every replacement of the lone server starts, takes the step's requests and dies (as a request
    that kills its server would do). After --rollout.max_restarts recoveries in one step the run stops with one line
    and a checkpoint of the last step trained, instead of restarting servers forever. (Under load this once hung in
    Run.close, and ended without its line when a request woken by a replacement already gone raised NoServerLeft, or
    when rank 1's waiting requests went to the replacement before rank 0 had woken it; tests/test_async.py tests the
    request's wait.)"""
    run_dir = tmp_path / "loop"
    args = ["--trainer.total_steps", "8", "--rollout.prompts_per_step", "16", "--rollout.max_restarts", "2"]
    args += ["--rollout.server_args", json.dumps({"decode_delay_ms": 20}), "--eval.path", "null", *schedule]
    killed: list[int] = []
    watching = threading.Event()

    def kill_each_server_that_serves() -> None:
        while watching.is_set():
            with contextlib.suppress(FileNotFoundError):
                starts = (run_dir / "logs/server_0.log").read_text().split("embedded engine for")[1:]
                serving = {int(re.search(r"\(pid (\d+)\)", start)[1]) for start in starts if "first /generate" in start}
                for pid in serving - set(killed):
                    killed.append(pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def start_killing(line: str) -> None:
        if "step 2/8 |" in line and not watching.is_set():
            watching.set()
            threading.Thread(target=kill_each_server_that_serves, daemon=True).start()

    try:
        code, log = run_watching(train_cmd("toy_cpu.yaml", run_dir, *args), start_killing)
    finally:
        watching.clear()
    assert code == 1, "".join(log[-60:])
    error = [line for line in log if "error:" in line]
    assert len(error) == 1 and "every one died 3 times in a row while serving step" in error[0], log[-60:]
    assert len(killed) >= 3 and "Traceback" not in "".join(log)
    trained = [r["step"] for r in trace(run_dir)]  # (async: a step ahead of colocated when the loop began)
    assert trained == list(range(len(trained))) and len(trained) >= 2
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{len(trained)}"
