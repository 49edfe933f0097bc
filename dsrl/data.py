"""Prompt datasets (JSONL or parquet rows, tokenized once, served in a seeded order by step) and samples."""

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsrl.config import DataConfig

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A dataset that cannot be used, with the file and row at fault."""


@dataclass
class Prompt:
    index: int
    """Row number in the dataset file (0-based)."""
    prompt_ids: list[int]
    text: str
    """The prompt as the reward function sees it (chat messages rendered to text when templated)."""
    answer: Any
    sampling: dict[str, Any] = field(default_factory=dict)
    """Per-prompt overrides of the sampling parameters (the row's `sampling_params` field)."""
    row: dict[str, Any] = field(default_factory=dict)
    """The dataset row, for reward functions that take `row=` (every field, not just the answer)."""


@dataclass
class Sample:
    """One response to a prompt, token-in/token-out, and what the trainer computes for it."""

    prompt: Prompt
    response_ids: list[int]
    engine_logprobs: list[float]
    """Logprobs the rollout engine reported for `response_ids` (its sampling distribution)."""
    finish_reason: str
    weight_version: int
    """The weight version the response finished under."""
    reward: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)
    """spans: [(first token index, weight version)] of the response (index None where not known: a request
    paused through an update, `rollout.interrupt pause`); per-token arrays the trainer fills in."""

    @property
    def oldest_version(self) -> int:
        return min(version for _, version in self.extras["spans"])


def read_rows(path: str, skip_bad_lines: bool = False, bad: list | None = None) -> list:
    """The rows of a .jsonl, .json or .parquet file; an unreadable JSONL line fails, or becomes None when skipped."""
    file = Path(path)
    if not file.is_file():
        raise DatasetError(f"{path}: file not found")
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(file).to_pylist()
    rows = []
    with open(file) as f:
        if file.suffix == ".json":
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from e
            if not isinstance(data, list):
                raise DatasetError(f"{path}: a .json dataset must hold a list of rows")
            return data
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                if not skip_bad_lines:
                    raise DatasetError(f"{path}, line {line_no}: not valid JSON ({e.msg})") from e
                bad.append((len(rows), f"{path}, line {line_no}: not valid JSON ({e.msg})"))
                rows.append(None)
    return rows


class PromptDataset:
    def __init__(self, cfg: DataConfig, tokenizer, seed: int = 0, path: str | None = None):
        """The prompts of `path` (default `cfg.train_path`: evaluation sets are read the same way)."""
        self.cfg, self.seed, self.path = cfg, seed, path or cfg.train_path
        self.use_template = cfg.apply_chat_template and getattr(tokenizer, "chat_template", None)
        self.prompts: list[Prompt] = []
        self.skipped_bad: list[tuple[int, str]] = []  # (row, why), with --data.on_bad_row skip
        self.too_long = 0  # skipped or truncated, by --data.on_long_prompt
        self._orders: dict[int, list[int]] = {}
        rows = read_rows(self.path, skip_bad_lines=cfg.on_bad_row == "skip", bad=self.skipped_bad)
        for i, row in enumerate(rows):
            if row is None:  # an unreadable line, already counted
                continue
            try:
                prompt = self._prompt(i, row, tokenizer)
            except DatasetError as e:
                if cfg.on_bad_row == "fail":
                    raise
                self.skipped_bad.append((i, str(e)))
                continue
            if prompt is not None:
                self.prompts.append(prompt)
        if self.skipped_bad:
            log.warning(
                "%d bad rows skipped (--data.on_bad_row skip), first: %s", len(self.skipped_bad), self.skipped_bad[0][1]
            )
        if self.too_long:
            verb = "truncated" if cfg.on_long_prompt == "truncate" else "skipped"
            log.warning(
                "%d prompts longer than --data.max_prompt_tokens=%d %s", self.too_long, cfg.max_prompt_tokens, verb
            )
        if not self.prompts:
            raise DatasetError(f"{self.path}: no usable prompts ({len(rows)} rows)")

    def _prompt(self, i: int, row, tokenizer) -> Prompt | None:
        cfg, where = self.cfg, f"{self.path}, row {i}"
        if not isinstance(row, dict) or cfg.prompt_key not in row:
            found = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise DatasetError(f"{where}: no field {cfg.prompt_key!r} (set --data.prompt_key); row has {found}")
        raw = row[cfg.prompt_key]
        is_chat = isinstance(raw, list) and all(isinstance(m, dict) and "content" in m for m in raw)
        if not (isinstance(raw, str) or is_chat):
            raise DatasetError(f"{where}: {cfg.prompt_key!r} must be a string or a list of chat messages, got {raw!r}")
        if self.use_template:
            messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        elif isinstance(raw, str):
            text = raw
        else:
            raise DatasetError(
                f"{where}: {cfg.prompt_key!r} holds chat messages, but the tokenizer has no chat template"
            )
        if not text.strip():
            raise DatasetError(f"{where}: {cfg.prompt_key!r} is empty")
        overrides = row.get("sampling_params") or {}
        if not isinstance(overrides, dict):
            raise DatasetError(f"{where}: sampling_params must be a mapping, got {overrides!r}")
        ids = tokenizer(text, add_special_tokens=not self.use_template)["input_ids"]
        if len(ids) > cfg.max_prompt_tokens:
            self.too_long += 1
            if cfg.on_long_prompt == "skip":
                return None
            ids = ids[-cfg.max_prompt_tokens :]  # keep the end: the question and the generation prompt
        return Prompt(i, ids, text, row.get(cfg.answer_key), overrides, row)

    def __len__(self) -> int:
        return len(self.prompts)

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.prompts)))
            if self.cfg.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # batches touch at most two epochs; keep the latest
        return self._orders[epoch]

    def batch(self, step: int, prompts_per_step: int, rank: int = 0, world: int = 1) -> list[Prompt]:
        """This rank's share of step `step`: the same on every call, so a resumed run sees the same data."""
        per_rank = prompts_per_step // world
        start = step * prompts_per_step + rank * per_rank
        out = []
        for pos in range(start, start + per_rank):
            epoch, offset = divmod(pos, len(self.prompts))
            out.append(self.prompts[self.order(epoch)[offset]])
        return out
