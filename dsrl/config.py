"""The run configuration: nested typed dataclasses, parsed by jsonargparse from YAML and CLI flags.

Every field's docstring is its ``--help`` text. This module imports no torch, so ``dsrl --help``
and config errors are instant. Cross-field checks live in :func:`validate` and are reported
together, each naming the flag, the value and what is allowed.
"""

import json
import operator
import os
import re
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from difflib import get_close_matches
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal, NoReturn

from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter, Namespace, set_parsing_settings

set_parsing_settings(docstring_parse_attribute_docstrings=True)


@dataclass
class ModelConfig:
    path: str
    """Hugging Face model directory: config.json, tokenizer and (unless init_from_config) weights."""
    init_from_config: bool = False
    """Start from random weights built from the config in `path` (from-scratch runs, tests); no weights needed."""
    trust_remote_code: bool = False
    """Passed to transformers when loading the model and tokenizer."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute each decoder layer's activations in the backward pass: memory for one more forward pass. auto:
    on a GPU, decided before each update: on when the activations of its largest micro-batch
    (`trainer.max_tokens_per_micro_batch`, or micro_batch_size x the batch's longest sample) would not fit beside
    the trainers' states in the device's memory (the GPU's; on CPU the rank's share of the host's); each change
    is logged with its numbers."""
    liger_kernel: bool = False
    """Run the trainer's RMSNorm, SwiGLU MLP and rotary embedding as liger-kernel's fused Triton kernels (`pip
    install liger-kernel`; CUDA; the model types liger patches: Llama, Qwen2/3, Mistral, Gemma, ...): fewer
    passes over the activations. The servers and the weights are unchanged."""
    freeze_vision_tower: bool = False
    """A vision-language model's vision tower (its patch embedding, blocks and merger) takes no gradient: only the
    language model trains."""
    lora_rank: int = 0
    """LoRA adapters of this rank on the actor (0: train every weight). The base is frozen: no gradients or
    optimizer states for it, the reference model is the base with the adapters off (no second engine), and
    the servers get the base with the adapters merged. RL with LoRA wants a learning rate about 10x that of
    full fine-tuning (--trainer.lr 1e-5 where full weights take 1e-6); ranks 8-64 match full fine-tuning in
    policy-gradient RL when every linear layer has an adapter."""
    lora_alpha: float | None = None
    """LoRA's scale numerator (the adapter's update is scaled by alpha / rank); default 2 x lora_rank."""
    lora_target_modules: list[str] | str = "all-linear"
    """Modules that get adapters: "all-linear" (every linear layer but the output head, MLP included), or
    names such as [q_proj, k_proj, v_proj, o_proj]."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training (0: the update's logprobs equal the log-prob pass's)."""
    lora_base: Literal["auto", "replicated", "partitioned"] = "auto"
    """Where LoRA's frozen base lives. replicated: whole on every rank, outside ZeRO-3 (no gathers, no per-layer
    hooks: the trainer runs at the GPU's speed), only the adapters in DeepSpeed's optimizer (ZeRO-2); partitioned:
    in ZeRO-3, like a full model's. auto: replicated when the base takes at most a third of a rank's device memory
    (on CPU its share of the host's); the choice is logged with its numbers."""


@dataclass
class DataConfig:
    train_path: str
    """Prompt dataset: a .jsonl or .parquet file, one prompt per row."""
    prompt_key: str = "prompt"
    """Row field holding the prompt: a string, or a list of chat messages ({role, content})."""
    answer_key: str = "answer"
    """Row field passed to the reward function as `answer` (may be absent when the reward needs none); a dotted
    key reads a nested field, e.g. `reward_model.ground_truth` in verl's parquet files."""
    max_prompt_tokens: int = 512
    """Longest prompt in tokens, after the chat template; longer ones are handled by `on_long_prompt`."""
    on_long_prompt: Literal["skip", "truncate"] = "skip"
    """Prompts over max_prompt_tokens: skip them, or keep their last max_prompt_tokens tokens (counted either way)."""
    on_bad_row: Literal["fail", "skip"] = "fail"
    """A malformed row (bad JSON, missing or mistyped prompt): stop naming it, or skip it (counted, logged)."""
    apply_chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template when it has one."""
    image_key: str = "images"
    """Row field holding a vision-language prompt's images (verl's layout): a list of paths (relative to the dataset
    file) or {bytes: ...} (parquet), one "<image>" in the prompt's text for each (docs/vision-language.md)."""
    shuffle: bool = True
    """Shuffle the prompts each epoch (seeded by `seed` and the epoch)."""


@dataclass
class RolloutConfig:
    prompts_per_step: int = 32
    """Prompts per training step, across all trainer ranks."""
    n_samples: int = 8
    """Responses sampled per prompt (the GRPO group size)."""
    max_new_tokens: int = 256
    """Longest response, in tokens."""
    temperature: float = 1.0
    """Sampling temperature; the trainer divides its logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling threshold, in (0, 1]."""
    top_k: int = -1
    """Sample from the k most likely tokens; -1 for all."""
    rollout_fn: str | None = None
    """A custom rollout in place of one `/generate` per sample: `module:function` (or, from Python, the
    function), called as `await fn(engine, prompt, sampling)` for each sample and returning a `Sample`;
    `engine.generate(input_ids, sampling)` sends one request to the servers, `engine.sample(prompt,
    sampling)` is dsrl's own rollout (docs/tutorial.md has an example). Colocated schedules only."""
    env: str | None = None
    """Multi-turn agent episodes: an environment class, `module:Class` (a `dsrl.Environment`; built in:
    `dsrl.tasks.toy:KeyLookupEnv`, `dsrl.tasks.calculator:CalculatorEnv`). Each sample is then an episode of model turns
    and the environment's observations (masked out of the loss), rewarded by the environment; limits and
    tools are `agent.*`. Unset: one response per sample, rewarded by `algorithm.reward_fn`."""
    env_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment class, e.g. {difficulty: 2}."""
    engine: Literal["auto", "embedded", "sglang"] = "auto"
    """Rollout engine dsrl starts when `server_urls` is empty: auto = SGLang on GPU, the embedded engine on CPU."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """The servers' weights. bf16: as the trainer holds them (bf16 on GPUs, fp32 on CPU). fp8: every linear layer of
    the decoder (attention and MLP projections; not embeddings, norms or the output head) in block-wise FP8, a float32
    scale per 128 x 128 block, as DeepSeek's and SGLang's FP8 checkpoints: the servers start from such a copy of the
    model (<run_dir>/fp8_model), each weight update quantizes its buckets on the trainer's devices and sends half the
    bytes of bf16, SGLang runs FP8 GEMMs (activations quantized per token, in groups of 128), and the embedded engine
    rounds weights and activations the same way. The trainer keeps its precision, so the rollouts are off-policy:
    `algorithm.off_policy` auto corrects them, and the probe's default tolerance allows FP8's rounding. External
    servers (`server_urls`) must have been started from such a checkpoint."""
    server_urls: list[str] = field(default_factory=list)
    """URLs of running SGLang servers to use instead of starting any (e.g. http://10.0.0.5:30000)."""
    fleet: Literal["auto", "local", "ray", "external"] = "auto"
    """Who runs the servers: local = subprocesses of trainer rank 0; ray = one Ray actor per server, placed on
    the Ray cluster's nodes; external = the running servers of `server_urls`; auto = external when
    `server_urls` is set, else local. Servers can join and leave a live run: `dsrl fleet add/remove`."""
    num_servers: int = 1
    """Servers dsrl starts (fleet local or ray)."""
    ray_address: str = "auto"
    """fleet ray: the cluster to join, as ray.init(address=...); auto joins the running one, or starts a local
    cluster when there is none (CPU servers only: start Ray yourself to place GPU servers)."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """fleet ray: how the servers' placement-group bundles (one per server) spread over the nodes."""
    cpus_per_server: float = 1.0
    """fleet ray: CPUs reserved per server (GPUs: tp_size each, for SGLang)."""
    host: str | None = None
    """Address the servers trainer rank 0 starts, and its fleet control endpoint, bind and are reached at. Default:
    loopback (127.0.0.1) on a one-node trainer; with --trainer.hostfile, the node's address on the route to the
    others. Servers on other nodes (Ray's, colocated ones of other trainer nodes) bind their own node's address."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer <key>` on every request to the servers and the fleet control endpoint;
    servers dsrl starts (SGLang's --api-key, the embedded engine's) require it."""
    route: Literal["group", "least_loaded"] = "group"
    """How a request picks its server: group = every sample of one prompt on the server the first went to
    (the prompt's prefix is then cached once), groups spread least loaded first; least_loaded = each request
    on its own."""
    tp_size: int = 1
    """Tensor-parallel GPUs per started SGLang server."""
    mem_fraction_static: float = 0.5
    """Fraction of GPU memory a started SGLang server takes for weights and KV cache (lower it when colocated)."""
    first_gpu: int = 0
    """First GPU of the first started server; servers take consecutive GPUs (disaggregated: after the trainer's)."""
    placement: Literal["colocate", "disaggregate"] = "colocate"
    """colocate: servers share the trainer's devices and sleep while it trains; disaggregate: their own devices."""
    max_staleness: int = 0
    """How many weight versions a trained sample may lag the trainer (0 synchronous, 1 one-step-off, k fully
    async). Generation runs ahead by at most this many batches. Colocated, 0 or 1: with 1 the next batch is
    generated while the optimizer steps, with the weights before that step (the servers keep their weights
    through the update, only their KV cache sleeps)."""
    max_ahead: int | None = None
    """Disaggregated: how many batches generation may admit ahead of the trainer (default, and at most,
    max_staleness). Lower it to keep short responses fresh while long ones may still take up to
    max_staleness versions to finish: a group is only as stale as the time it waits to be trained."""
    interrupt: Literal["wait", "abort", "partial", "pause"] = "partial"
    """In-flight requests at a weight update: wait for them, abort and restart them, abort and resume
    them from the tokens so far under the new weights (partial rollout), or pause them on the servers
    (SGLang /pause_generation, `pause_mode`) and let them go on once the new weights are in."""
    pause_mode: Literal["retract", "in_place"] = "retract"
    """With interrupt pause, SGLang's pause mode: retract frees each request's KV cache and prefills it
    again under the new weights (dsrl starts SGLang with --disable-radix-cache then, else the prefix
    cached under the old weights would be reused); in_place keeps the KV cache of the old weights."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no GRPO signal) and generate other prompts instead."""
    max_concurrency: int = 256
    """Most /generate requests in flight at once, per trainer rank."""
    request_timeout_s: float = 600.0
    """Seconds one HTTP request to a server may take before it fails."""
    startup_timeout_s: float = 300.0
    """Seconds a server this run starts may go without a new line in its log before it answers /health (its start
    may take longer while it loads, compiles and captures); an external server's to answer /health at all. With
    every server down (a lone server died), a request waits for a replacement (or an external server to answer
    again) this long, each try of a start counted on its own."""
    max_restarts: int = 3
    """Tries in a row to start a dead server's replacement before it is given up, and recoveries from every server
    down within one step (a crash loop: each replacement dies serving); then the run stops, naming the server and the
    end of its log, with a checkpoint of the last step it trained."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """Extra launch arguments for started servers, by field or flag name, e.g. {attention_backend: triton,
    fp8_gemm_backend: deep_gemm}; true adds a bare flag."""

    @property
    def fleet_kind(self) -> str:
        """`fleet` decided: auto is external with server_urls, else local."""
        return ("external" if self.server_urls else "local") if self.fleet == "auto" else self.fleet


@dataclass
class AgentConfig:
    max_turns: int = 8
    """Most model turns of an episode (stop reason max_turns)."""
    max_episode_tokens: int = 2048
    """Most tokens after the prompt, the model's and the environment's together (stop reason max_tokens);
    each model turn also stops at rollout.max_new_tokens (stop reason length)."""
    max_observation_tokens: int = 512
    """Most tokens of one tool result or observation message; longer ones are cut (`truncate_side`)."""
    truncate_side: Literal["head", "tail", "middle"] = "middle"
    """What a cut tool output or observation keeps: its head, its tail, or both ends."""
    env_workers: int = 4
    """Processes per trainer rank the environments run in: each episode's lives in one of them from its first
    turn to its last. 0: every environment in the trainer's process, as one that sets `in_process` does."""
    env_timeout_s: float = 60.0
    """Seconds one call of the environment's `step` may take; a step that fails or hangs fails the episode
    (as a reward function that fails: `algorithm.on_reward_error`), and its worker process is replaced."""
    tool_workers: int = 4
    """Processes per trainer rank that run tool calls."""
    max_parallel_calls: int = 4
    """Tool calls of one turn that run at once; more wait for a free slot."""
    tool_timeout_s: float = 30.0
    """Seconds one tool call may take; a call that raises, hangs or kills its process becomes an error
    result the model reads (counted in agent/tool_errors, agent/tool_timeouts), and the episode goes on."""
    max_tool_output_chars: int = 8192
    """Characters of a tool's output kept (printed text, then the return value), cut by `truncate_side`."""
    episode_timeout_s: float = 600.0
    """Wall-clock seconds an episode may take (stop reason deadline); its environment and tool calls get
    at most what is left of it."""


@dataclass
class TrainerConfig:
    total_steps: int = 100
    """Training steps (one rollout batch and its updates each)."""
    num_ranks: int = 2
    """Trainer ranks per node that `dsrl train` starts with DeepSpeed's node launcher (on GPUs the first visible
    ones; with --trainer.hostfile, deepspeed --num_gpus per node)."""
    hostfile: str | None = None
    """DeepSpeed hostfile for multi-node training (deepspeed --hostfile)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer runs: auto = cuda when a GPU is visible, else cpu (gloo, DS_ACCELERATOR=cpu)."""
    max_tokens_per_micro_batch: int | Literal["auto"] | None = "auto"
    """Tokens per forward/backward pass on one rank, padding included: samples are taken in order of length
    into micro-batches of rows x longest sample at most this (a longer sample goes alone), so rows of similar
    lengths share one and little is padding; every rank runs as many. auto: `micro_batch_size` x the rank's
    longest sample, the most that `micro_batch_size` padded rows could need, so it fits wherever they did
    (equal lengths give the same micro-batches; a long-tail batch, far fewer and little padding). Null:
    `micro_batch_size` rows each, in batch order. Fewer, larger micro-batches are faster (ZeRO-3 gathers every
    parameter for each one); memory grows with the tokens (3B: ~5 GB per 1,000 tokens without checkpointing)."""
    pack_sequences: bool | Literal["auto"] = "auto"
    """Pack a micro-batch's samples into one row, positions restarting per sample: no padding at all. The model's
    attention is then dsrl's (`dsrl/zero/varlen.py`): torch's flash-attention varlen kernel on CUDA in bf16, each
    sequence alone through sdpa elsewhere; not for sliding-window or soft-capped attention. auto: on CUDA, not on
    CPU. false: right-padded rows of similar lengths (`max_tokens_per_micro_batch`), the model's own attention."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass on one rank when max_tokens_per_micro_batch is null."""
    updates_per_step: int = 1
    """Optimizer steps per rollout batch (PPO mini-batches); each rank's samples are split evenly."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    old_logprobs: Literal["auto", "recompute"] = "auto"
    """The old policy's logprobs (PPO's ratio, decoupled PPO's proximal policy). auto: where the batch gets one
    optimizer step (updates_per_step 1, ppo_epochs 1, no kl_in_reward), the update's own forward pass gives them,
    detached (the ratio is 1, the gradient the same), and the pass over the batch before the update is saved (11-15%
    of a step at 1.5B and 3B: docs/history.md); recompute: always that pass. (Either way, policy_loss bypass_mode
    takes the engine's, and advantage optimal_token_baseline has the pass.)"""
    lr: float = 1e-6
    """Peak learning rate."""
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate decay after warm-up."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    min_lr_ratio: float = 0.0
    """Final learning rate of cosine/linear decay, as a fraction of `lr`."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Parameter and compute precision: auto = bf16 on GPU, fp32 on CPU."""
    offload_optimizer: bool = False
    """Keep optimizer states in CPU memory (ZeRO-Offload): DeepSpeed's CPU Adam steps them on the host."""
    offload_optimizer_ratio: float = 1.0
    """With offload_optimizer, the share of the optimizer states (fp32 master weights, Adam's moments, fp32 grads:
    16 bytes per trained parameter) kept on the host; the rest stays on the GPU and steps there (DeepSpeed's
    partial offload, ZeRO-3). Below 1 when the host cannot hold them all: the start-up check names the share
    that fits."""
    gather_per_layer: bool = True
    """ZeRO-3 gathers and releases each decoder layer's parameters at once (DeepSpeed leaf modules: the model's
    `_no_split_modules` classes), one set of hooks per layer instead of one per submodule: the hooks' host-side
    work bound the update at 3B (2.9x the tokens/s on a long-tail batch, one H200). With LoRA the adapters are
    gathered with their layer (PEFT's adapted layer is five modules, each hooked alone otherwise). false: per
    submodule, DeepSpeed's default."""
    offload_states: Literal["auto", "always", "moments", "never"] = "auto"
    """Colocated on GPUs: what of the trainers' states moves to CPU while the servers generate. always: the
    optimizer states, fp32 master weights, grads and parameters; moments: of Adam's two moments (8 bytes per
    trained parameter) as many as the servers need (a third at 7B on one H200), so the optimizer still steps on the
    GPU (verl's way, which moves them all); never. auto decides at start-up (and prints why) from the GPU's memory,
    the states' size and the servers' mem_fraction_static: nothing moves when all fit, else moments when that is
    enough, else always."""
    max_bad_steps: int = 3
    """Steps in a row with non-finite logprobs, advantages or gradients (each skipped) before the run stops."""


@dataclass
class SyncConfig:
    type: Literal["auto", "ipc", "broadcast", "disk"] = "auto"
    """Checkpoint-engine transport: ipc (CUDA IPC, colocated GPUs), broadcast (NCCL on GPU, gloo on CPU),
    disk (safetensors on shared storage); auto = ipc when colocated on GPUs, else broadcast."""
    bucket_bytes: int | None = None
    """Bytes of gathered parameters sent per bucket; a larger tensor travels alone. None (auto): 1 GiB on GPUs,
    where each bucket costs SGLang a request and a load (a 7B sync over NCCL: 80 ms in 1 GiB buckets, 244 ms in
    256 MiB), 256 MiB on CPU. The trainer keeps 3 buckets' worth of buffers (the server one for NCCL). CUDA IPC
    with one trainer rank ignores it: the whole model is one bucket."""
    verify: Literal["off", "weights", "probe"] = "off"
    """Check every sync: weights = each server parameter equals the trainer's (embedded engine, Llama-family
    SGLang); probe = the servers' logprobs of fixed probe tokens match the trainer's forward (any model)."""
    verify_every: int = 1
    """Verify every N syncs (the first and the last always): the probe's forward and requests cost more than a
    small model's sync (timing/sync_verify)."""
    probe_tolerance: float | None = None
    """Largest mean |logprob difference| a probe accepts; default 0.05 (bf16 kernels differ by ~1e-2; a random-init
    7B on an H200 reads 0.050, and 0.055 with --model.liger_kernel, whose kernels are not SGLang's: raise it there),
    and 0.3 with --rollout.precision fp8, which allows FP8's rounding (the CPU toy, its FP8 emulated, read at most
    0.083 and 0.105 over two 200-step runs, growing as it trained; the GPU's: docs/benchmarks/fp8.md)."""
    timeout_s: float = 300.0
    """Seconds a weight-update group set-up or one bucket's transfer may take; one that does not fail by then is
    tried again after the fleet is healed. A wait stuck past it in NCCL ends the run, every process of it, with a
    line naming the wait and the servers; so does a whole update past three times it and 30 s (its tries)."""
    disk_dir: str | None = None
    """Directory the disk transport writes to; must be readable by every server. Default: <run_dir>/weights."""
    master_address: str | None = None
    """Address the servers reach trainer rank 0 at for the broadcast weight-update group. Default: 127.0.0.1
    when every server is on loopback, else this machine's address on the interface that routes to them."""
    senders: Literal["auto", "rank0", "all"] = "auto"
    """Who sends the broadcast's bytes. rank0: trainer rank 0 gathers each bucket and broadcasts it. all: every
    trainer rank broadcasts its own ZeRO-3 partition, in a weight-update group of its own, all at once, so every
    trainer node's link carries its share and nothing is gathered; the servers assemble it with dsrl's custom weight
    loader (dsrl starts them with it; start external ones with --custom-weight-loader dsrl.serving.shard_loader.load).
    auto: all with --sync.delta, else rank0: on one host, where every rank shares the loopback, all only adds copies
    (a 0.5B bf16 model, 2 CPU ranks, 2 servers: 2.6 s against 1.4 s, tools/bench_sync_nodes.py); its case is
    several trainer nodes, each with a link of its own."""
    delta: bool = False
    """Send only the words that changed since the last sync: each trainer rank keeps a host copy of its partition
    as last sent and sends the changed 2-byte words' positions and values (6 bytes each; all its words where a third
    or more changed), each bucket with a checksum the servers compare after applying it (a mismatch: one line, and
    every weight again in full). Pays where links are slow and few words change a step: the toy in bf16 changed 1.9 %
    of its words a step at lr 1e-6 (6 % of a full sync's bytes), 95 % at its 3e-3, and 97 % in fp32. Costs a copy of
    the partition on the host and, each sync, a pass over the weights on both sides (on one CPU host it is slower than
    a full sync). Needs --sync.senders all (auto) and servers that keep their weights between syncs (disaggregated)."""
    delta_full_every: int = 50
    """With --sync.delta, every weight in full every N versions; also at the first sync, after any change of the fleet
    (a join, a death), after a failed update, and whenever a bucket's checksum failed on a server."""
    lora: Literal["auto", "adapter", "merged"] = "auto"
    """With --model.lora_rank, what each update sends. adapter: the base once, then the adapter alone (megabytes),
    served by the servers' LoRA support (dsrl starts them with it) and named in every request; its files go
    through disk_dir unless colocated on GPUs (CUDA IPC). merged: every weight with its adapter merged in (any
    engine or layer). auto: merged over CUDA IPC (a colocated full sync is a zero-copy handle, and SGLang
    decodes the merged model ~2x faster than base + adapter on an H200), adapter over broadcast and disk,
    except to external servers (dsrl cannot enable their LoRA support) or servers on other machines (they
    may not read disk_dir)."""


@dataclass
class RolloutCorrectionConfig:
    is_level: Literal["none", "token", "sequence"] = "none"
    """Importance weights w = pi / mu, the trainer's (old, proximal) probability of each sampled token over the engine's
    (the behaviour policy that sampled it): per token, or per sequence (the product over its model tokens; Liu et al.
    2025, "When Speed Kills Stability"); none: no weights. They multiply PPO's per-token loss, as verl's rollout_is."""
    is_mode: Literal["truncate", "mask"] = "truncate"
    """truncate: w clamped to [is_low, is_high] (TIS, Yao et al. 2025); mask: w where it is inside, 0 outside (MIS)."""
    is_low: float = 0.0
    """Lower threshold of w (0: none)."""
    is_high: float = 2.0
    """Upper threshold of w."""
    rejection: dict[str, float | list[float]] = field(default_factory=dict)
    """Rejection masks, chained (a token is kept only if every one keeps it), by verl's names: token_k1/k2/k3,
    seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3, each with its threshold, e.g. {token_k1: [0.5, 2], seq_max_k3:
    0.1}. k1 = log(mu / pi), k2 = (log w)^2 / 2, k3 = w - 1 - log w per token; token_ tests each token, seq_ the sum,
    mean or max over its sequence's model tokens (rejecting the whole sequence). A k1 threshold is ratio bounds [low,
    high], or one number U for [1/U, U]; a k2 or k3 one an upper bound."""
    icepop: bool = False
    """IcePop (Ring-1T, 2025): tokens whose w lies outside icepop_bounds leave the loss."""
    icepop_bounds: tuple[float, float] = (0.5, 5.0)
    """IcePop's [low, high] of w."""
    geo_mask: bool = False
    """Geometric sequence mask (SkyRL): sequences whose geometric mean of w lies outside geo_mask_bounds leave the
    loss."""
    geo_mask_bounds: tuple[float, float] = (0.99, 1.01)
    """The geometric mask's [low, high]."""
    opsm: bool = False
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv:2512.02556; slime's --use-opsm): a token with a negative
    advantage leaves the loss when its sequence's mean log(mu / pi_current) over its model tokens, the current policy's
    divergence from the sampler's, exceeds opsm_delta."""
    opsm_delta: float = 1e-4
    """OPSM's threshold delta."""

    def enabled(self) -> bool:
        return self.is_level != "none" or bool(self.rejection) or self.icepop or self.geo_mask or self.opsm


@dataclass
class AlgorithmConfig:
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae", "remax",
                       "opo", "gpg", "grpo_passk", "gdpo", "optimal_token_baseline"] = "grpo"  # fmt: skip
    """Advantage estimator. grpo: rewards normalised within each prompt's group (Shao et al. 2024,
    arXiv:2402.03300). dr_grpo: group-centred, not divided by the std; use it with loss_agg
    seq_mean_token_sum_norm (Liu et al. 2025, arXiv:2503.20783). rloo: the mean of the group's other
    samples as baseline (Ahmadian et al. 2024, arXiv:2402.14740). reinforce_plus_plus: each token's
    return, whitened over the batch (Hu 2025, arXiv:2501.03262); reinforce_plus_plus_baseline: the group
    mean subtracted first. gae: PPO with a critic (`critic.*`), generalized advantage estimation
    (Schulman et al. 2016, arXiv:1506.02438), whitened over the batch. remax: the return less the reward of one
    greedy response per prompt, generated with its group (Li et al. 2023, arXiv:2310.10505). opo: the group's
    length-weighted mean reward as baseline (Hao et al. 2025, arXiv:2505.23585). gpg: group-centred, times the
    batch's samples over those with a nonzero reward (Chu et al. 2025, arXiv:2504.02546). grpo_passk: only the
    group's best sample has an advantage, its lead over the second (Tang et al. 2025, arXiv:2503.19595). gdpo:
    the reward model's and the rule's rewards group-normalised each on its own, weighted by reward_model.w_model and
    w_rule, summed and whitened (Liu et al. 2026, arXiv:2601.05242). optimal_token_baseline: a baseline per token,
    the group's returns weighted by each sample's accumulated sum of (1 - 2p + sum p^2) (Li et al. 2025, verl's OTB;
    the old logprobs pass computes sum p^2)."""
    norm_adv_by_std: bool = True
    """grpo: divide group-centred rewards by the group's standard deviation (false is dr_grpo's advantage)."""
    policy_loss: Literal["ppo", "gspo", "cispo", "dppo_tv", "dppo_kl", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean",
                         "dro", "bypass_mode"] = "ppo"  # fmt: skip
    """ppo: PPO-clip per token (Schulman et al. 2017, arXiv:1707.06347). gspo: the sequence's ratio (the
    geometric mean of its tokens'), clipped per sequence (Zheng et al. 2025, arXiv:2507.18071; use small
    clips, e.g. 3e-4 / 4e-4, and loss_agg seq_mean). cispo: REINFORCE weighted by the clipped,
    stop-gradient ratio, so no token's gradient is dropped (MiniMax-M1, arXiv:2506.13585). dppo_tv, dppo_kl:
    a token is masked once its probability moved more than clip_low / clip_high in total variation or binary KL,
    the rest weighted by the ratio truncated at clip_ratio_c (Qi et al. 2026, arXiv:2602.04879; its clips: 0.15 tv,
    0.05 kl). sapo: a soft sigmoid gate of the ratio instead of the clip, tau_pos / tau_neg (Gao et al. 2025,
    arXiv:2511.20347; loss_agg seq_mean). gpg: -A log pi, no ratio (Chu et al. 2025, arXiv:2504.02546). clip_cov,
    kl_cov: PPO whose tokens of highest advantage-logprob covariance lose their gradient, or (no clip) get a KL
    penalty (Cui et al. 2025, arXiv:2505.22617). geo_mean: GMPO, the geometric mean of token ratios clipped in log
    space (Zhao et al. 2025, arXiv:2507.20673; clips 0.4). dro: -A log pi plus dro_beta / 2 (log ratio)^2
    (Richemond et al. 2024, arXiv:2405.19107). bypass_mode: ppo against the engine's logprobs as the old policy, no
    pass recomputes them (verl's bypass mode, loss_type ppo_clip)."""
    clip_low: float = 0.2
    """Clip range below 1: ratios under 1 - clip_low are clipped."""
    clip_high: float = 0.2
    """Clip range above 1 (raise it for DAPO's clip-higher, Yu et al. 2025, arXiv:2503.14476)."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip PPO (Ye et al. 2020, arXiv:1912.09729): a token with a negative advantage costs at most
    -A * clip_ratio_c, however large its ratio (a stale token's could be 1e8); null disables. Must be > 1. dppo_*:
    the cap of their importance weight (the paper recommends a large one)."""
    tau_pos: float = 1.0
    """sapo: the gate's temperature for tokens with a positive advantage (larger: closer to a hard clip)."""
    tau_neg: float = 1.05
    """sapo: the gate's temperature for the other tokens."""
    cov_ratio: float = 2e-4
    """clip_cov, kl_cov: the share of a micro-batch's tokens whose gradient is dropped or given the KL penalty."""
    clip_cov_bounds: tuple[float, float] = (1.0, 5.0)
    """clip_cov: the covariance range its tokens are drawn from."""
    kl_cov_coef: float = 0.1
    """kl_cov: the weight of |log ratio| on its tokens."""
    dro_beta: float = 0.05
    """dro: the weight of the quadratic log-ratio penalty."""
    loss_agg: Literal["token_mean", "seq_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """Loss aggregation: token_mean = mean over every response token of the mini-batch, on all ranks (DAPO's
    token-level loss); seq_mean = mean over sequences of each one's token mean; seq_mean_token_sum_norm =
    each sequence's token sum / max_new_tokens, averaged over sequences (Dr. GRPO: no length bias)."""
    gamma: float = 1.0
    """Discount of future rewards per token (gae, reinforce_plus_plus)."""
    lam: float = 0.95
    """GAE's lambda: bias (0) against variance (1) of the advantage."""
    kl_coef: float = 0.0
    """Weight of KL(policy || reference); 0 skips the reference model (unless kl_target is set)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator of the loss term: k1 = log-ratio, k2 = half squared log-ratio, k3 = low-variance (exp(-r) - 1
    + r). Folded into the reward (kl_in_reward) it is always k1, as PPO's."""
    kl_in_reward: bool = False
    """Fold the KL into each token's reward (PPO/RLHF style, Ouyang et al. 2022) instead of a loss term."""
    kl_target: float | None = None
    """Adapt kl_coef toward this KL per token (Ziegler et al. 2019, arXiv:1909.08593); null: kl_coef is fixed."""
    kl_horizon: int = 10000
    """Adaptive KL: the controller's horizon in steps (larger: slower)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus; entropy is always logged."""
    off_policy: Literal["auto", "none", "decoupled", "tis"] = "auto"
    """Correction for samples the engine drew from older or slightly different weights: decoupled PPO
    (weight by trainer/engine probability ratio, drop tokens above is_cap; Hilton et al. 2022,
    arXiv:2110.00641) or truncated importance sampling (the same ratio clamped at is_cap; Yao et al. 2025).
    auto: tis with --rollout.precision fp8 (FP8 rollouts are off-policy by construction) and the ppo policy loss,
    unless rollout_correction is set, else none. decoupled and tis are rollout_correction's token-level weights,
    is_high is_cap (mask and truncate); the two cannot be set together."""
    is_cap: float = 2.0
    """Cap C of the importance weight exp(trainer logprob - engine logprob)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Off-policy correction between the trainer's logprobs and the engine's (FP8 rollouts, async staleness), on every
    schedule: importance weights and rejection masks, composed (`--algorithm.rollout_correction.*`). Metrics under
    actor/rollout_corr/: each level's (token, seq) share of model tokens masked, weights' mean, max and effective
    sample size (mean(w)^2 / mean(w^2))."""
    mask_truncated: bool = False
    """Responses cut by rollout.max_new_tokens (finish reason length; an episode's last turn) add no loss, and leave
    the loss's denominators (TRL's mask_truncated_completions); they still count in their group's baseline. Their
    share: actor/masked_truncated_frac."""
    routing_replay: bool | None = None
    """A mixture-of-experts model: the trainer's forward passes route each token to the experts the rollout
    engine routed it to ("R3"; the router's softmax still weighs them), so a router that would pick others does
    not add to the training/rollout mismatch (moe/routing_mismatch_frac: how often it would). None (the default):
    on for such a model; true on a dense model is an error."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476): responses longer than
    max_new_tokens - overlong_buffer lose up to overlong_penalty, linearly; 0 disables."""
    overlong_penalty: float = 1.0
    """The reward lost by a response of max_new_tokens tokens (overlong_buffer > 0)."""
    reward_fn: str = "dsrl.rewards:math_reward"
    """Reward function as module:function, called as fn(prompt, response, answer) -> float (with `row=`, the
    dataset row, when it takes it; async, or batched with @dsrl.rewards.batched), or verl's
    compute_score(data_source, solution_str, ground_truth, extra_info) as it is. From Python (`dsrl.train`),
    the function itself."""
    reward_workers: int = 2
    """Processes the reward function runs in, per trainer rank, each call with a timeout: a reward that
    hangs or kills its process fails its row, not the run. 0: in the trainer's process (no timeout)."""
    reward_timeout_s: float = 60.0
    """Seconds one call of the reward function may take (reward_workers > 0)."""
    on_reward_error: Literal["fail", "skip"] = "fail"
    """A reward that raises, times out, kills its process or returns no finite number: stop the run naming
    the row, or skip the row's group (its tokens leave the loss; counted in reward/failed)."""


@dataclass
class CriticConfig:
    path: str | None = None
    """Weights of the value model (a Hugging Face directory of the policy's architecture); default: the
    policy's (model.path), with a fresh scalar head. With --model.lora_rank there is no second model: the
    critic is a second adapter and a fresh scalar head on the actor's frozen base, in the actor's engine."""
    lr: float = 1e-5
    """The critic's peak learning rate (with LoRA its adapter's and head's: as for the actor, ~10x full
    fine-tuning's)."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward of the critic on one rank; default trainer.micro_batch_size (with LoRA
    always: the critic's loss joins the actor's in one backward pass)."""
    warmup_steps: int = 0
    """Steps at the start in which only the critic is trained (the actor waits for sensible values)."""
    value_clip: float | None = 0.2
    """Clip the new values to the old ones +-value_clip in the loss (PPO's value clipping); null disables."""


@dataclass
class RewardModelConfig:
    path: str | None = None
    """A reward model scoring every response (unset: rewards come from `algorithm.reward_fn` alone): a Hugging Face
    sequence classifier with one label (*ForSequenceClassification, *ForRewardModel), served by SGLang with
    --is-embedding (its /classify endpoint; the embedded engine on CPU); or, with `judge_template`, a causal LM
    that judges each response (/generate, greedy and seeded) and `judge_parse_fn` turns its text into a number."""
    server_urls: list[str] = field(default_factory=list)
    """Running servers of that model to use instead of starting any (`path` still gives its tokenizer)."""
    num_servers: int = 1
    """Servers dsrl starts for it: beside the rollout servers on their GPUs (colocated: it sleeps and wakes with
    them, and the memory planner counts it), or on GPUs of its own from `first_gpu` (disaggregated)."""
    first_gpu: int = 0
    """GPU of the first started server; servers take consecutive GPUs."""
    mem_fraction_static: float = 0.2
    """Fraction of GPU memory a started SGLang server takes for its weights and KV cache."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """Extra launch arguments for its started servers, as rollout.server_args."""
    w_model: float = 1.0
    """reward = w_model * the model's score (+ w_rule * the rule reward)."""
    w_rule: float | None = None
    """Weight of `algorithm.reward_fn`'s reward (or the environment's) beside the model's; null: it is not computed.
    0 computes and logs it (reward/rule_mean) without training on it."""
    normalize: Literal["none", "running"] = "none"
    """The model's scores as they are, or minus their running mean over the run, divided by its running std
    (checkpointed); reward/model_mean logs them raw."""
    timeout_s: float = 60.0
    """Seconds one group's request may take; a failure follows `algorithm.on_reward_error`."""
    max_length: int | None = None
    """Most tokens scored per response, prompt included (default: the model's context); longer ones are cut at
    `truncate_side`."""
    truncate_side: Literal["left", "right"] = "left"
    """What a cut conversation loses: its start (left; a reward model reads the score at its last token) or end."""
    input: Literal["auto", "token_ids", "text"] = "auto"
    """What the reward model reads: token_ids = the policy's prompt and response tokens as they are (the vocabularies
    must match); text = prompt and response re-rendered with the reward model's chat template and tokenizer;
    auto = token_ids when the two tokenizers' vocabularies match, else text."""
    judge_template: str | None = None
    """Makes `path` a judge: its prompt, with {prompt}, {response} and {answer} filled in (its chat template
    applied when it has one)."""
    judge_parse_fn: str = "dsrl.rewards.rules:extract_final_number"
    """The judge's verdict as a number: `module:function`, called as fn(text) -> float."""
    judge_max_new_tokens: int = 16
    """Longest verdict, in tokens."""


@dataclass
class DistillConfig:
    teacher_path: str | None = None
    """On-policy distillation (Agarwal et al. 2024, arXiv:2306.13649): a teacher (a Hugging Face causal LM with the
    policy's tokenizer) scores each group of the student's samples as it completes, its logprobs of the sampled tokens
    (the prompt logprobs of prompt + response); each model token's advantage is -coef * (student logprob - teacher
    logprob), the per-token reverse KL, with the engine's logprob as the student's (the sampling policy's). Served
    like the reward model: SGLang (the embedded engine on CPU), beside the rollout servers or on GPUs of its own."""
    coef: float = 1.0
    """Weight of the reverse KL in the advantage."""
    with_reward: bool = False
    """false: the reverse KL alone is the advantage (the reward is still computed and logged); true: it is added to
    `algorithm.advantage`'s advantages."""
    server_urls: list[str] = field(default_factory=list)
    """Running servers of the teacher to use instead of starting any (teacher_path still gives its tokenizer)."""
    num_servers: int = 1
    """Servers dsrl starts for it."""
    first_gpu: int = 0
    """GPU of its first started server (that of the rollout servers colocated: it sleeps and wakes with them)."""
    mem_fraction_static: float = 0.2
    """Fraction of GPU memory a started SGLang server of it takes."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """Extra launch arguments for its started servers, as rollout.server_args (not inherited from them: where SGLang
    needs e.g. attention_backend triton, give it here too)."""
    timeout_s: float = 60.0
    """Seconds one group's request may take; a failure follows `algorithm.on_reward_error`."""


@dataclass
class EvalConfig:
    path: str | None = None
    """Held-out prompts (.jsonl, .json or .parquet, the fields of data.train_path) scored with the reward
    function under the weights the servers hold after a sync; unset: no evaluation."""
    every: int = 0
    """Evaluate every N steps (0: only at the end). With a path set, the run always ends with an
    evaluation of its final weights."""
    before_train: bool = False
    """Also evaluate the starting weights, before the first step (logged at that step)."""
    n_samples: int = 1
    """Responses per prompt (above 1, eval/reward_best_mean adds each prompt's best)."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""
    max_new_tokens: int | None = None
    """Longest response in tokens; default rollout.max_new_tokens (a row's sampling_params still win)."""


@dataclass
class LoggingConfig:
    run_dir: str = "runs/dsrl"
    """Directory for the resolved config, tensorboard events, checkpoints, server logs and the exported model."""
    tensorboard: bool = True
    """Write tensorboard event files (rank 0) under <run_dir>/tensorboard."""
    trackers: list[Literal["wandb", "mlflow"]] = field(default_factory=list)
    """Trackers besides tensorboard, through accelerate's tracker layer, with the same tags: wandb (offline with
    WANDB_MODE=offline, files under <run_dir>/wandb), mlflow (MLFLOW_TRACKING_URI, default a SQLite file,
    <run_dir>/mlflow.db)."""
    project: str = "dsrl"
    """The trackers' project (wandb) or experiment (mlflow) name."""
    run_name: str | None = None
    """The trackers' run name; default: the run directory's name."""
    log_generations: int = 4
    """Sampled training generations logged per step (prompt, response, reward, weight version): to
    <run_dir>/generations.jsonl, tensorboard text and a wandb table; 0 disables."""
    save_every: int = 0
    """Write a DeepSpeed checkpoint every N steps (0: never) under <run_dir>/checkpoints/step_<N>."""
    keep_last: int = 2
    """Checkpoints to keep; older ones are deleted after a new one is complete (0 keeps all)."""
    resume: str = "auto"
    """auto: continue from <run_dir>/checkpoints/latest when there is one; never: start over; or a
    checkpoint directory to start from."""
    save_on_signal: bool = True
    """On SIGTERM or SIGINT to `dsrl train` (a job scheduler's stop, Ctrl-C): finish the step, write a checkpoint
    and stop; the same command resumes. A second signal stops at once."""
    stop_timeout_s: float = 600.0
    """`dsrl train`: seconds a signalled run has to finish its step and checkpoint before every process of it is
    killed."""
    export_hf: bool = True
    """At the end, export the actor as a Hugging Face model (safetensors + config + tokenizer) to <run_dir>/hf."""
    log_level: Literal["DEBUG", "INFO", "WARNING"] = "INFO"
    """Logging level of dsrl's own loggers."""


@dataclass
class Config:
    model: ModelConfig
    """The policy model."""
    data: DataConfig
    """Prompt data."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation: servers, sampling, batch shape."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn episodes (with --rollout.env): limits, tools, deadlines."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """DeepSpeed ZeRO-3 training."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Checkpoint engine: how weights reach the servers."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, policy loss, KL."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model, used with --algorithm.advantage gae."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A reward model or an LLM judge, served beside the rollouts."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation: a teacher's logprobs of the student's tokens."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation of the policy on held-out prompts."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Outputs of the run."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""


class DatasetError(ValueError):
    """A dataset that cannot be used, with the file and row at fault (defined here: `data` and `vision` raise it)."""


class ConfigError(ValueError):
    """One or more invalid settings, all reported at once."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        plural = "s" if len(errors) > 1 else ""
        super().__init__(f"{len(errors)} config error{plural}:\n" + "\n".join(f"  {e}" for e in errors))


PROBE_TOLERANCE = {"bf16": 0.05, "fp8": 0.3}
"""`sync.probe_tolerance`'s default for each --rollout.precision."""

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk", "gdpo",
                    "optimal_token_baseline")  # fmt: skip
"""Advantage estimators whose baseline is the prompt's group: they need n_samples >= 2."""


def eval_rollout(cfg: Config) -> RolloutConfig:
    """The sampling of an evaluation: `eval.*` over `rollout.*`. Its requests are never interrupted."""
    e = cfg.eval
    return replace(
        cfg.rollout,
        n_samples=e.n_samples,
        temperature=e.temperature,
        max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
        interrupt="wait",
    )


def critic_on_actor_base(cfg: Config) -> bool:
    """PPO with LoRA: the critic is a second adapter and a value head on the actor's base, not a model of its own."""
    return cfg.algorithm.advantage == "gae" and cfg.model.lora_rank > 0


def critic_of_its_own(cfg: Config) -> bool:
    """PPO without LoRA: the critic is a model of its own, as large as the actor and trained too."""
    return cfg.algorithm.advantage == "gae" and not critic_on_actor_base(cfg)


BOUNDS = {
    ">= 1": "rollout.num_servers rollout.tp_size rollout.max_concurrency rollout.max_restarts trainer.total_steps "
    "trainer.micro_batch_size trainer.updates_per_step trainer.ppo_epochs trainer.max_bad_steps algorithm.kl_horizon "
    "algorithm.is_cap sync.verify_every sync.delta_full_every eval.n_samples agent.max_turns agent.max_episode_tokens "
    "agent.max_observation_tokens agent.tool_workers agent.max_parallel_calls agent.max_tool_output_chars",
    "> 0": "data.max_prompt_tokens rollout.prompts_per_step rollout.max_new_tokens rollout.cpus_per_server trainer.lr "
    "algorithm.tau_pos algorithm.tau_neg algorithm.cov_ratio algorithm.dro_beta algorithm.reward_timeout_s critic.lr "
    "sync.timeout_s logging.stop_timeout_s agent.env_timeout_s agent.tool_timeout_s agent.episode_timeout_s",
    ">= 0": "rollout.max_staleness algorithm.clip_high algorithm.kl_coef algorithm.overlong_penalty "
    "algorithm.kl_cov_coef critic.warmup_steps logging.save_every logging.log_generations",
}
"""The fields whose one rule is a lower bound, by rule: `validate` checks them first, each as `--flag=value: must be
>= 1`; the other checks say what else a value allows."""


def validate_bounds(cfg: Config, check) -> None:
    for rule, flags in BOUNDS.items():
        op, bound = rule.split()
        for flag in flags.split():
            value = operator.attrgetter(flag)(cfg)
            check((operator.ge if op == ">=" else operator.gt)(value, int(bound)), flag, value, f"must be {rule}")


def validate(cfg: Config, world: int | None = None, check_paths: bool = True) -> None:
    """Raise ConfigError listing every cross-field problem; `world` is the real world size when known.

    `check_paths=False` skips the checks that files exist (for configs meant for another machine).
    """
    errors: list[str] = []

    def check(ok: bool, flag: str, value: Any, allowed: str) -> None:
        if not ok:
            errors.append(f"--{flag}={value!r}: {allowed}")

    r, t, a, s, e = cfg.rollout, cfg.trainer, cfg.algorithm, cfg.sync, cfg.eval
    validate_bounds(cfg, check)
    datasets = [("data.train_path", cfg.data.train_path)] + ([("eval.path", e.path)] if e.path else [])
    if check_paths:
        has_config = (Path(cfg.model.path) / "config.json").is_file()
        check(has_config, "model.path", cfg.model.path, "must be a directory with config.json")
        for flag, path in datasets:
            check(Path(path).is_file(), flag, path, "file not found")
    for flag, path in datasets:
        check(path.endswith((".jsonl", ".json", ".parquet")), flag, path, "must end in .jsonl, .json or .parquet")
    m = cfg.model
    check(0 < t.offload_optimizer_ratio <= 1, "trainer.offload_optimizer_ratio", t.offload_optimizer_ratio,
          "must be in (0, 1]")  # fmt: skip
    if m.liger_kernel:
        check(find_spec("liger_kernel") is not None, "model.liger_kernel", True, "liger-kernel is not installed")
        check(t.device != "cpu", "model.liger_kernel", True, "its kernels run on CUDA (--trainer.device cpu)")
    check(m.lora_rank >= 0, "model.lora_rank", m.lora_rank, "must be >= 0 (0: no adapters)")
    check(0 <= m.lora_dropout < 1, "model.lora_dropout", m.lora_dropout, "must be in [0, 1)")
    check(m.lora_alpha is None or m.lora_alpha > 0, "model.lora_alpha", m.lora_alpha, "must be > 0")
    check(s.lora != "adapter" or m.lora_rank > 0, "sync.lora", s.lora, "adapter needs --model.lora_rank > 0")
    grouped = a.advantage in GROUP_ESTIMATORS
    check(
        r.n_samples >= (2 if grouped else 1),
        "rollout.n_samples",
        r.n_samples,
        f"--algorithm.advantage {a.advantage} compares a prompt's samples: at least 2" if grouped else "must be >= 1",
    )
    check(r.temperature > 0, "rollout.temperature", r.temperature, "must be > 0 (RL needs sampling)")
    check(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must be in (0, 1]")
    check(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", r.top_k, "must be -1 (all tokens) or >= 1")
    check(0 < r.mem_fraction_static < 1, "rollout.mem_fraction_static", r.mem_fraction_static, "must be in (0, 1)")
    check(
        s.type != "ipc" or r.placement == "colocate",
        "sync.type",
        s.type,
        "ipc needs --rollout.placement colocate (trainer and server on the same GPUs)",
    )
    check(
        r.max_ahead is None or 0 <= r.max_ahead <= r.max_staleness,
        "rollout.max_ahead",
        r.max_ahead,
        f"must be in [0, rollout.max_staleness={r.max_staleness}]",
    )
    check(
        r.max_staleness <= 1 or r.placement == "disaggregate",
        "rollout.max_staleness",
        r.max_staleness,
        "colocated servers generate ahead by one step at most (1: beside the optimizer step); "
        "fully asynchronous rollout needs --rollout.placement disaggregate",
    )
    check(
        r.max_staleness == 0 or r.placement == "disaggregate" or t.offload_states in ("auto", "never"),
        "trainer.offload_states",
        t.offload_states,
        "one-step-off colocated (--rollout.max_staleness 1) keeps the trainers' states on the GPU while the servers "
        "generate beside the optimizer step: use auto or never",
    )
    for url in r.server_urls:
        check(url.startswith(("http://", "https://")), "rollout.server_urls", url, "each URL must start with http://")
    check(
        r.fleet == "auto" or (r.fleet == "external") == bool(r.server_urls),  # (auto: external with server_urls)
        "rollout.fleet",
        r.fleet,
        "external needs --rollout.server_urls, and servers dsrl starts (local, ray) take none",
    )
    check(t.num_ranks >= 0, "trainer.num_ranks", t.num_ranks, "must be >= 0 (0: every visible GPU)")
    if t.hostfile and check_paths and "RANK" not in os.environ:  # (the launcher's file: a rank's node may lack it)
        check(Path(t.hostfile).is_file(), "trainer.hostfile", t.hostfile, "file not found")
    budget = t.max_tokens_per_micro_batch
    check(budget in (None, "auto") or budget >= 1, "trainer.max_tokens_per_micro_batch", budget,
          "must be >= 1, auto, or null for micro_batch_size rows")  # fmt: skip
    check(0 <= t.min_lr_ratio <= 1, "trainer.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
    check(t.grad_clip >= 0, "trainer.grad_clip", t.grad_clip, "must be >= 0 (0 disables clipping)")
    check(0 <= a.clip_low < 1, "algorithm.clip_low", a.clip_low, "must be in [0, 1)")
    check(a.clip_ratio_c is None or a.clip_ratio_c > 1, "algorithm.clip_ratio_c", a.clip_ratio_c, "must be > 1 or null")
    check(a.kl_target is None or (a.kl_target > 0 and a.kl_coef > 0), "algorithm.kl_target", a.kl_target,
          "must be > 0, with --algorithm.kl_coef > 0 as the starting coefficient")  # fmt: skip
    check(0 < a.gamma <= 1, "algorithm.gamma", a.gamma, "must be in (0, 1]")
    check(0 <= a.lam <= 1, "algorithm.lam", a.lam, "must be in [0, 1]")
    check(a.off_policy in ("auto", "none") or a.policy_loss == "ppo", "algorithm.off_policy", a.off_policy,
          "the off-policy corrections weight PPO's per-token loss: use --algorithm.policy_loss ppo")  # fmt: skip
    check(0 <= a.overlong_buffer < r.max_new_tokens, "algorithm.overlong_buffer", a.overlong_buffer,
          f"must be in [0, rollout.max_new_tokens={r.max_new_tokens})")  # fmt: skip
    low, high = a.clip_cov_bounds
    check(low < high, "algorithm.clip_cov_bounds", a.clip_cov_bounds, "must be (low, high), low < high")
    gdpo = a.advantage != "gdpo" or (cfg.reward_model.path is not None and cfg.reward_model.w_rule is not None)
    check(gdpo, "algorithm.advantage", a.advantage,
          "gdpo normalises two rewards each on its own: set --reward_model.path and --reward_model.w_rule")  # fmt: skip
    check(a.advantage != "gdpo" or not (a.kl_in_reward or a.overlong_buffer), "algorithm.advantage", a.advantage,
          "gdpo's advantage is its two rewards' alone: no --algorithm.kl_in_reward or overlong_buffer")  # fmt: skip
    check(a.reward_workers >= 0, "algorithm.reward_workers", a.reward_workers, "must be >= 0 (0: in process)")
    c = cfg.critic
    check(c.value_clip is None or c.value_clip > 0, "critic.value_clip", c.value_clip, "must be > 0 or null")
    check(c.micro_batch_size is None or c.micro_batch_size >= 1, "critic.micro_batch_size", c.micro_batch_size,
          "must be >= 1")  # fmt: skip
    shared = critic_on_actor_base(cfg)
    check(
        not shared or c.path is None,
        "critic.path",
        c.path,
        "must be unset with --model.lora_rank: the critic is a second adapter and a value head on the actor's base",
    )
    check(not shared or c.micro_batch_size is None, "critic.micro_batch_size", c.micro_batch_size,
          "must be unset with --model.lora_rank: the critic shares the actor's micro-batches (one engine)")  # fmt: skip
    if check_paths and c.path:
        check((Path(c.path) / "config.json").is_file(), "critic.path", c.path, "must be a directory with config.json")
    check(is_function_spec(a.reward_fn), "algorithm.reward_fn", a.reward_fn,
          "must be module:function, e.g. dsrl.rewards:math_reward")  # fmt: skip
    check(r.rollout_fn is None or is_function_spec(r.rollout_fn), "rollout.rollout_fn", r.rollout_fn,
          "must be module:function, or null for dsrl's own rollout")  # fmt: skip
    check(r.rollout_fn is None or r.placement == "colocate", "rollout.rollout_fn", r.rollout_fn,
          "custom rollouts run in colocated schedules (disaggregated ones resume dsrl's own requests)")  # fmt: skip
    validate_agent(cfg, check)
    validate_reward_model(cfg, check, check_paths)
    validate_correction(a, check)
    validate_distill(cfg, check, check_paths)
    check(s.bucket_bytes is None or s.bucket_bytes > 0, "sync.bucket_bytes", s.bucket_bytes, "must be > 0")
    check(s.probe_tolerance is None or s.probe_tolerance > 0, "sync.probe_tolerance", s.probe_tolerance, "must be > 0")
    if r.precision == "fp8":
        check(s.verify != "weights", "sync.verify", s.verify, "FP8 servers hold rounded weights, never equal to the "
              "trainer's: use probe (its tolerance allows FP8) with --rollout.precision fp8")  # fmt: skip
        check(s.lora != "adapter", "sync.lora", s.lora, "an adapter served on its own over SGLang's FP8 layers is "
              "not supported: use merged (or auto) with --rollout.precision fp8 (merged weights in FP8)")  # fmt: skip
    check(not s.delta or s.senders != "rank0", "sync.senders", s.senders, "--sync.delta needs all (each rank diffs "
          "its own partition)")  # fmt: skip
    if s.delta or s.senders == "all":
        flag, value = ("sync.delta", True) if s.delta else ("sync.senders", "all")
        check(s.type in ("auto", "broadcast"), flag, value, f"goes over --sync.type broadcast, not {s.type}")
        check(m.lora_rank == 0, flag, value, "a LoRA model's served weights are no rank's partition: not supported")
        check(r.precision != "fp8", flag, value, "FP8 scales are per block of a whole tensor: not supported")
    check(not s.delta or r.placement == "disaggregate" or r.max_staleness > 0, "sync.delta", True, "colocated "
          "servers drop their weights while the trainers train, so every sync would be full: use it disaggregated "
          "(or one-step-off, whose servers keep them)")  # fmt: skip
    check(e.every >= 0, "eval.every", e.every, "must be >= 0 (0: only at the end)")
    check(e.temperature >= 0, "eval.temperature", e.temperature, "must be >= 0 (0: greedy)")
    check(e.max_new_tokens is None or e.max_new_tokens > 0, "eval.max_new_tokens", e.max_new_tokens, "must be > 0")
    check(cfg.logging.keep_last >= 0, "logging.keep_last", cfg.logging.keep_last, "must be >= 0 (0 keeps all)")

    world = world or (None if t.hostfile else t.num_ranks)  # the ranks the launcher starts, when known before
    if world and r.prompts_per_step > 0 and r.n_samples > 0:
        check(
            r.prompts_per_step % world == 0,
            "rollout.prompts_per_step",
            r.prompts_per_step,
            f"must be divisible by the {world} trainer ranks (each rank keeps whole GRPO groups)",
        )
        per_rank = r.prompts_per_step // world * r.n_samples
        check(
            per_rank % t.updates_per_step == 0,
            "trainer.updates_per_step",
            t.updates_per_step,
            f"each rank holds {per_rank} samples (prompts_per_step / ranks * n_samples): they must split evenly",
        )
        chunk = t.updates_per_step * t.micro_batch_size if t.max_tokens_per_micro_batch is None else 0
        check(
            per_rank % chunk == 0 if chunk > 0 else True,
            "trainer.micro_batch_size",
            t.micro_batch_size,
            f"each rank holds {per_rank} samples (prompts_per_step / ranks * n_samples), which must split into "
            f"updates_per_step={t.updates_per_step} mini-batches of whole micro-batches",
        )
        critic_chunk = t.updates_per_step * (c.micro_batch_size or t.micro_batch_size)
        check(
            a.advantage != "gae" or t.max_tokens_per_micro_batch is not None or per_rank % critic_chunk == 0,
            "critic.micro_batch_size",
            c.micro_batch_size,
            f"each rank holds {per_rank} samples, which must split into {t.updates_per_step} mini-batches of whole "
            "critic micro-batches",
        )
    if errors:
        raise ConfigError(errors)


def validate_agent(cfg: Config, check) -> None:
    r, g = cfg.rollout, cfg.agent
    check(r.env is None or is_function_spec(r.env), "rollout.env", r.env,
          "must be module:Class, e.g. dsrl.tasks.toy:KeyLookupEnv")  # fmt: skip
    check(r.env is None or r.rollout_fn is None, "rollout.env", r.env,
          "an environment's episodes are dsrl's rollout: unset --rollout.rollout_fn")  # fmt: skip
    check(g.env_workers >= 0, "agent.env_workers", g.env_workers, "must be >= 0 (0: in the trainer's process)")


REJECTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")  # fmt: skip
"""verl's rejection masks (`algorithm.rollout_correction.rejection`): seq_max has no k1."""


def validate_correction(a: AlgorithmConfig, check) -> None:
    c, flag = a.rollout_correction, "algorithm.rollout_correction"
    check(a.off_policy in ("auto", "none") or not c.enabled(), "algorithm.off_policy", a.off_policy,
          f"set --{flag} or this, not both (decoupled and tis are its token-level weights)")  # fmt: skip
    check(
        c.is_level == "none" or a.policy_loss == "ppo",
        f"{flag}.is_level",
        c.is_level,
        "its importance weights multiply PPO's per-token loss: use --algorithm.policy_loss ppo (masks work with any)",
    )
    check(0 <= c.is_low < c.is_high, f"{flag}.is_high", c.is_high, f"must be > is_low={c.is_low} >= 0")
    for name, bound in c.rejection.items():
        pair = isinstance(bound, list)
        ok = (name.endswith("k1") or not pair) and (len(bound) == 2 and 0 < bound[0] < bound[1] if pair else bound > 0)
        check(name in REJECTIONS, f"{flag}.rejection", name, f"expected one of {', '.join(REJECTIONS)}")
        check(ok, f"{flag}.rejection.{name}", bound, "k1: ratio bounds [low, high] or one number U > 0 for [1/U, U]; "
              "k2, k3: an upper bound > 0")  # fmt: skip
    for name in ("icepop_bounds", "geo_mask_bounds"):
        low, high = getattr(c, name)
        check(0 <= low < high, f"{flag}.{name}", [low, high], "must be [low, high] with 0 <= low < high")
    check(c.opsm_delta >= 0, f"{flag}.opsm_delta", c.opsm_delta, "must be >= 0")


def validate_distill(cfg: Config, check, check_paths: bool) -> None:
    d, flag = cfg.distill, "distill"
    if d.teacher_path is None:
        check(not d.server_urls, f"{flag}.server_urls", d.server_urls, "needs --distill.teacher_path (its tokenizer)")
        return
    if check_paths:
        check((Path(d.teacher_path) / "config.json").is_file(), f"{flag}.teacher_path", d.teacher_path,
              "must be a model directory with config.json (e.g. a run's <run_dir>/hf, or `dsrl export`'s)")  # fmt: skip
    check(d.coef > 0, f"{flag}.coef", d.coef, "must be > 0")
    for url in d.server_urls:
        check(url.startswith(("http://", "https://")), f"{flag}.server_urls", url, "must start with http://")
    check(d.num_servers >= 1, f"{flag}.num_servers", d.num_servers, "must be >= 1")
    check(d.timeout_s > 0, f"{flag}.timeout_s", d.timeout_s, "must be > 0")
    used, m = 0.0, cfg.reward_model
    if beside_rollouts(cfg, d):
        used = cfg.rollout.mem_fraction_static + (m.mem_fraction_static if beside_rollouts(cfg, m) else 0.0)
    check(0 < d.mem_fraction_static < 1 - used, f"{flag}.mem_fraction_static", d.mem_fraction_static,
          f"must be in (0, {1 - used:.2f}): beside the rollout servers' (and the reward model's) share")  # fmt: skip


def validate_reward_model(cfg: Config, check, check_paths: bool) -> None:
    m, r = cfg.reward_model, cfg.rollout
    if m.path is None:
        check(not m.server_urls, "reward_model.server_urls", m.server_urls, "needs --reward_model.path (its tokenizer)")
        return
    if check_paths:
        kind, what = reward_model_kind(m.path)
        want = "judge" if m.judge_template else "classifier"
        allowed = ("with --reward_model.judge_template it must be a causal LM (*ForCausalLM)" if m.judge_template else
                   "a reward model is a *ForSequenceClassification with one label (num_labels 1) or a *ForRewardModel "
                   "(a causal LM judges with --reward_model.judge_template)")  # fmt: skip
        check(kind == want, "reward_model.path", m.path, f"{what}: {allowed}")
    check(m.judge_template is None or is_function_spec(m.judge_parse_fn), "reward_model.judge_parse_fn",
          m.judge_parse_fn, "must be module:function")  # fmt: skip
    for url in m.server_urls:
        check(url.startswith(("http://", "https://")), "reward_model.server_urls", url, "must start with http://")
    check(m.num_servers >= 1, "reward_model.num_servers", m.num_servers, "must be >= 1")
    check(m.timeout_s > 0, "reward_model.timeout_s", m.timeout_s, "must be > 0")
    check(m.max_length is None or m.max_length > 1, "reward_model.max_length", m.max_length, "must be > 1")
    check(m.judge_max_new_tokens >= 1, "reward_model.judge_max_new_tokens", m.judge_max_new_tokens, "must be >= 1")
    colocated = beside_rollouts(cfg, m)
    check(0 < m.mem_fraction_static < 1 - (r.mem_fraction_static if colocated else 0),
          "reward_model.mem_fraction_static", m.mem_fraction_static, f"must be in (0, 1 - rollout.mem_fraction_static="
          f"{r.mem_fraction_static}) beside the rollout servers" if colocated else "must be in (0, 1)")  # fmt: skip


def reward_model_kind(path: str) -> tuple[str | None, str]:
    """What config.json says a model directory is: 'classifier' (one label, or a *ForRewardModel), 'judge' (a
    causal LM) or None; and in words."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        build = f"`python tools/toy_reward_model.py {path}` builds the toy task's"
        return None, f"no readable config.json ({e}; {build})"
    arch = (config.get("architectures") or ["model with no architectures"])[0]
    labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 2)
    if arch.endswith("ForRewardModel") or (arch.endswith("ForSequenceClassification") and labels == 1):
        return "classifier", f"a {arch}"
    what = f"a {arch} with {labels} labels" if arch.endswith("ForSequenceClassification") else f"a {arch}"
    return ("judge" if arch.endswith("ForCausalLM") else None), what


def beside_rollouts(cfg: Config, m: "RewardModelConfig | DistillConfig") -> bool:
    """Whether dsrl starts the reward model's (or the teacher's, `distill`) servers on the rollout servers' GPUs,
    colocated with the trainer: they sleep and wake with the rollout servers, and the memory planner counts them."""
    path = m.path if isinstance(m, RewardModelConfig) else m.teacher_path
    return (
        bool(path)
        and not m.server_urls
        and cfg.rollout.placement == "colocate"
        and m.first_gpu == cfg.rollout.first_gpu
    )


def side_rollout(cfg: Config, m: "RewardModelConfig | DistillConfig", used: float = 0.0) -> RolloutConfig:
    """The servers of the reward model or the teacher, as the rollout servers' config: their own count, GPUs, memory
    and arguments. Colocated, they keep a copy of the weights on the host to sleep (SGLang drops released weights'
    contents). `used`: the share of the GPU other tenants hold when they start; SGLang fills a GPU up to its
    mem_fraction_static, so that is their share plus this."""
    args = {"is_embedding": not m.judge_template} if isinstance(m, RewardModelConfig) else {}
    args |= {"enable_weights_cpu_backup": cfg.rollout.placement == "colocate"}
    share = min(0.95, m.mem_fraction_static + used)
    return replace(cfg.rollout, server_urls=m.server_urls, fleet="external" if m.server_urls else "local",
                   num_servers=m.num_servers, first_gpu=m.first_gpu, tp_size=1, interrupt="wait",
                   mem_fraction_static=share, server_args=args | m.server_args)  # fmt: skip


class Parser(ArgumentParser):
    """jsonargparse's parser, whose errors are read at a glance: the error, then the setting meant where one has a
    close name, without the usage block (145 lines) jsonargparse prints above them."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:  # a caller that handles the error (jsonargparse's inner parsers)
            super().error(message, ex)
        hint = self.meant(message)
        print(f"{self.prog}: error: {message}" + (f"\n{self.prog}: {hint}" if hint else ""), file=sys.stderr)
        sys.exit(2)

    def meant(self, message: str) -> str | None:
        """The "did you mean" for a name this parser does not know: a flag, a YAML key or a --config file."""
        if m := re.search(r"File does not exist: '(.+)'", message):
            path = Path(m[1])
            near = get_close_matches(path.name, [p.name for p in path.parent.glob("*")], 1)
            return f"did you mean {os.path.relpath(path.parent / near[0])}?" if near else None
        if m := re.match(r"unrecognized arguments: (.*)", message):
            words = m[1].split()
            bad = [w.split("=")[0][2:] for w in words if w.startswith("--")]
            if not bad and words[0].endswith((".yaml", ".yml")):  # `dsrl train my.yaml`
                return f"did you mean --config {words[0]}?"
            dashes = "--"
        elif m := re.search(r"Group '(\S+)' does not accept option '(\S+)'|Option '(\S+)' is not accepted", message):
            bad, dashes = [m[3] or f"{m[1]}.{m[2]}"], ""  # a YAML key
        else:
            return None
        names = [o[2:] for a in self._actions for o in a.option_strings if o.startswith("--")]
        meant = [dashes + n for n in (close_name(b, names) for b in bad) if n]
        return f"did you mean {' and '.join(meant)}?" if meant else f"`{self.prog} --help` lists every setting"


def close_name(bad: str, names: list[str]) -> str:
    """The known name closest to `bad`, by the part after the group (the group's prefix, shared by all of its
    settings, would make any of them look close): in its own group first, then in any; "" if none is close."""
    group, _, leaf = bad.rpartition(".")
    for same_group in (True, False):
        leaves = {n.rpartition(".")[2]: n for n in reversed(names) if not same_group or n.rpartition(".")[0] == group}
        if near := get_close_matches(leaf, leaves, 1):
            return leaves[near[0]]
    return ""


class HelpFormatter(DefaultHelpFormatter):
    """Each flag's help on the lines under it, as wide as the terminal (beside the flag it had 54 columns of 80)."""

    def __init__(self, prog: str, **kwargs):
        super().__init__(prog, max_help_position=6, **kwargs)


def build_parser(prog: str = "dsrl train") -> Parser:
    # No abbreviations: a misspelt flag (--rollout.num_server) is an error, not a guess (jsonargparse 5 agrees)
    parser = Parser(
        prog=prog,
        usage="%(prog)s [--config FILE] [--GROUP.SETTING VALUE ...]",
        description="Train an LLM policy with RL on DeepSpeed ZeRO-3 and SGLang. Every setting below is a flag "
        "(--trainer.lr 1e-5) and a key of a --config YAML file (trainer: {lr: 1e-5}); flags override the file "
        "before them. The groups: " + ", ".join(f.name for f in fields(Config) if f.name != "seed") + ".",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config file; later flags override it.")
    parser.add_class_arguments(Config, None, as_group=False)  # as a group, its title was its dataclass signature
    for name, group in parser.groups.items():
        group.title = f"{name} - {group.title}"
    return parser


def to_config(parser: ArgumentParser, ns: Namespace) -> Config:
    init = parser.instantiate(ns)
    return Config(**{f.name: init[f.name] for f in fields(Config)})


def parse_config(argv: list[str] | None = None, world: int | None = None) -> Config:
    """Parse flags and YAML into a validated Config; on a bad config print every error and exit 2."""
    parser = build_parser()
    cfg = to_config(parser, parser.parse_args(argv))
    try:
        validate(cfg, world)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    return cfg


def is_function_spec(value: Any) -> bool:
    """A function, or its `module:function` name."""
    return callable(value) or (isinstance(value, str) and value.count(":") == 1 and all(value.split(":")))


def function_spec(fn: Any) -> Any:
    """What a config file holds for a function: its `module:function` name (a string stays as it is)."""
    return f"{fn.__module__}:{getattr(fn, '__qualname__', repr(fn))}" if callable(fn) else fn


SECRETS = ("rollout.api_key",)
"""Fields never logged nor sent to a tracker; a file that holds them is readable by its user alone."""


def write_private(path: Path, text: str, private: bool = True) -> None:
    """Write `text` to `path`, readable by this user alone when `private` (a file holding --rollout.api_key);
    an existing file takes that mode too."""
    mode = 0o600 if private else 0o644
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as f:
        f.write(text)
    os.chmod(path, mode)


def dump_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML that `--config` reads back (a reward or rollout function given as
    a callable is written as its module:function, or its name when it has none to import it by)."""
    parser = build_parser()
    values = asdict(cfg)
    values["algorithm"]["reward_fn"] = function_spec(cfg.algorithm.reward_fn)
    values["rollout"]["rollout_fn"] = function_spec(cfg.rollout.rollout_fn)
    values["rollout"]["env"] = function_spec(cfg.rollout.env)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_private(Path(path), parser.dump(parser.parse_object(values), skip_none=False), bool(cfg.rollout.api_key))
