"""The embedded rollout engine: a CPU server answering the SGLang 0.5.17 HTTP endpoints dsrl uses.

It holds a transformers model and generates token-in/token-out with SGLang's request and
response fields, so the same client drives it and real SGLang. It is deliberately small: no KV
cache (every decode step re-runs the whole sequence), one scheduler thread that steps every
running request together (continuous batching by construction), and state kept honest --
generation waits while paused or while memory is released, weight updates are refused while the
weights are released, and `weight_version` follows the updates. Start it with
``python -m dsrl.serving.embedded --model-path DIR --port P``.
"""

import asyncio
import base64
import contextlib
import hmac
import importlib
import io
import json
import logging
import os
import pickle
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from aiohttp import web
from safetensors.torch import load_file

from dsrl import vision
from dsrl.fp8 import FP8, KV_SCALES, SCALE, dequantize, is_quantized, round_trip_activations, unflatten
from dsrl.moe import moe_blocks, split_experts
from dsrl.serving import shard_loader
from dsrl.serving.embedded_args import parse_args

log = logging.getLogger("dsrl.embedded")

SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos",
                 "skip_special_tokens", "no_stop_trim", "sampling_seed", "n"}  # fmt: skip
MEMORY_TAGS = {"weights", "kv_cache", "cuda_graph"}


class BadRequest(ValueError):
    """A request the engine refuses with HTTP 400, as SGLang does."""


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_ids: set[int]
    generator: torch.Generator | None
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    start: float = field(default_factory=time.monotonic)
    abort_message: str | None = None
    priority: int = 0
    """Higher first, as SGLang's --enable-priority-scheduling; equal priorities keep arrival order."""
    adapter: "Adapter | None" = None
    """The LoRA adapter the request named (`lora_path`), fixed when it arrives, as SGLang fixes its lora_id."""
    routed: list[torch.Tensor] | None = None
    """With `return_routed_experts`: the experts each forwarded token was routed to, [tokens, layers, top k]."""
    pixels: tuple[torch.Tensor, torch.Tensor] | None = None
    """Its images' pixel values and grids (`image_data`; `input_ids` hold their image tokens)."""

    def finish(self, finish_reason: dict, weight_version: str) -> None:
        logprobs = [[logprob, token, None] for logprob, token in zip(self.logprobs, self.output_ids)]
        meta = {"id": self.rid, "finish_reason": finish_reason, "prompt_tokens": len(self.input_ids),
                "completion_tokens": len(self.output_ids), "cached_tokens": 0, "weight_version": weight_version,
                "e2e_latency": time.monotonic() - self.start, "output_token_logprobs": logprobs}  # fmt: skip
        if self.routed is not None:  # SGLang's encoding: base64 of int32 [prompt + output - 1, layers, top k]
            rows = torch.cat(self.routed) if self.routed else torch.zeros(0, dtype=torch.int32)
            meta["routed_experts"] = base64.b64encode(rows.numpy().tobytes()).decode()
        result = {"output_ids": list(self.output_ids), "meta_info": meta}
        self.loop.call_soon_threadsafe(_resolve, self.done, result)


def _resolve(future: asyncio.Future, result: dict) -> None:
    if not future.done():
        future.set_result(result)


@dataclass
class Adapter:
    """One loaded LoRA adapter: per adapted layer, (A, B, scale)."""

    name: str
    layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]]


class Adapters:
    """LoRA adapters served as SGLang serves them: loaded from a PEFT directory by name, applied unmerged to the
    requests that name them, x W^T + (x A^T B^T) s, as PEFT computes it in the trainer, and to no other."""

    def __init__(self, model: torch.nn.Module, max_rank: int | None, targets: list[str] | None):
        self.max_rank, self.loaded = max_rank, {}  # loaded: name -> Adapter
        self.active: Adapter | None = None  # the adapter of the group of requests being stepped (scheduler thread)
        self.layers = set()
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and (not targets or name.rsplit(".", 1)[-1] in targets):
                module.register_forward_hook(self._hook(name))
                self.layers.add(name)

    def _hook(self, name: str):
        def add_adapter(module, args, out):
            lora = self.active.layers.get(name) if self.active is not None else None
            if lora is None:
                return out
            a, b, scale = lora
            return out + (F.linear(F.linear(args[0].to(a.dtype), a), b) * scale).to(out.dtype)  # (--dtype)

        return add_adapter

    def load(self, name: str, path: str) -> None:
        if name in self.loaded:
            raise BadRequest(f"Failed to load LoRA adapter {name} because it is already loaded")
        folder = Path(path)
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
            tensors = load_file(folder / "adapter_model.safetensors")
        except (OSError, ValueError) as e:
            raise BadRequest(f"cannot read the LoRA adapter at {path}: {e}") from e
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        if self.max_rank is not None and rank > self.max_rank:
            raise BadRequest(f"LoRA adapter {name} with rank {rank} is incompatible: --max-lora-rank {self.max_rank}")
        scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
        layers = {}
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            layer = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            if layer not in self.layers:
                raise BadRequest(f"LoRA adapter {name} adapts {layer!r}, which --lora-target-modules leaves out")
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            layers[layer] = (a.float(), b.float(), scale)
        self.loaded[name] = Adapter(name, layers)

    def unload(self, name: str) -> None:
        if self.loaded.pop(name, None) is None:
            raise BadRequest(f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.loaded)}")

    def named(self, name: str | None) -> Adapter | None:
        if name is None:
            return None
        if name not in self.loaded:
            raise BadRequest(f"The following requested LoRA adapters are not loaded: {name}")
        return self.loaded[name]


class Engine:
    def __init__(self, model_path: str, seed: int = 0, max_batch_tokens: int = 16384, decode_delay_ms: float = 0.0,
                 deterministic: bool = False, crash_marker: str | None = None,
                 lora: tuple[int | None, list[str] | None] | None = None, is_embedding: bool = False,
                 weights_backup: bool = False, dtype: str = "auto", return_routed_experts: bool = False,
                 custom_weight_loaders: tuple[str, ...] = ()):  # fmt: skip
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

        self.model_path, self.is_embedding, self.weights_backup = model_path, is_embedding, weights_backup
        config = AutoConfig.from_pretrained(model_path)
        # An FP8 checkpoint (`dsrl.fp8`: --rollout.precision fp8) is served as SGLang serves it, emulated: its weights
        # dequantized on arrival, each linear layer's input rounded through FP8 (transformers' FP8 path needs a GPU)
        self.fp8 = getattr(config, "quantization_config", None) is not None
        if self.fp8:
            del config.quantization_config
        torch.manual_seed(seed)
        auto = AutoModelForSequenceClassification if is_embedding else AutoModelForCausalLM  # (a reward model)
        dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
        weights = any(Path(model_path).glob("*.safetensors")) or any(Path(model_path).glob("*.bin"))
        if weights and not self.fp8:
            self.model = auto.from_pretrained(model_path, dtype=dtype)
        else:  # a config-only directory: random weights until the trainer's first sync (FP8: loaded at the end)
            self.model = auto.from_config(config, dtype=dtype)
        self.model.eval()
        self.params = dict(self.model.named_parameters())
        self.storage, self.offsets = _flatten_parameters(self.model)
        for name, view in split_experts(list(self.params.items())):  # a mixture of experts' per-expert names too
            start = view.data_ptr() - self.storage.data_ptr()
            self.params.setdefault(name, view)
            self.offsets.setdefault(name, (start, view.numel() * view.element_size()))
        for name, saved in vision.saved_names(self.model, list(self.offsets)).items():  # (a VL model's, as SGLang's)
            self.params[saved], self.offsets[saved] = self.params[name], self.offsets[name]
        self.model.dsrl_params = self.params  # (the shard loader's names)
        self._hook_forward(return_routed_experts)
        self.adapters = Adapters(self.model, *lora) if lora is not None else None
        """--enable-lora: (max rank, target layer names)."""
        self.context_len = getattr(text := config.get_text_config(), "max_position_embeddings", 1 << 30)  # (a VL's LM)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.eos_ids = _as_set(text.eos_token_id)
        with contextlib.suppress(OSError):
            self.eos_ids |= _as_set(GenerationConfig.from_pretrained(model_path).eos_token_id)
        self.pad_id = text.pad_token_id if text.pad_token_id is not None else 0
        self.generator, self.max_batch_tokens = torch.Generator().manual_seed(seed), max_batch_tokens
        self.decode_delay_s = decode_delay_ms / 1000  # emulate a slower engine (tests, benchmarks)
        self.deterministic = deterministic  # batch-invariant: each request's forward runs alone
        self.crash_marker = crash_marker  # fault injection for tests: see --crash-marker
        self.failing, self.custom_weight_loaders, self.weight_version = False, custom_weight_loaders, "default"
        self.running: list[Request] = []
        self.paused = self.stopped = False
        self.released: set[str] = set()
        self.groups: dict[str, Any] = {}
        self.cond = threading.Condition()
        self.model_lock = threading.Lock()  # a weight update never lands in the middle of a decode step
        # Updates receive in arrival order, but one may receive while the previous still loads;
        # receive buffers are reused (fresh pages cost more than the copy on small hosts).
        self.recv_lock = threading.Lock()
        self.free_buffers: dict[int, list[torch.Tensor]] = {}
        if weights and self.fp8:
            self.update_from_disk(model_path)
        self.thread = threading.Thread(target=self._loop, name="embedded-scheduler", daemon=True)
        self.thread.start()

    def _hook_forward(self, return_routed_experts: bool) -> None:
        """What SGLang's options add to the forward: FP8's rounding of each linear layer's input (an FP8 checkpoint),
        each MoE layer's routing kept for the reply (--enable-return-routed-experts)."""
        for name, module in self.model.named_modules() if self.fp8 else []:
            if isinstance(module, torch.nn.Linear) and is_quantized(f"{name}.weight", module.weight):
                module.register_forward_pre_hook(lambda module, args: (round_trip_activations(args[0]), *args[1:]))
        self.return_routed_experts, self.routing = return_routed_experts, {}  # layer -> its last forward's top k
        for layer, block in moe_blocks(self.model) if return_routed_experts else []:
            block.gate.register_forward_hook(lambda _, __, out, layer=layer: self.routing.__setitem__(layer, out[2]))

    # -- generation ---------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        with self.cond:
            self.running.append(req)
            self.cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.stopped and (self.paused or self.released or not self.running):
                    self.cond.wait()
                if self.stopped:
                    return
                batch, tokens = [], 0
                for req in sorted(self.running, key=lambda r: -r.priority):  # stable: arrival order within
                    tokens += len(req.input_ids) + len(req.output_ids)
                    if batch and tokens > self.max_batch_tokens:
                        break
                    batch.append(req)
            try:
                with self.model_lock:
                    next_ids, logprobs = self._step_by_adapter(batch)
            except BaseException:  # the server ends, as SGLang's does when its scheduler raises: the fleet sees it
                log.exception("decode step failed; the server exits")  # gone and restarts it, rather than every
                logging.shutdown()  # request hanging on a scheduler thread that is no more
                os._exit(1)
            if self.decode_delay_s:
                time.sleep(self.decode_delay_s)
            with self.cond:
                for req, tok, lp in zip(batch, next_ids, logprobs):
                    if req.abort_message is not None:
                        continue  # finished by abort while this step ran
                    req.output_ids.append(tok)
                    req.logprobs.append(lp)
                    if tok in req.stop_ids:
                        self._finish(req, {"type": "stop", "matched": tok})
                    elif len(req.output_ids) >= req.max_new_tokens:
                        self._finish(req, {"type": "length", "length": req.max_new_tokens})

    def _step_by_adapter(self, batch: list[Request]) -> tuple[list[int], list[float]]:
        """One decode step of `batch`: one forward per adapter its requests name (the base's included); deterministic,
        one per request."""
        groups: dict[int, list[int]] = {}
        for i, req in enumerate(batch):
            groups.setdefault(id(req) if self.deterministic else id(req.adapter), []).append(i)
        next_ids, logprobs = [0] * len(batch), [0.0] * len(batch)
        for members in groups.values():
            ids, lps = self._step([batch[i] for i in members])
            for i, tok, lp in zip(members, ids, lps):
                next_ids[i], logprobs[i] = tok, lp
        return next_ids, logprobs

    @torch.no_grad()
    def _step(self, batch: list[Request]) -> tuple[list[int], list[float]]:
        if self.adapters is not None:
            self.adapters.active = batch[0].adapter  # one adapter per call (_step_by_adapter)
        seqs = [req.input_ids + vision.text_only(req.output_ids, self.model.config) for req in batch]
        ids, mask = self._left_padded(seqs)  # positions count real tokens only, as the trainer's do
        logits = self._forward(ids, mask, [req.pixels for req in batch])[:, -1].float()
        if self.routing:  # a prefill's tokens, then each decode step's new one, as SGLang captures them
            shape = (self.model.config.num_hidden_layers, self.model.config.num_experts_per_tok)
            routed = torch.zeros(*ids.shape, *shape, dtype=torch.int32)
            for layer, experts in self.routing.items():
                routed[:, :, layer] = experts.view(*ids.shape, -1)
            for req, seq, row in zip(batch, seqs, routed):
                if req.routed is not None:
                    req.routed.append(row[-1:] if req.output_ids else row[ids.shape[1] - len(seq) :])
        next_ids, logprobs = [], []
        for req, row in zip(batch, logits):
            if req.top_k == 1:  # greedy, as SGLang rewrites temperature 0: unscaled logprobs
                tok = int(row.argmax())
                logprobs.append(float(torch.log_softmax(row, -1)[tok]))
            else:
                # SGLang returns log-softmax of logits / T over the full vocabulary (not renormalised by top-p/k)
                scaled = torch.log_softmax(row / req.temperature, -1)
                probs = _filter_top_k_top_p(scaled.exp(), req.top_k, req.top_p)
                tok = int(torch.multinomial(probs, 1, generator=req.generator or self.generator))
                logprobs.append(float(scaled[tok]))
            next_ids.append(tok)
        return next_ids, logprobs

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pixels: list) -> torch.Tensor:
        """The logits of left-padded rows; with images (`pixels`: each row's or None), the model's mrope positions."""
        given, positions = [p for p in pixels if p is not None], (mask.cumsum(-1) - 1).clamp(min=0)
        if not given:  # positions count real tokens only, as the trainer's do
            return self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        image = (ids == self.model.config.image_token_id).int()
        return self.model(input_ids=ids, attention_mask=mask, pixel_values=torch.cat([p for p, _ in given]),
                          image_grid_thw=torch.cat([g for _, g in given]), mm_token_type_ids=image).logits  # fmt: skip

    def _finish(self, req: Request, finish_reason: dict) -> None:
        self.running.remove(req)
        req.finish(finish_reason, self.weight_version)

    def _left_padded(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequences' ids, left-padded to the longest, and their attention mask."""
        width = max(map(len, seqs))
        ids = torch.tensor([[self.pad_id] * (width - len(seq)) + seq for seq in seqs])
        return ids, torch.tensor([[0] * (width - len(seq)) + [1] * len(seq) for seq in seqs])

    @torch.no_grad()
    def classify(self, batch: list[list[int]]) -> list[list[float]]:
        """A sequence classifier's logits at each sequence's last token, as SGLang's reward models pool (HF's own
        pooling skips trailing pad-id tokens, which a sampled response may end with)."""
        ids, mask = self._left_padded(batch)
        with self.model_lock:
            hidden = self.model.base_model(
                input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
            )
            return self.model.score(hidden.last_hidden_state[:, -1]).float().tolist()

    @torch.no_grad()
    def prompt_logprobs(self, input_ids: list[int], start: int, adapter: Adapter | None = None, pixels=None) -> list:
        """SGLang's input_token_logprobs: unscaled logprob of each prompt token given the ones before it."""
        with self.model_lock:
            if self.adapters is not None:
                self.adapters.active = adapter
            ids = torch.tensor([input_ids])
            logits = self._forward(ids, torch.ones_like(ids), [pixels])[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(input_ids[1:])[:, None])[:, 0].tolist()
        rows = [[None, input_ids[0], None]] + [[lp, tok, None] for lp, tok in zip(logprobs, input_ids[1:])]
        return rows[start:]

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "Aborted") -> int:
        with self.cond:
            # An exact id, as SGLang 0.5.17 (its HTTP layer ignores an id it does not know, e.g. a prefix)
            hits = [r for r in self.running if abort_all or (rid and r.rid == rid)]
            for req in hits:
                req.abort_message = message
                self._finish(req, {"type": "abort", "message": message})
            return len(hits)

    def lora_adapters(self) -> Adapters:
        if self.adapters is None:
            raise BadRequest("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        return self.adapters

    def make_request(self, input_ids: list[int], params: dict, rid: str, loop, lora: str | None = None,
                     routed: bool = False, image_data: list[str] | None = None) -> Request:  # fmt: skip
        adapter = self.lora_adapters().named(lora) if lora is not None else None
        pixels = None
        if image_data:  # each image's placeholder expanded, as SGLang's processor does
            if not vision.is_vision(self.model.config):
                raise BadRequest(f"image_data: the model at {self.model_path} is not a vision-language model")
            input_ids, pixels = vision.request_inputs(image_data, input_ids, self.model_path)
        elif getattr(self.model.config, "image_token_id", -1) in input_ids:  # (a batch's forward would count them)
            raise BadRequest("input_ids hold an image placeholder but the request has no image_data")
        unknown = set(params) - SAMPLING_KEYS
        if unknown:
            raise BadRequest(f"unknown sampling_params {sorted(unknown)}; allowed: {sorted(SAMPLING_KEYS)}")
        if not input_ids:
            raise BadRequest("input_ids is empty")
        outside = next((i for i, t in enumerate(input_ids) if not 0 <= t < self.vocab_size), None)
        if outside is not None:
            token, vocab = input_ids[outside], self.vocab_size
            raise BadRequest(f"input_ids[{outside}] = {token} is outside the vocabulary [0, {vocab})")
        if params.get("n", 1) != 1:
            raise BadRequest("the embedded engine supports n=1 only; send one request per sample")
        max_new = params.get("max_new_tokens") or 128
        if len(input_ids) + max_new > self.context_len:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {len(input_ids) + max_new} tokens: {len(input_ids)} tokens from the input "
                f"messages and {max_new} tokens for the completion."
            )
        temperature = float(params.get("temperature", 1.0))
        top_k = int(params.get("top_k", -1) or -1)
        if temperature < 1e-6:
            temperature, top_k = 1.0, 1
        top_p = float(params.get("top_p", 1.0))
        if not 0 < top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {top_p}.")
        stop_ids = set() if params.get("ignore_eos") else self.eos_ids | set(params.get("stop_token_ids") or ())
        seed = params.get("sampling_seed")
        return Request(
            rid=rid,
            input_ids=list(input_ids),
            max_new_tokens=max_new,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_ids=stop_ids,
            generator=torch.Generator().manual_seed(seed) if seed is not None else None,
            done=loop.create_future(),
            loop=loop,
            adapter=adapter,
            routed=[] if routed and self.return_routed_experts else None,  # (SGLang's, without its flag: none)
            pixels=pixels,
        )

    # -- control ------------------------------------------------------------------------------

    def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode must be one of abort, retract, in_place; got {mode!r}")
        with self.cond:
            self.paused = True
        if mode == "abort":
            self.abort(abort_all=True)

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def is_idle(self) -> bool:
        with self.cond:
            return not self.running

    def release_memory(self, tags: list[str] | None) -> None:
        tags = set(tags or MEMORY_TAGS)
        if tags - MEMORY_TAGS:
            raise BadRequest(f"unknown memory tags {sorted(tags - MEMORY_TAGS)}; allowed: {sorted(MEMORY_TAGS)}")
        if not self.is_idle():
            raise BadRequest("release_memory_occupation needs an idle server: requests are still running")
        with self.cond:
            self.released |= tags

    def resume_memory(self, tags: list[str] | None) -> None:
        tags = set(tags or MEMORY_TAGS)
        with self.cond:
            if tags - self.released:
                raise BadRequest(f"memory tags {sorted(tags - self.released)} were not released")
            self.released -= tags
            if "weights" in tags and not self.weights_backup:  # as SGLang's memory saver (without a CPU backup):
                with self.model_lock:  # released weights come back without their contents
                    self.storage.fill_(0xFF)  # NaN in every float dtype
            self.cond.notify_all()

    def check_weights_resident(self) -> None:
        if "weights" in self.released:
            raise BadRequest("weights are released; call /resume_memory_occupation with tags [weights] first")

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        scales = {name: tensor for name, tensor in named_tensors if name.endswith(SCALE)}
        if self.fp8:  # SGLang's KV-cache scales (`dsrl.fp8.kv_scales`): this engine keeps its KV cache unquantized
            scales |= {name: tensor for name, tensor in named_tensors if name.endswith(KV_SCALES)}
        with self.model_lock, torch.no_grad():
            for name, tensor in (item for item in named_tensors if item[0] not in scales):
                param = self.params.get(name)
                if param is None:
                    raise BadRequest(f"unknown parameter {name!r}")
                if self.fp8 and is_quantized(name, param):
                    if tensor.dtype != FP8 or name + SCALE not in scales:
                        raise BadRequest(f"{name!r} is an FP8 layer: send it in float8_e4m3fn beside its {name}{SCALE}")
                    tensor = dequantize(tensor, scales[name + SCALE])
                elif tensor.dtype == FP8:
                    raise BadRequest(f"{name!r} in FP8: not an FP8 layer of the model at {self.model_path}")
                if param.shape != tensor.shape:
                    raise BadRequest(f"parameter {name!r} has shape {list(param.shape)}, got {list(tensor.shape)}")
                param.copy_(tensor)

    def init_group(self, body: dict) -> None:
        from dsrl.collectives import init_weight_update_group

        name = body.get("group_name", "weight_update_group")
        self.groups[name] = init_weight_update_group(
            body["master_address"],
            int(body["master_port"]),
            int(body["rank_offset"]),  # tensor-parallel rank 0 is this process's only rank
            int(body["world_size"]),
            name,
            body.get("backend", "gloo"),
            timeout_s=float(body.get("timeout_s", 600)),
        )

    def destroy_group(self, name: str) -> None:
        """SGLang's /destroy_weights_update_group. A receive still waiting in the group ends with an error: a
        trainer whose broadcast failed (a peer died) asks this, or the receive would hold the weights' locks,
        and every later update and decode step, until the group's own timeout."""
        if self.groups.pop(name, None) is None:
            raise BadRequest(f"no weight update group named {name!r}")
        shard_loader.abandoned.add(name)

    def update_from_distributed(self, body: dict) -> None:
        self.check_weights_resident()
        self._maybe_crash()
        name = body.get("group_name", "weight_update_group")
        group = self.groups.get(name)
        if group is None:
            raise BadRequest(f"no weight update group named {name!r}; call /init_weights_update_group")
        names, shapes = body["names"], body["shapes"]
        dtypes = [getattr(torch, d) for d in body["dtypes"]]
        if body.get("load_format") != "flattened_bucket":  # one broadcast per tensor, in order
            tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]
            with self.recv_lock:
                self._receive(tensors, name, group)
            self.load_weights(list(zip(names, tensors)))
            return
        # One uint8 broadcast holding every tensor's bytes back to back, in `names` order (SGLang's layout).
        sizes = [torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dtypes)]
        in_place = self._storage_slice(names, dtypes, sizes)
        if in_place is not None:  # the bucket is a run of consecutive parameters: receive straight into them
            with self.recv_lock, self.model_lock:
                self._receive([in_place], name, group)
            return
        with self.recv_lock:
            free = self.free_buffers.setdefault(sum(sizes), [])
            flat = free.pop() if free else torch.empty(sum(sizes), dtype=torch.uint8)
            self._receive([flat], name, group)  # (a buffer an abandoned receive may still write to is not reused)
        try:
            self.load_weights(list(zip(names, unflatten(flat, zip(names, dtypes, shapes)))))
        finally:
            with self.recv_lock:
                self.free_buffers[sum(sizes)].append(flat)

    def _receive(self, tensors: list[torch.Tensor], name: str, group) -> None:
        """Trainer rank 0's broadcasts into `tensors`, in order, unless the group is destroyed meanwhile."""
        import torch.distributed as dist

        works = [dist.broadcast(t, group=group, group_src=0, async_op=True) for t in tensors]
        for work in works:
            while not work.is_completed():
                if self.groups.get(name) is not group:
                    raise BadRequest(f"weight update group {name!r} was destroyed while this update waited in it")
                time.sleep(0.001)
            work.wait()

    def _maybe_crash(self) -> None:
        """When a test asks for it, the server that takes the crash marker dies in the middle of a weight update
        (a crash mid-sync), or, when the marker says `fail`, fails this and every later update (a sick server)."""
        if self.crash_marker and not self.failing:
            taken = f"{self.crash_marker}.{os.getpid()}"
            try:
                os.rename(self.crash_marker, taken)  # one server takes it
            except FileNotFoundError:
                return
            self.failing = Path(taken).read_text().strip() == "fail"
            os.remove(taken)
            if not self.failing:
                log.error("crash marker %s found: exiting in the middle of a weight update", self.crash_marker)
                os._exit(1)
        if self.failing:
            raise RuntimeError(f"crash marker {self.crash_marker} said fail: this server fails every weight update")

    def update_from_tensor(self, body: dict) -> None:
        """SGLang's /update_weights_from_tensor through one of its --custom-weight-loader functions, called as SGLang
        calls it, with the model and this rank's named tensors (whose bytes travel in the request here: CUDA IPC
        handles need a GPU)."""
        self.check_weights_resident()
        self._maybe_crash()
        load_format = body.get("load_format")
        if load_format not in self.custom_weight_loaders:
            raise BadRequest(
                f"load_format {load_format!r}: not one of --custom-weight-loader {self.custom_weight_loaders}"
            )
        named = _TensorUnpickler(io.BytesIO(base64.b64decode(body["serialized_named_tensors"][0]))).load()
        module, _, function = load_format.rpartition(".")
        with self.recv_lock, self.model_lock:
            getattr(importlib.import_module(module), function)(self.model, named)

    def _storage_slice(self, names: list[str], dtypes: list, sizes: list[int]) -> torch.Tensor | None:
        start = self.offsets.get(names[0], (None,))[0]
        if start is None:
            return None
        offset = start
        for name, dtype, size in zip(names, dtypes, sizes):
            param = self.params.get(name)
            if param is None or param.dtype != dtype or self.offsets[name] != (offset, size):
                return None
            offset += size
        return self.storage[start:offset]

    def update_from_disk(self, model_path: str) -> None:
        self.check_weights_resident()
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise BadRequest(f"no *.safetensors files in {model_path}")
        for file in files:
            self.load_weights(list(load_file(file).items()))

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.abort(abort_all=True, message="server shutting down")


class _TensorUnpickler(pickle.Unpickler):
    """Named tensors pickled with their bytes, and nothing else (SGLang's SafeUnpickler allows little more)."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):  # (torch's own unpickles anything)
            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict")):
            return super().find_class(module, name)
        raise BadRequest(f"serialized_named_tensors: {module}.{name} is not a tensor's part")


def _flatten_parameters(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, tuple[int, int]]]:
    """Move every parameter into one byte buffer, in named_parameters() order (the trainer's bucket order).

    A flattened bucket of consecutive parameters then lands in place, with no copy after the receive.
    """
    named = list(model.named_parameters())
    storage = torch.empty(sum(p.numel() * p.element_size() for _, p in named), dtype=torch.uint8)
    offsets, offset = {}, 0
    for name, param in named:
        size = param.numel() * param.element_size()
        view = storage[offset : offset + size].view(param.dtype).view(param.shape)
        view.copy_(param.data)
        param.data = view
        offsets[name] = (offset, size)
        offset += size
    return storage, offsets


def _as_set(ids) -> set[int]:
    if ids is None:
        return set()
    return {ids} if isinstance(ids, int) else set(ids)


def _filter_top_k_top_p(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < probs.numel():
        kth = probs.topk(top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p * sorted_probs.sum()
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs * keep)
    return probs


# -- HTTP ---------------------------------------------------------------------------------------


def ok(**fields) -> web.Response:
    return web.json_response({"success": True, **fields})


async def body_of(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    body = await request.json()
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def require_key(api_key: str):
    """SGLang's --api-key: every request but /health carries `Authorization: Bearer <key>`, or gets a 401."""

    @web.middleware
    async def check(request: web.Request, handler):
        given = request.headers.get("Authorization", "").encode()
        if not request.path.startswith("/health") and not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        return await handler(request)

    return check


@web.middleware
async def errors(request: web.Request, handler):
    """SGLang's way to refuse a request: HTTP 400 with the reason as `message`; a failure of the engine's own is a
    500 that names it too (and its traceback goes to the server's log)."""
    try:
        return await handler(request)
    except (BadRequest, KeyError, TypeError, ValueError) as e:
        message, status = f"missing field {e}" if isinstance(e, KeyError) else str(e), 400
    except web.HTTPException:
        raise
    except Exception as e:  # noqa: BLE001 -- the caller's error names the cause, not a bare "500 Internal Server Error"
        log.exception("%s failed", request.path)
        message, status = f"{type(e).__name__}: {e}", 500
    return web.json_response({"success": False, "message": message, "error": {"message": message}}, status=status)


def request_ids(body: dict, n: int) -> list[str]:
    """One id per prompt of a /generate body, as SGLang names them."""
    rid = body.get("rid")
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, list):
        return rid
    return [f"{rid}_{i}" for i in range(n)] if n > 1 else [rid]


class Api:
    """The endpoints dsrl calls, one handler each, with SGLang 0.5.17's paths and fields."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.served_a_request = False
        self.unpaused = asyncio.Event()  # like SGLang, requests sent while paused wait outside the scheduler
        self.unpaused.set()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/generate", self.generate),
            web.post("/classify", self.classify),
            web.get("/health", self.health),
            web.get("/model_info", self.model_info),
            web.get("/server_info", self.server_info),
            web.post("/flush_cache", self.flush_cache),
            web.post("/pause_generation", self.pause_generation),
            web.post("/continue_generation", self.continue_generation),
            web.post("/abort_request", self.abort_request),
            web.post("/release_memory_occupation", self.release_memory),
            web.post("/resume_memory_occupation", self.resume_memory),
            web.post("/init_weights_update_group", self.init_weights_update_group),
            web.post("/update_weights_from_distributed", self.update_weights_from_distributed),
            web.post("/destroy_weights_update_group", self.destroy_weights_update_group),
            web.post("/update_weights_from_disk", self.update_weights_from_disk),
            web.post("/update_weights_from_tensor", self.update_weights_from_tensor),
            web.post("/update_weight_version", self.update_weight_version),
            web.post("/get_weights_by_name", self.get_weights_by_name),
            web.post("/load_lora_adapter", self.load_lora_adapter),
            web.post("/unload_lora_adapter", self.unload_lora_adapter),
        ]

    async def generate(self, request: web.Request) -> web.Response:
        """Token-in/token-out generation; a list of prompts is a batch (a list comes back)."""
        body, engine = await body_of(request), self.engine
        if "text" in body:
            raise BadRequest("the embedded engine is token-in/token-out: send input_ids, not text")
        input_ids = body.get("input_ids")
        if not input_ids:
            raise BadRequest("input_ids is required")
        batched = isinstance(input_ids[0], list)
        batch = input_ids if batched else [input_ids]
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(batch)
        if engine.released:  # SGLang's scheduler dies on this; fail loudly here so CPU tests catch the order
            raise BadRequest(f"memory {sorted(engine.released)} is released; /resume_memory_occupation first")
        await self.unpaused.wait()
        if not self.served_a_request:  # the tests check that a server joining a run was given the weights first
            self.served_a_request = True
            log.info("first /generate, under weight version %s", engine.weight_version)
        loop = asyncio.get_running_loop()
        loras = body.get("lora_path")
        loras = loras if isinstance(loras, list) else [loras] * len(batch)
        rids = request_ids(body, len(batch))
        routed = bool(body.get("return_routed_experts"))
        images = body.get("image_data")  # (a list of images a prompt, or for a batch a list of those)
        images = images if batched else [[images] if isinstance(images, str) else images]
        reqs = [engine.make_request(*args, loop, lora, routed, image)
                for *args, lora, image in zip(batch, params, rids, loras, images or [None] * len(batch))]  # fmt: skip
        for req in reqs:
            req.priority = int(body.get("priority") or 0)
            engine.submit(req)
        try:
            results = await asyncio.gather(*(req.done for req in reqs))
        except asyncio.CancelledError:  # client went away: stop generating for it
            for req in reqs:
                engine.abort(req.rid)
            raise
        for res, req in zip(results, reqs):
            if not body.get("return_logprob"):
                res["meta_info"].pop("output_token_logprobs")
            elif body.get("logprob_start_len", -1) not in (None, -1):
                start, prompt_logprobs = int(body["logprob_start_len"]), engine.prompt_logprobs
                res["meta_info"]["input_token_logprobs"] = await asyncio.to_thread(
                    prompt_logprobs, req.input_ids, start, req.adapter, req.pixels
                )
        return web.json_response(results if batched else results[0])

    async def classify(self, request: web.Request) -> web.Response:
        """A reward model's scores (`--is-embedding`): SGLang's EmbeddingReqInput in (input_ids: one sequence or a
        list), {embedding: the logits, meta_info} out per sequence."""
        body, engine, start = await body_of(request), self.engine, time.monotonic()
        if not engine.is_embedding:
            raise BadRequest("/classify needs a model served with --is-embedding")
        input_ids = body.get("input_ids")
        if not input_ids or "text" in body:
            raise BadRequest("input_ids is required (the embedded engine is token-in)")
        if engine.released:
            raise BadRequest(f"memory {sorted(engine.released)} is released; /resume_memory_occupation first")
        batched = isinstance(input_ids[0], list)
        batch = input_ids if batched else [input_ids]
        scores = await asyncio.to_thread(engine.classify, batch)
        meta = {"finish_reason": {"type": "length", "length": 0}, "weight_version": engine.weight_version}
        results = [{"embedding": score, "meta_info": {**meta, "id": rid, "prompt_tokens": len(ids),
                    "e2e_latency": time.monotonic() - start}} for score, ids, rid in
                   zip(scores, batch, request_ids(body, len(batch)))]  # fmt: skip
        return web.json_response(results if batched else results[0])

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.released:  # SGLang's /health generates a token, and its scheduler dies doing so asleep
            log.error("/health while memory %s is released: SGLang's scheduler crashes here",
                      sorted(self.engine.released))  # fmt: skip
            os._exit(1)
        return web.Response(status=200 if self.engine.thread.is_alive() else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        engine, config = self.engine, self.engine.model.config
        return web.json_response({"model_path": engine.model_path, "tokenizer_path": engine.model_path,
                                  "is_generation": not engine.is_embedding, "weight_version": engine.weight_version,
                                  "model_type": config.model_type, "architectures": config.architectures})  # fmt: skip

    async def server_info(self, request: web.Request) -> web.Response:
        engine = self.engine
        return web.json_response({"model_path": engine.model_path, "weight_version": engine.weight_version,
                                  "engine": "dsrl-embedded"})  # fmt: skip

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not self.engine.is_idle():
            return web.Response(status=400, text="Cache not flushed because there are pending requests.")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details.")

    async def pause_generation(self, request: web.Request) -> web.Response:
        self.engine.pause((await body_of(request)).get("mode", "abort"))
        self.unpaused.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.engine.resume()
        self.unpaused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await body_of(request)
        self.engine.abort(body.get("rid", ""), bool(body.get("abort_all", False)))
        return web.Response(status=200)

    async def release_memory(self, request: web.Request) -> web.Response:
        self.engine.release_memory((await body_of(request)).get("tags"))
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        self.engine.resume_memory((await body_of(request)).get("tags"))
        return web.json_response(None)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        await asyncio.to_thread(self.engine.init_group, await body_of(request))
        return ok(message="Succeeded to initialize custom process group.")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        self.engine.destroy_group((await body_of(request)).get("group_name", "weight_update_group"))
        return ok(message="Succeeded to destroy custom process group.")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await body_of(request)
        await asyncio.to_thread(self.engine.update_from_distributed, body)
        return self._weights_updated(body, "Succeeded to update parameter online.")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await body_of(request)
        await asyncio.to_thread(self.engine.update_from_disk, body["model_path"])
        return self._weights_updated(body, "Succeeded to update model weights.", num_paused_requests=0)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await body_of(request)
        await asyncio.to_thread(self.engine.update_from_tensor, body)
        return self._weights_updated(body, "Success")

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await body_of(request)
        if body.get("abort_all_requests", True):
            self.engine.abort(abort_all=True)
        version = self.engine.weight_version = str(body["new_version"])
        return ok(message=f"Weight version updated to {version}", new_version=version)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await body_of(request)
        param = self.engine.params.get(body["name"])
        if param is None:
            return web.json_response({"error": {"message": "Get parameter by name failed"}}, status=400)
        with self.engine.model_lock:
            rows = param.detach()[: int(body.get("truncate_size", 100))].tolist()
        return web.json_response(rows)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body, adapters = await body_of(request), self.engine.lora_adapters()
        await asyncio.to_thread(adapters.load, body["lora_name"], body["lora_path"])
        return web.json_response({"success": True, "loaded_adapters": {n: n for n in adapters.loaded}})

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        adapters = self.engine.lora_adapters()
        adapters.unload((await body_of(request))["lora_name"])  # requests that named it keep its weights
        return web.json_response({"success": True, "loaded_adapters": {n: n for n in adapters.loaded}})

    def _weights_updated(self, body: dict, message: str, **extra) -> web.Response:
        if body.get("weight_version") is not None:
            self.engine.weight_version = str(body["weight_version"])
            message += f" Weight version updated to {self.engine.weight_version}."
        return ok(message=message, **extra)


def build_app(engine: Engine, api_key: str | None = None) -> web.Application:
    middlewares = [require_key(api_key), errors] if api_key else [errors]
    app = web.Application(middlewares=middlewares, client_max_size=1 << 30)
    app.add_routes(Api(engine).routes())
    app.on_shutdown.append(lambda app: asyncio.to_thread(engine.stop))
    return app


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # shares a small CPU with the trainer ranks
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = Engine(args.model_path, args.seed, args.max_batch_tokens, args.decode_delay_ms,
                    args.enable_deterministic_inference, args.crash_marker,
                    (args.max_lora_rank, args.lora_target_modules) if args.enable_lora else None, args.is_embedding,
                    args.enable_weights_cpu_backup, args.dtype, args.enable_return_routed_experts,
                    tuple(args.custom_weight_loader))  # fmt: skip
    log.info("embedded engine for %s on http://%s:%d (pid %d)", args.model_path, args.host, args.port, os.getpid())
    if os.environ.get("DSRL_PARENT_PID"):
        threading.Thread(target=_exit_with_parent, args=(int(os.environ["DSRL_PARENT_PID"]),), daemon=True).start()
    # Idle connections closed after 5 s, as SGLang's uvicorn does: the client's reuse of them is tested here too
    app = build_app(engine, args.api_key)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, keepalive_timeout=5)
    logging.shutdown()  # and no teardown of torch and transformers after SIGTERM: a second of CPU that stop() waits for
    os._exit(0)


def _exit_with_parent(parent: int) -> None:
    """No orphans: when the trainer that started this server dies (even by SIGKILL), stop serving."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            log.warning("parent process %d is gone: exiting", parent)
            os._exit(0)


if __name__ == "__main__":
    main()
