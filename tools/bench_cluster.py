"""The weight sync and the rollout across nodes, on links shaped like a cluster's (tests/cluster.py, as root).

node1 runs the trainer (one rank), node2 and node3 the embedded servers (`dsrl serve`). For each link rate (tc tbf,
each way on every node's link) it prints the sync of a ~750 MB fp32 model (`tools/bench_sync.py`: the update as
training runs it, best of --repeats) to one server node and to two: bytes, seconds, and the fraction of the link's
rate the trainer's link carried (every server's copy leaves through it). Then the rollout's response tokens per
second, the toy task synchronous, with its one server on node2 against the same on node1 beside the trainer (one
host), as `tools/bench_fleet.py` measures it.

    python tools/bench_cluster.py                          # unshaped, 1, 10 and 100 Gbit/s
    python tools/bench_cluster.py --rates 10gbit --repeats 5

`--sync-nodes` runs, instead, `tools/bench_sync_nodes.py` across four nodes: node1 and node2 a trainer rank each
(a DeepSpeed hostfile), node3 and node4 a server each (`dsrl serve` with the shard loader), for each link rate and
model: rank 0 sends everything, every rank its partition, every rank only the changed words. "Carried" is what the
busiest link carried: a trainer node's, which sends its bytes to each server (rank 0 alone: all of them twice).

    python tools/bench_cluster.py --sync-nodes --rates 10gbit 100gbit --models toy 0.5b
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster import SHARED, missing, up  # noqa: E402 -- after the path


def gbit(rate: str | None) -> float | None:
    if rate is None:
        return None
    number, unit = re.fullmatch(r"([\d.]+)([gm])bit", rate).groups()
    return float(number) * (1 if unit == "g" else 1e-3)


ENV = {"TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions")}  # (the suite's: built once a venv)


def sync_rows(node, urls: list[str], repeats: int) -> dict:
    cmd = f"python tools/bench_sync.py --ranks 1 --repeats {repeats} --bucket-mb 256 --workdir {SHARED}"
    out = node.run(f"{cmd} --server-urls '{json.dumps(urls)}'", env=ENV, timeout=1200, cwd=ROOT).stdout
    return next(json.loads(line) for line in out.splitlines() if line.startswith("{"))


def rollout_tokens_per_s(node, name: str, fleet: str, steps: int) -> float:
    """Response tokens per second of a synchronous toy run (bench_fleet's measure), past its first two steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = f"{SHARED}/{name}"
    cmd = f"dsrl train --config configs/toy_cpu.yaml --trainer.num_ranks 1 --trainer.total_steps {steps} {fleet}"
    cmd += f" --rollout.placement disaggregate --rollout.max_staleness 0 --logging.run_dir {run_dir} --eval.path null"
    node.run(cmd + " --logging.export_hf false", env=ENV, timeout=1200, cwd=ROOT)
    events = EventAccumulator(str(node.cluster.dir / "shared" / Path(run_dir).name / "tensorboard"))
    events.Reload()
    lengths, seconds = (
        [e.value for e in events.Scalars(tag)[2:]] for tag in ("response/length_mean", "timing/generate")
    )
    return statistics.median(n * 32 * 8 / s for n, s in zip(lengths, seconds))  # toy_cpu.yaml: 32 prompts x 8


def serve(nodes, model: str, flags: str = "") -> list:
    """`dsrl serve` of `model` on port 30000 of each of `nodes`, answering."""
    cmd = f"exec dsrl serve --model-path {model} --port 30000 {flags}"
    started = [node.popen(f"{cmd} --host {node.address}") for node in nodes]
    for node in nodes:
        node.wait_port(30000, timeout=300)
    return started


def sync_nodes(args) -> None:
    """rank0, all and delta (`tools/bench_sync_nodes.py`) from 2 trainer nodes to 2 server nodes, each rate, model."""
    work, loader = f"{SHARED}/sync_nodes", "--dtype bfloat16 --custom-weight-loader dsrl.serving.shard_loader.load"
    bench = f"python tools/bench_sync_nodes.py --workdir {work} --repeats {args.repeats} --changed {args.changed}"
    with up(4) as cluster:
        trainers, servers = cluster.nodes[:2], cluster.nodes[2:]
        (cluster.dir / "shared" / "hostfile").write_text(cluster.hostfile(trainers))
        trainers[0].run(f"{bench} --prepare --models {' '.join(args.models)}", env=ENV, timeout=1200, cwd=ROOT)
        urls = " ".join(f"http://{node.address}:30000" for node in servers)
        print("model | link | mode | changed words | MB a sync | seconds | carried on the busiest link | fraction")
        parts = []
        for model in args.models:
            started = serve(servers, f"{work}/{model} {loader}")
            for rate in args.rates:
                cluster.shape(None if rate == "none" else rate)
                cmd = f"{bench} --models {model} --hostfile {SHARED}/hostfile --ranks 1 --servers {urls}"
                out = trainers[0].run(cmd, env=ENV, timeout=3600, cwd=ROOT)
                results = cluster.dir / "shared/sync_nodes/results.jsonl"
                if not results.is_file():
                    raise SystemExit(f"bench_sync_nodes.py gave no results:\n{out.stdout[-4000:]}{out.stderr[-4000:]}")
                for line in results.read_text().splitlines():
                    r = json.loads(line)
                    senders = 1 if r["mode"] == "rank0" else len(trainers)
                    carried = r["mb"] * 8e-3 * len(servers) / senders / r["seconds"]  # Gbit/s of one trainer node
                    link = gbit(None if rate == "none" else rate)
                    print(f"{model} | {rate} | {r['mode']} | {r['changed']:.4f} | {r['mb']:.3g} | {r['seconds']:.3f} | "
                          f"{carried:.3g} Gbit/s | {f'{carried / link:.3g}' if link else '-'}", flush=True)  # fmt: skip
                    parts.append(f"{model} | {rate} | {r['mode']} | seconds in the median sync (rank 0): {r['parts']}")
            for node, proc in zip(servers, started):
                node.end(proc)
    print("\n".join(parts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rates = ["none", "1gbit", "10gbit", "100gbit"]
    p.add_argument("--rates", nargs="*", default=rates, help="tc's words; none: unshaped")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="steps of each rollout run")
    p.add_argument("--sync-nodes", action="store_true", help="rank0/all/delta from 2 trainer nodes to 2 server nodes")
    p.add_argument("--models", nargs="+", default=["toy", "0.5b"], help="with --sync-nodes")
    p.add_argument("--changed", type=float, default=0.01, help="with --sync-nodes: fraction changed between syncs")
    args = p.parse_args()
    if why := missing():
        raise SystemExit(f"bench_cluster: {why}")
    if args.sync_nodes:
        return sync_nodes(args)
    from tools.bench_sync import make_cpu_model

    with up(3) as cluster:
        trainer, servers = cluster.nodes[0], cluster.nodes[1:]
        model = make_cpu_model(cluster.dir / "shared" / "cpu-750mb")
        urls = [f"http://{node.address}:30000" for node in servers]
        started = serve(servers, f"{SHARED}/{model.name}")
        print("link | server nodes | MB a sync | seconds (best) | Gbit/s on the trainer's link | fraction of the link")
        for rate in args.rates:
            cluster.shape(None if rate == "none" else rate)
            for count in (1, 2):
                row = sync_rows(trainer, urls[:count], args.repeats)
                carried = row["gb"] * 8 * count / (row["sync_ms"] / 1e3)  # each server's copy leaves rank 0's link
                link = gbit(None if rate == "none" else rate)
                fraction = f"{carried / link:.2f}" if link else "-"
                print(f"{rate} | {count} | {row['gb'] * 1e3:.0f} | {row['sync_ms'] / 1e3:.3f} | {carried:.1f} | "
                      f"{fraction}", flush=True)  # fmt: skip
        for node, proc in zip(servers, started):
            node.end(proc)
        serve(servers[:1], str(ROOT / "examples/toy/model"))  # the toy task's own
        cluster.shape("10gbit")
        across = f"--rollout.fleet external --rollout.server_urls '[\"{urls[0]}\"]'"
        across = rollout_tokens_per_s(trainer, "across", across, args.steps)
        one_host = rollout_tokens_per_s(trainer, "one_host", "--rollout.num_servers 1", args.steps)
        print(f"rollout, response tokens/s (toy, 10 Gbit/s links): server on node2 {across:.0f}; on the trainer's "
              f"node (one host) {one_host:.0f}; ratio {across / one_host:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
