"""The critic (--algorithm.advantage gae): a ZeRO-3 value model, its values of a batch and its update.

The value of response position t estimates the return from generating token t on: it is read at
the same positions as the policy's logprobs (the hidden state before the token), so `values`,
`returns` and `advantages` line up with `old_logprobs` token for token.

Two shapes of critic:

    full   its own engine: the policy's architecture with a scalar head (`load_engine(critic=True)`)
    LoRA   with --model.lora_rank, no second model: a second adapter and a scalar head on the actor's
           frozen base (`PolicyAndValue`), one engine for the actor, the critic and the reference
           (adapters off), trained together (`update_actor_and_critic`)
"""

import contextlib

import torch
from peft import PeftModelForCausalLM
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers.modeling_outputs import TokenClassifierOutput

from dsrl.algorithms import value_loss
from dsrl.config import Config
from dsrl.data import Sample
from dsrl.moe import replay_inputs
from dsrl.zero.actor import (
    keep_per_sample,
    micro_batch_loss,
    per_token,
    run_updates,
    trainer_micro_batches,
)
from dsrl.zero.batches import MicroBatch
from dsrl.zero.lora import ADAPTER

CRITIC = "critic"
"""The critic's adapter's name beside the actor's (`lora.ADAPTER`)."""


class PolicyAndValue(PeftModelForCausalLM):
    """One frozen base under two LoRA adapters: the actor's (`ADAPTER`, what the servers get) and the critic's
    (`CRITIC`), with the critic's scalar head on the base's last hidden state. `model(**inputs)` is the policy;
    `model(**inputs, values=True)` the values, [B, T, 1] as `.logits`, as a token-classification critic gives.

    The critic's adapter is switched on for its forward without touching `requires_grad` (PEFT's set_adapter
    would freeze the actor's). Under gradient checkpointing a layer's forward is recomputed during the
    backward pass, when the actor's adapter is on again: the checkpoints replay the adapter that was on at
    their forward (`replay_adapter`, torch's non-reentrant checkpoint's context_fn)."""

    def __init__(self, model: torch.nn.Module, config):
        super().__init__(model, config, ADAPTER, autocast_adapter_dtype=False)
        self.add_adapter(CRITIC, config)  # PEFT leaves an added adapter frozen and fp32 (the base's dtype here)
        dtype = next(p.dtype for n, p in self.named_parameters() if f".{ADAPTER}." in n)
        for name, p in self.named_parameters():
            if f".{CRITIC}." in name:
                p.data, p.requires_grad = p.data.to(dtype), True
        hidden = model.config.hidden_size
        self.value_head = torch.nn.Linear(hidden, 1, dtype=dtype)
        torch.nn.init.normal_(self.value_head.weight, std=model.config.initializer_range)  # as HF's scalar heads
        torch.nn.init.zeros_(self.value_head.bias)
        self._adapter_on = ADAPTER
        self._tuner_layers = [m for m in self.modules() if isinstance(m, BaseTunerLayer)]

    def forward(self, *args, values: bool = False, **kwargs):
        if not values:
            return super().forward(*args, **kwargs)
        with self.adapter_on(CRITIC):
            hidden = self.get_base_model().get_decoder()(*args, **kwargs).last_hidden_state
        return TokenClassifierOutput(logits=self.value_head(hidden))

    @contextlib.contextmanager
    def adapter_on(self, name: str):
        before, self._adapter_on = self._adapter_on, name
        for layer in self._tuner_layers:
            layer._active_adapter = name
        try:
            yield
        finally:
            for layer in self._tuner_layers:
                layer._active_adapter = before
            self._adapter_on = before

    @contextlib.contextmanager
    def disable_adapter(self):
        """The reference policy (`reference_off`): PEFT's, which on leaving leaves every adapter but the active
        one frozen; the critic's is trained too."""
        trained = [p for p in self.parameters() if p.requires_grad]
        try:
            with super().disable_adapter():
                yield
        finally:
            for p in trained:
                p.requires_grad = True

    def replay_adapter(self):
        """torch.utils.checkpoint's context_fn: (the forward's context, the recomputation's)."""
        return contextlib.nullcontext(), self.adapter_on(self._adapter_on)

    def param_groups(self, critic_lr: float) -> list[dict]:
        """The optimizer's groups: the actor's adapter at trainer.lr, the critic's adapter and head at critic.lr."""
        actor = [p for n, p in self.named_parameters() if p.requires_grad and f".{ADAPTER}." in n]
        critic = [p for n, p in self.named_parameters() if p.requires_grad and f".{ADAPTER}." not in n]
        return [{"params": actor}, {"params": critic, "lr": critic_lr}]


def has_values(engine) -> bool:
    """Whether `engine` is the actor and the critic in one (LoRA with a critic)."""
    return isinstance(engine.module, PolicyAndValue)


def forward_values(engine, mb: MicroBatch) -> torch.Tensor:
    """Response-aligned [samples, longest response] values (the scalar head at the positions before each token)."""
    inputs = mb.model_inputs() | replay_inputs(engine, mb) | ({"values": True} if has_values(engine) else {})
    values = engine(**inputs).logits[..., 0]
    return mb.response_aligned(mb.at_keep(values).float())


@torch.no_grad()
def compute_values(engine, samples: list[Sample], cfg: Config, pad_id: int) -> None:
    """Each sample's values of its response positions, as its `values`."""
    for chunk in trainer_micro_batches(engine, samples, cfg, cfg.critic.micro_batch_size):
        mb = MicroBatch.build(chunk, pad_id, engine.device, engine.plan.packs)
        keep_per_sample(forward_values(engine, mb), chunk, "values")


def critic_loss(engine, mb: MicroBatch, cfg: Config, num_tokens: float, num_seqs: float):
    """The value loss of one micro-batch as its share of the mini-batch's, its metrics and its mask: the values
    regressed on the GAE `returns`, with PPO's value clipping."""
    mask = mb.mask
    values = forward_values(engine, mb)
    old = per_token(mb, "values")
    returns = per_token(mb, "returns")
    loss, stats = value_loss(values, old, returns, mask, cfg.critic.value_clip, "token_mean", num_tokens, num_seqs)
    n = mask.sum().clamp(min=1)
    stats["value_loss"] = loss.detach()
    stats["values_mean"] = (values.detach() * mask).sum() / n
    stats["returns_mean"] = (returns * mask).sum() / n
    return loss, stats, mask


def update_critic(engine, samples: list[Sample], cfg: Config, pad_id: int) -> dict[str, float]:
    """The critic's own engine's update: `ppo_epochs` passes of `updates_per_step` optimizer steps."""

    def loss(mb: MicroBatch, num_tokens: float, num_seqs: float):
        return critic_loss(engine, mb, cfg, num_tokens, num_seqs)

    size = cfg.critic.micro_batch_size or cfg.trainer.micro_batch_size
    return {f"critic/{k}": v for k, v in run_updates(engine, samples, cfg, size, loss, pad_id).items()}


def update_actor_and_critic(
    engine, samples: list[Sample], cfg: Config, pad_id: int, kl_coef: float, train_actor: bool, beside=None
) -> dict[str, float]:
    """`PolicyAndValue`'s update: each micro-batch's loss is the critic's plus (after critic.warmup_steps) the
    actor's, their gradients summed, one optimizer step per mini-batch, as many as either would take alone. The
    two adapters share no parameter, so each gets the gradient of its own loss and Adam's steps are its own; they
    are clipped together (trainer.grad_clip on the joint norm, reported as actor/grad_norm). `beside`: as
    `run_updates`."""

    def loss(mb: MicroBatch, num_tokens: float, num_seqs: float):
        total, stats, mask = critic_loss(engine, mb, cfg, num_tokens, num_seqs)
        stats = {f"critic/{k}": v for k, v in stats.items()}
        if train_actor:
            # Each pass over the base has a backward pass of its own: ZeRO-3 reduces a layer gathered whole
            # (`gather_per_layer`) once per call of it, and a second call in one backward reduced it twice. The
            # first never ends the accumulation: ZeRO-2 (a replicated base) replaced its gradients with the second's.
            boundary = engine.is_gradient_accumulation_boundary()
            engine.set_gradient_accumulation_boundary(False)
            engine.backward(total, scale_wrt_gas=False)
            engine.set_gradient_accumulation_boundary(boundary)
            total, actor_stats, _ = micro_batch_loss(
                engine, mb, cfg, num_tokens, num_seqs, kl_coef, engine.plan.old_from_update
            )
            stats |= {f"actor/{k}": v for k, v in actor_stats.items()}
        return total, stats, mask

    stats = run_updates(engine, samples, cfg, cfg.trainer.micro_batch_size, loss, pad_id, beside)
    one_engine = ("padded_frac", "grad_norm", "lr", "steps_skipped", "optimizer_seconds")
    shared = {f"actor/{k}": stats.pop(k) for k in one_engine}
    return stats | shared | {"critic/lr": engine.get_lr()[1]}
