"""verl and dsrl back to back on one GPU: the same model directory, prompts, reward function and GRPO settings;
each framework's own timings mapped to the same phases, peak GPU and host memory polled the same way, one table.

Both read one parquet file in verl's format (chat-message prompts, the answer at reward_model.ground_truth,
data_source) made from the toy task's prompts, and score with one function in verl's interface
(tools/peers/verl_reward.py, which dsrl calls as it is). The model directory gets a chat template that renders the
messages' text as it is (verl always applies one), so both send the same token ids. On the GPU machine, after
`source .gpu/setup.sh` and with verl's packages unpacked (tools/peers/build_site.sh):

    python3 tools/peers/peers.py --model /tmp/models/1.5b --runs verl dsrl --limits 305 170 --out $OUT  # 64 x 8 x 512
    python3 tools/peers/peers.py --workload toy --runs verl dsrl --seeds 0 1 --steps 100 --out $OUT
    python3 tools/peers/peers.py --workload 7b --model /tmp/models/7b --runs verl dsrl --out $OUT  # 16 x 4 x 256
    python3 tools/peers/report.py $OUT                                                   # the table again

On an H200 (1.5B), verl's three steps took 317 s in all: ~200 s of start-up and exit, ~65 s for its first step
(one-time compilation and warm-up), ~24 s a step after it; dsrl ~130 s to its first step, ~14 s a step after it:
give each run's --limits room for the steps asked.

A run is `verl` (its best settings this image can run), `dsrl` (dsrl's defaults), `dsrl-padded`, `dsrl-recompute`
or `dsrl-sync` (like verl's in one respect each: DSRL_VARIANTS). Each run's record
goes into OUT/peers.json as soon as it ends, so a call cut off keeps what finished; with --budget (the seconds the
caller gives the whole invocation) each run's limit is cut so that the harness, not the caller, stops the last one,
and its steps so far are kept too.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""The chat template given to the model: the messages' text as it is, so a templated prompt is the toy prompt."""

REWARD = ROOT / "tools/peers/verl_reward.py"


def verl_rows(rows: list[dict], source: str = "toy") -> list[dict]:
    """Rows of prompt/answer as verl's data preprocessing writes them (e.g. its gsm8k.py)."""
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": row["prompt"]}],
            "ability": "copy",
            "reward_model": {"style": "rule", "ground_truth": row["answer"]},
            "extra_info": {"split": "train", "index": i},
        }
        for i, row in enumerate(rows)
    ]


def write_parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(verl_rows(rows)), path)
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


SERVER = {"attention_backend": "triton", "sampling_backend": "pytorch", "cuda_graph_backend_prefill": "disabled"}
"""SGLang's settings in both frameworks: the kernels this image carries (no FA3), and no prefill CUDA graphs (SGLang
0.5.17 captures 58 by default, a minute of each start, for prompts of 4 tokens here); decode graphs stay on."""

WORKLOADS = report.WORKLOADS


def verl_command(
    w: dict, model: Path, data: Path, work: Path, steps: int, seed: int, overrides: list[str] = ()
) -> list[str]:
    """verl 0.9.1's PPO entry point, GRPO, one GPU, colocated with SGLang (its hybrid engine), at the settings its
    docs give for one GPU that this image can run: dynamic batch size by tokens, its fused log-prob kernels, no
    remove-padding (it needs flash-attn, which has no wheel for torch 2.11: sdpa instead, padded rows), no offload,
    KL off. `overrides` (hydra's KEY=VALUE) replace or add settings: actor_rollout_ref.model.use_fused_kernels=false
    is the path the first runs took (a Python loop over every token's log-softmax; docs/benchmarks.md, "Beside
    verl")."""
    toy = w["new_tokens"] < 16
    args = {
        "algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": False,
        "data.train_files": data, "data.val_files": data, "data.train_batch_size": w["prompts"],
        "data.max_prompt_length": 16, "data.max_response_length": w["new_tokens"], "data.seed": seed,
        "data.filter_overlong_prompts": False, "data.dataloader_num_workers": 0,
        "actor_rollout_ref.model.path": model, "actor_rollout_ref.model.use_remove_padding": False,
        "actor_rollout_ref.model.enable_gradient_checkpointing": False,
        "actor_rollout_ref.model.use_fused_kernels": True,
        "+actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
        "actor_rollout_ref.actor.optim.lr": w["lr"], "actor_rollout_ref.actor.optim.weight_decay": 0.0,
        "actor_rollout_ref.actor.ppo_mini_batch_size": w["prompts"], "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": w["tokens"], "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.actor.entropy_coeff": 0, "actor_rollout_ref.actor.clip_ratio": 0.2,
        "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 2 * w["tokens"],
        "actor_rollout_ref.rollout.name": "sglang", "actor_rollout_ref.rollout.mode": "async",
        "actor_rollout_ref.rollout.n": w["n"], "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "actor_rollout_ref.rollout.gpu_memory_utilization": w["mem"], "actor_rollout_ref.rollout.enforce_eager": toy,
        **{f"+actor_rollout_ref.rollout.engine_kwargs.sglang.{k}": v for k, v in SERVER.items()},
        "reward.custom_reward_function.path": REWARD, "reward.custom_reward_function.name": "compute_score",
        "trainer.n_gpus_per_node": 1, "trainer.nnodes": 1, "trainer.total_training_steps": steps,
        "trainer.total_epochs": 1000, "trainer.logger": '["console","file"]', "trainer.val_before_train": False,
        "trainer.test_freq": -1, "trainer.save_freq": -1, "trainer.project_name": "peers",
        "trainer.experiment_name": "verl", "trainer.default_local_dir": work / "verl_ckpt",
        "+ray_kwargs.ray_init.include_dashboard": False, "hydra.run.dir": work / "verl_hydra",
    }  # fmt: skip
    # fp32 training as dsrl's toy run (configs/toy_gpu.yaml: precision fp32, no CUDA graphs); SGLang serves that
    # fp32 model in float16 (its `--dtype auto`), as it does for dsrl: its RMSNorm kernel has no fp32
    if toy:
        args |= {"actor_rollout_ref.rollout.dtype": "float16",
                 "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": "fp32"}  # fmt: skip
    if w.get("offload"):  # the optimizer's states alone: with the parameters too (its docs' one-GPU 7B setting),
        # its first weight sync ran a 128 GB host out of memory (docs/benchmarks.md, "Beside verl": 7B)
        args |= {"actor_rollout_ref.actor.fsdp_config.param_offload": False,
                 "actor_rollout_ref.actor.fsdp_config.optimizer_offload": True,
                 "actor_rollout_ref.model.enable_gradient_checkpointing": True}  # fmt: skip
    args |= dict(o.split("=", 1) for o in overrides)  # one value a key: hydra refuses a key given twice
    return [sys.executable, "-m", "verl.trainer.main_ppo", *(f"{k}={_hydra(v)}" for k, v in args.items())]


def _hydra(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


DSRL_VARIANTS = {
    "dsrl": ("best", {}),
    "dsrl-padded": ("padded rows", {"--trainer.pack_sequences": "false"}),
    "dsrl-recompute": ("old log-probs pass", {"--trainer.old_logprobs": "recompute"}),
    "dsrl-sync": ("synchronous", {"--rollout.max_staleness": 0, "--algorithm.off_policy": "none"}),
}
"""dsrl's runs, each a mode (the table's column) and the flags that differ from its defaults: padded rows, like
verl's here (flash-attn, which verl's remove-padding needs, has no wheel for this torch); the old log-probs in a pass
of their own before the update, as verl computes them; synchronous (the 7B workload's dsrl is one-step-off), as
verl's trainer is."""


def dsrl_command(w: dict, model: Path, data: Path, run_dir: Path, steps: int, seed: int, name: str = "dsrl") -> list:
    """dsrl's colocated GRPO at its defaults (`name` a variant: DSRL_VARIANTS), with the same workload, reward and
    learning settings as verl's."""
    toy = w["new_tokens"] < 16
    args = {
        "--model.path": model, "--data.train_path": data, "--data.answer_key": "reward_model.ground_truth",
        "--algorithm.reward_fn": "verl_reward:compute_score",
        "--rollout.prompts_per_step": w["prompts"], "--rollout.n_samples": w["n"],
        "--rollout.max_new_tokens": w["new_tokens"], "--rollout.mem_fraction_static": w["mem"],
        "--trainer.lr": w["lr"], "--trainer.max_tokens_per_micro_batch": w["tokens"],
        "--trainer.total_steps": steps, "--seed": seed, "--sync.verify": "off",
        "--logging.tensorboard": "true", "--logging.run_dir": run_dir, "--rollout.server_args": json.dumps(SERVER),
    }  # fmt: skip
    if w.get("offload"):  # (the host's RAM holds 60% of 7B's Adam states beside the rest: docs/benchmarks.md)
        args |= {"--trainer.offload_optimizer": "true", "--trainer.offload_optimizer_ratio": 0.6,
                 "--rollout.max_staleness": 1, "--algorithm.off_policy": "tis"}  # fmt: skip
    args |= DSRL_VARIANTS[name][1]
    if toy:
        server = SERVER | {"disable_cuda_graph": True}
        args |= {"--trainer.precision": "fp32", "--rollout.server_args": json.dumps(server)}
    flat = [str(x) for kv in args.items() for x in kv]
    return [sys.executable, "-m", "dsrl.cli", "train", "--config", str(ROOT / "configs/gpu_colocate.yaml"), *flat]


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


def gpu_used_gb() -> float:
    try:
        return sum(float(x) for x in gpu_query("memory.used").split()) * 2**20 / 1e9
    except ValueError:
        return 0.0


def host_used_gb() -> float:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    kb = int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])
    return kb * 1024 / 1e9


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


def one_run(name: str, args, w: dict, model: Path, data: Path, seed: int, limit: float) -> dict:
    """Run `name` (verl, or one of DSRL_VARIANTS) once; its record: per-step metrics, memory, the command."""
    work = args.workdir / f"{name}_{args.workload}_s{seed}"
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # DeepSpeed's FusedAdam build (dsrl) cannot parse torch's default arch list ("9.0a"): name the GPU's own
    env["TORCH_CUDA_ARCH_LIST"] = gpu_query("compute_cap") or "9.0"
    env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/jitcache/torch_extensions")
    # tools/peers for dsrl's `verl_reward:compute_score` (the GPU site has a top-level package named `tools`)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(REWARD.parent), env.get("PYTHONPATH", "")) if p)
    framework = name.split("-")[0]
    if framework == "verl":
        env["VERL_FILE_LOGGER_PATH"] = str(work / "metrics.jsonl")
        env["PYTHONPATH"] = os.pathsep.join((str(args.verl_site), env["PYTHONPATH"]))
        argv = verl_command(w, model, data, work, args.steps, seed, args.verl_overrides)
    else:
        argv = dsrl_command(w, model, data, work / "run", args.steps, seed, name)
    log = args.out / f"{name}_{args.workload}_s{seed}.log"
    outcome = run(argv, log, limit, env, VERL_DONE if framework == "verl" else None)
    if framework == "verl":
        steps = report.verl_steps(work / "metrics.jsonl", log.read_text(errors="replace"))
    else:
        steps = report.dsrl_steps(work / "run")
    mode = DSRL_VARIANTS[name][0] if framework == "dsrl" else "best"
    return {"framework": framework, "mode": mode, "workload": f"{args.workload} {model.name}", "model": str(model),
            "gpu": gpu_query("uuid"), "seed": seed, "samples": w["prompts"] * w["n"], "steps": steps,
            "command": " ".join(map(str, argv)), **outcome}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a model directory (tools/gpu_models.py); the toy's is built")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="step")
    p.add_argument("--runs", nargs="+", default=["verl", "dsrl"], choices=["verl", *DSRL_VARIANTS])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--limits", type=float, nargs="+", default=[240], help="seconds each run may take (one for all)")
    p.add_argument("--budget", type=float, default=float("inf"), help="seconds for the whole invocation (run_limit)")
    p.add_argument("--data", type=Path, default=ROOT / "examples/toy/train.jsonl")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/peers"))
    p.add_argument("--verl-site", type=Path, default=Path("/tmp/verlsite"))
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
    data = write_parquet(rows, args.workdir / "train.parquet")
    record_path = args.out / "peers.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {"runs": {}}
    limits = dict(zip(args.runs, args.limits * len(args.runs) if len(args.limits) == 1 else args.limits))
    for seed in args.seeds:
        for name in args.runs:
            key = f"{name} {source.name}" + (f" seed {seed}" if len(args.seeds) > 1 else "")
            limit = run_limit(limits[name], deadline, time.monotonic())
            if limit <= 0:
                print(f"{key}: not run, --budget {args.budget:.0f} s is spent", flush=True)
                continue
            record["runs"][key] = one_run(name, args, w, model, data, seed, limit)
            record_path.write_text(json.dumps(record, indent=1))
            print(report.table({"runs": {key: record["runs"][key]}}).splitlines()[-1], flush=True)
    print(report.table(record))
    report.plot_phases(record, args.out / "phases.png")
    report.plot_curves(record, args.out / "curves.png")
    # few files come back from $OUT: the runs' logs go as one archive per invocation
    with tarfile.open(args.out / f"logs_{args.workload}_{source.name}.tar.gz", "w:gz") as tar:
        for name, seed in ((n, s) for s in args.seeds for n in args.runs):
            log = args.out / f"{name}_{args.workload}_s{seed}.log"
            tar.add(log, arcname=log.name)
            log.unlink()


if __name__ == "__main__":
    main()
