"""verl and dsrl on one host: the same model directory, prompts, reward function and GRPO settings; each framework's
own timings mapped to the same phases, peak GPU and host memory polled the same way, one table.

Both read one parquet file in verl's format (chat-message prompts, the answer at reward_model.ground_truth,
data_source) made from the toy task's prompts, and score with one function in verl's interface
(tools/peers/verl_reward.py, which dsrl calls as it is). The model directory gets a chat template that renders the
messages' text as it is (verl always applies one), so both send the same token ids.

**Matched pairs** (`--pairs`, issue 53): each pair is two runs doing the same algorithmic work, one per framework,
repeated `--repeats` times on one host in alternating order (`schedule`: the side that goes first alternates from
repeat to repeat and from pair to pair), both sides of a repeat with the same seed; each run's record names its host
and GPUs (nvidia-smi's UUIDs), and the report gives each pair's ratio per repeat (the two runs of a repeat back to
back), their median and min–max (report.pair_table). `--repeat-from K` runs a later call's share of the repeats:
the same order and seeds, the records merged by report.py.

- `auto`: dsrl `--trainer.old_logprobs auto` (the update's own forward gives the old log-probs) against verl with
  `algorithm.rollout_correction.bypass_mode=true` (the rollout's log-probs stand for them): neither runs a pass of
  its own for them. Synchronous against synchronous: the headline.
- `recompute`: dsrl `recompute` against verl's default, each with its pass for the old log-probs.
- `offpolicy`: one-step-off on the same GPUs: dsrl `--rollout.max_staleness 1` with TIS against verl 0.9.1's own
  colocated asynchronous trainer (`trainer.v1.trainer_mode=colocate_async`, one batch ahead, partial rollout, the
  rollout's log-probs as its one-step-off recipe sets them). A row of its own, never the headline.
- `offpolicy-split` (2 GPUs or more): one-step-off with the trainer on half the GPUs and the servers on the other half:
  dsrl disaggregated against verl's `separate_async` trainer (its recipe's NCCL checkpoint engine, a weight sync
  every step; its trainer's GPUs hold replicas that sleep from the first step: `SEPARATE_ASYNC`). verl's experimental
  `one_step_off_policy` and `fully_async_policy` recipes need the same split; `separate_async` is the one its main
  entry point runs.
- `best-split` (2 GPUs or more): best against best on split GPUs, each side's asynchronous design as its users run it:
  dsrl 2 + 2 async with a staleness bound of 2, partial rollout and TIS, against verl's `separate_async` with two
  batches generated ahead (`num_warmup_batches` 2). Not like for like in the samples' staleness: a row of its own.
  verl's `separate_async` can also lend its idle trainer GPUs to rollout (`hybrid_rollout.enable_switch`, with its
  hybrid engine on), which dsrl has no counterpart for: a second run of the pair with `--verl-overrides
  trainer.v1.separate_async.hybrid_rollout.enable_switch=true`.

verl runs at its best: FSDP2, its fused log-prob kernels, dynamic batch sizes by tokens, its replay buffer with a
0.05 s poll in place of its fixed 2 s (its own extension point: tools/peers/verl_sampler.py; `--verl-poll 2` keeps
verl's and the poll then shows in its generate phase), on its own pinned stack where `--verl-site` holds one
(tools/peers/build_site.sh STACK=own). Every setting the harness gives verl is a `Setting` with its reason, kept in
each verl run's record and printed beside the table (report.settings_text). `--gpus N` runs both on N GPUs of one
host: dsrl with N colocated ranks and N servers (or N/2 + N/2 disaggregated for the split pairs), verl with N
FSDP ranks and N SGLang replicas of TP 1 (its tuning guide: more replicas before more TP).

Workloads (report.WORKLOADS): `step` (every sample to 512 tokens; a random-init model's rewards all 0), `tail` (the
realistic one: per-row `max_new_tokens` from 64 to 1024 tokens, each with `ignore_eos`, the same prompts in the same
step on both sides, and the `graded` reward, whose groups have a spread), `toy`, `7b` (16 x 4 x 256 with the
optimizer offloaded on one GPU; on several GPUs nothing is offloaded).

On the GPU machine, after `source .gpu/setup.sh` and with verl's stack unpacked (tools/peers/build_site.sh):

    python3 tools/peers/peers.py --model /tmp/models/1.5b --workload tail --pairs auto --repeats 3 --steps 11 \
        --verl-site /tmp/verlstack --out $OUT                     # 3 x (verl, dsrl) alternating, 10 steady steps each
    python3 tools/peers/peers.py --model /tmp/models/1.5b --runs verl dsrl --limits 305 170 --out $OUT  # one of each
    python3 tools/peers/peers.py --workload toy --runs verl dsrl --seeds 0 1 --steps 100 --out $OUT
    python3 tools/peers/report.py $OUT                                                   # the tables again

**Carrying the two stacks.** A device call carries at most 64 MiB beside the tree. verl's own stack
(.peers/verl_stack.tar.xz, 54.5 MiB) and dsrl's (.gpu: site.tar.xz, its JIT cache and setup.sh, ~53 MiB) cannot
travel in one call, so on one held machine: call 1 carries `.peers` and unpacks it into /tmp/verlstack; call 2
carries `.gpu`, sources its setup.sh (which unpacks /tmp/site) and starts the runs detached (tools/gpu_detach.sh);
later calls carry nothing (ignored folders already on the machine stay) and `wait`. verl's runs get
/tmp/verlstack alone on PYTHONPATH (with the repo and tools/peers): the dsrl site's SGLang 0.5.17 and
transformers 5.12.1 stay off it. docs/benchmarks/verl.md has the calls.

On an H200 (1.5B, 64 x 8 x 512), verl took ~200 s of start-up, ~65 s for its first step, ~24 s a step after it;
dsrl ~130 s to its first step, ~14 s a step after it: give each run's --limits room for the steps asked.

`--runs` is the older form: `verl`, `dsrl` (its defaults), `dsrl-padded`, `dsrl-recompute` or `dsrl-sync` (like
verl's in one respect each: DSRL_VARIANTS), back to back. Each run's record goes into OUT/peers.json as soon as it
ends, so a call cut off keeps what finished; with --budget (the seconds the caller gives the whole invocation) each
run's limit is cut so that the harness, not the caller, stops the last one, and its steps so far are kept too. The
runs' logs go into one compressed archive per invocation (OUT/logs_*.tar.gz), for committing beside peers.json.
"""

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""The chat template given to the model: the messages' text as it is, so a templated prompt is the toy prompt."""

PEERS = ROOT / "tools/peers"
REWARD = PEERS / "verl_reward.py"
SAMPLER = PEERS / "verl_sampler.py"
AGENT_LOOPS = PEERS / "verl_agent_loops.yaml"
TRACE = "agent_trace.jsonl"
"""In a verl run's work directory: its agent loop's line a sample (verl_agent.TRACE), where the custom loop runs."""

TAIL_CAPS = (64,) * 6 + (128,) * 4 + (256,) * 3 + (512,) * 2 + (1024,)
"""The `tail` workload's `max_new_tokens`, row by row in turn (a mean of 232 tokens, one row in 16 at 1024): every
step's 32 prompts, taken in order on both sides, hold each cap twice."""


def tail_rows(rows: list[dict]) -> list[dict]:
    """`rows` with the long-tail caps (TAIL_CAPS in turn), each sample run to its cap (ignore_eos)."""
    return [row | {"sampling_params": {"max_new_tokens": TAIL_CAPS[i % len(TAIL_CAPS)], "ignore_eos": True}}
            for i, row in enumerate(rows)]  # fmt: skip


def verl_rows(rows: list[dict], source: str = "toy") -> list[dict]:
    """Rows of prompt/answer as verl's data preprocessing writes them (e.g. its gsm8k.py); a row's own sampling
    parameters go into its extra_info, where tools/peers/verl_agent.py reads them."""
    out = []
    for i, row in enumerate(rows):
        extra = {"split": "train", "index": i}
        if row.get("sampling_params"):
            extra["sampling_params"] = row["sampling_params"]
        out.append({"data_source": source, "prompt": [{"role": "user", "content": row["prompt"]}], "ability": "copy",
                    "reward_model": {"style": "rule", "ground_truth": row["answer"]}, "extra_info": extra})  # fmt: skip
    return out


def write_parquet(rows: list[dict], path: Path, source: str = "toy", framework: str = "verl") -> Path:
    """The rows in verl's format; for dsrl, a row's own sampling parameters also at the top (dsrl reads a row's
    `sampling_params`; in verl's file that column would collide with its agent loop's own argument)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = verl_rows(rows, source)
    if framework == "dsrl":
        table = [r | ({"sampling_params": r["extra_info"]["sampling_params"]} if "sampling_params" in r["extra_info"]
                      else {}) for r in table]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(table), path)
    return path


QWEN_TOKENS = ("\n", "<|im_end|>")
"""What verl's agent loop asks of a Qwen2 model's tokenizer (its QwenContinuousTokenBuilder): a newline of one
token and ChatML's end of turn. The toy tokenizer (one token per character, whitespace dropped) gets them in two
of its unused slots, so every id stays in the model's vocabulary and no toy prompt tokenizes differently."""


def chat_model(src: Path, out: Path) -> Path:
    """`src` with the chat template: its weights and config linked, its tokenizer files copied with TEMPLATE and
    (a WordLevel tokenizer: the toy's) QWEN_TOKENS. The files are edited as JSON, so whichever class the installed
    transformers loads them as, both frameworks load the same."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(("tokenizer", "chat_template")):
            (out / f.name).unlink(missing_ok=True)
            (out / f.name).symlink_to(f.resolve())
    settings = json.loads((src / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template": TEMPLATE}, indent=1))
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = spec["model"].get("vocab", {})
    if spec["model"]["type"] == "WordLevel" and "<unused_1>" in vocab:
        for i, token in enumerate(QWEN_TOKENS):
            vocab[token] = vocab.pop(f"<unused_{i}>")
            added = {"id": vocab[token], "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                     "normalized": False, "special": token != "\n"}  # fmt: skip
            spec["added_tokens"].append(added)
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def toy_model(out: Path, seed: int = 0) -> Path:
    """The toy task's model (fp32, 14 tokens) with seeded random weights saved: verl loads weights from disk."""
    import torch
    from transformers import AutoModelForCausalLM

    from dsrl.tasks.toy import build_model_config, build_tokenizer

    if not (out / "config.json").is_file():
        torch.manual_seed(seed)
        config = build_model_config()
        config.vocab_size += len(QWEN_TOKENS)  # two unused slots, for chat_model's QWEN_TOKENS
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
        build_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def model_params(model: Path) -> float:
    """A decoder's parameter count from its config.json (embeddings once: the harness's models tie them)."""
    c = json.loads((model / "config.json").read_text())
    h, layers, inter = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * h // c["num_attention_heads"]
    return c["vocab_size"] * h + layers * (2 * h * h + 2 * h * kv + 3 * h * inter)


SERVER = {"attention_backend": "triton", "sampling_backend": "pytorch", "cuda_graph_backend_prefill": "disabled"}
"""SGLang's settings in both frameworks: the kernels this image carries (no FA3), and no prefill CUDA graphs (SGLang
0.5.17 captures 58 by default, a minute of each start, for prompts of 4 tokens here); decode graphs stay on."""

SERVER_0512 = {"attention_backend": "triton", "sampling_backend": "pytorch", "disable_piecewise_cuda_graph": True}
"""The same settings for verl's own stack: SGLang 0.5.12 has no `cuda_graph_backend_prefill` (a ServerArgs field it
would refuse); its prefill CUDA graphs are its piecewise ones, on by default for Qwen2 on CUDA."""


def own_stack(site: Path) -> bool:
    """Whether a verl site holds its own SGLang (build_site.sh STACK=own) rather than layering on dsrl's."""
    return (site / "sglang").is_dir()


WORKLOADS = report.WORKLOADS
CHECKPOINTING_PARAMS = 5e9
"""verl's gradient checkpointing (its default) stays on for models past this size; below it, the activations of a
micro-batch fit without it and the step is faster (dsrl's `auto` chose off at 1.5B and 3B)."""
SMALL_GPU_GB = 100
"""On GPUs of less memory (an H100's 80 GB) verl keeps its default checkpointing at every size: its 1.5B update on
micro-batches of about 16k positions peaked at 83.7 GB without it on an H200 (the `step` workload, eighth session)."""
PROMPT_LENGTH = 16
"""verl's data.max_prompt_length, in tokens: the harness's prompts (the toy task's) are a few tokens long."""


@dataclass(frozen=True)
class Setting:
    """One hydra KEY=VALUE the harness gives verl, and why."""

    key: str
    value: object
    why: str


def _hydra(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Pair:
    """Two runs doing the same algorithmic work: dsrl's flags and verl's settings that differ from each one's
    defaults (the rest: the workload's and the GPUs', the same in every pair)."""

    what: str
    dsrl: dict = field(default_factory=dict)
    verl: tuple[Setting, ...] = ()
    split: bool = False  # trainer and servers on GPUs of their own, half each


BYPASS = Setting(
    "algorithm.rollout_correction.bypass_mode",
    True,
    "verl's own switch that skips its pass for the old log-probs (the rollout's stand for them), as "
    "dsrl's `auto` skips its own (the update's forward gives them): the same passes on both sides",
)
SEPARATE_ASYNC = (
    Setting(
        "trainer.v1.trainer_mode", "separate_async", "verl's own asynchronous trainer with rollout GPUs of their own"
    ),
    Setting("trainer.v1.separate_async.parameter_sync_step", 1, "a weight sync every step, as dsrl's"),
    Setting("actor_rollout_ref.rollout.checkpoint_engine.backend", "nccl", "what separate_async asks for"),
    Setting(BYPASS.key, True, "what verl's asynchronous recipes set (the rollout's log-probs as the old ones)"),
)
"""verl's `separate_async` trainer as both split pairs run it (its one batch ahead by default). Its hybrid engine stays
on, its default: replicas on the trainer's GPUs generate until the first step, then sleep (`enable_switch` off). With
`actor_rollout_ref.hybrid_engine=false` (the servers' GPUs alone) verl 0.9.1 dies in its setup: `logger.info(...,
flush=True)` in trainer_separate_async.py, a TypeError of Python's logging (2 x H200, 2026-11-28)."""
PAIRS = {
    "auto": Pair("no old log-probs pass", {"--trainer.old_logprobs": "auto"}, (BYPASS,)),
    "recompute": Pair("old log-probs pass", {"--trainer.old_logprobs": "recompute"}),
    "offpolicy": Pair(
        "one-step-off, colocated",
        {"--rollout.max_staleness": 1, "--algorithm.off_policy": "tis"},
        (
            Setting(
                "trainer.v1.trainer_mode",
                "colocate_async",
                "verl's own one-step-off on shared GPUs (v1 trainer): one batch generated ahead, partial rollout",
            ),
            Setting(BYPASS.key, True, "what verl's one-step-off recipe sets (the rollout's log-probs as the old ones)"),
        ),
    ),
    "offpolicy-split": Pair(
        "one-step-off, split GPUs",
        {"--rollout.max_staleness": 1, "--algorithm.off_policy": "tis"},
        SEPARATE_ASYNC,
        split=True,
    ),
    "best-split": Pair(
        "each at its best, split GPUs",
        {"--rollout.max_staleness": 2, "--rollout.interrupt": "partial", "--algorithm.off_policy": "tis"},
        (
            *SEPARATE_ASYNC,
            Setting(
                "trainer.v1.separate_async.num_warmup_batches",
                2,
                "two batches generated ahead, as dsrl's staleness bound of 2 lets its servers run",
            ),
        ),
        split=True,
    ),
}
"""The matched pairs (module docstring)."""


def verl_settings(
    w: dict,
    model: Path,
    data: Path,
    work: Path,
    steps: int,
    seed: int,
    gpus: int = 1,
    pair: Pair | None = None,
    poll: float = 0.05,
    overrides: list[str] = (),
    server: dict = SERVER,
    gpu_gb: float = 141.0,
) -> list[Setting]:
    """verl 0.9.1's PPO entry point, GRPO, colocated with SGLang (its hybrid engine) on `gpus` GPUs of one host, at
    its best on this machine: FSDP2, dynamic batch size by tokens, its fused log-prob kernels, its replay buffer's
    poll at `poll` seconds, no remove-padding (it needs flash-attn, which has no wheel for torch 2.11: sdpa instead,
    padded rows), no offload, KL off, SGLang with `server` (SERVER_0512 on verl's own stack); `pair`'s settings on
    top; gradient checkpointing as `CHECKPOINTING_PARAMS` and `SMALL_GPU_GB` say, on GPUs of `gpu_gb` GB each.
    `overrides` (hydra's KEY=VALUE) replace or add
    settings last: actor_rollout_ref.model.use_fused_kernels=false is the path the first runs took (a Python loop
    over every token's log-softmax; docs/benchmarks/verl.md)."""
    toy, tail = w["new_tokens"] < 16, w.get("tail", False)
    offload = w.get("offload", False) and gpus == 1
    split = pair is not None and pair.split
    trainer_gpus = gpus // 2 if split else gpus
    mode = next((x.value for x in (pair.verl if pair else ()) if x.key == "trainer.v1.trainer_mode"), "sync")
    same, run = "the workload: the same on both sides", "the harness's run: logs, no validation, no saving"
    s = [
        Setting("algorithm.adv_estimator", "grpo", same), Setting("algorithm.use_kl_in_reward", False, same),
        Setting("data.train_files", data, same), Setting("data.val_files", data, run),
        Setting("data.train_batch_size", w["prompts"], same), Setting("data.max_prompt_length", PROMPT_LENGTH, same),
        Setting("data.max_response_length", w["new_tokens"], same), Setting("data.seed", seed, same),
        Setting("data.shuffle", False, "the same prompts (and per-row lengths) in the same step on both sides"),
        Setting("data.filter_overlong_prompts", False, same), Setting("data.dataloader_num_workers", 0, run),
        Setting("actor_rollout_ref.model.path", model, same),
        Setting("actor_rollout_ref.actor.optim.lr", w["lr"], same),
        Setting("actor_rollout_ref.actor.optim.weight_decay", 0.0, same),
        Setting("actor_rollout_ref.actor.ppo_mini_batch_size", w["prompts"], "one optimizer step a batch, as dsrl"),
        Setting("actor_rollout_ref.actor.use_kl_loss", False, same),
        Setting("actor_rollout_ref.actor.entropy_coeff", 0, same),
        Setting("actor_rollout_ref.actor.clip_ratio", 0.2, same),
        Setting("actor_rollout_ref.actor.loss_agg_mode", "token-mean", same),
        Setting("actor_rollout_ref.rollout.n", w["n"], same),
        Setting("actor_rollout_ref.rollout.gpu_memory_utilization", 0.7 if split else w["mem"],
                "SGLang's static memory, as dsrl's --rollout.mem_fraction_static: the KV cache holds every request of "
                "the step at once either way"),
        Setting("reward.custom_reward_function.path", REWARD, "the reward both frameworks call (verl_reward.py)"),
        Setting("reward.custom_reward_function.name", "compute_score", same),
        # verl at its best
        Setting("actor_rollout_ref.actor.strategy", "fsdp2", "its tuning guide: FSDP2 over FSDP1 (the ref follows)"),
        Setting("actor_rollout_ref.model.use_fused_kernels", True,
                "its fused log-prob/entropy kernels: without flash-attn its fallback loops over every token"),
        *micro_batches(w),
        Setting("actor_rollout_ref.model.use_remove_padding", False,
                "its packing needs flash-attn, which has no wheel for the image's torch 2.11 (PyPI: source only)"),
        Setting("+actor_rollout_ref.model.override_config.attn_implementation", "sdpa",
                "its default is flash_attention_2 (no package here): torch's own flash kernel on padded rows"),
        Setting("trainer.v1.sampler.custom_sampler.path", SAMPLER,
                "its replay buffer as it is, polling at sampler_kwargs.poll_interval instead of every 2 s"),
        Setting("trainer.v1.sampler.custom_sampler.name",
                "QuickPollReplayBuffer" if mode == "sync" else "QuickPollReplayBufferAsync",
                "the class its trainer mode builds by default, with the shorter poll"),
        Setting("+trainer.v1.sampler.sampler_kwargs.poll_interval", poll, "seconds between its looks for a batch"),
        Setting("actor_rollout_ref.rollout.name", "sglang", "SGLang, as dsrl"),
        Setting("actor_rollout_ref.rollout.mode", "async", "its SGLang server mode (the default), as dsrl's"),
        Setting("actor_rollout_ref.rollout.tensor_model_parallel_size", 1,
                "its tuning guide: more replicas before more TP (one SGLang server a GPU, as dsrl's)"),
        Setting("actor_rollout_ref.rollout.enforce_eager", toy, "CUDA graphs in decode, as dsrl (not for the toy)"),
        *(Setting(f"+actor_rollout_ref.rollout.engine_kwargs.sglang.{k}", v,
                  "the same SGLang settings as dsrl's (triton attention: no FA3 kernels carried; no prefill graphs)")
          for k, v in server.items()),
        Setting("trainer.n_gpus_per_node", trainer_gpus, "the GPUs of the host (the trainer's half, split)"),
        Setting("trainer.nnodes", 1, "one host, as dsrl's runs"),
        Setting("trainer.total_training_steps", steps, same), Setting("trainer.total_epochs", 1000, same),
        Setting("trainer.logger", '["console","file"]', run), Setting("trainer.val_before_train", False, run),
        Setting("trainer.test_freq", -1, run), Setting("trainer.save_freq", -1, run),
        Setting("trainer.project_name", "peers", run), Setting("trainer.experiment_name", "verl", run),
        Setting("trainer.default_local_dir", work / "verl_ckpt", run),
        Setting("+ray_kwargs.ray_init.include_dashboard", False, "Ray as its minimal install runs: no dashboard"),
        Setting("hydra.run.dir", work / "verl_hydra", run),
    ]  # fmt: skip
    big = model_params(model) > CHECKPOINTING_PARAMS if (model / "config.json").is_file() else False
    s.append(Setting("actor_rollout_ref.model.enable_gradient_checkpointing", big or offload or gpu_gb < SMALL_GPU_GB,
                     "its default (on) for 7B and on 80 GB GPUs; off where a micro-batch's activations fit (faster; "
                     "an H200's 141 GB at 1.5B and 3B, where dsrl's auto chose off too)"))  # fmt: skip
    if split:
        s += [Setting("actor_rollout_ref.rollout.nnodes", 1, "the servers' GPUs: the other half of the host"),
              Setting("actor_rollout_ref.rollout.n_gpus_per_node", gpus - trainer_gpus, "the other half")]  # fmt: skip
    if tail:
        s += [
            Setting(
                "actor_rollout_ref.rollout.agent.agent_loop_config_path",
                AGENT_LOOPS,
                "each row's own max_new_tokens and ignore_eos, as dsrl takes a row's sampling_params "
                "(verl_agent.py: its single-turn loop with the row's parameters merged in)",
            ),
            Setting(
                "actor_rollout_ref.rollout.agent.default_agent_loop", "row_sampling_agent", "that loop for every row"
            ),
        ]
    # fp32 training as dsrl's toy run (configs/toy_gpu.yaml: precision fp32, no CUDA graphs); SGLang serves that
    # fp32 model in float16 (its `--dtype auto`), as it does for dsrl: its RMSNorm kernel has no fp32
    if toy:
        s += [Setting("actor_rollout_ref.rollout.dtype", "float16", "the toy's fp32 model served as dsrl serves it"),
              Setting("+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype", "fp32",
                      "the toy trains in fp32 on both sides")]  # fmt: skip
    if offload:  # the optimizer's states alone: with the parameters too (its docs' one-GPU 7B setting), its first
        # weight sync ran a 128 GB host out of memory (docs/benchmarks/verl.md: 7B)
        s += [Setting("actor_rollout_ref.actor.fsdp_config.param_offload", False,
                      "its docs' one-GPU 7B setting offloads these too: that ran a 128 GB host out of memory"),
              Setting("actor_rollout_ref.actor.fsdp_config.optimizer_offload", True,
                      "7B's Adam states do not fit one GPU beside the rest (dsrl offloads 60% of them)")]  # fmt: skip
    s += list(pair.verl if pair else ())
    given = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in overrides}
    s = [x for x in s if x.key not in given]  # one value a key: hydra refuses a key given twice
    s += [Setting(k, v, "--verl-overrides") for k, v in given.items()]
    return list({x.key: x for x in s}.values())  # a pair's setting replaces the base's


def micro_batches(w: dict) -> list[Setting]:
    """verl's micro-batches: by tokens (its dynamic batch size, as its tuning guide says), except where the rows'
    lengths vary (`tail`). Its dynamic batch size counts real tokens (the attention mask's sum), but without
    remove-padding (no flash-attn here) its model runs on the padded rows: a micro-batch of 16,384 real tokens, rows
    of about 242 (prompt and 232 new tokens on average), held about 68 rows of 1,040 positions, and its 1.5B update
    ran out of memory on an H100 and an H200 (twelfth session). There, a fixed number of rows holds the same
    positions as dsrl's token budget."""
    if not w.get("tail", False):
        return [
            Setting("actor_rollout_ref.actor.use_dynamic_bsz", True, "its tuning guide: micro-batches by tokens"),
            Setting("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", w["tokens"],
                    "tokens a micro-batch, as dsrl's --trainer.max_tokens_per_micro_batch (its guide: at least 2x "
                    "prompt + response)"),
            Setting("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", 2 * w["tokens"],
                    "its tuning guide: forward-only micro-batches 2x the update's"),
        ]  # fmt: skip
    rows = 2 ** round(math.log2(w["tokens"] / (PROMPT_LENGTH + w["new_tokens"])))  # (a power of 2 divides the batch)
    why = (
        f"rows of {PROMPT_LENGTH} + {w['new_tokens']} padded positions, {rows} a micro-batch: about dsrl's "
        f"{w['tokens']} tokens; its dynamic batch size counts real tokens and ran out of memory on padded rows"
    )
    return [
        Setting("actor_rollout_ref.actor.use_dynamic_bsz", False, why),
        Setting("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", rows, why),
        Setting("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", 2 * rows,
                "its tuning guide: forward-only micro-batches 2x the update's"),
    ]  # fmt: skip


def verl_command(settings: list[Setting]) -> list[str]:
    return [sys.executable, "-m", "verl.trainer.main_ppo", *(f"{s.key}={_hydra(s.value)}" for s in settings)]


FP8_FLAGS = {"--rollout.precision": "fp8", "--sync.verify": "probe", "--sync.verify_every": 1000,
             "--sync.probe_tolerance": 10}  # fmt: skip
"""FP8 rollout, its probe measured at the first and the last sync (outside the steady steps' generate phase) and never
refusing: these runs measure what the default tolerance should be on a GPU."""

DSRL_VARIANTS = {
    "dsrl": ("best", {}),
    "dsrl-padded": ("padded rows", {"--trainer.pack_sequences": "false"}),
    "dsrl-recompute": ("old log-probs pass", {"--trainer.old_logprobs": "recompute"}),
    "dsrl-sync": ("synchronous", {"--rollout.max_staleness": 0, "--algorithm.off_policy": "none"}),
    "dsrl-moments": (
        "synchronous, Adam on the GPU",
        {
            "--rollout.max_staleness": 0,
            "--algorithm.off_policy": "none",
            "--trainer.offload_optimizer": "false",
            "--trainer.offload_states": "moments",
            "--model.gradient_checkpointing": "true",
        },
    ),
    "dsrl-fp8": ("FP8 rollout", FP8_FLAGS),
    "dsrl-auto": (  # pair `auto`'s dsrl side alone, as its records ran it: tools/gpu_run.sh `gate` (issue 89)
        PAIRS["auto"].what,
        {"--rollout.max_staleness": 0, "--algorithm.off_policy": "none", "--data.shuffle": "false"}
        | PAIRS["auto"].dsrl,
    ),
    "dsrl-moments-fp8": (
        "synchronous, Adam on the GPU, FP8 rollout",
        {
            "--rollout.max_staleness": 0,
            "--trainer.offload_optimizer": "false",
            "--trainer.offload_states": "moments",
            "--model.gradient_checkpointing": "true",
            **FP8_FLAGS,
        },
    ),
}
for _name, _extra in (("kv", {"kv_cache_dtype": "fp8_e4m3"}), ("fi", {"fp8_gemm_backend": "flashinfer_deepgemm"})):
    DSRL_VARIANTS[f"dsrl-moments-fp8{_name}"] = (  # issue 64's levers past DeepGEMM's 1.24x at 7B: the KV cache in FP8,
        f"synchronous, Adam on the GPU, FP8 rollout, {_extra}",  # or FlashInfer's DeepGEMM for small decode batches
        DSRL_VARIANTS["dsrl-moments-fp8"][1] | {"--rollout.server_args": json.dumps(SERVER | _extra)},
    )
"""dsrl's runs, each a mode (the table's column) and the flags that differ from its defaults: padded rows, like
verl's here (flash-attn, which verl's remove-padding needs, has no wheel for this torch); the old log-probs in a pass
of their own before the update, as verl computes them; synchronous (the 7B workload's dsrl is one-step-off), as
verl's trainer is; synchronous with Adam stepping on the GPU, its two moments alone on the host while the servers
generate (`--trainer.offload_states moments`), as verl's optimizer offload does (7B on one H200; gradient
checkpointing on, as verl's). The `-fp8` runs serve FP8 rollouts (issue 64; `algorithm.off_policy` left to auto, which
turns TIS on), beside `dsrl` and `dsrl-moments` on the same GPU (tools/gpu_run.sh `fp8`)."""


def dsrl_command(w: dict, model: Path, data: Path, run_dir: Path, steps: int, seed: int, name: str = "dsrl",
                 gpus: int = 1, pair: Pair | None = None) -> list:  # fmt: skip
    """dsrl's GRPO at its defaults (`name` a variant: DSRL_VARIANTS; or `pair`'s flags, synchronous unless the pair
    says otherwise), with the same workload, reward and learning settings as verl's, on `gpus` GPUs: N colocated
    ranks and N servers, or (a split pair) N/2 ranks and N/2 servers on GPUs of their own."""
    toy, offload = w["new_tokens"] < 16, w.get("offload", False) and gpus == 1
    split = pair is not None and pair.split
    args = {
        "--model.path": model, "--data.train_path": data, "--data.answer_key": "reward_model.ground_truth",
        "--algorithm.reward_fn": "verl_reward:compute_score",
        "--rollout.prompts_per_step": w["prompts"], "--rollout.n_samples": w["n"],
        "--rollout.max_new_tokens": w["new_tokens"], "--rollout.mem_fraction_static": 0.7 if split else w["mem"],
        "--trainer.lr": w["lr"], "--trainer.max_tokens_per_micro_batch": w["tokens"],
        "--trainer.total_steps": steps, "--seed": seed, "--sync.verify": "off",
        "--logging.tensorboard": "true", "--logging.run_dir": run_dir, "--rollout.server_args": json.dumps(SERVER),
    }  # fmt: skip
    if gpus > 1:
        half = gpus // 2
        args |= ({"--trainer.num_ranks": half, "--rollout.num_servers": gpus - half, "--rollout.first_gpu": half}
                 if split else {"--trainer.num_ranks": gpus, "--rollout.num_servers": gpus})  # fmt: skip
    if offload:  # (the host's RAM holds 60% of 7B's Adam states beside the rest: docs/history.md, ninth session)
        args |= {"--trainer.offload_optimizer": "true", "--trainer.offload_optimizer_ratio": 0.6,
                 "--rollout.max_staleness": 1, "--algorithm.off_policy": "tis"}  # fmt: skip
    if pair is not None:  # synchronous unless the pair says otherwise; the same prompts in each step as verl's
        args |= {"--rollout.max_staleness": 0, "--algorithm.off_policy": "none", "--data.shuffle": "false"}
        args |= pair.dsrl
    else:
        args |= DSRL_VARIANTS[name][1]
    if toy:
        server = SERVER | {"disable_cuda_graph": True}
        args |= {"--trainer.precision": "fp32", "--rollout.server_args": json.dumps(server)}
    flat = [str(x) for kv in args.items() for x in kv]
    config = ROOT / f"configs/gpu_{'disaggregate' if split else 'colocate'}.yaml"
    return [sys.executable, "-m", "dsrl.cli", "train", "--config", str(config), *flat]


def schedule(pairs: list[str], repeats: int, start: int = 0) -> list[tuple[str, str, int]]:
    """(pair, framework, repeat) in the order they run: each pair's repeats `start`, `start` + 1, ... in turn, the
    two sides of a repeat back to back, verl first where the repeat's number plus the pair's place in PAIRS is even:
    within a pair and across pairs neither side always runs first, and a later call with `--repeat-from` continues
    the same order (each repeat keeps its number, and so its seed and its side that goes first)."""
    order = []
    for pair in pairs:
        for r in range(start, start + repeats):
            sides = ("verl", "dsrl") if (r + list(PAIRS).index(pair)) % 2 == 0 else ("dsrl", "verl")
            order += [(pair, side, r) for side in sides]
    return order


class Monitor:
    """Peak GPU memory in use (nvidia-smi, every device, MiB) and host memory in use (MemTotal - MemAvailable)
    over a run, polled every `every` seconds; the host's is counted from what was in use when it started."""

    def __init__(self, every: float = 0.5):
        self.every, self.gpu_peak, self.host_peak = every, 0.0, 0.0
        self.host_base = host_used_gb()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            self.gpu_peak = max(self.gpu_peak, gpu_used_gb())
            self.host_peak = max(self.host_peak, host_used_gb() - self.host_base)
            self.stop.wait(self.every)

    def close(self) -> dict[str, float]:
        self.stop.set()
        self.thread.join()
        return {"gpu_peak_gb": self.gpu_peak, "host_peak_gb": self.host_peak}


def gpu_query(field: str) -> str:
    """nvidia-smi's value of `field`, one line per GPU ("" where there is none)."""
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""


def where(gpus: int = 1) -> dict:
    """The host, its memory (GB: verl's 7B on one GPU outgrew a host of 128 GiB) and the GPUs a run uses: nvidia-smi's
    UUIDs of the first `gpus` it lists (or of CUDA_VISIBLE_DEVICES' indices where set), comma-joined, "" without
    nvidia-smi."""
    uuids = gpu_query("uuid").split()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible and all(v.isdigit() and int(v) < len(uuids) for v in visible.split(",")):
        uuids = [uuids[int(v)] for v in visible.split(",")]
    return {"host": socket.gethostname(), "host_gb": round(meminfo_gb()["MemTotal"], 1), "gpu": ",".join(uuids[:gpus])}


def gpu_gb(field: str) -> list[float]:
    """nvidia-smi's memory `field` (memory.used, memory.total: MiB) in GB, one per GPU ([] without nvidia-smi)."""
    try:
        return [float(x) * 2**20 / 1e9 for x in gpu_query(field).split()]
    except ValueError:
        return []


def gpu_used_gb() -> float:
    return sum(gpu_gb("memory.used"))


def meminfo_gb() -> dict[str, float]:
    """/proc/meminfo's fields in GB, read once."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return {field: int(value.split()[0]) * 1024 / 1e9 for field, value in info.items() if value.strip().endswith("kB")}


def host_used_gb() -> float:
    info = meminfo_gb()
    return info["MemTotal"] - info["MemAvailable"]


def run(argv: list[str], log: Path, limit: float, env: dict, finished: str | None = None) -> dict:
    """`argv` in its own session, logged to `log`, stopped (the whole session) at `limit` seconds or once it is
    done (`wait_for`); then whatever it left on the GPU is ended (Ray's and SGLang's processes can outlive their
    parent)."""
    monitor, start = Monitor(), time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        rc = wait_for(proc, log, start + limit, finished)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(5)
    if rc in ("timeout", "finished"):
        proc.wait()
    clear_gpu(env)
    return {"rc": rc, "wall_s": time.monotonic() - start, **monitor.close()}


EXIT_GRACE_S = 15
"""Seconds a run may take to exit once its log says it is done: verl's last step logged, its process has sat in a
Ray call until the harness's limit (seventh session, H200), device time spent on nothing."""


def wait_for(proc: subprocess.Popen, log: Path, deadline: float, finished: str | None) -> int | str:
    """The run's exit status; "timeout" at `deadline`; "finished" EXIT_GRACE_S after `finished` shows in its log
    while it is still running."""
    seen = None
    while (rc := proc.poll()) is None:
        now = time.monotonic()
        if now >= deadline:
            return "timeout"
        if finished and seen is None and finished in log.read_text(errors="replace"):
            seen = now
        if seen is not None and now - seen >= EXIT_GRACE_S:
            return "finished"
        time.sleep(1)
    return rc


def clear_gpu(env: dict) -> None:
    """Stop Ray (verl's cluster) and end every process still holding the GPU: each was started by a run."""
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], env=env, capture_output=True,
                   timeout=60, check=False)  # fmt: skip
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True, check=False).stdout  # fmt: skip
    for pid in out.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError, PermissionError):
            pass
    deadline = time.monotonic() + 30
    while gpu_used_gb() > 2 and time.monotonic() < deadline:
        time.sleep(1)


STOP_S = 60
"""Seconds to stop a run at its limit and clear the GPU after it (SIGTERM, SIGKILL, `ray stop`, the GPU freed)."""


def run_limit(asked: float, deadline: float, now: float) -> float:
    """A run's limit within the invocation's `--budget`: what was asked, cut to what is left of the budget less the
    time to stop it, so the harness itself writes the run's record (a harness killed from outside writes none)."""
    return min(asked, deadline - now - STOP_S)


VERL_DONE = "Final validation metrics"
"""What verl's trainer prints after its last step (`trainer/ppo/v1`, validation or not)."""


def verl_env(env: dict, site: Path, work: Path) -> dict:
    """verl's environment: its site first on PYTHONPATH, with the repo (dsrl.tasks.toy, for the reward) and
    tools/peers (its sampler, agent loop and reward). A site that holds its own SGLang (build_site.sh STACK=own)
    replaces the caller's PYTHONPATH (the dsrl site: SGLang 0.5.17, transformers 5.12.1), and gets JIT caches of its
    own (VERL_JIT); a layered one goes before it. Its agent loop traces each sample into `work`/TRACE."""
    env = dict(env, VERL_FILE_LOGGER_PATH=str(work / "metrics.jsonl"), PEERS_AGENT_TRACE=str(work / TRACE))
    own = own_stack(site)
    rest = [] if own else [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(ROOT), str(PEERS), *rest) if p)
    if own:  # outside /tmp/jitcache, which gpu_run.sh brings back for .gpu: that would outgrow a call's 64 MiB
        env |= {k: f"/tmp/jitcache_verl/{v}" for k, v in VERL_JIT.items()}
    return env


VERL_JIT = {"FLASHINFER_WORKSPACE_BASE": "fi", "TVM_FFI_CACHE_DIR": "tvmffi", "TRITON_CACHE_DIR": "triton"}
"""verl's own stack's JIT caches (its flashinfer and tvm-ffi are other versions than the dsrl site's): compiled in
the first verl run on a machine (~1 min: sgl_kernel's RMSNorm builds flashinfer's norm.cu), kept for the next."""


def one_run(name: str, args, w: dict, model: Path, data: dict[str, Path], seed: int, limit: float,
            pair: str | None = None, repeat: int = 0, order: int = 0) -> dict:  # fmt: skip
    """Run `name` (verl, or one of DSRL_VARIANTS; with `pair`, that pair's side) once; its record: per-step
    metrics, memory, host and GPUs, the command, and verl's settings with their reasons."""
    framework = name.split("-")[0]
    tag = f"{pair}_{framework}_r{repeat}" if pair else name
    work = args.workdir / f"{tag}_{args.workload}_s{seed}"
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # DeepSpeed's FusedAdam build (dsrl) cannot parse torch's default arch list ("9.0a"): name the GPU's own
    env["TORCH_CUDA_ARCH_LIST"] = (gpu_query("compute_cap").split() or ["9.0"])[0]
    env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/jitcache/torch_extensions")
    # tools/peers for dsrl's `verl_reward:compute_score` (the GPU site has a top-level package named `tools`)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(PEERS), env.get("PYTHONPATH", "")) if p)
    p = PAIRS[pair] if pair else None
    settings = []
    if framework == "verl":
        (work / TRACE).unlink(missing_ok=True)  # its agent loop appends: a run again in this directory starts anew
        env = verl_env(env, args.verl_site, work)
        server = SERVER_0512 if own_stack(args.verl_site) else SERVER
        settings = verl_settings(w, model, data["verl"], work, args.steps, seed, args.gpus, p, args.verl_poll,
                                 args.verl_overrides, server, min(gpu_gb("memory.total"), default=141.0))  # fmt: skip
        argv = verl_command(settings)
    else:
        argv = dsrl_command(w, model, data["dsrl"], work / "run", args.steps, seed, name, args.gpus, p)
    log = args.out / f"{tag}_{args.workload}_s{seed}.log"
    started = time.time()
    outcome = run(argv, log, limit, env, VERL_DONE if framework == "verl" else None)
    if framework == "verl":
        steps = report.verl_steps(work / "metrics.jsonl", log.read_text(errors="replace"), work / TRACE)
    else:
        steps = report.dsrl_steps(work / "run")
        for bulky in ("hf", "checkpoints", "fp8_model"):  # a 7B run leaves ~22 GB: a 64 GiB disk fills in 3 runs
            shutil.rmtree(work / "run" / bulky, ignore_errors=True)
    mode = p.what if p else DSRL_VARIANTS[name][0] if framework == "dsrl" else "best"
    return {"framework": framework, "mode": mode, "workload": f"{args.workload} {model.name}", "model": str(model),
            **where(args.gpus), "gpus": args.gpus, "seed": seed, "samples": w["prompts"] * w["n"], "steps": steps,
            "pair": pair, "repeat": repeat, "order": order, "started": started, "log": log.name,
            "command": " ".join(map(str, argv)), "settings": [[s.key, _hydra(s.value), s.why] for s in settings],
            **outcome}  # fmt: skip


def archive_logs(out: Path, logs: list[Path], name: str) -> Path | None:
    """The runs' logs in one compressed archive (few files come back from a device call's $OUT; the archive is
    what gets committed beside peers.json), the logs themselves removed."""
    logs = [log for log in logs if log.is_file()]
    if not logs:
        return None
    path = out / name
    with tarfile.open(path, "w:gz") as tar:
        for log in logs:
            tar.add(log, arcname=log.name)
    for log in logs:
        log.unlink()
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a model directory (tools/gpu_models.py); the toy's is built")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="step")
    p.add_argument("--pairs", nargs="*", default=[], choices=sorted(PAIRS), help="matched pairs (module docstring)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each pair, alternating which side runs first")
    p.add_argument("--repeat-from", type=int, default=0, help="the first repeat's number (a later call's share)")
    p.add_argument("--runs", nargs="+", default=["verl", "dsrl"], choices=["verl", *DSRL_VARIANTS])
    p.add_argument("--gpus", type=int, default=1, help="GPUs of the host both frameworks run on")
    p.add_argument("--steps", type=int, default=3, help="steps a run (the first is warm-up: 11 gives 10 steady)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="--runs: one set a seed; --pairs: the first's")
    p.add_argument(
        "--limits",
        type=float,
        nargs="+",
        default=[240],
        help="seconds each run may take: one for all, one a run (--runs), or verl's and dsrl's (--pairs)",
    )
    p.add_argument("--budget", type=float, default=float("inf"), help="seconds for the whole invocation (run_limit)")
    p.add_argument("--data", type=Path, default=ROOT / "examples/toy/train.jsonl")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/peers"))
    p.add_argument("--verl-site", type=Path, default=Path("/tmp/verlsite"))
    p.add_argument("--verl-poll", type=float, default=0.05, help="verl's replay-buffer poll, s (its own: 2)")
    p.add_argument("--verl-overrides", nargs="*", default=[], help="hydra KEY=VALUE for verl's runs (replace or add)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    deadline = time.monotonic() + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    w = WORKLOADS[args.workload]
    source = toy_model(args.workdir / "toy_model") if args.workload == "toy" else args.model
    model = chat_model(source, args.workdir / f"model_{source.name}")
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    rows = tail_rows(rows) if w.get("tail") else rows
    data = {fw: write_parquet(rows, args.workdir / f"train_{fw}.parquet", w.get("source", "toy"), fw)
            for fw in ("verl", "dsrl")}  # fmt: skip
    record_path = args.out / "peers.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {"runs": {}}
    if args.pairs:
        limits = dict(zip(("verl", "dsrl"), args.limits * 2 if len(args.limits) == 1 else args.limits))
        todo = [(f"{pair} {side} {source.name} r{r}", side, args.seeds[0] + r, pair, r)
                for pair, side, r in schedule(args.pairs, args.repeats, args.repeat_from)]  # fmt: skip
    else:
        limits = dict(zip(args.runs, args.limits * len(args.runs) if len(args.limits) == 1 else args.limits))
        todo = [(f"{name} {source.name}" + (f" seed {seed}" if len(args.seeds) > 1 else ""), name, seed, None, 0)
                for seed in args.seeds for name in args.runs]  # fmt: skip
    logs = []
    for k, (key, name, seed, pair, r) in enumerate(todo):
        limit = run_limit(limits[name], deadline, time.monotonic())
        if limit <= 0:
            print(f"{key}: not run, --budget {args.budget:.0f} s is spent", flush=True)
            continue
        record["runs"][key] = one_run(name, args, w, model, data, seed, limit, pair, r, k)
        logs.append(args.out / record["runs"][key]["log"])
        record_path.write_text(json.dumps(record, indent=1))
        print(report.table({"runs": {key: record["runs"][key]}}).splitlines()[-1], flush=True)
    print(report.table(record))
    if args.pairs:
        print(report.pair_table(record))
        print(report.settings_text(record))
    report.plot_phases(record, args.out / "phases.png")
    report.plot_curves(record, args.out / "curves.png")
    archive_logs(args.out, logs, f"logs_{args.workload}_{source.name}_{time.strftime('%H%M%S')}.tar.gz")


if __name__ == "__main__":
    main()
