"""Prompt datasets (JSONL or parquet rows, tokenized once, served in a seeded order by step) and samples."""

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from dsrl.vision import Images

from dsrl.config import Config, DataConfig, DatasetError, RolloutConfig, eval_rollout

log = logging.getLogger(__name__)


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
    images: "Images | None" = None
    """A vision-language prompt's images (`dsrl.vision`): `prompt_ids` hold their image tokens."""


@dataclass
class EpisodeRecord:
    """What a sample keeps of its agent episode (`dsrl.rollout.episode`): its model turns, why it stopped
    (`STOP_REASONS`; None while it runs), the environment's reward and failure, seconds in all, its tool calls and
    those that failed or (of them) ran out of time, and seconds in the environment, in tools, between model turns."""

    turns: int = 0
    stop: str | None = None
    reward: float = 0.0
    error: str | None = None
    seconds: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    env_s: float = 0.0
    tool_s: float = 0.0
    between_s: float = 0.0


TokenField = Literal[
    "old_logprobs", "ref_logprobs", "values", "advantages", "returns", "engine_logprobs", "sum_pi_squared",
    "teacher_logprobs"
]  # fmt: skip
"""The fields of a `Sample` that hold one value per response token."""


@dataclass
class Sample:
    """One response to a prompt, token-in/token-out, and what the trainer computes for it.

    Everything after the prompt is `response_ids`: one model turn, or an agent episode's model turns
    with the environment's tokens (tool results, user turns) between them, as they went to the server.
    Per response token: `loss_mask` (1 for the model's tokens, 0 for the environment's), the engine's
    logprob, and (through `spans`) the weight version that produced it."""

    prompt: Prompt
    response_ids: list[int]
    engine_logprobs: list[float]
    """Logprobs the rollout engine reported for `response_ids` (its sampling distribution); 0 where masked."""
    finish_reason: str
    weight_version: int
    """The weight version the response finished under."""
    reward: float = 0.0
    loss_mask: list[int] | None = None
    """1 for each token the model generated, 0 for each the environment added; None: all the model's."""
    # What the trainer computes per response token (`dsrl.zero.actor.per_token` reads them by `TokenField`)
    old_logprobs: "torch.Tensor | None" = None
    ref_logprobs: "torch.Tensor | None" = None
    values: "torch.Tensor | None" = None
    """The critic's (gae)."""
    advantages: "torch.Tensor | None" = None
    returns: "torch.Tensor | None" = None
    """The critic's targets (gae)."""
    sum_pi_squared: "torch.Tensor | None" = None
    """sum over the vocabulary of the old policy's p^2 at each token (--algorithm.advantage optimal_token_baseline)."""
    routed_experts: "torch.Tensor | None" = None
    """A mixture-of-experts model's routing in the engine: int32 [tokens, layers, top k] of the prompt and the
    response but the last token (SGLang's `routed_experts`), for routing replay; None for a dense model."""
    spans: list[tuple[int | None, int]] = field(default_factory=list)
    """[(first token index, weight version)] of the model's tokens (index None where not known: a request
    paused through an update, `rollout.interrupt pause`)."""
    skip: bool = False
    """No loss: its reward failed (`--algorithm.on_reward_error skip`; then no evaluation score either), or it was cut
    at max_new_tokens (`--algorithm.mask_truncated`)."""
    episode: EpisodeRecord | None = None  # (an agent's episode)
    teacher_logprobs: list[float] | None = None
    """The teacher's logprobs of `response_ids` (`--distill.teacher_path`)."""
    reward_model: float | None = None  # (the reward model's raw score, and the rule's beside it: --reward_model)
    reward_rule: float | None = None
    reward_baseline: float | None = None  # (the reward of a greedy response to its prompt: --algorithm.advantage remax)

    @property
    def oldest_version(self) -> int:
        return min(version for _, version in self.spans)

    def mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.response_ids)

    def model_tokens(self) -> int:
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)


def read_rows(path: str, bad: list | None = None) -> list:
    """The rows of a .jsonl, .json or .parquet file. A JSONL line that is not UTF-8 or not JSON becomes None
    and (its index, why) goes to `bad`; without `bad` it fails at once, naming the line."""
    file = Path(path)
    if not file.is_file():
        raise DatasetError(f"{path}: file not found")
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(file).to_pylist()
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read it ({e.strerror or e})") from e
    if file.suffix == ".json":
        try:
            data = json.loads(raw)
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path}: not valid UTF-8 (byte {e.start})") from e
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from e
        if not isinstance(data, list):
            raise DatasetError(f"{path}: a .json dataset must hold a list of rows")
        return data
    rows = []
    for line_no, line in enumerate(raw.split(b"\n"), 1):
        try:
            text = line.decode("utf-8")
            if not text.strip():
                continue
            rows.append(json.loads(text))
        except UnicodeDecodeError as e:
            why = f"{path}, line {line_no}: not valid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})"
        except json.JSONDecodeError as e:
            why = f"{path}, line {line_no}: not valid JSON ({e.msg})"
        else:
            continue
        if bad is None:
            raise DatasetError(why)
        bad.append((len(rows), why))
        rows.append(None)
    return rows


MAX_LISTED = 10
"""Problems of one dataset listed in its error; the rest are counted."""


class PromptDataset:
    def __init__(
        self, cfg: DataConfig, tokenizer, seed: int = 0, path: str | None = None, tools: list[dict] | None = None
    ):
        """The prompts of `path` (default `cfg.train_path`: evaluation sets are read the same way), rendered
        with the chat template (and the environment's `tools`, which it lists for the model). Every bad row
        is found before it fails (on_bad_row fail) or is skipped (skip), one line per problem."""
        self.cfg, self.seed, self.path, self.tools = cfg, seed, path or cfg.train_path, tools
        self.use_template = cfg.apply_chat_template and getattr(tokenizer, "chat_template", None)
        self.prompts: list[Prompt] = []
        self.too_long = 0  # skipped or truncated, by --data.on_long_prompt
        self._orders: dict[int, list[int]] = {}
        bad: list[tuple[int, str]] = []
        rows = read_rows(self.path, bad)
        for i, row in enumerate(rows):
            if row is None:  # an unreadable line, already in `bad`
                continue
            try:
                prompt = self._prompt(i, row, tokenizer)
            except DatasetError as e:
                bad.append((i, str(e)))
                continue
            if prompt is not None:
                self.prompts.append(prompt)
        if bad and cfg.on_bad_row == "fail":
            listed = [why for _, why in bad[:MAX_LISTED]]
            more = f"\n  ... and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
            raise DatasetError(
                f"{len(bad)} bad rows (--data.on_bad_row skip skips them):\n  " + "\n  ".join(listed) + more
                if len(bad) > 1
                else listed[0]
            )
        self.skipped_bad = sorted(bad)  # (row, why), with --data.on_bad_row skip
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
        files = None
        if row.get(cfg.image_key):  # (a vision-language prompt: README "Vision-language")
            from dsrl import vision

            files = vision.read_images(row[cfg.image_key], self.path, where)
        if self.use_template:
            messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
            messages = vision.place_images(messages, len(files), where) if files else messages
            text = tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False, add_generation_prompt=True)
        elif isinstance(raw, str) and not files:
            text = raw
        else:
            what = "images" if files else "chat messages"
            raise DatasetError(f"{where}: {cfg.prompt_key!r} holds {what}, but the tokenizer has no chat template")
        if not text.strip():
            raise DatasetError(f"{where}: {cfg.prompt_key!r} is empty")
        overrides = row.get("sampling_params") or {}
        if not isinstance(overrides, dict):
            raise DatasetError(f"{where}: sampling_params must be a mapping, got {overrides!r}")
        ids = tokenizer(text, add_special_tokens=not self.use_template)["input_ids"]
        images = None
        if files:  # each image's tokens in its placeholder
            ids, images = vision.prompt_images(ids, files, tokenizer.name_or_path, where)
        if len(ids) > cfg.max_prompt_tokens:
            self.too_long += 1
            if cfg.on_long_prompt == "skip":
                return None
            if images:
                raise DatasetError(f"{where}: {len(ids)} tokens with its images, over --data.max_prompt_tokens: "
                                   "truncating would cut an image (--data.on_long_prompt skip skips it)")  # fmt: skip
            ids = ids[-cfg.max_prompt_tokens :]  # keep the end: the question and the generation prompt
        return Prompt(i, ids, text, field_at(row, cfg.answer_key), overrides, row, images)

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
        places = (divmod(pos, len(self.prompts)) for pos in range(start, start + per_rank))  # (epoch, offset)
        return [self.prompts[self.order(epoch)[offset]] for epoch, offset in places]


def field_at(row: dict, key: str):
    """`row[key]`, or for a dotted key that is not a field itself the nested field it names (verl's files keep the
    answer at `reward_model.ground_truth`); None where it is absent."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def check_fits_context(rollout: RolloutConfig, dataset: PromptDataset, context: int, flags: str = "rollout") -> None:
    """SGLang refuses a request whose prompt + max_new_tokens passes the model's context, and an input
    within 6 tokens of it (its scheduler keeps context - 1 - 5): a partial rollout resumes with prompt +
    tokens so far as input. Fail at start-up, naming the first row, rather than mid-run. `rollout` is
    the sampling of these prompts' requests, set by `--{flags}.max_new_tokens`."""
    partial = rollout.placement == "disaggregate" and rollout.interrupt == "partial"
    limit = context - 6 if partial else context
    for p in dataset.prompts:
        new_tokens = int(p.sampling.get("max_new_tokens", rollout.max_new_tokens))
        if len(p.prompt_ids) + new_tokens > limit:
            why = f"the model's context ({context})" + (
                ", less the 6 tokens SGLang keeps free, which a resumed partial rollout needs" if partial else ""
            )
            raise DatasetError(
                f"{dataset.path}, row {p.index}: prompt ({len(p.prompt_ids)} tokens) + max_new_tokens "
                f"({new_tokens}) = {len(p.prompt_ids) + new_tokens} tokens, over {limit}: {why}. Lower "
                f"--{flags}.max_new_tokens (or the row's sampling_params) or --data.max_prompt_tokens"
                + (", or use --rollout.interrupt abort" if partial else "")
            )


def check_datasets(
    cfg: Config, tokenizer, context: int | None, tools: list[dict] | None = None
) -> tuple[PromptDataset, PromptDataset | None]:
    """The training and evaluation prompts, read and checked (encoding, rows, prompt key, lengths; against
    the servers' context when `context` is known): `dsrl train` runs this before the launcher starts, so
    bad data fails in one message naming every bad row, not as a traceback from each rank."""
    train = PromptDataset(cfg.data, tokenizer, cfg.seed, tools=tools)
    held_out = PromptDataset(cfg.data, tokenizer, cfg.seed, cfg.eval.path, tools) if cfg.eval.path else None
    if context:
        check_fits_context(cfg.rollout, train, context)
        if held_out is not None:
            check_fits_context(eval_rollout(cfg), held_out, context, flags="eval")
    return train, held_out


def server_context(cfg: Config, model_dir: str, engine: str, fleet: str) -> int | None:
    """The context SGLang enforces on a request, where requests must fit it (SGLang, external servers)."""
    if fleet != "external" and engine != "sglang":
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    return getattr(config.get_text_config(), "max_position_embeddings", None)
