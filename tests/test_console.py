"""What a user reads during a long wait: a server that is slow to start and a write of many bytes say how far they
got, every `every_s` (10 s in a run), instead of nothing. (A whole run's output, line by line, is checked by
tests/test_nothing_lost.py's SIGTERM run.)"""

import logging
import re
import sys
import time

import pytest

from dsrl.rundir import report_writes
from dsrl.serving.servers import free_port, spawn, wait_healthy

SLOW_SERVER = """
import http.server, sys, time
print("loading the weights", flush=True)
time.sleep(2)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_server_slow_to_start_says_how_long_it_has_waited_and_what_its_log_says(tmp_path, caplog):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = spawn([sys.executable, "-c", SLOW_SERVER, str(port)], {}, tmp_path / "server_0.log", url)
    try:
        with caplog.at_level(logging.INFO, logger="dsrl.serving.servers"):
            wait_healthy(server, timeout_s=60, every_s=0.5)
    finally:
        server.stop()
    assert re.search(rf"server {url} not ready after \d+ s; its log ends: loading the weights", caplog.text)


def test_a_long_write_says_the_bytes_written_so_far_and_at_the_end_the_total(tmp_path, caplog):
    out = tmp_path / "step_8"
    with caplog.at_level(logging.INFO, logger="dsrl.rundir"):
        with report_writes(out, "checkpoint step_8", every_s=0.05):
            out.mkdir()
            (out / "shard").write_bytes(bytes(3 << 20))
            deadline = time.monotonic() + 30
            # (a report may come while the file is still being written: CI saw "2.1 MB written so far" first)
            while "3.1 MB written so far" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
    assert "checkpoint step_8: 3.1 MB written so far in " in caplog.text, caplog.text
    assert caplog.messages[-1].startswith("checkpoint step_8: 3.1 MB written in "), caplog.text


BUILD_NINJA = """rule compile
  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out $post_cflags
rule link
  command = $cxx $in $ldflags -o $out

build shm_interface.o: compile /site-packages/deepspeed/ops/csrc/cpu/comm/shm_interface.cpp
build shm.o: compile /site-packages/deepspeed/ops/csrc/cpu/comm/shm.cpp

build deepspeed_shm_comm.so: link shm_interface.o shm.o

default deepspeed_shm_comm.so
"""


def test_an_op_build_says_its_seconds_and_steps_as_ninja_ends_each(tmp_path, caplog):
    """torch's JIT build of DeepSpeed's comm op (build.ninja as torch writes it, .ninja_log as ninja appends to it):
    its objects come at the end of a minute, so bytes written looked stuck at 0.0 MB; its steps move."""
    (tmp_path / "build.ninja").write_text(BUILD_NINJA)
    with caplog.at_level(logging.INFO, logger="dsrl.rundir"):
        with report_writes(tmp_path, "the comm op's build", every_s=0.05):
            deadline = time.monotonic() + 30
            while "under way" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            (tmp_path / ".ninja_log").write_text("# ninja log v7\n0\t75764\t17957364\tshm_interface.o\t5c685a9e\n")
            while "1 of 3" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            with open(tmp_path / ".ninja_log", "a") as log:
                log.write("7\t76162\t17957364\tshm.o\t2f80d4cd\n")
            while "2 of 3" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            with open(tmp_path / ".ninja_log", "a") as log:
                log.write("76162\t76475\t17957365\tdeepspeed_shm_comm.so\td18a283e\n")
    said = [m.split(" s, ", 1)[1] for m in caplog.messages if m.startswith("the comm op's build: ")]
    assert said[0] == "0 of 3 steps done, under way: compiling shm_interface.cpp, compiling shm.cpp", said
    assert "1 of 3 steps done, under way: compiling shm.cpp" in said, said
    assert "2 of 3 steps done, under way: linking deepspeed_shm_comm.so" in said, said
    assert said[-1] == "3 of 3 steps done", said


def test_a_long_engine_build_says_its_seconds_and_the_hosts_memory_and_a_short_one_nothing(caplog):
    """32B with ZeRO-Offload spent 3 silent minutes in deepspeed.initialize, which makes the optimizer's states on the
    host: a build past `every_s` says how long it has run and the host's memory in use, which grows as it goes."""
    from dsrl.zero.engine import said_while

    with caplog.at_level(logging.INFO, logger="dsrl.zero.engine"):
        with said_while("DeepSpeed's engine and optimizer", every_s=10.0):
            pass
        assert caplog.messages == []
        with said_while("DeepSpeed's engine and optimizer", every_s=0.05):
            time.sleep(0.3)
    assert re.fullmatch(r"DeepSpeed's engine and optimizer: \d s so far, the host's memory in use [\d.]+ GB",
                        caplog.messages[0]), caplog.messages  # fmt: skip
    assert re.fullmatch(r"DeepSpeed's engine and optimizer: \d s, the host's memory in use [\d.]+ GB",
                        caplog.messages[-1]), caplog.messages  # fmt: skip


COMPILING_SERVER = """
import http.server, sys, time
for i in range(10):  # a first start's JIT builds and CUDA graph captures: longer than the timeout, never silent
    print(f"capturing batch {i}", flush=True)
    time.sleep(0.3)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if sys.argv[2] == "up" else 503)  # (down: up, but never ready, as a hung SGLang)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_server_start_may_outlast_the_timeout_while_its_log_moves_and_fails_once_it_falls_silent(tmp_path):
    """--rollout.startup_timeout_s counts silence, not the whole start (a TP-2 server's first start on a fresh machine
    took over 300 s of JIT builds and CUDA graph captures); its answers to the /health polls are not progress."""
    for state in ("up", "down"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = spawn([sys.executable, "-c", COMPILING_SERVER, str(port), state], {}, tmp_path / f"{state}.log", url)
        start = time.monotonic()
        try:
            if state == "up":
                wait_healthy(server, timeout_s=1.5)
                assert time.monotonic() - start > 2.5  # (the start took longer than the timeout, and passed)
            else:
                with pytest.raises(TimeoutError, match=r"its log said nothing for 2s \(--rollout.startup_timeout_s\)"):
                    wait_healthy(server, timeout_s=1.5)
                assert '"GET /health HTTP/1.1" 503' in (tmp_path / "down.log").read_text()
        finally:
            server.stop()


def test_a_trainer_nodes_failed_launch_stops_the_others_after_the_grace_naming_it(tmp_path, capsys, monkeypatch):
    """pdsh says a node's launch ended in failure while the launcher goes on (the other nodes' ranks waiting to join
    a world that lost a rank): `dsrl train` stops the run NODE_GRACE_S later, in one line naming the node."""
    import subprocess

    from dsrl import cli

    monkeypatch.setattr(cli, "NODE_GRACE_S", 1.0)
    said = "pdsh@node1: 10.0.0.4: ssh exited with exit code 2"
    launcher = f"import sys, time; print({said!r}, file=sys.stderr, flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", launcher], stderr=subprocess.PIPE, text=True, start_new_session=True)
    started = time.monotonic()
    assert cli.supervise(proc, tmp_path, [], 600, cli.node_ends(proc)) == 1
    assert time.monotonic() - started < 30 and proc.poll() is not None
    err = capsys.readouterr().err
    assert said in err  # passed on
    assert (
        "the ranks of trainer node 10.0.0.4 exited with status 2 1 s ago and the others went on: stopping them" in err
    )
