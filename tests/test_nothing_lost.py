"""Nothing of the user's is lost: an export never deletes what dsrl did not write, a run directory has one
owner, SIGTERM stops the whole run with a checkpoint, a damaged checkpoint falls back to the previous one,
and bad data or a full disk get one-line messages naming the file.

Real processes: `dsrl train` with the deepspeed launcher, 2 ZeRO-3 ranks and the embedded server.
"""

import contextlib
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from dsrl.config import DataConfig
from dsrl.data import PromptDataset
from dsrl.rundir import (
    EXPORT_MARKER,
    ExportTargetError,
    RunDirLocked,
    RunLock,
    WriteError,
    check_export_target,
    write_error,
)
from dsrl.tasks import toy
from dsrl.zero.checkpoint import ShardWriter, export_hf
from tests.conftest import ROOT, TOY_MODEL, run_processes, still_running

TOY = ["--config", str(ROOT / "configs/toy_cpu.yaml"), "--eval.path", "null", "--logging.export_hf", "false"]


def train_cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dsrl.cli", "train", *TOY, "--logging.run_dir", str(run_dir), *extra]


def trace(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]


def expected_rows(step: int) -> list[int]:
    """The rows the toy config trains at `step` (32 prompts, 2 ranks): fixed by the step, whatever the weights."""
    dataset = PromptDataset(DataConfig(train_path=str(ROOT / "examples/toy/train.jsonl")), toy.build_tokenizer())
    return [p.index for rank in range(2) for p in dataset.batch(step, 32, rank, 2)]


# -- 1. exports ------------------------------------------------------------------------------------


def write_export(out: Path, overwrite: bool = False) -> None:
    writer = ShardWriter(out, overwrite=overwrite, source="test")
    writer.add("w", torch.ones(3))
    writer.close(str(TOY_MODEL))


def test_an_export_keeps_every_file_it_did_not_write(tmp_path):
    """`dsrl export --out DIR` used to delete DIR first: a model beside it went with it."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "other_model.safetensors").write_text("precious")
    with pytest.raises(ExportTargetError, match=r"models' holds files dsrl did not write \(other_model.safetensors\)"):
        write_export(models)
    assert (models / "other_model.safetensors").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # no staging directory left behind

    out = tmp_path / "export"
    write_export(out)
    assert (out / EXPORT_MARKER).is_file() and (out / "model.safetensors").is_file()
    with pytest.raises(ExportTargetError, match="holds a previous dsrl export: --overwrite replaces it"):
        write_export(out)
    (out / "model.safetensors").write_text("stale")
    write_export(out, overwrite=True)
    assert (out / "model.safetensors").read_bytes() != b"stale"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "models"]

    empty = tmp_path / "empty"
    empty.mkdir()
    write_export(empty)  # an empty directory is fine
    assert (empty / EXPORT_MARKER).is_file()


def test_an_export_never_targets_the_working_or_home_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for target in (Path("."), Path.home(), Path("/")):
        with pytest.raises(ExportTargetError, match="export into a directory of its own"):
            check_export_target(target, overwrite=True)


def test_the_export_command_refuses_a_directory_of_other_files(tmp_path):
    """The CLI says why in one line, before reading the checkpoint."""
    (tmp_path / "keep.txt").write_text("mine")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "dsrl_state.json").write_text("{}")
    (tmp_path / "run" / "config.yaml").write_text(f"model:\n  path: {TOY_MODEL}\n")
    cmd = [sys.executable, "-m", "dsrl.cli", "export", "--checkpoint", str(checkpoint), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "holds files dsrl did not write" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "keep.txt").read_text() == "mine"


# -- 2. one owner per run directory ----------------------------------------------------------------


def test_a_second_run_on_a_locked_run_dir_stops_at_once_naming_the_first(tmp_path):
    """Two runs on one --logging.run_dir both ran, interleaving trained_prompts.jsonl and checkpoints."""
    first = RunLock(tmp_path).acquire("the first run")
    try:
        start = time.monotonic()
        proc = subprocess.run(train_cmd(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - start
    finally:
        first.release()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"belongs to a run that is still going: pid {os.getpid()}" in proc.stderr and "the first run" in proc.stderr
    assert "deepspeed.launcher" not in proc.stderr and took < 60  # nothing started
    assert not (tmp_path / "config.yaml").exists() and not (tmp_path / "trained_prompts.jsonl").exists()


def test_a_lock_left_by_a_dead_run_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".dsrl.lock").write_text(json.dumps({"host": "h", "pid": dead.pid, "since": "then"}))
    with caplog.at_level(logging.WARNING):
        lock = RunLock(tmp_path).acquire()
    assert f"taking over the lock of a run that is gone (pid {dead.pid} on h" in caplog.text
    with pytest.raises(RunDirLocked):  # and it is held now
        RunLock(tmp_path).acquire()
    lock.release()
    RunLock(tmp_path).acquire().release()


def test_a_new_run_waits_for_a_lost_runs_processes_to_end_and_names_those_that_do_not(tmp_path, caplog):
    """A resume right after a kill -9: the dead run's processes still hold the run directory for a moment (their
    watch ends them); the new run waits for them, up to MEMBERS_WAIT_S, and then names them."""
    from dsrl.rundir import MEMBERS_FILE, _no_members_left

    hold = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
    hold += "fcntl.flock(fd, fcntl.LOCK_SH); print(flush=True); time.sleep(float(sys.argv[2]))"
    for seconds, wait_s in ((2, 15), (30, 1)):
        member = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / MEMBERS_FILE), str(seconds)],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        member.stdout.readline()  # it holds the members file now
        start = time.monotonic()
        try:
            if seconds < wait_s:
                with caplog.at_level(logging.WARNING):
                    _no_members_left(tmp_path, wait_s)
                assert 1 < time.monotonic() - start < wait_s and "waiting up to 15 s" in caplog.text
            else:
                with pytest.raises(RunDirLocked, match=rf"still alive 1 s on: pid {member.pid} \(") as refused:
                    _no_members_left(tmp_path, wait_s)
                assert f"pid {os.getpid()} " not in str(refused.value)
        finally:
            member.kill()
            member.wait()


# -- 3. signals stop the whole run -----------------------------------------------------------------


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> SimpleNamespace:
    """One run directory's story, for the two tests below: `dsrl train` stopped by SIGTERM after step 3 or so, the
    same command for two steps more, then its latest checkpoint truncated and the same command for two steps more
    again. What each test reads is kept as it was when that part ended (a third run would cost CI half a minute)."""
    run_dir, out = tmp_path_factory.mktemp("stopped") / "run", tmp_path_factory.mktemp("stopped_log") / "train.log"
    with open(out, "w") as f:
        proc = subprocess.Popen(train_cmd(run_dir, "--trainer.total_steps", "200"), cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT)  # fmt: skip
    logged = []
    try:
        while proc.poll() is None and (not logged or logged[-1] < 3):
            time.sleep(0.1)
            logged = steps_logged(out.read_text())  # the steps done when the signal is sent
        assert proc.poll() is None, out.read_text()[-3000:]
        run = [p.pid for p in run_processes(proc.pid)]
        assert len(run) >= 5, "the CLI, the launcher, its launch process, 2 ranks (and the server)"
        logged = steps_logged(out.read_text())  # again, the instant before: a step may have ended since
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    alive = still_running(run)
    stopped_at = int((run_dir / "checkpoints" / "latest").read_text().split("_")[1])
    manifest = (run_dir / "checkpoints" / f"step_{stopped_at}" / "manifest.json").is_file()
    stopped = SimpleNamespace(returncode=proc.returncode, text=out.read_text(), logged=logged, alive=alive,
                              at=stopped_at, trace=trace(run_dir), manifest=manifest,
                              stop_file=(run_dir / "STOP").exists(),
                              lock=(run_dir / ".dsrl.lock").read_text())  # fmt: skip

    # The same command, two more steps: it resumes where it stopped. (Their end saved: the checkpoint truncated next.)
    more = ["--logging.save_every", str(stopped_at + 2)]
    resumed = subprocess.run(train_cmd(run_dir, "--trainer.total_steps", str(stopped_at + 2), *more), cwd=ROOT,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    story = SimpleNamespace(run_dir=run_dir, stopped=stopped, resumed=resumed, resumed_trace=[])
    story.victim = story.again = None
    if resumed.returncode != 0:  # (the SIGTERM test says why)
        return story
    story.resumed_trace = trace(run_dir)

    # Its checkpoints now: step <stopped_at> and step <stopped_at + 2> (keep_last 2). One file of the latest cut short.
    (story.victim,) = (run_dir / "checkpoints" / f"step_{stopped_at + 2}").glob("*rank_1*optim_states.pt")
    story.victim.write_bytes(story.victim.read_bytes()[:1000])
    story.again = subprocess.run(train_cmd(run_dir, "--trainer.total_steps", str(stopped_at + 4), *more), cwd=ROOT,
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
    return story


def test_sigterm_to_dsrl_train_stops_every_process_of_the_run_with_a_checkpoint(stopped_run):
    """SIGTERM used to kill the CLI alone: the launcher, ranks and server trained on, detached, to the end. Its output
    goes to a file, as a job scheduler's does, and every line there means something: no library's warnings, no CUDA
    or GPU on CPU, no launcher chatter, no progress bar's \\r, one line per step, and the stop said once, at the end
    of the step the signal came in (it used to come two to four steps later)."""
    stopped, logged = stopped_run.stopped, stopped_run.stopped.logged
    text = stopped.text
    assert stopped.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "\r" not in text and not re.findall(r".*(?:Warning|CUDA|GPU|launch\.py).*", text), text
    assert text.count("stops at the end of this step") == 1 and text.count("stopped by SIGTERM after step") == 1
    assert not stopped.alive, f"processes of the run still alive: {stopped.alive}"

    stopped_at = stopped.at
    assert stopped_at in (logged[-1], logged[-1] + 1), "the end of the step under way, or of the one just logged"
    assert steps_logged(text) == list(range(1, stopped_at + 1)), "one line per step"
    assert stopped.manifest
    assert [r["step"] for r in stopped.trace] == list(range(stopped_at))
    assert not stopped.stop_file and stopped.lock == ""

    # The same command, two more steps: it resumes where it stopped and trains each step's prompts once.
    done = stopped_run.resumed
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"step_{stopped_at} at step {stopped_at}" in done.stderr
    assert [r["step"] for r in stopped_run.resumed_trace] == list(range(stopped_at + 2))
    assert [r["rows"] for r in stopped_run.resumed_trace] == [expected_rows(s) for s in range(stopped_at + 2)]


def steps_logged(text: str) -> list[int]:
    return [int(step) for step in re.findall(r"\[dsrl\] step (\d+)/\d+ \|", text)]


@pytest.mark.slow
def test_kill_9_of_dsrl_train_ends_every_process_of_the_run_and_the_run_dir_stays_locked_until_then(tmp_path):
    """`kill -9` of the CLI used to leave the launcher, the ranks and the server training on to the last step,
    and a second run took over the directory they were still writing. The ranks are held stopped (SIGSTOP)
    across the kill so that the second run deterministically meets them alive. Two ranks: rank 0 watches the CLI's
    pid, rank 1 that and rank 0's store (`rundir.OwnerWatch`); one rank's case is the first half of it."""
    run_dir, ranks = tmp_path / "run", "2"
    cmd = train_cmd(run_dir, "--trainer.total_steps", "200", "--trainer.num_ranks", ranks)
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True)
    run = []
    try:
        for line in proc.stderr:
            if "step 5/200 |" in line:
                break
        run = psutil.Process(proc.pid).children(recursive=True)
        ranks_ = [p for p in run if "-m dsrl.train " in " ".join(p.cmdline())]
        assert len(ranks_) == int(ranks) and any("dsrl.serving.embedded" in " ".join(p.cmdline()) for p in run)
        for p in ranks_:
            p.suspend()
        proc.kill()
        proc.wait(10)

        second = subprocess.run(train_cmd(run_dir, "--trainer.total_steps", "2"), cwd=ROOT, capture_output=True,
                                text=True, timeout=300)  # fmt: skip
        assert second.returncode == 2, second.stderr[-3000:]
        (message,) = [line for line in second.stderr.splitlines() if line.startswith("dsrl train: error:")]
        assert "processes of a run that lost its owner are still alive 20 s on: pid " in message, message
        assert any(f"pid {p.pid} " in message for p in run), message
        assert "-m dsrl.cli" not in message  # the refused run itself is not one of them (the old one's is dead)

        for p in ranks_:
            p.resume()
        _, alive = psutil.wait_procs(run, timeout=15)
        assert not alive, f"processes of the run alive 15 s after their owner died: {alive}"
    finally:
        proc.kill()
        for p in run:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    RunLock(run_dir).acquire("the next run").release()  # they are gone: the next run takes the directory


# -- 4. a damaged checkpoint -----------------------------------------------------------------------


def test_a_truncated_latest_checkpoint_resumes_from_the_previous_one(stopped_run):
    """One truncated file of the latest checkpoint used to end the resume with torch's "failed finding
    central directory"; the previous complete checkpoint was not used and the message named neither."""
    run_dir, again, victim, at = stopped_run.run_dir, stopped_run.again, stopped_run.victim, stopped_run.stopped.at
    assert again is not None, "the resume before the truncation failed (test_sigterm_to_dsrl_train_...)"
    assert again.returncode == 0, again.stderr[-3000:]
    latest = f"{run_dir}/checkpoints/step_{at + 2}"
    assert f"the latest checkpoint {latest} cannot be used ({victim.name} has 1000 bytes" in again.stderr
    assert f"resuming from {run_dir}/checkpoints/step_{at}" in again.stderr
    records = trace(run_dir)  # the two steps after step_<at> trained again from its state: the trace has them once
    assert [r["step"] for r in records] == list(range(at + 4))
    assert [r["rows"] for r in records] == [expected_rows(s) for s in range(at + 4)]


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    from dsrl.serving.servers import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def fake_checkpoint(root: Path, step: int) -> Path:
    from dsrl.zero.checkpoint import write_manifest

    path = root / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    (path / "dsrl_state.json").write_text(json.dumps({"step": step}))
    (path / "dsrl_rank0.pt").write_bytes(os.urandom(1000))
    write_manifest(path)
    (root / "checkpoints" / "latest").write_text(path.name)
    return path


def test_a_damaged_checkpoint_is_named_and_every_damaged_one_stops_the_resume(world_of_one, tmp_path):
    from dsrl.zero.checkpoint import CheckpointError, find_checkpoint

    older, newer = fake_checkpoint(tmp_path, 2), fake_checkpoint(tmp_path, 4)
    assert find_checkpoint(tmp_path, "auto") == newer
    data = (newer / "dsrl_rank0.pt").read_bytes()
    (newer / "dsrl_rank0.pt").write_bytes(bytes([data[0] ^ 1]) + data[1:])  # same size, one bit changed
    assert find_checkpoint(tmp_path, "auto") == older
    with pytest.raises(CheckpointError, match=r"--logging.resume='.*step_4': the checkpoint is damaged: "
                                              r"dsrl_rank0.pt has changed since it was written"):  # fmt: skip
        find_checkpoint(tmp_path, str(newer))
    (older / "dsrl_rank0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint to resume from is complete: .*step_4: .*changed.*; "
                                              r".*step_2: dsrl_rank0.pt is missing"):  # fmt: skip
        find_checkpoint(tmp_path, "auto")


# -- 5. messages that name the cause ---------------------------------------------------------------


def test_invalid_utf8_and_bad_rows_fail_before_the_launcher_in_one_message(tmp_path):
    """Invalid UTF-8 used to be a raw UnicodeDecodeError traceback from rank 0, after the launcher started."""
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"prompt": "12=", "answer": "12"}\n{"prompt": "1\xff=", "answer": "1"}\n{"answer": "3"}\n')
    proc = subprocess.run(train_cmd(tmp_path / "run", "--data.train_path", str(data)), cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "dsrl train: error: 2 bad rows (--data.on_bad_row skip skips them):" in proc.stderr
    assert f"{data}, line 2: not valid UTF-8 (byte 0xff at column 14)" in proc.stderr
    assert f"{data}, row 2: no field 'prompt'" in proc.stderr  # rows count every non-empty line
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr and "deepspeed.launcher" not in proc.stderr


def test_a_full_disk_names_the_checkpoint_and_the_cause(tmp_path):
    """A full disk used to say "basic_ios::clear: iostream error". The checkpoints go to a 600 kB tmpfs."""
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(tiny)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (test_a_full_disk_message_without_a_tmpfs covers the message)")
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "checkpoints").symlink_to(tiny)
        args = ["--trainer.total_steps", "4", "--logging.save_every", "2"]
        proc = subprocess.run(train_cmd(run_dir, *args), cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0
        assert f"cannot write {run_dir}/checkpoints/.tmp_step_2: no space left on the device (" in proc.stderr, (
            proc.stderr[-3000:]
        )
        assert "exits with return code" not in proc.stdout + proc.stderr  # the launcher adds nothing to the message
        assert not (tiny / "latest").exists()  # nothing half-written was published
    finally:
        subprocess.run(["umount", str(tiny)])


def test_an_export_the_disk_cannot_hold_is_refused_before_the_gather(tmp_path, world_of_one):
    """A 7B run's final export (14 GB) met a full disk after its last step and died in safetensors' words ("I/O
    error: No space left on device") while the other ranks gathered. A model of 40 TB (on the meta device: no
    memory) fits no disk here: refused with the sizes, before a bucket is gathered or a file written."""
    huge = torch.nn.Linear(1_000_000, 10_000_000, bias=False, device="meta")  # 10^13 fp32 parameters
    out = tmp_path / "run" / "hf"
    with pytest.raises(WriteError) as refused:
        export_hf(huge, str(TOY_MODEL), out, 1 << 20)
    assert re.fullmatch(rf"cannot write {tmp_path}/run: no space left on the device \([0-9.]+ MB free, the export "
                        r"needs about 42000001\.0 MB\)", str(refused.value)), str(refused.value)  # fmt: skip
    assert not out.parent.exists()


def test_a_run_its_disk_cannot_hold_is_warned_of_at_start_up(tmp_path, world_of_one, caplog):
    """What a run will write to its run directory, its checkpoints and final export, counted at start-up against the
    disk's free space: Qwen2-72B's shape (counted from its config, never allocated) fits no disk here, the toy does."""
    from dsrl.auto import make_plan
    from dsrl.config import Config, DataConfig, ModelConfig
    from dsrl.zero.checkpoint import warn_disk_room

    big = tmp_path / "qwen2_72b"
    big.mkdir()
    config = json.loads((TOY_MODEL / "config.json").read_text()) | {
        "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False, "layer_types": None}  # fmt: skip
    (big / "config.json").write_text(json.dumps(config))
    for model in (big, TOY_MODEL):
        cfg = Config(model=ModelConfig(path=str(model)), data=DataConfig(train_path="unused.jsonl"))
        cfg.logging.run_dir, cfg.logging.save_every, cfg.trainer.total_steps = str(tmp_path / "run"), 10, 100
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            warn_disk_room(cfg, make_plan(cfg, str(model)))
        if model == TOY_MODEL:
            assert not caplog.records
            continue
        plan = make_plan(cfg, str(model))
        assert 72e9 < plan.params < 73e9
        checkpoint, export = (
            12.6 * plan.params / 1e9,
            plan.params * plan.weight_bytes / 1e9,
        )  # (keep_last 2 and the next)
        assert (f"GB free, and this run writes about {3 * checkpoint + export:.1f} GB there: 3 checkpoint(s) of "
                f"{checkpoint:.1f} GB on it at once (logging.save_every, logging.keep_last) and the final export, "
                f"{export:.1f} GB") in caplog.text, caplog.text  # fmt: skip


def test_a_full_disk_message_without_a_tmpfs(tmp_path):
    for e in (OSError(errno.ENOSPC, "No space left on device"), RuntimeError("basic_ios::clear: iostream error")):
        message = str(write_error(tmp_path / "step_2", e))
        if isinstance(e, RuntimeError):  # the disk here is not full: torch's own words are all there is
            assert message.startswith(f"cannot write {tmp_path}/step_2: basic_ios::clear"), message
        else:
            assert message.startswith(f"cannot write {tmp_path}/step_2: no space left on the device ("), message
