"""The critic (--algorithm.advantage gae): a ZeRO-3 value model, its values of a batch and its update.

The value of response position t estimates the return from generating token t on: it is read at
the same positions as the policy's logprobs (the hidden state before the token), so `values`,
`returns` and `advantages` line up with `old_logprobs` token for token.
"""

import torch

from dsrl.algorithms import value_loss
from dsrl.config import Config
from dsrl.data import Sample
from dsrl.zero.actor import pack, per_token, run_updates


def forward_values(engine, input_ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    return engine(input_ids=input_ids, attention_mask=attention).logits[:, :-1, 0].float()


@torch.no_grad()
def compute_values(engine, samples: list[Sample], cfg: Config, pad_id: int) -> None:
    """Each sample's values of its response positions, under extras["values"]."""
    mb = cfg.critic.micro_batch_size or cfg.trainer.micro_batch_size
    for i in range(0, len(samples), mb):
        chunk = samples[i : i + mb]
        input_ids, attention, _ = pack(chunk, pad_id, engine.device)
        values = forward_values(engine, input_ids, attention)
        for row, s in zip(values, chunk):
            start = len(s.prompt.prompt_ids) - 1
            s.extras["values"] = row[start : start + len(s.response_ids)].float().cpu()


def update_critic(engine, samples: list[Sample], cfg: Config, pad_id: int) -> dict[str, float]:
    """Regress the values on the GAE returns (extras["returns"]), with PPO's value clipping."""
    clip = cfg.critic.value_clip

    def loss(chunk: list[Sample], num_tokens: float, num_seqs: float):
        input_ids, attention, mask = pack(chunk, pad_id, engine.device)
        width = mask.shape[1]
        values = forward_values(engine, input_ids, attention)
        old = per_token(chunk, "values", width, engine.device)
        returns = per_token(chunk, "returns", width, engine.device)
        loss, stats = value_loss(values, old, returns, mask, clip, "token_mean", num_tokens, num_seqs)
        n = mask.sum().clamp(min=1)
        stats["value_loss"] = loss.detach()
        stats["values_mean"] = (values.detach() * mask).sum() / n
        stats["returns_mean"] = (returns * mask).sum() / n
        return loss, stats, mask

    mb = cfg.critic.micro_batch_size or cfg.trainer.micro_batch_size
    return {f"critic/{k}": v for k, v in run_updates(engine, samples, cfg, mb, loss).items()}
