"""Metrics: cross-rank means, tensorboard scalars and a one-line summary per step (rank 0)."""

import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from dsrl.collectives import reduce_device
from dsrl.config import SECRETS, Config

log = logging.getLogger("dsrl")


class Timer:
    """Seconds per named phase, summed over repeats: `with timer("send"):`, or `timer.each(items, "gather")`
    for the time spent producing each item of an iterator. With `memory`, a phase on GPU also records
    its peak memory and the device memory in use at its end."""

    def __init__(self, memory: bool = False):
        self.seconds: dict[str, float] = {}
        self.memory: dict[str, float] = {}
        self.track_memory = memory

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        cuda = self.track_memory and torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
            if cuda:
                free, total = torch.cuda.mem_get_info()
                self.memory[f"memory/{phase}_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
                self.memory[f"memory/{phase}_device_used_gb"] = (total - free) / 1e9

    def each(self, items, phase: str):
        it = iter(items)
        while True:
            with self(phase):
                item = next(it, _END)
            if item is _END:
                return
            yield item

    def metrics(self, prefix: str = "timing/") -> dict[str, float]:
        return {f"{prefix}{phase}": s for phase, s in self.seconds.items()} | self.memory


_END = object()


def configure_logging(level: str) -> None:
    """dsrl's log lines at `level` on rank 0 (warnings only on the others), library warnings through the same handler
    (which tqdm redirects: never on the bar's line), and in a log file no library progress bar's \r updates."""
    level = level if os.environ.get("RANK", "0") == "0" else "WARNING"
    logging.basicConfig(level=level, format="%(asctime)s [dsrl] %(message)s", force=True)
    logging.captureWarnings(True)
    if not sys.stderr.isatty():
        import transformers

        transformers.utils.logging.disable_progress_bar()


SUMMED = ("rollout/interrupted", "rollout/resumed", "rollout/restarted", "rollout/dropped_stale",
          "rollout/filtered", "reward/failed", "rollout/tokens_per_s")  # fmt: skip
"""Per-rank counts (and rates) that add up over the ranks; maxima (`_max`, memory peaks) and minima (`_min`) are the
ranks' largest and smallest; every other metric is a per-rank mean, averaged."""

PER_RANK = ("memory/update_peak_gb", "timing/generate", "timing/generate_wait", "timing/release")
"""Also logged for each rank (`<key>/rank_<r>`): which rank's GPU is fullest, which rank's generation lags."""


def reduce_across_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each metric over trainer ranks (every rank must pass the same keys): the sum for counters (`SUMMED`), the
    largest of maxima and peaks, the smallest of minima, else the mean; `PER_RANK` keys also per rank."""
    keys, world = sorted(values), dist.get_world_size()
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=reduce_device())
    rows = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(rows, t)
    out = {}
    for k, ranks in zip(keys, torch.stack(rows).T.tolist()):
        if k in SUMMED:
            out[k] = sum(ranks)
        elif k.endswith(("_max", "_peak_gb")):
            out[k] = max(ranks)
        elif k.endswith("_min"):
            out[k] = min(ranks)
        else:
            out[k] = sum(ranks) / world
        if k in PER_RANK and world > 1:
            out |= {f"{k}/rank_{r}": v for r, v in enumerate(ranks)}
    return out


def gather_lists(values: list) -> list:
    """Every rank's list, concatenated (for histograms of the whole batch, not rank 0's share)."""
    lists = [None] * dist.get_world_size()
    dist.all_gather_object(lists, values)
    return [v for rank_values in lists for v in rank_values]


class MetricsWriter:
    """Rank 0's sinks: tensorboard (default), and wandb / mlflow through accelerate's tracker layer, all
    with the same tags; sampled generations also go to <run_dir>/generations.jsonl."""

    def __init__(self, run_dir: Path, enabled: bool, config: Config):
        """`config`: the run's, as the user gave it (the trackers store it; its `logging` picks the sinks)."""
        self.writer, self.trackers, self.run_dir = None, [], run_dir
        if not enabled:
            return
        if config.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        for name in config.logging.trackers:
            tracker = _tracker(name, config.logging, run_dir)
            tracker.start()
            tracker.store_init_configuration(tracker_config(config))
            self.trackers.append(tracker)

    def log(self, step: int, metrics: dict[str, float], histograms: dict[str, list[float]] | None = None) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
            for key, values in (histograms or {}).items():
                self.writer.add_histogram(key, torch.tensor(values, dtype=torch.float), step)
            self.writer.flush()
        for tracker in self.trackers:
            tracker.log(metrics, step=step)

    def log_generations(self, step: int, rows: list[dict]) -> None:
        if not rows or (self.writer is None and not self.trackers):
            return
        with open(self.run_dir / "generations.jsonl", "a") as f:
            f.writelines(json.dumps({"step": step, **row}, default=str) + "\n" for row in rows)
        columns = list(rows[0])
        if self.writer is not None:
            table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            table += ["| " + " | ".join(str(r[c]).replace("|", "\\|").replace("\n", " ") for c in columns) + " |"
                      for r in rows]  # fmt: skip
            self.writer.add_text("generations", "\n".join(table), step)
        for tracker in self.trackers:
            if tracker.name == "wandb":
                cells = [[json.dumps(r[c]) if isinstance(r[c], (dict, list)) else r[c] for c in columns] for r in rows]
                tracker.log_table("generations", columns=columns, data=cells, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        for tracker in self.trackers:
            tracker.finish()


def _tracker(name: str, cfg, run_dir: Path):
    from accelerate import PartialState
    from accelerate.tracking import MLflowTracker, WandBTracker

    PartialState()  # accelerate's trackers ask it which process is the main one (it reads torch.distributed)

    run_name = cfg.run_name or run_dir.resolve().name
    if name == "wandb":
        return WandBTracker(cfg.project, dir=str(run_dir), name=run_name)
    if name == "mlflow":
        # MLflow's file store refuses new runs since 3.x: a SQLite file in the run's directory is its local default
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
        return MLflowTracker(experiment_name=cfg.project, logging_dir=str(run_dir), run_name=run_name)
    raise ValueError(f"--logging.trackers: unknown tracker {name!r}; expected wandb or mlflow")


REWARD_PARTS = [("reward/model_mean", "model score"), ("reward/rule_mean", "rule reward")]


def summary_line(step: int, total: int, m: dict[str, float]) -> str:
    """One line per step; a figure the step did not compute (KL without a reference model, the actor's
    during the critic's warm-up) is left out rather than printed as 0."""
    parts = [f"step {step}/{total}", f"reward {m['reward/mean']:.3f}±{m['reward/std']:.3f}"]
    parts += [f"{name} {m[key]:.3f}" for key, name in REWARD_PARTS if key in m]  # with a reward model: its parts
    parts.append(f"len {m['response/length_mean']:.1f}")
    shown = [("actor/kl", "kl", 4), ("actor/entropy", "ent", 3), ("actor/clip_frac", "clip", 3)]
    shown += [("actor/grad_norm", "gnorm", 3), ("critic/value_loss", "vloss", 4)]
    parts += [f"{name} {m[key]:.{digits}f}" for key, name, digits in shown if key in m]
    if "sync/gb_per_s" in m:
        parts.append(f"sync {m['sync/gb_per_s']:.2f} GB/s")
    parts.append(f"{m['timing/step']:.2f}s")
    return " | ".join(parts)


def tracker_config(cfg: Config) -> dict:
    """The run's config as the trackers store it: flat `section.field` keys, secrets redacted."""
    flat = {}
    for section, values in asdict(cfg).items():
        for key, value in values.items() if isinstance(values, dict) else []:
            flat[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
    return flat | {name: "<redacted>" for name in SECRETS if flat.get(name)}
