"""The critic (--algorithm.advantage gae): a ZeRO-3 value model, its values of a batch and its update.

The value of response position t estimates the return from generating token t on: it is read at
the same positions as the policy's logprobs (the hidden state before the token), so `values`,
`returns` and `advantages` line up with `old_logprobs` token for token.
"""

import torch

from dsrl.algorithms import value_loss
from dsrl.config import Config
from dsrl.data import Sample
from dsrl.zero.actor import per_token, run_updates, trainer_micro_batches
from dsrl.zero.batches import MicroBatch


def forward_values(engine, mb: MicroBatch) -> torch.Tensor:
    """Response-aligned [samples, longest response] values (the scalar head at the positions before each token)."""
    return mb.response_aligned(mb.at_keep(engine(**mb.model_inputs()).logits[..., 0]).float())


@torch.no_grad()
def compute_values(engine, samples: list[Sample], cfg: Config, pad_id: int) -> None:
    """Each sample's values of its response positions, under extras["values"]."""
    for chunk in trainer_micro_batches(samples, cfg, cfg.critic.micro_batch_size):
        values = forward_values(engine, MicroBatch.build(chunk, pad_id, engine.device, cfg.trainer.pack_sequences))
        for row, s in zip(values, chunk):
            s.extras["values"] = row[: len(s.response_ids)].float().cpu()


def update_critic(engine, samples: list[Sample], cfg: Config, pad_id: int) -> dict[str, float]:
    """Regress the values on the GAE returns (extras["returns"]), with PPO's value clipping."""
    clip = cfg.critic.value_clip

    def loss(mb: MicroBatch, num_tokens: float, num_seqs: float):
        mask = mb.mask
        values = forward_values(engine, mb)
        old = per_token(mb, "values")
        returns = per_token(mb, "returns")
        loss, stats = value_loss(values, old, returns, mask, clip, "token_mean", num_tokens, num_seqs)
        n = mask.sum().clamp(min=1)
        stats["value_loss"] = loss.detach()
        stats["values_mean"] = (values.detach() * mask).sum() / n
        stats["returns_mean"] = (returns * mask).sum() / n
        return loss, stats, mask

    size = cfg.critic.micro_batch_size or cfg.trainer.micro_batch_size
    return {f"critic/{k}": v for k, v in run_updates(engine, samples, cfg, size, loss, pad_id).items()}
