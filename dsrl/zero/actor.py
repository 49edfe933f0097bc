"""Trainer-side work on a rollout batch: logprobs (old, reference) and the PPO update of the actor.

Micro-batches are built by tokens, packed on CUDA (`dsrl/zero/batches.py`); the model computes logits of the
response positions only, and their fp32 log-softmax runs a chunk of positions at a time."""

import itertools
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist

from dsrl.algorithms import LOG_RATIO_LIMIT, LOSS_KNOBS, POLICY_LOSSES, aggregate, importance_weights, kl_estimate
from dsrl.collectives import reduce_device
from dsrl.config import Config
from dsrl.correction import correct, with_ess
from dsrl.data import Sample, TokenField
from dsrl.moe import replay_inputs
from dsrl.vision import pixel_inputs
from dsrl.zero.batches import MicroBatch, largest_micro_batch, micro_batches


def per_token(mb: MicroBatch, name: TokenField) -> torch.Tensor:
    """Each sample's response-aligned field `name` as [samples, longest response] on the micro-batch's device."""
    out = torch.zeros(mb.mask.shape, device=mb.mask.device)
    for i, s in enumerate(mb.samples):
        out[i, : len(s.response_ids)] = torch.as_tensor(getattr(s, name))
    return out


def keep_per_sample(rows: torch.Tensor, samples: list[Sample], name: TokenField) -> None:
    """`per_token`'s inverse: each sample's response part of response-aligned `rows` as its field `name`, fp32 on
    the CPU (a copy each, so that no sample's keeps the whole micro-batch's tensor alive)."""
    for row, s in zip(rows.float().cpu(), samples):
        setattr(s, name, row[: len(s.response_ids)].clone())


LOGPROB_CHUNK = 512
"""Positions whose fp32 log-softmax is computed at once: the fp32 [positions, vocabulary] tensor never exists
whole (at 151,936 tokens of vocabulary a chunk is 0.3 GB, and the backward pass holds about five; a micro-batch
of 8k positions would be 5 GB each). 2048 had those five at 6 GB of the 3B update's peak."""


class TokenLogprobs(torch.autograd.Function):
    """The sampled tokens' logprobs under softmax(logits / T), and the entropies, from [positions, vocabulary]
    logits, LOGPROB_CHUNK positions at a time in fp32. Nothing of the size of the logits is kept but the
    logits themselves: the backward pass recomputes each chunk's softmax from them and the saved log-sum-exp,
    and writes the gradient, (onehot - p) g_logprob - p (x - E[x]) g_entropy, over T, over the logits, chunk by
    chunk once read (nothing else needs them then: the model's output projection saves its input, not its output)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool | str = True):
        lse = torch.empty(logits.shape[0], device=logits.device)
        mean_x, logprobs = torch.zeros_like(lse), torch.empty_like(lse)
        for i in range(0, logits.shape[0], LOGPROB_CHUNK):
            x = logits[i : i + LOGPROB_CHUNK].float() / temperature
            rows = slice(i, i + x.shape[0])
            lse[rows] = torch.logsumexp(x, -1)
            if with_entropy == "sum_pi_squared":  # instead (no gradient): optimal_token_baseline's input
                mean_x[rows] = torch.exp(torch.logsumexp(2 * x, -1) - 2 * lse[rows])
            elif with_entropy:
                mean_x[rows] = (torch.softmax(x, -1) * x).sum(-1)
            logprobs[rows] = x.gather(-1, targets[rows, None])[:, 0] - lse[rows]
        ctx.save_for_backward(logits, targets, lse, mean_x)
        ctx.temperature = temperature
        if with_entropy == "sum_pi_squared":
            return logprobs, mean_x
        return logprobs, (lse - mean_x if with_entropy else torch.zeros_like(lse))

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, targets, lse, mean_x = ctx.saved_tensors
        grad = logits  # (in place: a second tensor of the logits' size was 2.5 GB of the 3B update's peak)
        g_lp = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.float()
        g_h = torch.zeros_like(lse) if grad_entropy is None else grad_entropy.float()
        for i in range(0, logits.shape[0], LOGPROB_CHUNK):
            rows = slice(i, i + min(LOGPROB_CHUNK, logits.shape[0] - i))
            x = logits[rows].float() / ctx.temperature
            p = torch.exp(x - lse[rows, None])
            g = -p * (g_lp[rows, None] + g_h[rows, None] * (x - mean_x[rows, None]))
            g.scatter_add_(-1, targets[rows, None], g_lp[rows, None])
            grad[rows] = (g / ctx.temperature).to(grad.dtype)
        return grad, None, None, None


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool | str = True
) -> tuple[torch.Tensor, ...]:
    """(logprobs, entropies) of [positions, vocabulary] `logits` (`TokenLogprobs`; entropies 0 without, and with
    "sum_pi_squared" each position's sum of p^2 over the vocabulary instead, without a gradient)."""
    return TokenLogprobs.apply(logits, targets, temperature, with_entropy)


def forward_logprobs(
    engine, mb: MicroBatch, temperature: float, with_entropy: bool | str = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Response-aligned [samples, longest response] logprobs of the sampled tokens and entropies. The model
    computes the logits of the response columns only (`logits_to_keep`), in its own dtype; their log-softmax
    runs on them as they are (a flat view), and only the per-position results are gathered."""
    inputs = mb.model_inputs() | replay_inputs(engine, mb) | pixel_inputs(engine, mb)  # (a mixture of experts', a VL's)
    logits = engine(**inputs, logits_to_keep=mb.columns).logits
    flat = logits.reshape(-1, logits.shape[-1])
    where = mb.keep_in_columns()
    targets = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    targets[where] = mb.targets  # (the other positions' are 0: computed, then not read, their gradient 0)
    logprobs, entropies = token_logprobs(flat, targets, temperature, with_entropy)
    return mb.response_aligned(logprobs[where]), mb.response_aligned(entropies[where])


def trainer_micro_batches(engine, samples: list[Sample], cfg: Config, micro_batch_size: int | None = None) -> list:
    """`samples` in micro-batches, packed as `engine`'s plan says (`load_engine`)."""
    t = cfg.trainer
    return micro_batches(
        samples, t.max_tokens_per_micro_batch, micro_batch_size or t.micro_batch_size, engine.plan.packs
    )


@torch.no_grad()
def compute_logprobs(engine, samples: list[Sample], name: TokenField, cfg: Config, pad_id: int) -> None:
    """Each sample's response-token logprobs as its field `name` (micro-batched by tokens, no grad)."""
    squares = name == "old_logprobs" and cfg.algorithm.advantage == "optimal_token_baseline"
    for chunk in trainer_micro_batches(engine, samples, cfg):
        mb = MicroBatch.build(chunk, pad_id, engine.device, engine.plan.packs)
        logprobs, second = forward_logprobs(engine, mb, cfg.rollout.temperature, "sum_pi_squared" if squares else False)
        keep_per_sample(logprobs, chunk, name)
        if squares:
            keep_per_sample(second, chunk, "sum_pi_squared")


def global_denominators(mini: list[Sample]) -> tuple[float, float]:
    """The mini-batch's model tokens and sequences over every rank, divided by the number of ranks.

    DeepSpeed averages the ranks' gradients; a rank that divides its sum by (global count / ranks)
    then contributes exactly its share of the global mean. Dividing by its own count instead made
    `token_mean` the mean of per-rank means: wrong whenever ranks hold different token totals.
    Skipped samples (a failed reward, `on_reward_error skip`) count for nothing.
    """
    kept = [s for s in mini if not s.skip]
    counts = [float(sum(s.model_tokens() for s in kept)), float(len(kept))]
    counts = torch.tensor(counts, dtype=torch.float64, device=reduce_device())
    dist.all_reduce(counts)
    counts = counts.clamp(min=1) / dist.get_world_size()
    return counts[0].item(), counts[1].item()


def micro_batch_loss(
    engine, mb: MicroBatch, cfg: Config, num_tokens: float, num_seqs: float, kl_coef: float, old_from_update: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The policy loss of one micro-batch as its share of the mini-batch loss (`global_denominators`),
    its metrics, and its loss mask. Advantages come per token from each sample's `advantages`; the old logprobs from
    its `old_logprobs`, or (`old_from_update`: `Plan.old_from_update`) from this forward pass, detached and kept
    there."""
    a, mask = cfg.algorithm, mb.mask
    advantages = per_token(mb, "advantages")
    logprobs, entropy = forward_logprobs(engine, mb, cfg.rollout.temperature)
    if old_from_update:
        old = logprobs.detach()
        keep_per_sample(old, mb.samples, "old_logprobs")
    else:
        old = per_token(mb, "old_logprobs")
    agg = (a.loss_agg, num_tokens, num_seqs)
    weights, corrected = None, {}
    if a.policy_loss == "ppo" and a.off_policy not in ("none", "auto"):  # (auto: none unless `dsrl.auto` decided)
        behaviour = per_token(mb, "engine_logprobs")
        weights = importance_weights(old, behaviour, a.off_policy, a.is_cap)
    elif a.rollout_correction.enabled():  # masked tokens leave every term of the loss, not its denominators
        behaviour = per_token(mb, "engine_logprobs")
        weights, kept, corrected = correct(a.rollout_correction, old, behaviour, logprobs.detach(), advantages, mask)
        mask = mask * kept
    knobs = {k: getattr(a, k) for k in LOSS_KNOBS.get(a.policy_loss, ())}
    if weights is not None:
        knobs["is_weights"] = weights
    loss, stats = POLICY_LOSSES[a.policy_loss](
        logprobs, old, advantages, mask, a.clip_low, a.clip_high, *agg, horizon=cfg.rollout.max_new_tokens, **knobs
    )
    if weights is not None and not corrected:
        stats |= importance_stats(old, behaviour, weights, mask, a.is_cap)
    stats |= corrected
    n = mask.sum().clamp(min=1)
    stats["pg_loss"] = loss.detach()
    if kl_coef > 0 and not a.kl_in_reward:
        kl = kl_estimate(logprobs, per_token(mb, "ref_logprobs"), a.kl_estimator)
        loss = loss + kl_coef * aggregate(kl, mask, *agg, cfg.rollout.max_new_tokens)
        stats["kl"] = (kl.detach() * mask).sum() / n
    if a.entropy_coef > 0:
        loss = loss - a.entropy_coef * aggregate(entropy, mask, *agg, cfg.rollout.max_new_tokens)
    stats["entropy"] = (entropy.detach() * mask).sum() / n
    return loss, stats, mb.mask


def importance_stats(old, behaviour, weights, mask, cap: float) -> dict[str, torch.Tensor]:
    n = mask.sum().clamp(min=1)
    raw = torch.exp((old - behaviour).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    return {
        "is_weight_mean": (weights * mask).sum() / n,
        "is_weight_max": (raw * mask).max(),
        "is_capped_frac": ((raw > cap).float() * mask).sum() / n,
    }


def update_actor(
    engine, samples: list[Sample], cfg: Config, pad_id: int, kl_coef: float, beside: Callable | None = None
) -> dict[str, float]:
    """The policy update: `ppo_epochs` passes of `updates_per_step` optimizer steps, micro-batched; `beside` as
    `run_updates`."""

    def loss(mb, num_tokens, num_seqs):
        return micro_batch_loss(engine, mb, cfg, num_tokens, num_seqs, kl_coef, engine.plan.old_from_update)

    stats = run_updates(engine, samples, cfg, cfg.trainer.micro_batch_size, loss, pad_id, beside)
    return {f"actor/{k}": v for k, v in stats.items()}


def run_updates(
    engine, samples: list[Sample], cfg: Config, micro_batch_size: int, loss_fn, pad_id: int, beside=None
) -> dict[str, float]:
    """`ppo_epochs` passes over the batch, each `updates_per_step` optimizer steps of gradient accumulation
    over micro-batches (by tokens: `trainer_micro_batches`, as many on every rank); `loss_fn(mb, num_tokens,
    num_seqs)` -> (loss, metrics, mask) gives each micro-batch's share of its mini-batch loss. Their number
    varies from step to step, so the last one of each mini-batch is marked as DeepSpeed's accumulation
    boundary. `beside()` is called after the last backward pass, before the last optimizer step, which then runs
    beside what it started (what that is: `dsrl.train.beside_optimizer_step`). Returns the metrics as this rank's
    share of their token-weighted means over every rank (its sums over the global token count / ranks: the ranks'
    mean, `reduce_across_ranks`, is the batch's on any number of ranks; a rank's own mean made it the mean of per-rank
    means), `padded_frac` (the padding's share of the tokens the model ran on) and `steps_skipped`: optimizer
    steps DeepSpeed skipped, their gradient norm not finite (non-finite logprobs in the update give that), and
    `optimizer_seconds`, the optimizer steps' wall time."""
    t = cfg.trainer
    mini_size = len(samples) // t.updates_per_step
    sums: dict[str, float] = defaultdict(float)
    maxima: dict[str, float] = {}
    shares, grad_norms, lrs, ran, real, skipped, optimizer_s = 0.0, [], [], 0, 0, 0, 0.0
    with training(engine, samples, cfg, micro_batch_size):
        for epoch, m in itertools.product(range(t.ppo_epochs), range(0, len(samples), mini_size)):
            mini = samples[m : m + mini_size]
            num_tokens, num_seqs = global_denominators(mini)
            shares += num_tokens
            chunks = trainer_micro_batches(engine, mini, cfg, micro_batch_size)
            for i, chunk in enumerate(chunks):
                mb = MicroBatch.build(chunk, pad_id, engine.device, engine.plan.packs)
                ran += mb.input_ids.numel()
                real += sum(len(s.prompt.prompt_ids) + len(s.response_ids) for s in chunk)
                boundary = i == len(chunks) - 1
                engine.set_gradient_accumulation_boundary(boundary)
                loss, stats, mask = loss_fn(mb, num_tokens, num_seqs)
                # The loss is already a share of the mini-batch mean: no extra 1/accumulation scaling.
                engine.backward(loss, scale_wrt_gas=False)
                last = epoch == t.ppo_epochs - 1 and m + mini_size >= len(samples) and boundary
                if last and beside is not None:
                    beside()
                start = settled() if boundary else 0.0
                engine.step()
                if boundary:  # the optimizer's step: DeepSpeed skips one whose gradient norm is not finite
                    optimizer_s += settled() - start
                    skipped += not engine.was_step_applied()
                weight = mask.sum().item()
                for key in [k for k in stats if k.endswith("_max")]:
                    maxima[key] = max(maxima.get(key, 0.0), stats.pop(key).item())
                for key, value in stats.items():
                    # the loss is a share of the mini-batch loss already; the rest are per-token means
                    sums[key] += value.item() * (num_tokens if key.endswith("_loss") else weight)
            grad_norms.append(float(engine.get_global_grad_norm() or 0.0))
            lrs.append(engine.get_lr()[0])
    out = with_ess({k: v / shares for k, v in sums.items()})
    out.update(maxima)
    out["padded_frac"] = 1 - real / max(ran, 1)
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["lr"] = lrs[-1]
    out["steps_skipped"] = float(skipped)
    out["optimizer_seconds"] = optimizer_s
    return out


def settled() -> float:
    """The time once the GPU's queued work is done: an optimizer step's seconds are its own (with ZeRO-Offload, CPU
    Adam's and the copies to and from the host), not the tail of the backward pass before it."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


@contextmanager
def training(engine, samples: list[Sample], cfg: Config, micro_batch_size: int):
    """The engine in training mode for an update (transformers checkpoints layers in training mode only; the
    log-prob passes run in eval mode), its layers' checkpointing decided first where it is auto."""
    auto = getattr(engine, "auto_checkpointing", None)  # (a trained engine under --model.gradient_checkpointing auto)
    if auto is not None:
        longest = max(len(s.prompt.prompt_ids) + len(s.response_ids) for s in samples)
        auto.apply(
            engine.module, largest_micro_batch(cfg.trainer.max_tokens_per_micro_batch, micro_batch_size, longest)
        )
    engine.train()
    try:
        yield
    finally:
        engine.eval()
