"""Prompt datasets: JSONL or parquet rows, tokenized once, served in a seeded order by step."""

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


def read_rows(path: str) -> list[dict]:
    file = Path(path)
    if not file.is_file():
        raise DatasetError(f"--data.train_path={path!r}: file not found")
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(file).to_pylist()
    rows = []
    with open(file) as f:
        if file.suffix == ".json":
            data = json.load(f)
            if not isinstance(data, list):
                raise DatasetError(f"{path}: a .json dataset must hold a list of rows")
            return data
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}, line {line_no}: not valid JSON ({e.msg})") from e
    return rows


class PromptDataset:
    def __init__(self, cfg: DataConfig, tokenizer, seed: int = 0):
        self.cfg, self.seed = cfg, seed
        use_template = cfg.apply_chat_template and getattr(tokenizer, "chat_template", None)
        self.prompts: list[Prompt] = []
        self.skipped_too_long = 0
        self._orders: dict[int, list[int]] = {}
        for i, row in enumerate(read_rows(cfg.train_path)):
            if not isinstance(row, dict) or cfg.prompt_key not in row:
                raise DatasetError(
                    f"{cfg.train_path}, row {i}: no field {cfg.prompt_key!r} (set --data.prompt_key); "
                    f"row has {sorted(row) if isinstance(row, dict) else type(row).__name__}"
                )
            raw = row[cfg.prompt_key]
            if use_template:
                messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            elif isinstance(raw, str):
                text = raw
            else:
                raise DatasetError(
                    f"{cfg.train_path}, row {i}: {cfg.prompt_key!r} is a {type(raw).__name__}, but the tokenizer "
                    "has no chat template to render it; give a string"
                )
            ids = tokenizer(text, add_special_tokens=not use_template)["input_ids"]
            if len(ids) > cfg.max_prompt_tokens:
                self.skipped_too_long += 1
                continue
            overrides = row.get("sampling_params") or {}
            if not isinstance(overrides, dict):
                raise DatasetError(f"{cfg.train_path}, row {i}: sampling_params must be a mapping, got {overrides!r}")
            self.prompts.append(Prompt(i, ids, text, row.get(cfg.answer_key), overrides))
        if self.skipped_too_long:
            log.warning(
                "%d prompts longer than --data.max_prompt_tokens=%d skipped",
                self.skipped_too_long,
                cfg.max_prompt_tokens,
            )
        if not self.prompts:
            raise DatasetError(f"{cfg.train_path}: no usable prompts")

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
