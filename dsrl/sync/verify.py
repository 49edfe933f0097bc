"""Verification of a weight update: the servers hold exactly the trainer's weights.

Two checks: `verify_weights` compares every server parameter with the trainer's gathered one
(/get_weights_by_name: the embedded engine, Llama-family SGLang); the probe compares the
servers' logprobs of fixed probe tokens with the trainer's own forward on them (any model:
SGLang 0.5.17 has no /get_weights_by_name for Qwen2).
"""

import torch

from dsrl.serving.client import RolloutClient, ServerError
from dsrl.sync.base import SyncError
from dsrl.vision import vision_tokens
from dsrl.zero.buckets import gathered_buckets


def verify_weights(
    module: torch.nn.Module, client: RolloutClient, bucket_bytes: int, rank0: bool, merge: bool = True
) -> None:
    """Compare every server parameter with the trainer's gathered one; raise naming the first that differs.
    A LoRA model's adapters are merged into its weights unless served on their own (`merge` False: the probe
    checks those).

    Call on every rank; only rank 0 (`rank0`) asks the servers. Rank 0 raises only once every bucket
    has been gathered: the other ranks are in those all-gathers too.
    """
    problem: Exception | None = None
    for bucket in gathered_buckets(module, bucket_bytes, merge):
        for name, tensor in bucket if rank0 and problem is None else []:
            try:
                _check_parameter(client, name, tensor.detach().float().cpu())
            except (SyncError, ServerError) as e:
                problem = e
    if problem is not None:
        raise problem


def _check_parameter(client: RolloutClient, name: str, want: torch.Tensor) -> None:
    rows = want.shape[0] if want.dim() else 1
    replies = client.call_all("/get_weights_by_name", {"name": name, "truncate_size": rows})
    for url, got in zip(client.live_urls(), replies):
        got = torch.tensor(got, dtype=torch.float32)
        if got.shape != want.shape:
            raise SyncError(f"{url}: parameter {name!r} has shape {list(got.shape)}, trainer {list(want.shape)}")
        if not torch.equal(got, want):
            diff = (got - want).abs().max().item()
            raise SyncError(f"{url}: parameter {name!r} differs from the trainer's (max |diff| {diff:.3g})")


def probe_ids(vocab_size: int, sequences: int = 4, length: int = 32, seed: int = 1234) -> list[list[int]]:
    """Fixed pseudo-random token ids: the same probe for every check of a run."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (sequences, length), generator=gen).tolist()


@torch.no_grad()
def probe_reference(engine, vocab_size: int) -> tuple[list[list[int]], torch.Tensor]:
    """The probe token ids and the trainer's logprobs of them (call on every rank: a ZeRO-3 forward); a vision-language
    model's image tokens are left out (`dsrl.vision.image_probe` probes an image)."""
    special = vision_tokens(getattr(engine, "module", engine).config)
    ids = [[0 if t in special else t for t in seq] for seq in probe_ids(vocab_size)]
    tokens = torch.tensor(ids, device=engine.device)
    logits = engine(input_ids=tokens).logits[:, :-1].float()
    return ids, torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0].cpu()


async def probe_servers(
    client: RolloutClient,
    ids: list[list[int]],
    reference: torch.Tensor,
    tolerance: float,
    flush: bool = True,
    fp8: bool = False,
    image: tuple[dict, torch.Tensor] | None = None,
) -> float:
    """Compare each server's logprobs of the probe tokens with the trainer's; return the worst mean |diff|. On the
    client's loop: the trainer may go on while it runs (`client.submit`). `fp8`: the servers run FP8 layers, and
    `tolerance` allows their rounding. `image`: a vision-language model's probe of its vision tower too
    (`dsrl.vision.image_probe`): the logprobs of the text after an image, the last of the request's prompt logprobs
    (its image's positions are the server's to count).

    Prompt logprobs come from /generate with logprob_start_len=0, after /flush_cache. SGLang matches
    no cached prefix past logprob_start_len anyway (`Req._compute_max_prefix_len`), so `flush` False
    (with requests running, which SGLang's flush refuses) checks the same. The servers must hold
    their KV cache: SGLang dies generating while it is released.
    """
    if flush:
        await client.all_servers("/flush_cache")
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        **({"lora_path": client.adapter.name} if client.adapter is not None else {}),  # (the policy's, as served)
    }
    worst, checks = 0.0, [(payload, reference, 1)]
    if image is not None:  # (one more request: the image's, alone)
        checks.append(({**payload, **image[0]}, image[1][None], -len(image[1])))
    for body, want, first in checks:
        worst = max(worst, await _probe(client, body, want, first, tolerance, fp8))
    return worst


async def _probe(client: RolloutClient, payload: dict, reference, first: int, tolerance: float, fp8: bool) -> float:
    """One probe request to every live server: its prompt logprobs from `first` on against the trainer's."""
    worst, urls = 0.0, client.live_urls()
    replies = await client.all_servers("/generate", payload, urls=urls)  # those that answered, in order
    for url, outs in zip([u for u in urls if u not in client.down], replies):
        outs = outs if isinstance(outs, list) else [outs]
        got = torch.tensor([[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][first:]] for o in outs])
        diff = (got - reference).abs()
        if diff.mean() > tolerance:
            allows = ", which allows FP8's rounding (--rollout.precision fp8)" if fp8 else ""
            raise SyncError(
                f"{url}: logprobs of the probe tokens differ from the trainer's by {diff.mean():.3g} on average "
                f"(max {diff.max():.3g}, --sync.probe_tolerance {tolerance}{allows}): the server holds other weights"
            )
        worst = max(worst, diff.mean().item())
    return worst
