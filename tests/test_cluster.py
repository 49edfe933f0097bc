"""The commands of docs/several-machines.md, run as written on a cluster of four nodes on one box (tests/cluster.py):
node1 and node2 are the trainer nodes (one rank each), node3 and node4 the rollout nodes (Ray's head and a raylet).

One run carries the story, and the tests below read what it left: `dsrl fleet add` and `remove` from the rollout
nodes, then rollout node4 lost (every process of it killed) and back, then trainer node2 lost, and the same command
resuming the run from its checkpoint. Then the same run colocated across the two trainer nodes, and a run whose run
directory is not shared, which stops before any rank starts.
"""

import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster import SHARED, Cluster, missing, up
from tests.conftest import ROOT
from tests.test_reliability import assert_every_prompt_accounted_for, scalars, trace

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STEPS, SAVE = 60, 5
ADD_AT, REMOVE_AT, NODE_LOST_AT = 2, 4, 6
ROLES = {"10.0.0.1": 2, "10.0.0.2": 3, "10.0.0.3": 0, "10.0.0.4": 1}
"""The page's addresses, and the cluster's node (by index) each stands for: rollout nodes A and B are node3 and
node4, trainer nodes C and D node1 and node2."""
SCALE = {"slots=8": "slots=1", "--trainer.num_ranks 8": "--trainer.num_ranks 1",
         "--rollout.num_servers 16": "--rollout.num_servers 2"}  # fmt: skip
"""The page's 8 GPUs a node, on a cluster of one rank and one server a node."""


def page_blocks() -> list[str]:
    """The bash blocks of docs/several-machines.md, continuation lines joined."""
    text = (ROOT / "docs/several-machines.md").read_text()
    return [re.sub(r"\\\n\s*", " ", block) for block in re.findall(r"```bash\n(.*?)```", text, re.S)]


def on_cluster(command: str, cluster: Cluster) -> str:
    """A line of the page with the cluster's addresses and sizes."""
    for old, new in SCALE.items():
        command = command.replace(old, new)
    return re.sub(r"10\.0\.0\.\d", lambda m: cluster.nodes[ROLES[m[0]]].address, command)


def launch_lines_of_page() -> list[tuple[int, str]]:
    """The page's first block: (the node that runs it, the command as written), in order."""
    lines = []
    for line in page_blocks()[0].splitlines():
        if m := re.fullmatch(r"(.*?)\s+# on \w+ node \w \((10\.0\.0\.\d)\)", line.strip()):
            lines.append((ROLES[m[2]], m[1]))
    return lines


def launch_lines(cluster: Cluster) -> list[tuple[int, str]]:
    return [(node, on_cluster(cmd, cluster)) for node, cmd in launch_lines_of_page()]


def fleet_line(action: str, cluster: Cluster) -> str:
    """The page's `dsrl fleet <action>` line (the first, for add: a count)."""
    lines = [line.split("#")[0].strip() for line in page_blocks()[1].splitlines()]
    return on_cluster(next(line for line in lines if line.split()[:3] == ["dsrl", "fleet", action]), cluster)


def run_yaml(run_dir: str, **overrides) -> str:
    """configs/toy_cpu_async.yaml as the page's run.yaml: the toy task, async k = 2 with partial rollout."""
    cfg = yaml.safe_load((ROOT / "configs/toy_cpu_async.yaml").read_text())
    cfg["model"]["path"] = str(ROOT / cfg["model"]["path"])
    cfg["data"]["train_path"] = str(ROOT / cfg["data"]["train_path"])
    cfg["trainer"]["total_steps"] = STEPS
    cfg["rollout"] |= {"max_staleness": 2, "server_args": {"decode_delay_ms": 5}}  # (requests in flight at changes)
    cfg["logging"] = {"run_dir": run_dir, "save_every": SAVE, "export_hf": False}
    for key, value in overrides.items():
        section, field = key.split("__")
        cfg.setdefault(section, {})[field] = value
    return yaml.safe_dump(cfg)


ENV = {"RAY_AUTH_MODE": "disabled", "TORCH_EXTENSIONS_DIR": str(ROOT / ".venv" / "torch_extensions"),
       "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}  # fmt: skip
"""The users' environment on every node: Ray without its token file (shared /root), a lost node found within ~3 s
(Ray's default: 15 s), the venv's JIT builds."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if why := missing():
        pytest.skip(why)
    with up(4, base=tmp_path_factory.mktemp("cluster")) as c:
        yield c


class Run:
    """`dsrl train` on a node, its output read line by line (the launcher prefixes each rank's with its host)."""

    def __init__(self, cluster: Cluster, node: int, command: str, total: int = STEPS):
        self.total = total
        self.proc = cluster.nodes[node].popen(command, env=ENV, cwd=SHARED, stdout=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.seen:
                self.lines.append(line)
                self.seen.notify_all()
        self.proc.wait()
        with self.seen:
            self.seen.notify_all()

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        with self.seen:
            found = self.seen.wait_for(lambda: self.proc.poll() is not None or self.search(pattern), timeout)
        if not found or not self.search(pattern):
            raise AssertionError(f"never seen: {pattern!r}; the run's end:\n{''.join(self.lines[-60:])}")
        return self.search(pattern)

    def search(self, pattern: str) -> re.Match | None:
        return next((m for line in reversed(self.lines) if (m := re.search(pattern, line))), None)

    def step(self, n: int) -> None:
        self.wait_for(rf"step {n}/{self.total} \|")

    @property
    def log(self) -> str:
        return "".join(self.lines)


def processes(cluster: Cluster, node: int, name: str) -> list[str]:
    """The command lines of a node's processes that run module `name`."""
    found = []
    for pid in cluster.nodes[node].processes():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if any(cmd[i : i + 2] == ["-m", name] for i in range(len(cmd))):
            found.append(" ".join(cmd))
    return found


@pytest.fixture(scope="module")
def story(cluster):
    """The page's run, its fleet changed, a rollout node lost and back, a trainer node lost, and resumed."""
    # (sync.timeout_s 120, not 300: a node lost during a weight update costs that timeout before the fleet heals, and
    # the kill below can land in one: CI saw it, and the run's return went unseen for the 240 s the story waits)
    (cluster.dir / "shared" / "run.yaml").write_text(run_yaml("runs/my_run", sync__timeout_s=120))
    lines = launch_lines(cluster)
    head, *raylets = [(node, cmd) for node, cmd in lines if cmd.startswith("ray start")]
    cluster.nodes[head[0]].run(head[1], env=ENV, timeout=180)
    workers = [cluster.nodes[node].popen(cmd, env=ENV) for node, cmd in raylets]
    assert all(w.wait(180) == 0 for w in workers), "a raylet did not start"
    for node, cmd in lines:
        if cmd.startswith("printf"):
            cluster.nodes[node].run(cmd, cwd=SHARED)
    node, train = next((node, cmd) for node, cmd in lines if cmd.startswith("dsrl train"))
    events: dict = {"train": train}
    run = Run(cluster, node, f"exec {train}")
    try:
        run.step(ADD_AT)
        events["placed"] = {n: processes(cluster, n, name) for n in range(4) for name in ("dsrl.train",)}
        events["servers"] = {n: processes(cluster, n, "dsrl.serving.embedded") for n in range(4)}
        events["connections"] = {n: cluster.nodes[n].run("ss -tnpH state established").stdout for n in (0, 1)}
        add = cluster.nodes[2].run(fleet_line("add", cluster), env=ENV, cwd=SHARED, timeout=600, check=False)
        events["add"] = add.stdout + add.stderr
        run.step(REMOVE_AT)
        listed = json.loads(cluster.nodes[3].run(fleet_line("list", cluster), env=ENV, cwd=SHARED).stdout)
        node4 = next(url for url in listed["servers"] if cluster.nodes[3].address in url)
        remove = re.sub(r"--url \S+", f"--url {node4}", fleet_line("remove", cluster))
        events["remove"] = cluster.nodes[3].run(remove, env=ENV, cwd=SHARED).stdout
        events["removed"] = node4
        run.wait_for(r"weight-update group .* trainer \+ 3 server ranks")
        run.step(NODE_LOST_AT)
        cluster.nodes[3].kill()
        cluster.nodes[3].revive()  # at once: the raylet's start takes 10-20 s
        cluster.nodes[3].run(raylets[0][1], env=ENV, timeout=180)
        rejoined = int(run.wait_for(r"restarted at", timeout=240) and run.search(rf"step (\d+)/{STEPS} \|")[1])
        lost_at = (rejoined // SAVE + 1) * SAVE + 1  # a step after a checkpoint that follows the return
        assert lost_at < STEPS, f"node4 rejoined at step {rejoined}: too late for the rest of the story"
        run.step(lost_at)
        lost = time.monotonic()
        cluster.nodes[1].kill()
        events["trainer_lost"] = run.proc.wait(60)
        events["exited_in_s"] = time.monotonic() - lost
        events["left"] = {n: processes(cluster, n, "dsrl.train") + processes(cluster, n, "dsrl.serving.embedded")
                          for n in range(4)}  # fmt: skip
        events["first_log"] = run.log
        (cluster.dir / "first_run.log").write_text(run.log)  # (kept for a look after a failure)
        cluster.nodes[1].revive()
        resumed = Run(cluster, node, f"exec {train}")
        assert resumed.proc.wait(400) == 0, resumed.log[-5000:]
        events["resumed_log"] = resumed.log
        (cluster.dir / "resumed_run.log").write_text(resumed.log)
    finally:
        run.proc.kill()
    return cluster.dir / "shared" / "runs" / "my_run", events


def test_the_documented_commands_run_as_written(story):
    _, events = story
    assert events["train"].startswith("dsrl train --config run.yaml --trainer.hostfile hostfile")
    assert "198.18.0.3:6379" in events["train"], events["train"]


def test_each_rank_and_each_server_is_on_its_own_node(story, cluster):
    _, events = story
    assert [len(events["placed"][n]) for n in range(4)] == [1, 1, 0, 0], events["placed"]
    for n in (2, 3):  # one server a rollout node, bound to that node's address
        (server,) = events["servers"][n]
        assert f"--host {cluster.nodes[n].address}" in server, server
    for n in (0, 1):  # each rank talks from its node's address to the other's
        other = cluster.nodes[1 - n].address
        assert re.search(rf"{cluster.nodes[n].address}:\d+\s+{other}:\d+", events["connections"][n]), events


def test_the_reward_rises_and_nothing_is_lost_or_trained_twice(story):
    run_dir, _ = story
    reward = scalars(run_dir)["reward/mean"]
    assert sorted(reward) == list(range(1, STEPS + 1))
    values = [reward[s] for s in sorted(reward)]
    assert sum(values[-8:]) / 8 > sum(values[:5]) / 5 + 0.05, values
    assert [r["step"] for r in trace(run_dir)] == list(range(STEPS))
    assert_every_prompt_accounted_for(run_dir, f"step_{STEPS}")


def test_servers_join_and_leave_from_the_rollout_nodes(story):
    _, events = story
    assert "done" in events["add"], events["add"]
    assert events["removed"] in events["first_log"]
    assert "leaves the fleet (asked to)" in events["first_log"]


def test_a_lost_rollout_node_is_routed_around_and_its_return_rejoins(story):
    _, events = story
    log = events["first_log"]
    assert "is down" in log and "restarted at" in log, log[-3000:]


def test_a_lost_trainer_node_ends_every_process_within_15_s_and_the_same_command_resumes(story):
    _, events = story
    log = events["first_log"]
    assert events["trainer_lost"] != 0
    assert events["exited_in_s"] < 15, events["exited_in_s"]
    assert not any(events["left"].values()), events["left"]  # the ranks and servers of every node
    assert "dsrl train: trainer node 198.18.0.2 does not answer ssh" in log, log[-3000:]
    assert "the trainer rank at 198.18.0.2 is gone" in log, log[-3000:]
    assert re.search(r"resumed from runs/my_run/checkpoints/step_(\d+) at step \1", events["resumed_log"])


COLOCATED = (
    "--rollout.placement colocate --rollout.num_servers 2 --rollout.max_staleness 0 --logging.run_dir runs/coloc"
)


@pytest.fixture(scope="module")
def colocated(cluster, story):
    """The page's command colocated: the trainer nodes' servers started by their own nodes (after the story)."""
    train = re.sub(r"--rollout\.placement .* --rollout\.placement_strategy \S+", COLOCATED, story[1]["train"])
    run = Run(cluster, 0, f"exec {train} --trainer.total_steps 6 --logging.save_every 0", total=6)
    try:
        run.step(2)
        servers = {n: processes(cluster, n, "dsrl.serving.embedded") for n in range(4)}
        assert run.proc.wait(300) == 0, run.log[-5000:]
    finally:
        run.proc.kill()
    return train, servers, run.log


def test_colocated_across_two_nodes_each_node_serves_from_its_own(colocated, cluster):
    train, servers, log = colocated
    assert "--rollout.placement colocate" in train and "ray" not in train, train
    assert [len(servers[n]) for n in range(4)] == [1, 1, 0, 0], servers
    for n in (0, 1):
        assert f"--host {cluster.nodes[n].address}" in servers[n][0], servers[n]
    assert "step 6/6 |" in log


def test_a_run_directory_not_shared_stops_the_run_before_any_rank_starts(tmp_path):
    """Each node its own /mnt/shared: `dsrl train` names the node that does not see the run directory."""
    if why := missing():
        pytest.skip(why)
    with up(4, shared=False, base=tmp_path / "cluster") as cluster:
        (cluster.nodes[0].dir / "shared" / "run.yaml").write_text(run_yaml("runs/my_run"))
        for node, cmd in launch_lines(cluster):
            if not cmd.startswith("ray start"):  # (it stops before it would need Ray)
                out = cluster.nodes[node].run(cmd, env=ENV, cwd=SHARED, check=False, timeout=300)
    lines = [line for line in out.stderr.splitlines() if "node 198.18.0.2" in line]
    assert out.returncode == 2, out.stdout + out.stderr
    lacks = f"node 198.18.0.2 (node2) lacks the run directory {SHARED}/runs/my_run this node holds (not shared with it"
    assert len(lines) == 1 and lacks in lines[0], out.stderr
    assert "deepspeed.launcher" not in out.stdout + out.stderr  # no rank started


def test_a_partition_longer_than_the_sync_timeout_is_one_line_naming_the_server_not_a_hang(cluster):
    """Servers the user runs on the rollout nodes (`dsrl serve`), a trainer of one rank on node1; node4's link goes
    down for three times --sync.timeout_s. Its server is set aside within the timeout, named in one line, and the
    run goes on with node3's while the partition lasts; once the link is back the server rejoins."""
    serve = f"exec dsrl serve --model-path {ROOT / 'examples/toy/model'} --port 30000 --host"
    servers = [cluster.nodes[n].popen(f"{serve} {cluster.nodes[n].address}", env=ENV) for n in (2, 3)]
    urls = [f"http://{cluster.nodes[n].address}:30000" for n in (2, 3)]
    for n in (2, 3):
        cluster.nodes[n].wait_port(30000)
    args = f"--rollout.fleet external --rollout.server_urls '{json.dumps(urls)}' --sync.timeout_s 5"
    args += " --trainer.num_ranks 1 --trainer.total_steps 20 --logging.run_dir part"
    (cluster.dir / "shared" / "part.yaml").write_text(run_yaml("part"))
    run = Run(cluster, 0, f"exec dsrl train --config part.yaml {args}", total=20)
    try:
        run.step(5)
        cluster.nodes[3].partition()
        parted = time.monotonic()
        run.wait_for(rf"external rollout server {urls[1]} is down: set aside", timeout=200)
        during = len(re.findall(r"step \d+/20 \|", run.log))
        run.step(during + 2)  # two more steps while the partition lasts
        time.sleep(max(0.0, 15 - (time.monotonic() - parted)))  # (3 x --sync.timeout_s in all)
        cluster.nodes[3].heal()
        run.wait_for(rf"answer again and rejoin: {urls[1]}", timeout=60)
        assert run.proc.wait(300) == 0, run.log[-5000:]
    finally:
        run.proc.kill()
        for server in servers:
            server.kill()
        (cluster.dir / "partition_run.log").write_text(run.log)
    assert run.log.count("is down: set aside") == 1, run.log[-5000:]  # said once, naming it
    assert [r["step"] for r in trace(cluster.dir / "shared" / "part")] == list(range(20))


def test_the_slurm_recipe_runs_the_documented_run_across_a_jobs_nodes(tmp_path):
    """tools/slurm/dsrl.sbatch, submitted to Debian's Slurm on the cluster (where Slurm is installed: .ci/run does not
    install it, for time): Ray on the job's last two nodes, `dsrl train` from the first over both trainer nodes."""
    if why := missing() or (None if shutil.which("slurmctld") else "Slurm is not installed (apt-get install slurmd "
                                                                       "slurmctld slurm-client munge)"):  # fmt: skip
        pytest.skip(why)
    with up(4, base=tmp_path / "cluster") as cluster:
        env = cluster.start_slurm() | ENV | {"GPUS_PER_NODE": "1"}
        (cluster.dir / "shared" / "run.yaml").write_text(run_yaml("runs/slurm", trainer__total_steps=8))
        job = f"sbatch --wait --nodes 4 -o slurm.out {ROOT / 'tools/slurm/dsrl.sbatch'} run.yaml"
        done = cluster.nodes[0].run(job, env=env, cwd=SHARED, timeout=600, check=False)
        log = (cluster.dir / "shared" / "slurm.out").read_text()
    assert done.returncode == 0, done.stdout + done.stderr + log[-5000:]
    assert "198.18.0.1: " in log and "198.18.0.2: " in log  # a rank on each trainer node
    servers = re.findall(r"rollout server \d ready at http://([\d.]+):", log)
    assert sorted(servers) == ["198.18.0.3", "198.18.0.4"], log[-5000:]
    assert "step 8/8 |" in log
