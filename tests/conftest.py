import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
TOY_MODEL = ROOT / "examples" / "toy" / "model"

os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch builds DeepSpeed's comm op under ~/.cache/torch_extensions by its name alone, its build.ninja naming this
# venv's paths: with two checkouts on one machine, each run rebuilt it over the other's (30-70 s a run on 2 cores,
# and the other rank waits). One build per venv; CI's clean machine builds it once either way.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

SHARED_RUNS = (
    ("tests/test_e2e.py::",),
    ("tests/test_fleet.py::",),
    ("tests/test_lora.py::",),
    ("tests/test_nothing_lost.py::test_sigterm_", "tests/test_nothing_lost.py::test_a_truncated_latest_"),
    ("tests/test_sync.py::",),
    ("tests/test_agents.py::",),
    ("tests/test_async.py::",),
    ("tests/test_embedded.py::",),
    ("tests/test_parity.py::test_layout_",),
    ("tests/test_parity.py::test_corrupt_",),
    ("tests/test_cluster.py::",),
)
"""Tests that share one costly module fixture, by their ids' beginnings: whole files (the toy run, the Ray fleet run,
the LoRA run: 80-150 s each; the sync worker's runs on 2 ranks and on 1, 25-30 s each, which split files built on
both workers; the servers of the agent, async and embedded tests, 4-5 s each), or the tests of one file that read one
story (the stopped run; the layout parity's process groups on 1, 2 and 4 ranks; the corrupted servers' run; the
cluster tests, one cluster and its story of runs)."""


def pytest_xdist_make_scheduler(config, log):
    """Two workers (-n 2), each group of SHARED_RUNS whole on one of them, so that its run is built once (plain load
    built the Ray run on both); every other test goes where there is room, as with --dist load. (xdist's own
    --dist loadgroup groups nothing under pytest 9: it renames `item._nodeid`, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SharedRunsWhole(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((group[0] for group in SHARED_RUNS if nodeid.startswith(group)), nodeid)

    return SharedRunsWhole(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `slow` tests first (xdist hands out the groups of SHARED_RUNS first, then single tests in this order): the
    suite then ends on short tests on both workers, instead of one worker finishing a run of a minute or more alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def toy_weights(tmp_path_factory) -> Path:
    """The toy model with fixed random weights, saved once per session."""
    import torch
    from transformers import AutoModelForCausalLM

    from dsrl.tasks.toy import build_model_config, build_tokenizer

    out = tmp_path_factory.mktemp("toy_weights")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_model_config()).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def run_ranks(ranks: int, script: Path, *args) -> int:
    """`script` on `ranks` gloo ranks, started as `dsrl train` starts its ranks (`cli.launcher_command`: DeepSpeed's
    node launcher); a rank's failure fails the test with the output's end. Returns the master port."""
    from dsrl.cli import launcher_command
    from dsrl.config import TrainerConfig
    from dsrl.serving.servers import free_port

    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    port = free_port()
    cmd = launcher_command(TrainerConfig(num_ranks=ranks), False, env, port)
    cmd += ["--no_local_rank", str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return port


def run_processes(pid: int) -> list[psutil.Process]:
    """`dsrl train` (its pid) and every process it started: the launcher has a session of its own, so its process
    group would miss the ranks."""
    owner = psutil.Process(pid)
    return [owner, *owner.children(recursive=True)]


def still_running(pids: list[int], within_s: float = 10) -> list[int]:
    """Those of `pids` still running (not gone, not a zombie) after up to `within_s`: a SIGKILL is delivered, and a
    process torn down, a moment after it is sent (CI once saw a killed child "running" the instant after)."""

    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    due = time.monotonic() + within_s
    while any(running(pid) for pid in pids) and time.monotonic() < due:
        time.sleep(0.1)
    return [pid for pid in pids if running(pid)]


def pytest_terminal_summary(terminalreporter) -> None:
    """One line: how many of the `cluster` tests (tests/cluster.py: a cluster of namespaces) ran, or why none did."""
    reports = [r for kind in ("passed", "failed", "error", "skipped") for r in terminalreporter.stats.get(kind, [])]
    cluster = {r.nodeid: r for r in reports if "cluster" in getattr(r, "keywords", {}) and r.when in ("setup", "call")}
    if not cluster:
        return
    skipped = [r for r in cluster.values() if r.skipped]
    why = f"; {len(skipped)} skipped: {skipped[0].longrepr[-1].removeprefix('Skipped: ')}" if skipped else ""
    terminalreporter.write_line(f"cluster tests (tests/cluster.py): {len(cluster) - len(skipped)} ran{why}")
