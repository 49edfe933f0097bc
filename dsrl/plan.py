"""The run's plan: what start-up decided from the config and the machine (`dsrl.auto.plan`), once. Rank 0's is held by
every rank and saved beside config.yaml as plan.json; the rooms read its fields, not the config's autos. Data only."""

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Plan:
    cuda: bool
    """The trainer runs on CUDA (trainer.device; auto where torch sees a GPU)."""
    bf16: bool
    """The trainer's weights and grads in bf16 (trainer.precision; auto: on GPU), else fp32."""
    packs: bool
    """Micro-batches packed, no padding (trainer.pack_sequences; auto: on GPU), rows on CPU."""
    old_from_update: bool
    """The update's own forward pass gives the old logprobs (trainer.old_logprobs auto, where the batch gets one
    optimizer step and nothing reads them before it); then no pass computes them before it."""
    engine: str
    """The rollout engine: sglang or embedded (rollout.engine)."""
    fleet: str
    """The servers' fleet: local, ray or external (rollout.fleet)."""
    colocated: bool
    """The servers share the trainers' GPUs (rollout.placement colocate)."""
    servers_first: bool
    """The rollout servers start before the trainer loads (`train.launch_before_trainer`): disaggregated on GPUs of
    their own, started here (not Ray's or external ones), not serving LoRA adapters (they are told the trainer's
    module names). Colocated they start after it, in the memory its plan leaves."""
    params: int
    """The model's parameters, counted from its config."""
    device_memory: int
    """The memory a trainer rank's states and activations live in: its GPU's, or on CPU its share of the host's."""
    device_name: str
    """`device_memory`'s name, for the log."""
    replicated_base: bool
    """LoRA's frozen base held whole by every rank, outside ZeRO-3 (model.lora_base)."""

    @property
    def weight_bytes(self) -> int:
        """Bytes of a trainer's weight (and of its grad): 2 in bf16, 4 in fp32."""
        return 2 if self.bf16 else 4
