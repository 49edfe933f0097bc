"""The trainer's micro-batches: built by tokens, not rows, with little or no padding.

`micro_batches` splits a rank's samples into micro-batches of at most `trainer.max_tokens_per_micro_batch`
tokens, and every rank ends up with the same number of them: ZeRO-3 gathers parameters in every forward, so
a rank that ran fewer would leave the others waiting. A rank with fewer splits its largest micro-batches
until it has as many.

`MicroBatch` lays the samples out for the model, in one of two ways:
- rows (the default): right-padded rows, the samples of a micro-batch of similar lengths (they are taken in
  order of length, and a micro-batch costs rows x its longest sample), so a long-tail batch is mostly not
  padding, and attention runs on sdpa's efficient kernels.
- packed (`trainer.pack_sequences`, by default on CUDA): every sample one after the other in a single row,
  positions restarting at each one, no padding at all. The sequences' boundaries go to the model as
  `cu_seq_lens_q`, which its attention (`dsrl/zero/varlen.py`: torch's flash varlen kernel on CUDA) reads:
  no mask. (With sdpa, transformers would build a dense block-causal mask over the whole row, quadratic in
  its length: seen on an H200, a 3B model at 14% MFU, and out of memory.) Samples all of one length go as
  rows even so.
Either way only the positions whose next token is a response token get logits; per-token results come back
response-aligned, [samples, longest response], the layout of the losses and estimators.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsrl.collectives import reduce_device
from dsrl.data import Sample

MICRO_BATCH_COST = 0.5
"""A micro-batch's fixed cost (ZeRO-3 gathers every parameter for it, its hooks run, the kernels launch), in
budgets: padding is worth adding where it saves a micro-batch, up to half a budget of tokens. Measured on one
H200 at 3B: 0.14 s a forward pass, as long as a forward of ~13k tokens (docs/benchmarks.md, Trainer)."""


def largest_micro_batch(max_tokens: int | str | None, micro_batch_size: int, longest: int) -> int:
    """The most tokens one of `micro_batches`' micro-batches can hold, its samples at most `longest` tokens long."""
    return max(max_tokens, longest) if isinstance(max_tokens, int) else micro_batch_size * longest


def plan_rows(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of `lengths`, longest first, in runs whose rows x longest is at most `max_tokens` (a longer
    one alone): padded rows of similar lengths. The runs minimise the tokens the model runs on, padding
    included, plus MICRO_BATCH_COST per micro-batch (exactly, by dynamic programming over the sorted order)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    sizes = [lengths[i] for i in order]
    n, overhead = len(sizes), MICRO_BATCH_COST * max_tokens
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)  # best[j]: the first j samples; cut[j]: where its run starts
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):  # the run sizes[i:j], whose longest is sizes[i]
            rows = j - i
            if rows > 1 and rows * sizes[i] > max_tokens:
                break
            cost = best[i] + rows * sizes[i] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bins, j = [], n
    while j > 0:
        bins.append(order[cut[j] : j])
        j = cut[j]
    return bins[::-1]


def plan(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of `lengths` in bins of at most `max_tokens` tokens (a longer one alone), first-fit decreasing:
    for packed rows, where a bin costs the sum of its lengths."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, left in enumerate(room):
            if lengths[i] <= left:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins


def split_to(bins: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    """`bins` split (the heaviest first, in halves by tokens) until there are `count` of them."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        b = max((b for b in bins if len(b) > 1), key=lambda b: sum(lengths[i] for i in b))
        bins.remove(b)
        half, total = [], sum(lengths[i] for i in b)
        while b and sum(lengths[i] for i in half) < total / 2:
            half.append(b.pop(0))
        bins += [half, b] if b else [half[:-1], half[-1:]]
    return bins


def micro_batches(
    samples: list[Sample], max_tokens: int | str | None, micro_batch_size: int, packed: bool = False
) -> list[list[Sample]]:
    """This rank's micro-batches of `samples`: by tokens (`max_tokens`, "auto" for `micro_batch_size` x the
    longest sample; `packed` rows cost their tokens, padded ones rows x longest), or `micro_batch_size` rows each
    when it is None; as many on every rank."""
    if not max_tokens:
        return [samples[i : i + micro_batch_size] for i in range(0, len(samples), micro_batch_size)]
    lengths = [len(s.prompt.prompt_ids) + len(s.response_ids) for s in samples]
    if max_tokens == "auto":
        max_tokens = micro_batch_size * max(lengths)
    bins = (plan if packed else plan_rows)(lengths, max_tokens)
    count = torch.tensor([len(bins)], device=reduce_device() if dist.is_initialized() else "cpu")
    if dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if count.item() > len(samples):  # cannot happen while every rank holds as many samples
        raise RuntimeError(f"a rank with {len(samples)} samples cannot run {count.item()} micro-batches")
    return [[samples[i] for i in sorted(b)] for b in split_to(bins, int(count.item()), lengths)]


@dataclass
class MicroBatch:
    samples: list[Sample]
    input_ids: torch.Tensor
    """[1, tokens] packed, or [samples, longest] right-padded."""
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    keep: torch.Tensor
    """Positions (of the flattened input) whose logits predict a response token, in sample order."""
    columns: torch.Tensor
    """The input columns whose logits are computed (`logits_to_keep`): packed, `keep`; padded, the span of
    columns any row needs (a 1-D index applies to every row in transformers 5.12)."""
    targets: torch.Tensor
    """The response token each `keep` position predicts."""
    bounds: torch.Tensor | None
    """Packed: where each sequence starts in the row, and the row's end (int32, `cu_seq_lens_q`)."""
    max_length: int
    """Packed: the longest sequence's tokens (`max_length_q`)."""
    slots: tuple[torch.Tensor, torch.Tensor]
    """(sample, response position) of each `keep` position, to scatter results response-aligned."""
    mask: torch.Tensor
    """[samples, longest response]: 1 where the loss counts (model tokens of samples not skipped)."""

    @property
    def packed(self) -> bool:
        return self.attention_mask is None

    def response_aligned(self, values: torch.Tensor) -> torch.Tensor:
        """Per-`keep` values as [samples, longest response] (0 where there is no token)."""
        out = values.new_zeros(self.mask.shape)
        out[self.slots] = values
        return out

    @classmethod
    def build(cls, samples: list[Sample], pad_id: int, device: torch.device, packed: bool = True) -> "MicroBatch":
        """Packed, or right-padded rows. Samples all of one length go as rows either way: no padding, no mask
        (`dsrl/zero/varlen.py`), and sdpa's kernel ran 2-3.5% faster than the varlen one on uniform lengths (3B,
        one H200, docs/benchmarks.md, Trainer)."""
        seqs = [s.prompt.prompt_ids + s.response_ids for s in samples]
        packed = packed and len(set(map(len, seqs))) > 1
        width = max(len(s.response_ids) for s in samples)
        mask = torch.zeros(len(samples), width)
        keep, targets, rows, cols = [], [], [], []
        if packed:
            input_ids = torch.tensor([[t for seq in seqs for t in seq]], dtype=torch.long)
            position_ids = torch.cat([torch.arange(len(seq)) for seq in seqs])[None]
            attention_mask = None
            bounds = torch.tensor([0] + [len(seq) for seq in seqs]).cumsum(0).to(torch.int32)
        else:
            longest = max(map(len, seqs))
            input_ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(seqs), longest), dtype=torch.long)
            position_ids = bounds = None
        offset = 0
        for i, (s, seq) in enumerate(zip(samples, seqs)):
            start = offset if packed else i * input_ids.shape[1]
            if not packed:
                input_ids[i, : len(seq)] = torch.tensor(seq)
                attention_mask[i, : len(seq)] = 1
            first = start + len(s.prompt.prompt_ids) - 1  # the position predicting the first response token
            keep += range(first, first + len(s.response_ids))
            targets += s.response_ids
            rows += [i] * len(s.response_ids)
            cols += range(len(s.response_ids))
            if not s.skip:  # a sample whose reward failed (on_reward_error skip) has no loss
                mask[i, : len(s.response_ids)] = torch.tensor(s.mask(), dtype=mask.dtype)
            offset += len(seq)
        as_long = dict(dtype=torch.long, device=device)
        if packed:
            columns = torch.tensor(keep, **as_long)
        else:
            width_in = input_ids.shape[1]
            first = min(k % width_in for k in keep) if keep else 0
            columns = torch.arange(first, max(k % width_in for k in keep) + 1 if keep else 0, **as_long)
        return cls(
            samples,
            input_ids.to(device),
            None if position_ids is None else position_ids.to(device),
            None if attention_mask is None else attention_mask.to(device),
            torch.tensor(keep, **as_long),
            columns,
            torch.tensor(targets, **as_long),
            None if bounds is None else bounds.to(device),
            max(map(len, seqs)),
            (torch.tensor(rows, **as_long), torch.tensor(cols, **as_long)),
            mask.to(device),
        )

    def model_inputs(self) -> dict:
        # No cache: transformers reads packed positions only without one (and training needs none).
        inputs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "use_cache": False}
        if self.packed:  # the sequences' boundaries, for a varlen attention (transformers' FlashAttentionKwargs)
            inputs |= {"position_ids": self.position_ids, "cu_seq_lens_q": self.bounds, "cu_seq_lens_k": self.bounds}
            inputs |= {"max_length_q": self.max_length, "max_length_k": self.max_length}
        return inputs

    def at_keep(self, per_position: torch.Tensor) -> torch.Tensor:
        """A model output of every input position ([rows, tokens, ...]) at the `keep` positions."""
        return per_position.reshape(-1, *per_position.shape[2:])[self.keep]

    def keep_in_columns(self) -> torch.Tensor:
        """Where each `keep` position sits in a model output of the `columns` only, flattened to
        [rows x len(columns)]: indexing small per-position results there is cheap, where gathering the
        [positions, vocabulary] logits first would copy them and scatter their gradient back."""
        if self.packed:
            return torch.arange(len(self.keep), device=self.keep.device)
        width = self.input_ids.shape[1]
        return self.keep // width * len(self.columns) + self.keep % width - self.columns[0]
