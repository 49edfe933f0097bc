"""The trainer's log-prob pass and update on synthetic samples, before and after micro-batches by tokens,
packing and chunked log-probs, in one run (one rank, DeepSpeed ZeRO-3).

    python tools/bench_trainer.py --model /tmp/models/3b --samples 256 --dist longtail     # GPU
    python tools/bench_trainer.py --model TOY_WEIGHTS --samples 32 --max-len 40 --prompt-len 8 --budget 400  # CPU
    python tools/bench_trainer.py --model /tmp/models/3b --engines 16:module 16:layer 0:layer \
        --samples 128 --dist uniform --max-len 512 --prompt-len 8 --modes packed  # LoRA against full, one call

--engines RANK:GATHER[:OPTION,...] ... (LoRA rank, 0 for full; ZeRO-3 gathering per layer or module) runs each engine
in a process of its own, one after another (memory one engine leaves behind would slow the next), and a last
`summary` line sets each engine's first row against the first full engine's. Options: `deepspeed`, DeepSpeed's
autograd function for every linear layer (ZeRO-3's `memory_efficient_linear` on; dsrl turns it off); `peft`, PEFT's own
adapter forward (`lora.add_in_place` not applied); `zero3`, LoRA's frozen base partitioned by ZeRO-3 (`--model.lora_base
partitioned`; dsrl replicates a base that fits). Without options an engine is built as dsrl builds it. LoRA per
module is the path before whole-layer gathering (PEFT's forward, five hooked modules per adapted layer).

Lengths: `longtail` = lognormal responses clipped to [32, max_len] (most short, a few at the limit, what
async rollout produces), `uniform` = every response max_len/2. Prompts are --prompt-len tokens. Each mode runs the
logprob pass and one update (the PPO loss, token_mean) `--repeats` times; the best is printed:

  before  right-padded micro-batches of --micro rows, the full fp32 log-softmax of every position (an emulation
          on today's code; --before-from runs an older dsrl/zero/actor.py itself instead, for an exact A/B:
          `git show REV:dsrl/zero/actor.py > /tmp/actor_before.py`)
  after   micro-batches of at most --budget tokens, padded rows of similar lengths, logits of response
          positions only, their fp32 log-softmax a chunk of positions at a time (dsrl's trainer as it is)
  packed  as after, every micro-batch one packed row under dsrl's attention (`trainer.pack_sequences`,
          `dsrl/zero/varlen.py`: torch's flash varlen kernel on CUDA), no padding; the default on CUDA

Figures: tokens/s (real tokens, no padding), MFU = (2 + 6) * params * tokens / seconds / --peak-tflops
(forward of the logprob pass + forward and backward of the update; with LoRA the same count, the full model's
work), the padded fraction of the tokens the
model ran on, and the update's peak memory; and how far each mode's logprobs are from the first mode's (mean
and max |difference| over the response tokens: the layouts agree to the precision's rounding).
"""

import argparse
import contextlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import time

import torch

from dsrl.auto import make_plan, use_cuda
from dsrl.config import Config, DataConfig, ModelConfig
from dsrl.data import Prompt, Sample
from dsrl.zero import actor, varlen
from dsrl.zero import engine as engine_module
from dsrl.zero.engine import init_distributed, load_engine


def legacy_forward_logprobs(engine, mb, temperature: float, with_entropy: bool = True):
    """The computation before this change, for the "before" row: every position's logits, fp32, log-softmax,
    and the entropy always."""
    logits = engine(**mb.model_inputs()).logits.float() / temperature
    logp = torch.log_softmax(logits, -1)
    token = mb.at_keep(logp).gather(-1, mb.targets[:, None])[:, 0]
    entropies = -(mb.at_keep(logp).exp() * mb.at_keep(logp)).sum(-1)
    return mb.response_aligned(token), mb.response_aligned(entropies)


def synthetic(n: int, dist: str, max_len: int, vocab: int, prompt_len: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if dist == "longtail":
            length = int(min(max_len, max(32, rng.lognormvariate(5.3, 1.1))))
        else:
            length = max_len // 2
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        s = Sample(
            Prompt(i, prompt, "", None), [rng.randrange(vocab) for _ in range(length)], [0.0] * length, "stop", 0
        )
        s.advantages = torch.full((length,), rng.choice([-1.0, 1.0]))
        out.append(s)
    return out


def load_actor(path: str):
    """An older dsrl/zero/actor.py as a module of its own (it imports today's dsrl for everything else)."""
    spec = importlib.util.spec_from_file_location("actor_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def profile(impl, engine, samples, cfg, rows: int = 25) -> None:
    """The logprob pass and the update, each under torch.profiler: its wall time against the GPU's busy time (a gap
    is time the GPU waited on the host), then the ops that took the GPU's time, and the host's."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = torch.cuda.is_available()
    passes = {
        "logprobs": lambda: impl.compute_logprobs(engine, samples, "old_logprobs", cfg, pad_id=0),
        "update": lambda: impl.update_actor(engine, samples, cfg, pad_id=0, kl_coef=0.0),
    }
    for name, run in passes.items():
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            run()
            torch.cuda.synchronize() if cuda else None
            wall = time.perf_counter() - start
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 1e6 if cuda else float("nan")
        launches = sum(e.count for e in events if e.key.startswith("cudaLaunchKernel"))
        print(f"profile {name}: wall {wall:.3f} s (under the profiler), GPU busy {busy:.3f} s, {launches} launches")
        by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        print(events.table(sort_by=by, row_limit=rows, max_name_column_width=60))
        print(events.table(sort_by="self_cpu_time_total", row_limit=rows // 2, max_name_column_width=60))


def measure(impl, engine, samples, cfg, repeats: int) -> dict:
    best = None
    for _ in range(repeats):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        start = time.perf_counter()
        impl.compute_logprobs(engine, samples, "old_logprobs", cfg, pad_id=0)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        logprobs_s = time.perf_counter() - start
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        stats = impl.update_actor(engine, samples, cfg, pad_id=0, kl_coef=0.0)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        update_s = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else float("nan")
        padded = stats.get("actor/padded_frac", float("nan"))
        run = {"logprobs_s": logprobs_s, "update_s": update_s, "peak_gb": peak, "padded": padded}
        if best is None or logprobs_s + update_s < best["logprobs_s"] + best["update_s"]:
            best = run
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--dist", nargs="+", default=["longtail", "uniform"], choices=["longtail", "uniform"])
    parser.add_argument("--max-len", type=int, default=4096, help="Longest response.")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--micro", type=int, default=16, help="before: rows per micro-batch.")
    parser.add_argument("--budget", default="16384", help='after: tokens per micro-batch, or "auto".')
    parser.add_argument("--before-from", help="before: run this older actor.py (see above), not the emulation.")
    parser.add_argument("--profile", type=int, default=0, help="Also profile each mode on this many samples.")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="The GPU's dense bf16 peak (H100/H200 SXM).")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (--model.lora_rank).")
    parser.add_argument("--checkpointing", action="store_true", help="Gradient checkpointing (both modes).")
    parser.add_argument("--liger", action="store_true", help="liger-kernel's fused kernels (--model.liger_kernel).")
    parser.add_argument(
        "--gather",
        default="layer",
        choices=["layer", "module"],
        help="ZeRO-3 gathers per decoder layer (--trainer.gather_per_layer) or per module.",
    )
    parser.add_argument("--engines", nargs="+", help="RANK:GATHER engines, one after another (see above).")
    parser.add_argument("--logprob-chunk", type=int, default=actor.LOGPROB_CHUNK, help="actor.LOGPROB_CHUNK.")
    parser.add_argument("--modes", nargs="+", default=["before", "after"], choices=["before", "after", "packed"])
    args = parser.parse_args()
    budget = args.budget if args.budget == "auto" else int(args.budget)
    before = load_actor(args.before_from) if args.before_from else None
    actor.LOGPROB_CHUNK = args.logprob_chunk

    specs = args.engines or [f"{args.lora_rank}:{args.gather}"]
    if len(specs) > 1:
        return each_in_its_own_process(specs)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    init_distributed(use_cuda(Config(model=ModelConfig(path=args.model), data=DataConfig(train_path="unused.jsonl"))))
    rank, gather, *options = specs[0].split(":")
    options = options[0].split(",") if options else []
    cfg = engine_config(args, int(rank), gather)
    cfg.model.lora_base = "partitioned" if "zero3" in options else "auto"
    with deepspeed_linear("deepspeed" in options), adapters_as("peft" in options):
        engine = load_engine(cfg, args.model, 1, train=True, plan=make_plan(cfg, args.model, 1))
    name = f"{f'LoRA {rank}' if int(rank) else 'full'} per {gather}" + "".join(f", {o}" for o in options)
    row = run_engine(args, cfg, engine, name, budget, before)
    print("ROW " + json.dumps({"name": name, **(row or {})}))


def each_in_its_own_process(specs: list[str]) -> None:
    """This command once per engine (`--engines SPEC`); then the summary against the first full engine."""
    argv, skipping = [], False
    for arg in sys.argv[1:]:  # all but --engines and its values
        skipping = arg == "--engines" or (skipping and not arg.startswith("--"))
        argv += [] if skipping else [arg]
    rows = {}
    for spec in specs:
        out = subprocess.run([sys.executable, __file__, *argv, "--engines", spec],
                             capture_output=True, text=True)  # fmt: skip
        print(out.stdout, end="", flush=True)
        if out.returncode:
            print(f"{spec}: exit {out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
        for line in out.stdout.splitlines():
            if line.startswith("ROW "):
                row = json.loads(line[4:])
                rows[row.pop("name")] = row
    full = next((r for name, r in rows.items() if name.startswith("full") and r), None)
    if full:
        figures = [f"{name}: " + ", ".join(f"{k} {r[k]:.2f} ({r[k] / full[k]:.2f}x)" for k in r)
                   for name, r in rows.items() if r]  # fmt: skip
        print("summary (against full):", "; ".join(figures))


@contextlib.contextmanager
def deepspeed_linear(on: bool):
    """With `on`, ZeRO-3's `memory_efficient_linear` for this process's engine (dsrl's `ds_config` turns it off)."""
    original = engine_module.ds_config

    def conf(*args, **kwargs) -> dict:
        out = original(*args, **kwargs)
        out["zero_optimization"]["memory_efficient_linear"] = on
        return out

    engine_module.ds_config = conf if on else original
    try:
        yield
    finally:
        engine_module.ds_config = original


@contextlib.contextmanager
def adapters_as(peft: bool):
    """With `peft`, PEFT's own adapter forward: `lora.add_in_place` is not applied."""
    original = engine_module.add_in_place
    engine_module.add_in_place = (lambda model: 0) if peft else original
    try:
        yield
    finally:
        engine_module.add_in_place = original


def engine_config(args, lora_rank: int, gather: str) -> Config:
    model = ModelConfig(path=args.model, gradient_checkpointing=args.checkpointing, lora_rank=lora_rank)
    model.liger_kernel = args.liger
    cfg = Config(model=model, data=DataConfig(train_path="unused.jsonl"))
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples = args.samples, 1
    cfg.trainer.lr, cfg.trainer.micro_batch_size = 1e-6, args.micro
    cfg.trainer.gather_per_layer = gather == "layer"
    return cfg


def run_engine(args, cfg, engine, name: str, budget, before) -> dict:
    """Every --dist and --modes row of one engine, ending in `name`; returns the first row's seconds and peak."""
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    vocab = engine.module.config.vocab_size
    print(
        f"model {args.model}: {params / 1e9:.2f}B parameters, vocabulary {vocab}, {args.samples} samples, "
        f"{name}{', checkpointing' if args.checkpointing else ''}"
        f"{', liger-kernel' if args.liger else ''}, log-probs {args.logprob_chunk} positions a chunk; "
        f"packed rows' attention: "
        f"{varlen.describe(next(engine.module.parameters()).dtype, torch.cuda.is_available())}"
    )
    header = f"{'lengths':>9} {'mode':>7} {'logprobs s':>11} {'update s':>9} {'tokens/s':>9} {'MFU':>6}"
    print(header + f" {'padded':>7} {'peak GB':>8} {'|dlogp| mean/max vs first':>26}  engine")
    first = None
    for dist in args.dist:
        samples = synthetic(args.samples, dist, args.max_len, vocab, args.prompt_len)
        tokens = sum(len(s.prompt.prompt_ids) + len(s.response_ids) for s in samples)
        agreement = {}  # each mode's logprobs, before any update moves the weights (and the kernels' warm-up)
        for mode in args.modes:
            with mode_of(mode, cfg, engine, budget, before) as impl:
                impl.compute_logprobs(engine, samples, "old_logprobs", cfg, pad_id=0)
            agreement[mode] = torch.cat([s.old_logprobs for s in samples])
        for mode in args.modes:
            try:
                with mode_of(mode, cfg, engine, budget, before) as impl:
                    r = measure(impl, engine, samples, cfg, args.repeats)
                    if args.profile:
                        print(f"== profile: {dist} {mode}, {args.profile} samples")
                        profile(impl, engine, samples[: args.profile], cfg)
            except torch.OutOfMemoryError as e:
                print(f"{dist:>9} {mode:>7}  out of memory: {str(e).splitlines()[0][:160]}  {name}")
                torch.cuda.empty_cache()
                continue
            diff = (agreement[mode] - agreement[args.modes[0]]).abs()
            agree = f"{diff.mean():12.2e} /{diff.max():9.2e}"
            seconds = r["logprobs_s"] + r["update_s"]
            mfu = 8 * params * tokens / seconds / (args.peak_tflops * 1e12)
            print(f"{dist:>9} {mode:>7} {r['logprobs_s']:11.2f} {r['update_s']:9.2f} {tokens / seconds:9.0f} "
                  f"{mfu:6.1%} {r['padded']:7.1%} {r['peak_gb']:8.1f} {agree}  {name}")  # fmt: skip
            first = first or {"logprobs_s": r["logprobs_s"], "update_s": r["update_s"], "peak_gb": r["peak_gb"]}
    return first


@contextlib.contextmanager
def mode_of(mode: str, cfg, engine, budget, before):
    """The trainer as `mode` runs it (its micro-batches, layout and attention); yields the actor module to call."""
    legacy = mode == "before"
    cfg.trainer.max_tokens_per_micro_batch = None if legacy else budget
    cfg.trainer.pack_sequences = mode == "packed"
    engine.module.config._attn_implementation = varlen.NAME if mode == "packed" else "sdpa"
    original = actor.forward_logprobs
    if legacy and not before:
        actor.forward_logprobs = legacy_forward_logprobs
    try:
        yield before if legacy and before else actor
    finally:
        actor.forward_logprobs = original


if __name__ == "__main__":
    main()
