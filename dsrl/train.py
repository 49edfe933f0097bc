"""The training loop, one rank of it: ``deepspeed --module dsrl.train --config run.yaml`` (or ``dsrl train``).
generate -> logprobs -> update -> sync, each phase timed; the details live below it."""

import gc
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from dsrl import rundir
from dsrl.auto import decode_graphs, log_decisions, lora_servers, make_plan, resolve, trainer_on_cuda
from dsrl.collectives import agreed, all_ranks
from dsrl.config import Config, parse_config, validate
from dsrl.data import DatasetError, check_datasets, server_context
from dsrl.evaluate import Evaluator
from dsrl.fp8 import servers_model_dir
from dsrl.lending import GpuLending
from dsrl.metrics import MetricsWriter, Timer, configure_logging, gather_lists, reduce_across_ranks, summary_line
from dsrl.moe import routing_replay, with_routed_experts
from dsrl.plan import Plan
from dsrl.rewards.models import start_reward_model
from dsrl.rewards.rewarder import Rewarder
from dsrl.rewards.teacher import start_teacher
from dsrl.rollout.episode import EpisodeRunner, episode_metrics, sample_row
from dsrl.rollout.manager import schedule
from dsrl.rollout.rollouts import Batch, Rollouts, rollout_metrics
from dsrl.rundir import ExportTargetError, OwnerWatch, RunDirLocked, RunStopped, StopRequests, WriteError
from dsrl.serving.client import RolloutClient
from dsrl.serving.control import FleetControl, start_control
from dsrl.serving.fleet import launch_fleet, start_rollout_servers
from dsrl.serving.servers import Fleet, ServerFleet, ServersLost, check_server_args
from dsrl.sync.weight_sync import WeightSync, make_transport
from dsrl.zero.checkpoint import CheckpointError
from dsrl.zero.engine import init_distributed, offload_states, prepare_model_dir
from dsrl.zero.lora import target_modules
from dsrl.zero.memory import plan_memory
from dsrl.zero.trainer import Trainer

log = logging.getLogger("dsrl")
T = TypeVar("T")


def train(cfg: Config, watch: OwnerWatch | None = None) -> dict[str, float]:
    run = setup(cfg, watch)
    start = run.start_step
    metrics: dict[str, float] = {}
    try:
        run.weights.update(start)  # every server holds the trainer's weights first
        # What start-up built lives for the whole run: keep it out of the collector's scans. DeepSpeed's
        # offload_states runs gc.collect() (twice per colocated step), which took 0.28 s each on an H200.
        gc.collect()
        gc.freeze()
        if run.evaluator is not None and cfg.eval.before_train:
            run.writer.log(start, run.evaluator(run.client, start) if run.rank == 0 else {})
        run.rollouts.start()
        # A bar on rank 0's terminal only (disable=None: not when the output is a file); else the step lines alone
        steps = tqdm(range(start, cfg.trainer.total_steps), "train", disable=run.rank != 0 or None, dynamic_ncols=True)
        for step in logging_redirect(steps):
            timer = Timer(memory=True)
            with timer("step"):
                with timer("generate"):
                    batch = served(run, partial(run.rollouts.collect, step), step)
                if run.gpu.colocated:
                    with timer("generate_wait"):  # the slowest rank's generation (and the last sync's probe: one that
                        run.weights.await_probe()  # failed stops the run before it trains on the batch)
                    with timer("release"):
                        run.gpu.to_trainers()
                with timer("logprobs"):
                    finite = run.trainer.logprobs(batch.samples, step)
                with timer("update"):
                    stats = run.trainer.update(batch.samples, step, finite, beside_optimizer_step(run, step + 1))
                with timer("sync"):
                    rank0 = sync(run, step + 1)
            if run.evaluator is not None and run.evaluator.due(step + 1) and run.rank == 0:  # the weights just synced
                rank0 |= run.evaluator(run.client, step + 1)
            metrics = log_step(run, step, batch, {**batch.metrics, **stats, **timer.metrics()}, rank0)
            steps.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
            saved = cfg.logging.save_every and (step + 1) % cfg.logging.save_every == 0
            if saved:
                checkpoint(run, step + 1, last=step + 1 >= cfg.trainer.total_steps)
            stop_if_asked(run, step + 1, saved)
        finish(run, metrics)
    except ServersLost:  # (in a step's rollout: the trainer holds the weights of the last step logged)
        if run.weights.version > start:
            checkpoint(run, run.weights.version, last=True)
        raise
    finally:
        run.close()
    return metrics


@dataclass(kw_only=True)
class Run:
    """Everything a rank holds for one training run."""

    cfg: Config
    """The run's config, its "auto" settings decided (`dsrl.auto.resolve`)."""
    plan: Plan
    """What start-up decided from the config and the machine (`dsrl.auto.make_plan`): rank 0's, on every rank."""
    rank: int
    world: int
    run_dir: Path
    tokenizer: PreTrainedTokenizerBase
    trainer: Trainer
    fleet: Fleet
    client: RolloutClient
    weights: WeightSync
    gpu: GpuLending
    """Colocated: which of the trainers and the servers holds the GPU, and when."""
    rewarder: Rewarder
    runner: EpisodeRunner
    rollouts: Rollouts
    evaluator: Evaluator | None  # (with --eval.path; rank 0 runs it)
    writer: MetricsWriter
    start_step: int
    stop: StopRequests
    control: FleetControl | None
    lock: rundir.RunLock | None
    """Rank 0, unless `dsrl train` holds it for the ranks: the run directory's lock."""
    watch: OwnerWatch | None
    """Launched by `dsrl train`: ends this rank when it dies, or rank 0 does (SIGKILL included)."""
    lost: ServersLost | None = None
    """Set when a weight update found no server left, none able to come back: the run stops once its step is logged."""

    def close(self) -> None:
        if self.watch is not None:
            self.watch.closing()  # the ranks close on their own now: rank 0 may well exit first
        self.rollouts.stop()
        self.rewarder.close()
        self.runner.close()
        if self.control is not None:
            self.client.run(self.control.stop())
        self.client.close()
        self.writer.close()
        self.fleet.stop()
        if self.lock is not None:
            self.lock.release()
        rundir.hold_run_dir(None)
        self.stop.restore()  # last: a SIGTERM meanwhile (the launcher's, when a rank failed) waits for the cleanup


def setup(cfg: Config, watch: OwnerWatch | None = None) -> Run:
    configure_logging(cfg.logging.log_level)
    init_distributed(trainer_on_cuda(cfg.trainer, torch.cuda.is_available))  # (the plan, after it, says the same)
    rank, world = dist.get_rank(), dist.get_world_size()
    validate(cfg, world)
    run_dir = Path(cfg.logging.run_dir)
    lock = take_run_dir(cfg, run_dir, rank, watch.holder if watch else None)
    stop = StopRequests(run_dir, watch_file=rank == 0).install()
    torch.manual_seed(cfg.seed + rank)
    model_dir = prepare_model_dir(cfg, run_dir)
    given, (cfg, decided) = cfg, resolve(cfg, model_dir)  # every "auto" the start-up decides, once
    plan = decide_plan(cfg, model_dir, run_dir, rank, world)
    if plan.fleet != "external":
        check_server_args(cfg.rollout, plan.engine)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    runner = EpisodeRunner(cfg, tokenizer)  # checks the chat template, with an environment
    context = server_context(cfg, model_dir, plan.engine, plan.fleet)
    dataset, held_out = check_datasets(cfg, tokenizer, context, runner.tool_schemas)  # every rank: the same errors
    cfg, graphs = decode_graphs(cfg, world)
    replay = routing_replay(cfg, AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code))
    if replay and plan.fleet != "external":
        cfg = with_routed_experts(cfg)  # (the servers this run starts return each request's routing)
    servers_dir = servers_model_dir(cfg, model_dir, run_dir)
    launched = launch_before_trainer(cfg, plan, servers_dir, run_dir, rank)
    try:
        trainer = Trainer(cfg, plan, model_dir, world, tokenizer)
    except BaseException:
        if launched is not None:
            launched.stop()
        raise
    start_step, rank_state = trainer.resume(run_dir)
    if rank == 0:
        rundir.trim_trace(run_dir / "trained_prompts.jsonl", start_step)
    memory = plan_memory(cfg, plan, trainer.engines, start_step > 0)  # do they lend the GPU to the servers?
    log_decisions(decided + graphs + ([memory.line] if memory.line else []))
    for engine in trainer.engines if memory.offload else []:  # before any server starts: it sizes its KV cache from
        offload_states(engine, memory.offload, params=False)  # the memory it finds free (Adam's moments exist here
        # only after a resume, Adam makes them at its first step: then all of them move, later memory.share)
    if cfg.sync.lora == "adapter":
        cfg = lora_servers(cfg, target_modules(trainer.actor.module))
    fleet, client = start_rollout_servers(cfg, servers_dir, run_dir, launched)
    client.return_routed_experts = replay  # (a mixture of experts replays the servers' routing: dsrl.moe)
    reward_model = start_reward_model(cfg, tokenizer, client, run_dir, rank == 0, plan.cuda)
    teacher = start_teacher(cfg, tokenizer, client, run_dir, rank == 0, plan.cuda)
    rewarder = Rewarder(cfg.algorithm, tokenizer, env=bool(cfg.rollout.env), model=reward_model, teacher=teacher)
    rewarder.restore((rank_state or {}).get("rewarder"))
    tenants = [m for m in (reward_model, teacher) if m is not None and rank == 0]
    gpu = GpuLending(cfg, client, trainer.engines, plan, memory, tenants, fleet)
    backend, fp8 = "nccl" if plan.cuda else "gloo", cfg.rollout.precision == "fp8"
    transport = make_transport(cfg.sync, client, run_dir, backend, cfg.rollout.tp_size, fp8)
    rollouts = schedule(client, cfg, dataset, rewarder, rank, world, runner, plan.colocated, rank_state, start_step)
    return Run(
        cfg=cfg, plan=plan, rank=rank, world=world, run_dir=run_dir, tokenizer=tokenizer, trainer=trainer, fleet=fleet,
        client=client, weights=WeightSync(cfg, trainer.actor, fleet, client, transport, gpu), gpu=gpu,
        rewarder=rewarder, runner=runner, rollouts=rollouts, start_step=start_step, stop=stop, lock=lock, watch=watch,
        evaluator=Evaluator(cfg, tokenizer, rewarder.frozen(), run_dir, held_out, runner) if held_out else None,
        control=start_control(cfg, fleet, client, run_dir) if rank == 0 else None,
        writer=MetricsWriter(run_dir, rank == 0, given),
    )  # fmt: skip


def decide_plan(cfg: Config, model_dir: str, run_dir: Path, rank: int, world: int) -> Plan:
    """Rank 0's plan, held by every rank (one decision for the run, not one a rank), saved beside config.yaml."""
    plans = [make_plan(cfg, model_dir, world) if rank == 0 else None]
    dist.broadcast_object_list(plans, src=0)
    if rank == 0:
        (run_dir / "plan.json").write_text(json.dumps(asdict(plans[0]), indent=1))
    return plans[0]


def launch_before_trainer(cfg: Config, plan: Plan, servers_dir: str, run_dir: Path, rank: int) -> ServerFleet | None:
    """Where `servers_first` (disaggregated, on GPUs of their own), rank 0 starts the rollout servers before the
    trainer loads, and `start_rollout_servers` waits for them after: a large model's trainer takes minutes
    (Qwen3-30B-A3B on 2 x H200: 8, and its TP-2 server 2 more after it)."""
    if not plan.servers_first or rank != 0:
        return None
    r = cfg.rollout
    return launch_fleet(r, servers_dir, run_dir, cfg.seed, r.engine, multi_node=bool(cfg.trainer.hostfile))


def take_run_dir(cfg: Config, run_dir: Path, rank: int, holder: tuple[int, str] | None) -> rundir.RunLock | None:
    """Rank 0 claims the run directory (`claim_run_dir`; `holder`: `dsrl train`, which holds it); a failure there
    stops every rank."""
    with agreed("taking the run directory", (RunDirLocked, PermissionError, ExportTargetError)):
        lock = rundir.claim_run_dir(run_dir, cfg, holder) if rank == 0 else None
    rundir.hold_run_dir(run_dir)  # locked while any process of the run lives: this rank, its servers and workers
    return lock


def stop_if_asked(run: Run, step: int, saved: bool) -> None:
    """At the end of a step: when any rank was asked to stop (a signal, or `dsrl train`'s STOP file),
    every rank checkpoints (unless it just did, or --logging.save_on_signal false) and stops."""
    if run.lost is not None:  # (on every rank: rank 0's heal decided it)
        checkpoint(run, step, last=True)
        raise run.lost
    signum = run.stop.requested()
    if all_ranks(signum is None):
        return
    signums = [None] * run.world
    dist.all_gather_object(signums, signum)
    signum = next(s for s in signums if s is not None)
    path = None
    if run.cfg.logging.save_on_signal:
        if not saved:
            checkpoint(run, step, last=True)
        path = run.run_dir / "checkpoints" / f"step_{step}"
    raise RunStopped(signum, step, path)


def checkpoint(run: Run, step: int, last: bool) -> None:
    """`last`: no step follows (the run ends or stops), so servers that gave the GPU back for it keep it."""
    started = time.monotonic()
    if run.gpu.offload:  # (the last sync's probe, before its servers sleep)
        run.weights.await_probe()
    with run.gpu.trainers_on_gpu(resync=None if last else lambda: sync(run, step)):  # with the schedule's, rewarder's
        run.trainer.save(run.run_dir, step, {"rollouts": run.rollouts.state(), "rewarder": run.rewarder.state()})
    if run.rank == 0:
        log.info("checkpoint step_%d written in %.1f s", step, time.monotonic() - started)


def beside_optimizer_step(run: Run, step: int) -> Callable[[], None] | None:
    """What runs beside the last optimizer step of a batch, the one place that says so: colocated one-step-off, the
    servers (with this step's weights) wake their KV cache and generate the batch of `step` while the optimizer
    steps; the weight update waits for it (`Rollouts.before_update`). Otherwise nothing: None."""
    if not run.gpu.ahead or step >= run.cfg.trainer.total_steps:
        return None

    def start() -> None:
        run.gpu.wake_kv_cache()
        run.rollouts.generate_ahead(step)

    return start


def sync(run: Run, version: int) -> dict[str, float]:
    """Every server to weight `version`, with the rollout schedule's requests drained (or left to the pause)."""
    timer = Timer()
    try:
        with timer("drain"):
            served(run, run.rollouts.before_update, version)
            dist.barrier()
        metrics = run.weights.update(version)
    except ServersLost as e:  # the step trained: it is logged, then the run stops (`stop_if_asked`)
        run.lost = e
        return {}
    with timer("readmit"):
        run.rollouts.after_update(version)
    return metrics | timer.metrics("timing/sync_")


def served(run: Run, work: Callable[[], T], version: int) -> T:
    """`work` (which waits for the rollout servers), on a thread of its own while this one watches the fleet: when a
    request waits for a server because every one is down (a lone server died), every rank heals the fleet together,
    and the replacement gets weight `version` (the trainer's now) before the requests waiting for it go on."""
    pending: Future = Future()

    def target() -> None:
        try:
            pending.set_result(work())
        except BaseException as e:  # noqa: BLE001 -- raised below, on this thread
            pending.set_exception(e)

    # A daemon: a run that ends while it waits (no server could come back) does not wait for it at exit
    threading.Thread(target=target, daemon=True, name="rollout-wait").start()
    for recovered in range(run.cfg.rollout.max_restarts + 1):
        if all_ranks(not run.client.wait_or_starve(pending)):
            return pending.result()
        if recovered < run.cfg.rollout.max_restarts:
            run.weights.recover(version)
    # Each replacement started and then died too: what is in flight kills them (a crash loop, not bad luck)
    raise ServersLost(f"no rollout server left: every one died {recovered + 1} times in a row while serving step "
                      f"{version}'s requests; {run.run_dir / 'logs'} has their logs")  # fmt: skip


def log_step(run: Run, step: int, batch: Batch, local: dict, rank0: dict) -> dict[str, float]:
    """`local`: every rank's metrics, reduced over the ranks (counters summed, the rest averaged); `rank0`:
    those only rank 0 has (sync, evaluation). Histograms cover every rank's samples."""
    samples = batch.samples
    seconds = local.get("timing/generate_ahead", local.get("timing/generate", 0.0))  # (generated ahead: its own)
    tokens_per_s = sum(len(s.response_ids) for s in samples) / max(seconds, 1e-9)
    local = {**rollout_metrics(samples, step), **episode_metrics(samples), **run.rewarder.metrics(samples), **local,
             "rollout/tokens_per_s": tokens_per_s}  # fmt: skip
    metrics = reduce_across_ranks(local)
    rows = [None] * run.world
    dist.all_gather_object(rows, ([s.prompt.index for s in samples[:: run.cfg.rollout.n_samples]], batch.filtered_rows))
    histograms = {"rollout/staleness": gather_lists([step - s.oldest_version for s in samples]),
                  "response/length": gather_lists([len(s.response_ids) for s in samples])}  # fmt: skip
    if run.rank == 0:
        metrics.update(rank0)
        run.writer.log(step + 1, metrics, histograms)
        n = run.cfg.logging.log_generations  # a few of rank 0's generations, spread over its batch
        chosen = samples[:: max(1, len(samples) // n)][:n] if n else []
        run.writer.log_generations(step + 1, [sample_row(s, run.tokenizer) for s in chosen])
        trained, filtered = ([row for rank_rows in rows for row in rank_rows[i]] for i in (0, 1))
        rundir.record_trace(run.run_dir / "trained_prompts.jsonl", step, trained, filtered)
        log.info(summary_line(step + 1, run.cfg.trainer.total_steps, metrics))
    return metrics


def finish(run: Run, metrics: dict[str, float]) -> None:
    metrics.update(run.weights.check_probe())
    if run.rank == 0 and metrics:
        log.info("final metrics: %s", json.dumps({k: round(v, 6) for k, v in sorted(metrics.items())}))
        (run.run_dir / "final_metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True))
    run.rollouts.stop()
    if run.cfg.logging.export_hf:
        started = time.monotonic()
        with run.gpu.trainers_on_gpu(resync=None):  # (the export gathers them)
            run.trainer.export(run.run_dir / "hf", run.rank)
        if run.rank == 0:
            log.info("exported %s in %.1f s", run.run_dir / "hf", time.monotonic() - started)


def main(argv: list[str] | None = None) -> None:
    # The deepspeed launcher appends --local_rank=N unless told not to; LOCAL_RANK carries it anyway.
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")]
    watch, argv = OwnerWatch.of(argv)
    try:
        train(parse_config(argv), watch)
    except RunStopped as e:  # a clean stop: exit 0, so the launcher does not kill the ranks still closing
        if os.environ.get("RANK", "0") == "0":  # said once
            log.warning("%s; the same command resumes the run", e)
    except USER_ERRORS as e:  # they name the file, row or flag: a traceback would only hide that line
        if not isinstance(e, ServersLost) or os.environ.get("RANK", "0") == "0":  # (every rank has that one)
            log.error("error: %s", e)
        sys.exit(1)
    except RuntimeError as e:  # gloo's, when a rank of another node is gone (its node lost): no traceback says more
        peer = re.search(r"by peer.*?\[([\w.:-]+)\]:\d+|\[([\w.:-]+)\]:\d+: Connection reset by peer", str(e))
        if peer is None:
            raise
        log.error("error: the trainer rank at %s is gone (its process or its node): %s", peer[1] or peer[2],
                  str(e).splitlines()[0][:200])  # fmt: skip
        sys.exit(1)


USER_ERRORS = (WriteError, CheckpointError, DatasetError, RunDirLocked, ExportTargetError, MemoryError, ServersLost)
"""Errors whose message says all a user needs: logged as one line, without a traceback."""


def logging_redirect(steps: tqdm):
    """The steps, with log lines written through tqdm while its bar shows, so that they never share its line."""
    with nullcontext() if steps.disable else logging_redirect_tqdm():
        yield from steps


if __name__ == "__main__":
    main()
    # The run is closed (Run.close: servers, reward workers, trackers): skip the interpreter's teardown of torch,
    # DeepSpeed and transformers, 1.5 s of CPU a rank that the launcher and `dsrl train` wait for.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)
