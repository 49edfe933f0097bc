"""The trainer's side: DeepSpeed engines, their batches, checkpoints and LoRA. Warnings that libraries raise on their
own calls, which dsrl cannot change, are filtered here, once, by message."""

import warnings

# DeepSpeed's ZeRO-3 calls torch.distributed's all_gather_into_tensor and reduce_scatter_tensor (torch 2.13: *_single)
warnings.filterwarnings("ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
# PEFT reads transformers' is_gradient_checkpointing (transformers 5: is_activation_checkpointing)
warnings.filterwarnings("ignore", r"`is_gradient_checkpointing` is deprecated")
