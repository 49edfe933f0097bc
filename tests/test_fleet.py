"""The fleet across machines: Ray-placed servers on a real two-node Ray cluster, servers joining and
leaving a live run, a Ray actor killed mid-step, external servers that go down and come back.

One asynchronous run (k=4, partial rollout, an API key) on a local Ray cluster of two nodes
(`ray.cluster_utils.Cluster`: two raylets with their own resources on this machine) carries the
whole story; the tests below read what it left behind.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dsrl.serving.servers import free_port, wait_healthy
from tests.conftest import ROOT, run_processes
from tests.test_reliability import assert_every_prompt_accounted_for, trace, train_cmd

STEPS = 40
ADD_AT, REMOVE_AT, KILL_AT = 8, 16, 24
SERVE = [sys.executable, "-m", "dsrl.cli", "serve", "--model-path", str(ROOT / "examples/toy/model")]
"""A server the user runs (`dsrl serve`, the embedded engine) of the toy model; add --port."""


@pytest.fixture(scope="module")
def ray_cluster():
    ray_cluster_utils = pytest.importorskip("ray.cluster_utils")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no ~/.ray/auth_token written
    cluster = ray_cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"node_b": 1})
    cluster.wait_for_nodes()
    yield cluster.address
    cluster.shutdown()


def fleet(run_dir: Path, *args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "dsrl.cli", "fleet", *args, "--run", str(run_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout if args[0] == "list" else out.stdout.splitlines()[0])


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.fixture(scope="module")
def ray_run(ray_cluster, tmp_path_factory):
    """3 Ray-placed embedded servers spread over 2 nodes; at step 8 one more joins (`dsrl fleet add`), at 16
    server 0 leaves (`dsrl fleet remove`), at 24 the Ray actor of server 1 is SIGKILLed mid-step. Each change waits
    for the weight-update group the last one formed: the `dsrl fleet` calls block this reader, which then reads the
    lines the run wrote meanwhile (seen on CI: the kill came before the leave was applied, and one update did both)."""
    run_dir = tmp_path_factory.mktemp("ray_run")
    args = ["--trainer.total_steps", str(STEPS), "--logging.save_every", str(STEPS)]
    args += ["--rollout.fleet", "ray", "--rollout.ray_address", ray_cluster, "--rollout.num_servers", "3"]
    args += ["--rollout.placement_strategy", "SPREAD", "--rollout.api_key", "s3cret", "--sync.verify", "probe"]
    args += ["--rollout.server_args", json.dumps({"decode_delay_ms": 2})]  # requests in flight at each change
    proc = subprocess.Popen(
        train_cmd("toy_cpu_async.yaml", run_dir, *args), cwd=ROOT, stderr=subprocess.PIPE, text=True
    )
    log, events, formed = [], {}, 0
    try:
        for line in proc.stderr:
            log.append(line)
            formed += bool(re.search(r"weight-update group .* server ranks", line))
            step = int(m.group(1)) if (m := re.search(rf"step (\d+)/{STEPS} \|", line)) else 0
            if step >= ADD_AT and "add" not in events:
                events["add"] = fleet(run_dir, "add", "--count", "1")
            if step >= REMOVE_AT and formed == 2 and "remove" not in events:  # the joined server is in the group
                events["before_remove"] = fleet(run_dir, "list")["servers"]
                events["remove"] = fleet(run_dir, "remove", "--url", events["before_remove"][0])
            if step >= KILL_AT and formed == 3 and "killed_actor" not in events:  # the leave is applied
                server_pid = int(re.search(r"\(pid (\d+)\)", (run_dir / "logs" / "server_1.log").read_text()).group(1))
                events["killed_actor"] = parent_pid(server_pid)
                os.kill(events["killed_actor"], signal.SIGKILL)
                events["server_pid"] = server_pid
        assert proc.wait(600) == 0, "".join(log[-80:])
        assert {"add", "remove", "killed_actor"} <= events.keys(), f"the run ended before every change: {events}"
    finally:
        proc.kill()
    return run_dir, "".join(log), events


def test_ray_places_the_servers_across_the_nodes(ray_run):
    _, log, _ = ray_run
    nodes = re.findall(r"rollout server \d ready at \S+ on Ray node (\w+)", log)[:3]  # the first three
    assert len(nodes) == 3 and len(set(nodes)) == 2, nodes  # SPREAD over the two nodes


def test_a_run_on_a_ray_fleet_learns_the_toy_task(ray_run):
    run_dir, _, _ = ray_run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    reward = [e.value for e in events.Scalars("reward/mean")]
    assert len(reward) == STEPS
    assert sum(reward[-8:]) / 8 > sum(reward[:5]) / 5 + 0.05, reward
    assert max(e.value for e in events.Scalars("rollout/staleness_max")) <= 4


def test_a_server_that_joins_has_the_weights_before_its_first_request(ray_run):
    """The joining server (number 3) is synced inside the next update and held until then: its first
    request finds a weight version the trainer pushed (not the 'default' of a fresh server), and every
    probe after it passed (the run would have stopped)."""
    run_dir, log, events = ray_run
    assert events["add"]["status"].startswith("queued")
    assert "rollout servers joined the fleet" in log
    first = re.search(r"first /generate, under weight version (\S+)", (run_dir / "logs" / "server_3.log").read_text())
    assert first is not None, "the server that joined never took a request"
    assert first.group(1) != "default" and int(first.group(1)) >= ADD_AT


def test_servers_that_leave_or_die_lose_no_prompt_and_train_none_twice(ray_run):
    run_dir, log, events = ray_run
    assert "leaves the fleet (asked to)" in log
    assert "starting a new actor in its placement bundle" in log  # the killed actor's server
    time.sleep(1.5)  # the embedded engine polls for its parent once a second
    assert not Path(f"/proc/{events['server_pid']}").exists(), "the killed actor's server outlived it"
    assert [r["step"] for r in trace(run_dir)] == list(range(STEPS))
    assert_every_prompt_accounted_for(run_dir, f"step_{STEPS}")


def test_the_weight_update_group_is_rebuilt_only_when_membership_changes(ray_run):
    _, log, _ = ray_run
    formed = re.findall(r"weight-update group dsrl_weight_update_\d+: trainer \+ (\d+) server ranks", log)
    # at the start (3 servers), after the join (4), the leave (3), the death (2: the update goes on without it), and
    # its replacement's join (3) when it started before the run's end (it starts in the background)
    changes = re.findall(r".*(?:weight-update group|joined the fleet|leaves the fleet|is down|restarted at).*", log)
    assert formed in (["3", "4", "3", "2"], ["3", "4", "3", "2", "3"]), "\n".join(changes)
    assert (len(formed) == 5) == ("restarted at" in log), "\n".join(changes)


def test_training_against_external_servers_that_go_down_and_come_back(tmp_path):
    """Servers the user runs (`dsrl serve`, here the embedded engine): one is killed at step 3 and is set
    aside, the run goes on with the other; started again on its address at step 6, it rejoins at the next
    update with that update's weights, and takes requests again. Every step trains its whole batch.

    The run is suspended while the server starts again: a restart takes seconds (7 s on an idle 2-core host, more
    beside another test), steps half a second; a CI run once ended before the server answered."""
    ports = [free_port(), free_port()]
    logs = [tmp_path / f"external_{i}.log" for i in range(2)]

    def start(i: int) -> subprocess.Popen:
        with open(logs[i], "a") as out:
            return subprocess.Popen([*SERVE, "--port", str(ports[i])], stdout=out, stderr=subprocess.STDOUT)

    servers = [start(0), start(1)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    run_dir, steps = tmp_path / "external", 20
    args = ["--rollout.server_urls", json.dumps(urls), "--rollout.placement", "disaggregate"]
    args += ["--trainer.total_steps", str(steps), "--rollout.prompts_per_step", "16", "--sync.verify", "probe"]
    proc = subprocess.Popen(train_cmd("toy_cpu.yaml", run_dir, *args), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    log, set_aside, restarted = [], False, False
    try:
        for line in proc.stderr:
            log.append(line)
            if f"step 3/{steps} |" in line:
                servers[1].kill()
            set_aside |= "is down: set aside" in line
            step = int(m.group(1)) if (m := re.search(rf"step (\d+)/{steps} \|", line)) else 0
            if step >= 6 and set_aside and not restarted:  # (lines read late: not before it was set aside)
                run = run_processes(proc.pid)
                for p in run:
                    p.suspend()
                try:
                    servers[1].wait()
                    servers[1], restarted = start(1), True
                    wait_healthy(urls[1], 300)
                finally:
                    for p in run:
                        p.resume()
        assert proc.wait(600) == 0, "".join(log[-60:])
    finally:
        proc.kill()
        for server in servers:
            server.kill()
    text = "".join(log)
    assert f"external rollout server {urls[1]} is down: set aside" in text
    assert f"answer again and rejoin: {urls[1]}" in text
    restarted = logs[1].read_text().split("embedded engine for")[-1]  # the second life of server 1
    first = re.search(r"first /generate, under weight version (\d+)", restarted)
    assert first is not None and int(first.group(1)) >= 6, "the server that came back took no request, or too early"
    assert [len(r["rows"]) for r in trace(run_dir)] == [16] * steps


def test_an_external_server_that_fails_its_updates_ends_the_run_naming_it(tmp_path):
    """A server the user runs that answers but fails every weight update (its crash marker says `fail`) cannot
    be replaced by dsrl: after the retry the run ends, naming the server and its error (a server dsrl started is
    replaced instead: test_reliability's sync-crash test)."""
    port, marker = free_port(), tmp_path / "marker"
    marker.write_text("fail")
    server = subprocess.Popen([*SERVE, "--port", str(port), "--crash-marker", str(marker)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 300)
        args = ["--rollout.server_urls", json.dumps([url]), "--rollout.placement", "disaggregate"]
        out = subprocess.run(
            train_cmd("toy_cpu.yaml", tmp_path / "run", *args, "--trainer.total_steps", "3"),
            cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        server.kill()
    assert out.returncode != 0
    assert f"{url} failed the retried weight update; dsrl cannot replace a server it did not start" in out.stderr
    assert "SyncError: weight sync to version 0 failed twice" in out.stderr  # (external servers get version 0)
    assert "said fail: this server fails every weight update" in out.stderr
