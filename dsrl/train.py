"""The training loop, one rank of it: ``deepspeed --module dsrl.train --config run.yaml`` (or ``dsrl train``).

generate -> logprobs -> update -> sync, each phase timed; the details live below it.
"""

import gc
import json
import logging
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoTokenizer

from dsrl.advantages import KlController, compute_advantages
from dsrl.auto import (
    decide_offload,
    fleet_kind,
    log_decisions,
    lora_servers,
    old_from_update,
    resolve,
    rollout_engine,
    use_cuda,
)
from dsrl.collectives import agreed, all_ranks
from dsrl.config import SECRETS, Config, critic_on_actor_base, dump_config, parse_config, validate
from dsrl.data import DatasetError, Sample, check_datasets, server_context
from dsrl.evaluate import Evaluator
from dsrl.lending import GpuLending
from dsrl.metrics import MetricsWriter, Timer, gather_lists, mean_across_ranks, reduce_across_ranks, summary_line
from dsrl.rewards.models import RewardModel, reward_servers
from dsrl.rewards.rewarder import Rewarder
from dsrl.rollout.episode import EpisodeRunner, episode_metrics, episode_row
from dsrl.rollout.manager import PromptStream, RolloutManager
from dsrl.rollout.rollouts import Batch, Rollouts, SyncRollouts, rollout_metrics
from dsrl.rundir import (
    OWNER_FLAG,
    ExportTargetError,
    OwnerWatch,
    RunDirLocked,
    RunLock,
    RunStopped,
    StopRequests,
    WriteError,
    check_export_target,
    check_writable,
    clear_stop,
    hold_run_dir,
    lock_run_dir,
    trim_trace,
)
from dsrl.serving.client import RolloutClient
from dsrl.serving.control import FleetControl
from dsrl.serving.fleet import start_fleet_for_ranks
from dsrl.serving.servers import ServerFleet, check_server_args, server_host
from dsrl.sync.weight_sync import WeightSync, make_transport
from dsrl.zero.actor import compute_logprobs, logprob_mismatch, update_actor
from dsrl.zero.checkpoint import CheckpointError, export_hf, find_checkpoint, load_checkpoint, save_checkpoint
from dsrl.zero.critic import compute_values, has_values, update_actor_and_critic, update_critic
from dsrl.zero.engine import check_host_memory, init_distributed, load_engine, offload_states, prepare_model_dir
from dsrl.zero.lora import is_lora, reference_off, save_adapter, target_modules

log = logging.getLogger("dsrl")


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps in a row)."""


def train(cfg: Config) -> dict[str, float]:
    run = setup(cfg)
    start = run.start_step
    metrics: dict[str, float] = {}
    try:
        run.weights.update(start)  # every server holds the trainer's weights first
        # What start-up built lives for the whole run: keep it out of the collector's scans. DeepSpeed's
        # offload_states runs gc.collect() (twice per colocated step), which took 0.28 s each on an H200.
        gc.collect()
        gc.freeze()
        if run.evaluator is not None and cfg.eval.before_train:
            evaluate(run, start)
        run.rollouts.start()
        steps = tqdm(range(start, cfg.trainer.total_steps), desc="train", disable=run.rank != 0, dynamic_ncols=True)
        for step in logging_redirect(steps, run.rank):
            timer = Timer(memory=True)
            with timer("step"):
                with timer("generate"):
                    batch = run.rollouts.collect(step)
                if run.gpu.colocated:
                    with timer("release"):  # a probe that failed stops the run before it trains on the batch
                        run.weights.await_probe()
                        run.gpu.to_trainers()
                with timer("logprobs"):
                    finite = compute_all_logprobs(run, step, batch.samples)
                with timer("update"):
                    stats = update(run, step, batch.samples, finite, beside_optimizer_step(run, step + 1))
                with timer("sync"):
                    rank0 = sync(run, step + 1)
            if run.evaluator is not None and run.evaluator.due(step + 1):  # the weights just synced
                rank0 |= evaluate(run, step + 1)
            metrics = log_step(run, step, batch, {**batch.metrics, **stats, **timer.metrics()}, rank0)
            steps.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
            saved = cfg.logging.save_every and (step + 1) % cfg.logging.save_every == 0
            if saved:
                checkpoint(run, step + 1)
            stop_if_asked(run, step + 1, saved)
        finish(run, metrics)
    finally:
        run.close()
    return metrics


@dataclass
class Run:
    """Everything a rank holds for one training run."""

    cfg: Config
    rank: int
    world: int
    run_dir: Path
    model_dir: str
    tokenizer: object
    pad_id: int
    actor: object
    ref: object | None
    critic: object | None
    """With --algorithm.advantage gae, the critic's own engine; None with LoRA, where the actor is the critic too."""
    kl: KlController
    fleet: ServerFleet
    client: RolloutClient
    """Every rank generates through its own client; only rank 0's talks to the servers about weights."""
    weights: WeightSync
    gpu: GpuLending
    """Colocated: which of the trainers and the servers holds the GPU, and when."""
    rewarder: Rewarder
    runner: EpisodeRunner
    """Plays the episodes (single responses without --rollout.env); owns the environment and tool workers."""
    rollouts: Rollouts
    evaluator: Evaluator | None
    """With --eval.path; rank 0 runs it."""
    writer: MetricsWriter
    start_step: int
    stop: StopRequests
    control: FleetControl | None = None
    """Rank 0: the endpoint `dsrl fleet add/remove` talks to."""
    lock: RunLock | None = None
    """Rank 0, unless `dsrl train` holds it for the ranks: the run directory's lock."""
    bad_steps: int = 0

    def close(self) -> None:
        if _watch is not None:
            _watch.stop()  # the ranks close on their own now: rank 0 may well exit first
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
        hold_run_dir(None)
        self.stop.restore()  # last: a SIGTERM meanwhile (the launcher's, when a rank failed) waits for the cleanup


def setup(cfg: Config) -> Run:
    init_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    validate(cfg, world)
    if fleet_kind(cfg.rollout) != "external":
        check_server_args(cfg.rollout, rollout_engine(cfg, use_cuda(cfg)))
    logging.basicConfig(
        level=cfg.logging.log_level if rank == 0 else "WARNING", format="%(asctime)s [dsrl] %(message)s", force=True
    )
    run_dir = Path(cfg.logging.run_dir)
    lock = take_run_dir(cfg, run_dir, rank)
    stop = StopRequests(run_dir, watch_file=rank == 0).install()
    torch.manual_seed(cfg.seed + rank)
    model_dir = prepare_model_dir(cfg, run_dir)
    given, (cfg, decided) = cfg, resolve(cfg, model_dir)  # every "auto" the start-up decides, once
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    runner = EpisodeRunner(cfg, tokenizer)  # checks the chat template, with an environment
    context = server_context(cfg, model_dir, cfg.rollout.engine)
    dataset, held_out = check_datasets(cfg, tokenizer, context, runner.tool_schemas)  # every rank: the same errors
    check_host_memory(cfg, model_dir, world)  # ZeRO-Offload's states, before DeepSpeed allocates them
    actor = load_engine(cfg, model_dir, world, train=True)
    ref = None  # the reference policy; with LoRA the actor itself, its adapters off (`reference_off`)
    if cfg.algorithm.kl_coef > 0:
        ref = actor if cfg.model.lora_rank > 0 else load_engine(cfg, model_dir, world, train=False)
    critic = None  # its own engine; with LoRA the actor's (`PolicyAndValue`: an adapter and a head on its base)
    if cfg.algorithm.advantage == "gae" and not critic_on_actor_base(cfg):
        critic = load_engine(cfg, model_dir, world, train=True, critic=True)
    start_step, rank_state, kl = resume(cfg, run_dir, actor, critic, rank)
    trainers = [e for e in (actor, critic) if e is not None]
    offload, why = decide_offload(cfg, trainers)  # do they lend the GPU to the servers?
    log_decisions(decided + ([why] if why else []))
    for engine in trainers if offload else []:  # before any server starts: it sizes its KV cache from the
        offload_states(engine, params=False)  # memory it finds free
    if cfg.sync.lora == "adapter":
        cfg = lora_servers(cfg, target_modules(actor.module))
    multi_node = bool(cfg.trainer.hostfile)  # (servers reachable from every node)
    fleet = start_fleet_for_ranks(cfg.rollout, model_dir, run_dir, cfg.seed, cfg.rollout.engine, multi_node)
    r = cfg.rollout
    client = RolloutClient(fleet.urls, r.max_concurrency, r.request_timeout_s, api_key=r.api_key, route=r.route)
    rewarder = start_rewarder(cfg, tokenizer, client, run_dir, rank, rank_state)
    evaluator = Evaluator(cfg, tokenizer, rewarder.frozen(), run_dir, held_out, runner) if held_out else None
    transport = make_transport(cfg.sync, client, run_dir, "nccl" if use_cuda(cfg) else "gloo", r.tp_size)
    gpu = GpuLending(cfg, client, trainers, offload, rewarder.model if rank == 0 else None)
    weights = WeightSync(cfg, actor, fleet, client, transport, gpu)
    control = fleet_control(cfg, fleet, client, run_dir) if rank == 0 else None
    if cfg.rollout.placement == "colocate":
        rollouts = SyncRollouts(client, cfg, dataset, rewarder, rank, world, runner)
    else:  # disaggregated: generation runs ahead of training by up to max_staleness versions
        stream = PromptStream(dataset, cfg.rollout.prompts_per_step, rank, world)
        rollouts = RolloutManager(client, cfg, stream, rewarder, runner)
    if rank_state is not None:
        rollouts.restore(rank_state["rollouts"], start_step)
    writer = MetricsWriter(run_dir, rank == 0, cfg.logging, tracker_config(given))
    return Run(cfg, rank, world, run_dir, model_dir, tokenizer, pad_id, actor, ref, critic, kl, fleet, client, weights,
               gpu, rewarder, runner, rollouts, evaluator, writer, start_step, stop, control, lock)  # fmt: skip


def fleet_control(cfg: Config, fleet, client: RolloutClient, run_dir: Path) -> FleetControl:
    """Rank 0: the endpoint servers join and leave the live run through (dsrl fleet add/remove)."""
    frozen = "CUDA IPC ties each server to a trainer rank's GPU: this run's fleet cannot change"
    r = cfg.rollout
    control = FleetControl(fleet, run_dir, server_host(r, bool(cfg.trainer.hostfile)), r.api_key,
                           frozen if cfg.sync.type == "ipc" else None)  # fmt: skip
    client.run(control.start())
    return control


def start_rewarder(cfg: Config, tokenizer, client: RolloutClient, run_dir: Path, rank: int, rank_state: dict | None):
    """The run's rewarder, as a checkpoint left it; with --reward_model.path its servers start beside the rollouts'."""
    model = None
    if cfg.reward_model.path:
        r, multi_node = reward_servers(cfg, use_cuda(cfg)), bool(cfg.trainer.hostfile)
        path, engine = cfg.reward_model.path, cfg.rollout.engine
        fleet = start_fleet_for_ranks(r, path, run_dir, cfg.seed, engine, multi_node, "reward")
        model = RewardModel(cfg, tokenizer, client, fleet, rank == 0)
    rewarder = Rewarder(cfg.algorithm, tokenizer, env=bool(cfg.rollout.env), model=model)
    rewarder.restore((rank_state or {}).get("rewarder"))
    return rewarder


def take_run_dir(cfg: Config, run_dir: Path, rank: int) -> RunLock | None:
    """Rank 0, before anything is written: the run directory's lock (unless `dsrl train` holds it for us),
    a writable checkpoint directory, an export target that holds nothing but dsrl's own; then the config.
    A failure there stops every rank."""
    lock = None
    with agreed("taking the run directory", (RunDirLocked, PermissionError, ExportTargetError)):
        if rank == 0:
            lock = lock_run_dir(run_dir, "python -m dsrl.train")
            if lock is not None:  # launched without `dsrl train`: a stale stop request is ours to clear
                clear_stop(run_dir)
            check_writable(run_dir)
            if cfg.logging.export_hf:
                check_export_target(run_dir / "hf", overwrite=True, flag="the final export <run_dir>/hf")
            dump_config(cfg, run_dir / "config.yaml")
    hold_run_dir(run_dir)  # locked while any process of the run lives: this rank, its servers and workers
    return lock


def owner_watch(owner: str) -> OwnerWatch:
    """Launched by `dsrl train` (`--dsrl_owner=PID@HOST`): watch it on its host and, on ranks above 0, rank 0."""
    pid, host = owner.split("@", 1)
    rank0 = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])) if os.environ.get("RANK", "0") != "0" else None
    return OwnerWatch(int(pid) if host == socket.gethostname() else None, rank0)


def stop_if_asked(run: Run, step: int, saved: bool) -> None:
    """At the end of a step: when any rank was asked to stop (a signal, or `dsrl train`'s STOP file),
    every rank checkpoints (unless it just did, or --logging.save_on_signal false) and stops."""
    signum = run.stop.requested()
    if all_ranks(signum is None):
        return
    signums = [None] * run.world
    dist.all_gather_object(signums, signum)
    signum = next(s for s in signums if s is not None)
    path = None
    if run.cfg.logging.save_on_signal:
        if not saved:
            checkpoint(run, step)
        path = run.run_dir / "checkpoints" / f"step_{step}"
    raise RunStopped(signum, step, path)


def resume(cfg: Config, run_dir: Path, actor, critic, rank: int) -> tuple[int, dict | None, KlController]:
    """Restore the latest checkpoint when there is one: (the step to start from, this rank's saved state,
    the KL coefficient as it was)."""
    path = find_checkpoint(run_dir, cfg.logging.resume)
    step, rank_state, kl = 0, None, KlController(cfg)
    if path is not None:
        state, rank_state = load_checkpoint(actor, path, critic)
        step, kl.value = state["step"], state.get("kl_coef", kl.value)
        log.info("resumed from %s at step %d", path, step)
    if rank == 0:
        trim_trace(run_dir / "trained_prompts.jsonl", step)
    return step, rank_state, kl


def checkpoint(run: Run, step: int) -> None:
    state = {"step": step, "weight_version": step, "kl_coef": run.kl.value}
    rank_state = {"rollouts": run.rollouts.state(), "rewarder": run.rewarder.state()}
    with run.gpu.trainers_on_gpu():
        save_checkpoint(run.actor, run.run_dir, state, rank_state, run.cfg.logging.keep_last, run.critic)


def compute_all_logprobs(run: Run, step: int, samples: list[Sample]) -> bool:
    """Old logprobs (unless the update's forward pass gives them: `old_from_update`), reference logprobs and the
    critic's values; False on every rank when any rank saw a non-finite value."""
    if not (old_from_update(run.cfg) and trains_actor(run.cfg, step)):
        compute_logprobs(run.actor, samples, "old_logprobs", run.cfg, run.pad_id)
    if run.ref is not None:
        with reference_off(run.ref.module):
            compute_logprobs(run.ref, samples, "ref_logprobs", run.cfg, run.pad_id)
    if run.critic is not None or has_values(run.actor):
        compute_values(run.critic or run.actor, samples, run.cfg, run.pad_id)
    values = [s.extras[k] for s in samples for k in ("old_logprobs", "ref_logprobs", "values") if k in s.extras]
    return all_ranks(all(torch.isfinite(v).all() for v in values))


def trains_actor(cfg: Config, step: int) -> bool:
    """Whether `step` updates the actor: with GAE, not before the critic's warm-up steps."""
    return step >= cfg.critic.warmup_steps or cfg.algorithm.advantage != "gae"


def update(run: Run, step: int, samples: list[Sample], finite: bool, beside=None) -> dict[str, float]:
    """Advantages, then the critic's and the actor's updates (the actor waits out critic.warmup_steps); a step
    with non-finite inputs, or whose actor step DeepSpeed skipped (a non-finite gradient norm), is skipped and
    counted. `beside()`, before the actor's last optimizer step, starts what runs beside it (a step that trains
    no actor starts nothing)."""
    stats = compute_advantages(samples, run.cfg, run.kl.value) if finite else {}
    advantages = [s.extras["advantages"] for s in samples] if finite else []
    if finite and all_ranks(all(torch.isfinite(a).all() for a in advantages)):
        train_actor = trains_actor(run.cfg, step)
        if has_values(run.actor):
            stats |= update_actor_and_critic(
                run.actor, samples, run.cfg, run.pad_id, run.kl.value, train_actor, beside if train_actor else None
            )
        else:
            if run.critic is not None:
                stats |= update_critic(run.critic, samples, run.cfg, run.pad_id)
            if train_actor:
                stats |= update_actor(run.actor, samples, run.cfg, run.pad_id, run.kl.value, beside)
        if not stats.get("actor/steps_skipped"):
            run.bad_steps = 0
            return {**stats, **kl_in_batch(run, samples), "train/skipped_step": 0.0}
    run.bad_steps += 1
    log.warning("non-finite logprobs, advantages or gradients: step skipped (%d in a row)", run.bad_steps)
    if run.bad_steps >= run.cfg.trainer.max_bad_steps:
        raise TrainingError(
            f"{run.bad_steps} steps in a row had non-finite logprobs, advantages or gradients "
            f"(--trainer.max_bad_steps={run.cfg.trainer.max_bad_steps}); check the rewards' scale and the learning rate"
        )
    return {"train/skipped_step": 1.0}


def beside_optimizer_step(run: Run, step: int) -> Callable[[], None] | None:
    """What runs beside the trainer's last optimizer step of a batch, the one place that says so: colocated
    one-step-off (max_staleness 1), the servers, holding the weights of this step, wake their KV cache and generate
    the batch of `step` while the optimizer steps (ZeRO-Offload's CPU Adam at 7B: seconds); the weight update waits
    for that batch (`Rollouts.before_update`). Otherwise nothing: None."""
    if not run.gpu.ahead or step >= run.cfg.trainer.total_steps:
        return None

    def start() -> None:
        run.gpu.wake_kv_cache()
        run.rollouts.generate_ahead(step)

    return start


def kl_in_batch(run: Run, samples: list[Sample]) -> dict[str, float]:
    """The batch's KL(old || ref) per model token (k1), and the coefficient, which adapts to it (kl_target)."""
    if run.ref is None:
        return {}
    model = torch.cat([torch.tensor(s.mask(), dtype=torch.bool) for s in samples])
    old = torch.cat([s.extras["old_logprobs"] for s in samples])
    kl = (old - torch.cat([s.extras["ref_logprobs"] for s in samples]))[model].mean().item()
    coef = run.kl.value
    run.kl.update(mean_across_ranks({"kl": kl})["kl"])
    return {"kl/coef": coef, "kl/old_ref_k1": kl}


def sync(run: Run, version: int) -> dict[str, float]:
    """Every server to weight `version`, with the rollout schedule's requests drained (or left to the pause)."""
    timer = Timer()
    with timer("drain"):
        run.rollouts.before_update()
        dist.barrier()
    metrics = run.weights.update(version)
    with timer("readmit"):
        run.rollouts.after_update(version)
    return metrics | timer.metrics("timing/sync_")


def evaluate(run: Run, step: int) -> dict[str, float]:
    """Rank 0: the reward of weight version `step` on the held-out prompts (the servers hold it now)."""
    if run.rank != 0:
        return {}
    metrics = run.evaluator(run.client, step)
    if step == run.start_step:  # before the first step: no step's metrics to go with
        run.writer.log(step, metrics)
    return metrics


def log_step(run: Run, step: int, batch: Batch, local: dict, rank0: dict) -> dict[str, float]:
    """`local`: every rank's metrics, reduced over the ranks (counters summed, the rest averaged); `rank0`:
    those only rank 0 has (sync, evaluation). Histograms cover every rank's samples."""
    samples = batch.samples
    seconds = local.get("timing/generate_ahead", local.get("timing/generate", 0.0))  # (generated ahead: its own)
    tokens_per_s = sum(len(s.response_ids) for s in samples) / max(seconds, 1e-9)
    local = {
        **rollout_metrics(samples, step),
        **episode_metrics(samples),
        **logprob_mismatch(samples),
        **run.rewarder.metrics(samples),
        **local,
        "rollout/tokens_per_s": tokens_per_s,
    }
    metrics = reduce_across_ranks(local)
    rows = [None] * run.world
    dist.all_gather_object(rows, ([s.prompt.index for s in samples[:: run.cfg.rollout.n_samples]], batch.filtered_rows))
    histograms = {
        "rollout/staleness": gather_lists([step - s.oldest_version for s in samples]),
        "response/length": gather_lists([len(s.response_ids) for s in samples]),
    }
    if run.rank == 0:
        metrics.update(rank0)
        run.writer.log(step + 1, metrics, histograms)
        run.writer.log_generations(step + 1, generation_rows(run, samples))
        trace = {"step": step, "rows": [row for trained, _ in rows for row in trained]}
        filtered = [row for _, rank_filtered in rows for row in rank_filtered]
        with open(run.run_dir / "trained_prompts.jsonl", "a") as f:  # every prompt used, once
            f.write(json.dumps(trace | ({"filtered": filtered} if filtered else {})) + "\n")
        log.info(summary_line(step + 1, run.cfg.trainer.total_steps, metrics))
    return metrics


def generation_rows(run: Run, samples: list[Sample]) -> list[dict]:
    """A few of rank 0's training generations, spread over its batch, for the trackers' tables."""
    n = run.cfg.logging.log_generations
    chosen = samples[:: max(1, len(samples) // n)][:n] if n else []
    return [
        {
            "prompt": s.prompt.text,
            "response": run.tokenizer.decode(s.response_ids, skip_special_tokens=True),
            "reward": s.reward,
            "weight_version": s.weight_version,
            "row": s.prompt.index,
            **episode_row(s, run.tokenizer),
        }
        for s in chosen
    ]


def tracker_config(cfg: Config) -> dict:
    """The run's config as the trackers store it: flat `section.field` keys."""
    flat = {}
    for section, values in asdict(cfg).items():
        for key, value in values.items() if isinstance(values, dict) else []:
            flat[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
    return flat | {name: "<redacted>" for name in SECRETS if flat.get(name)}


def finish(run: Run, metrics: dict[str, float]) -> None:
    metrics.update(run.weights.check_probe())
    if run.rank == 0 and metrics:
        log.info("final metrics: %s", json.dumps({k: round(v, 6) for k, v in sorted(metrics.items())}))
        (run.run_dir / "final_metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True))
    run.rollouts.stop()
    run.gpu.trainers_back()
    if run.cfg.logging.export_hf:
        # The probe's forward may leave ZeRO-3 prefetches in flight, which a gather refuses to partition
        # again (seen on an H200 with the states kept on the GPU); offloading used to reset them.
        run.actor.empty_partition_cache()
        export_hf(run.actor.module, run.model_dir, run.run_dir / "hf", run.cfg.sync.bucket_bytes)
        if is_lora(run.actor.module):
            save_adapter(run.actor.module, run.run_dir / "adapter", run.rank == 0)


def main(argv: list[str] | None = None) -> None:
    # The deepspeed launcher appends --local_rank=N unless told not to; LOCAL_RANK carries it anyway.
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")]
    global _watch
    owner = next((a.split("=", 1)[1] for a in argv if a.startswith(OWNER_FLAG)), None)
    _watch = owner_watch(owner) if owner else None
    argv = [a for a in argv if not a.startswith(OWNER_FLAG)]
    try:
        train(parse_config(argv))
    except RunStopped as e:  # a clean stop: exit 0, so the launcher does not kill the ranks still closing
        log.warning("%s; the same command resumes the run", e)
    except USER_ERRORS as e:  # they name the file, row or flag: a traceback would only hide that line
        log.error("error: %s", e)
        sys.exit(1)


_watch: OwnerWatch | None = None
"""Launched by `dsrl train`: ends this rank when it dies, or rank 0 does (SIGKILL included)."""

USER_ERRORS = (WriteError, CheckpointError, DatasetError, RunDirLocked, ExportTargetError, MemoryError)
"""Errors whose message says all a user needs: logged as one line, without a traceback."""


def logging_redirect(steps, rank: int):
    """The steps, with log lines written through tqdm on rank 0 so the bar and the logs stay readable."""
    if rank != 0:
        yield from steps
        return
    with logging_redirect_tqdm():
        yield from steps


if __name__ == "__main__":
    main()
