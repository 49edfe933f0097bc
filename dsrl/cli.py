"""The `dsrl` console script: `dsrl train ...` runs the deepspeed launcher for you; `dsrl serve` the embedded engine."""

import argparse
import base64
import contextlib
import difflib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from dsrl.auto import rollout_engine, trainer_on_cuda
from dsrl.config import ConfigError, build_parser, dump_config, side_rollout, to_config, validate
from dsrl.rundir import (
    LOCK_FILE,
    OWNER_FLAG,
    STOP_SIGNALS,
    ExportTargetError,
    RunDirLocked,
    RunLock,
    WriteError,
    clear_stop,
    die_with_parent,
    request_stop,
)
from dsrl.serving.servers import check_server_args, free_port

USAGE = """usage: dsrl <command> [options]

commands:
  train   train a policy: parses and checks the config, then starts the trainer ranks with the
          deepspeed launcher (see `dsrl train --help`; `--print_config` shows the resolved config)
  serve   run the embedded CPU rollout engine (see `dsrl serve --help`)
  fleet   add servers to a live run, remove them, list them (see `dsrl fleet --help`)
  eval    score a model (a Hugging Face directory, or --checkpoint) on --eval.path with the run's reward
  export  write a training checkpoint as a Hugging Face model directory (see `dsrl export --help`)
"""


class Parser(argparse.ArgumentParser):
    """A subcommand's flags; a wrong one gets two lines, the error and "did you mean" where a close flag exists, as
    `dsrl train` says it, not argparse's usage block."""

    def parse_args(self, argv: list[str]) -> argparse.Namespace:
        self.argv = argv
        return super().parse_args(argv)

    def error(self, message: str):
        flags = [o for a in self._actions for o in a.option_strings]
        unknown = [w.split("=")[0] for w in self.argv if w.startswith("--") and w.split("=")[0] not in flags]
        near = difflib.get_close_matches(unknown[0], flags, n=1) if unknown else []
        hint = f"did you mean {near[0]}?" if near else f"`{self.prog} --help` lists the flags"
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: {hint}\n")


def train(argv: list[str]) -> int:
    parser = build_parser("dsrl train")
    cfg = to_config(parser, parser.parse_args(argv))
    run_dir = Path(cfg.logging.run_dir)
    try:
        validate(cfg)
        cuda = trainer_on_cuda(cfg.trainer, cuda_available)
        if not cuda:  # DeepSpeed (imported by PEFT here) would warn that it found no GPU
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        engine = rollout_engine(cfg, cuda)
        if cfg.rollout.fleet_kind != "external":
            check_server_args(cfg.rollout, engine)
        if cfg.reward_model.path and not cfg.reward_model.server_urls:
            check_server_args(side_rollout(cfg, cfg.reward_model), engine, "--reward_model.server_args")
        if cfg.distill.teacher_path and not cfg.distill.server_urls:
            check_server_args(side_rollout(cfg, cfg.distill), engine, "--distill.server_args")
        check_inputs(cfg, engine)
        from dsrl.fp8 import check_servers_load_fp8  # (torch: not imported before the launcher otherwise)

        check_servers_load_fp8(cfg, engine)
        check_lora_targets(cfg)
        lock = RunLock(run_dir).acquire("dsrl train")  # before anything is written there
    except (RunDirLocked, ValueError, TypeError) as e:  # a bad config (ConfigError), row, environment, template
        print(f"dsrl train: error: {e}", file=sys.stderr)
        return 2
    try:
        clear_stop(run_dir)
        return launch(cfg, run_dir, cuda)
    except NodeError as e:
        print(f"dsrl train: error: {e}", file=sys.stderr)
        return 2
    finally:
        lock.release()


def check_inputs(cfg, engine: str) -> None:
    """The datasets (and an environment: its class, tools and the chat template's rendering of its turns), the reward
    model's and the teacher's tokenizers against the policy's (their token ids must mean the same tokens) and a
    judge's parse function: read and checked here, before the launcher starts (what every rank would find)."""
    from transformers import AutoTokenizer

    from dsrl.data import check_datasets, server_context
    from dsrl.rewards.rules import load_function
    from dsrl.rollout.episode import Renderer, check_rendering, tool_schemas

    def tokenizer(path: str):
        return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)

    policy, tools, m = tokenizer(cfg.model.path), None, cfg.reward_model
    if cfg.rollout.env:
        tools = tool_schemas(load_function(cfg.rollout.env, "rollout.env"))
        check_rendering(Renderer(policy, tools, cfg.data.apply_chat_template))
    check_datasets(cfg, policy, server_context(cfg, cfg.model.path, engine, cfg.rollout.fleet_kind), tools)
    if m.path:
        from dsrl.rewards.models import sends_token_ids

        sends_token_ids(m, policy, tokenizer(m.path))
        if m.judge_template:
            load_function(m.judge_parse_fn, "reward_model.judge_parse_fn")
    if cfg.distill.teacher_path:
        from dsrl.rewards.teacher import check_vocabulary

        check_vocabulary(cfg.distill.teacher_path, policy, tokenizer(cfg.distill.teacher_path))


def check_lora_targets(cfg) -> None:
    """--model.lora_target_modules, matched by PEFT itself against the model's modules (built without weights)
    here, before any rank starts: a name no module has is one line naming the model's linear layers."""
    if not cfg.model.lora_rank:
        return
    import torch
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from dsrl.zero.lora import lora_config  # (it registers the vision-language models as causal LMs)

    config = AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    try:
        get_peft_model(model, lora_config(cfg.model))
    except ValueError as e:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(
            f"--model.lora_target_modules={cfg.model.lora_target_modules!r}: {str(e).splitlines()[0]} "
            f"The model's linear layers: {', '.join(linear)} (or all-linear)"
        ) from None


def launch(cfg, run_dir: Path, cuda: bool) -> int:
    """The deepspeed launcher for the run's ranks, in a process group of its own. SIGTERM or SIGINT here
    asks the ranks to stop at the end of the step (and checkpoint: --logging.save_on_signal) through the
    run directory; a second signal, or --logging.stop_timeout_s later, kills every process of the run.
    Returns the launcher's exit status, or 128 + the signal's number when it was stopped."""
    config_path = run_dir / "config.yaml"
    dump_config(cfg, config_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cuda:
        env.update(NCCL_CUMEM_ENABLE="0", DSRL_CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", ""))
    else:
        # gloo ranks on CPU; one thread each (measured: 3x faster on a small box than the default)
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
        pin_cpu_kernels(env)
    owner, port = f"{os.getpid()}@{socket.gethostname()}", free_port()
    if cfg.trainer.hostfile:
        listener, port = across_nodes(cfg, run_dir, env)
        owner += f"@{listener[0]}:{listener[1]}"  # ranks on other nodes watch it: it refuses once this process is gone
    cmd = launcher_command(cfg.trainer, cuda, env, port)
    cmd += ["--module", "--no_local_rank", "dsrl.train", "--config", str(config_path)]
    say(f"{' '.join(cmd)}\ndsrl train: the ranks speak once torch, DeepSpeed and transformers are imported (10-70 s)")
    cmd.append(f"{OWNER_FLAG}{owner}")  # each rank ends when this process does
    # Its own process group: a Ctrl-C on the terminal reaches this process only (the launcher would kill
    # the ranks at once), and the whole run can be killed as a group. Killed with this process (SIGKILL
    # included): the ranks see this process gone and end themselves (dsrl.rundir.OwnerWatch).
    pipe = subprocess.PIPE if cfg.trainer.hostfile else None  # (pdsh's word of each node's end: `node_ends`)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent, stderr=pipe, text=True)
    signals: list[int] = []
    ended = node_ends(proc) if pipe else []

    def asked(signum: int, _) -> None:  # the STOP file at once: the ranks read it at the end of the step under way
        if not signals:
            request_stop(run_dir, signum)
        signals.append(signum)

    previous = {sig: signal.signal(sig, asked) for sig in STOP_SIGNALS}
    try:
        status = supervise(proc, run_dir, signals, cfg.logging.stop_timeout_s, ended)
        if status and not signals and cfg.trainer.hostfile:  # a node lost? (a rank on it left no word of its own)
            from dsrl.nodes import hostfile_hosts, unanswering

            for host, why in unanswering(hostfile_hosts(cfg.trainer.hostfile)).items():
                say(f"trainer node {host} does not answer ssh ({why}): it is lost; once it is back, the same command "
                    "resumes the run from its last checkpoint")  # fmt: skip
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        kill_group(proc)  # nothing of the run outlives this command


def across_nodes(cfg, run_dir: Path, env: dict) -> tuple[tuple[str, int], int]:
    """A run on the nodes of --trainer.hostfile: a port of this process's that the ranks of other nodes watch (it
    refuses once this process is gone), each node checked over ssh (`nodes.check_nodes`: the run directory, the model
    and the data at the same path, that port reached), and the settings the launcher does not pass on written for it
    (`nodes.env_file`). Returns the port's address, and rank 0's master port (free on its node). A node that lacks
    anything stops the run here, before any rank starts, with a line naming the node and what it lacks."""
    from dsrl.nodes import check_nodes, env_file, hostfile_hosts, routable_address

    hosts = hostfile_hosts(cfg.trainer.hostfile)
    server = socket.create_server((routable_address(hosts[0]), 0))

    def answer() -> None:
        while True:
            server.accept()[0].close()

    threading.Thread(target=answer, daemon=True).start()
    paths = {"the working directory": os.getcwd(), "--model.path": cfg.model.path, "--data.train_path":
             cfg.data.train_path, "--eval.path": cfg.eval.path}  # fmt: skip
    paths = {flag: str(Path(p).resolve()) for flag, p in paths.items() if p and Path(p).exists()}
    problems, port = check_nodes(hosts, paths, run_dir.resolve() / LOCK_FILE, server.getsockname()[:2])
    if problems:
        raise NodeError("a node of --trainer.hostfile cannot run this: " + "\n".join(problems))
    env["DS_ENV_FILE"] = str(env_file(run_dir, env))
    return server.getsockname()[:2], port


class NodeError(RuntimeError):
    """A node of the hostfile lacks what the run needs (`across_nodes`)."""


def pin_cpu_kernels(env) -> None:
    """AVX2 kernels in the processes started with `env`, on an x86 CPU with AVX-512 too: torch's own and MKL's GEMMs
    (MKL_CBWR, its reproducible mode). AVX2 and AVX-512 round differently and sampling grows it: without torch's pin
    the toy run's numbers parted at step 27 (README); with it alone, an AMX-capable VM still parted before step 50,
    where MKL chose other kernels. A user's own setting of either stays."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and "avx2" in cpuinfo.read_text().split():
        env.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        env.setdefault("MKL_CBWR", "AVX2")


NODE_GRACE_S = 10.0
"""How long the other nodes' ranks may go on after one node's failed, before `dsrl train` stops them: they end on
their own at their next collective, but not those still waiting to join the world (a rank that failed before it
joined left the others waiting 30 minutes, the store's timeout)."""


def node_ends(proc: subprocess.Popen) -> list[tuple[str, int, float]]:
    """The launcher's stderr, passed on line by line; the list fills with (host, status, when) as pdsh says a node's
    launch ended in failure ("pdsh@a: 10.0.0.4: ssh exited with exit code 1")."""
    ended: list[tuple[str, int, float]] = []

    def read() -> None:
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            if (m := re.match(r"pdsh@\S+: (\S+): ssh exited with exit code (\d+)", line)) and int(m[2]):
                ended.append((m[1], int(m[2]), time.monotonic()))

    threading.Thread(target=read, daemon=True).start()
    return ended


def supervise(proc: subprocess.Popen, run_dir: Path, signals: list[int], stop_timeout_s: float,
              ended: list[tuple[str, int, float]] = ()) -> int:  # fmt: skip
    deadline = None
    while proc.poll() is None:
        if ended and time.monotonic() > ended[0][2] + NODE_GRACE_S:
            say(f"the ranks of trainer node {ended[0][0]} exited with status {ended[0][1]} {NODE_GRACE_S:.0f} s ago "
                "and the others went on: stopping them")  # fmt: skip
            kill_group(proc)
            return 1
        if signals and deadline is None:
            deadline = time.monotonic() + stop_timeout_s
            say(f"{signal.Signals(signals[0]).name}: the run stops at the end of this step (within "
                f"{stop_timeout_s:g}s, --logging.stop_timeout_s); send it again to stop at once")  # fmt: skip
        if len(signals) > 1 or (deadline is not None and time.monotonic() > deadline):
            say(f"{'a second signal' if len(signals) > 1 else f'--logging.stop_timeout_s={stop_timeout_s:g}s passed'}"
                ": killing the run")  # fmt: skip
            kill_group(proc)
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
    if signals:
        clear_stop(run_dir)
        return 128 + signals[0]
    if proc.returncode not in (0, 1):  # 1: a rank said why (its error, or a traceback); the launcher is quiet (QUIET)
        say(rank_failure(proc.returncode))
    return proc.returncode


def rank_failure(status: int) -> str:
    """What the launcher's exit status says: it exits with a failed rank's return code, and a rank killed by signal N
    returns -N, which exits as 256 - N (a 32B rank killed by the kernel when the host ran out of memory: 247)."""
    sig = next((s for s in KILLS if status in (256 - s, -s)), None)
    if sig is None:
        return f"a trainer rank failed: the launcher exited with status {status}"
    why = (": most often the kernel's OOM killer, when the host's memory ran out (`dmesg` says; with ZeRO-Offload, "
           "a smaller --trainer.offload_optimizer_ratio)") if sig == signal.SIGKILL else ""  # fmt: skip
    who = "the launcher" if status < 0 else "a trainer rank"
    return f"{who} was killed by {sig.name} (the launcher's status {status}){why}"


KILLS = (signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGTERM)
"""Signals a rank dies of; other statuses above 128 may be a rank's own sys.exit(-1) (255)."""


def say(line: str) -> None:
    """A line to stderr; on a terminal it first clears rank 0's progress bar from the line, which tqdm redraws below."""
    print(("\r\x1b[K" if sys.stderr.isatty() else "") + f"dsrl train: {line}", file=sys.stderr, flush=True)


def kill_group(proc: subprocess.Popen, grace_s: float = 40.0) -> None:
    """SIGTERM the launcher's process group (DeepSpeed's launcher then terminates each rank's process tree,
    servers included, within 30 s), SIGKILL what is left after `grace_s`."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the launcher itself, or the group never empties
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch (2-3 s of start-up) where no NVIDIA driver is."""
    if not Path("/proc/driver/nvidia").exists() and not any(Path("/dev").glob("nvidia[0-9]*")):
        return False
    import torch

    return torch.cuda.is_available()


def launcher_command(t, cuda: bool, env: dict, port: int) -> list[str]:
    """DeepSpeed's launcher for the ranks. On one machine its node launcher (`deepspeed.launcher.launch`) is
    started directly with the ranks' devices, as DeepSpeed's runner would start it: the runner, a process that
    only reads the hostfile and starts the node launcher, cost 4 s of every run. With --trainer.hostfile the
    runner reaches the other nodes."""
    if t.hostfile:
        runner = [sys.executable, "-m", "deepspeed.launcher.runner", QUIET]
        cmd = runner + ["--master_port", str(port), "--hostfile", t.hostfile]
        if not cuda:
            return cmd + ["--num_accelerators", str(t.num_ranks or 1)]
        return cmd + (["--num_gpus", str(t.num_ranks)] if t.num_ranks else [])  # per node; the hostfile's GPUs
    devices = range(t.num_ranks or 1)
    if cuda:  # the node launcher sets CUDA_VISIBLE_DEVICES itself, to these
        devices = local_gpus(t.num_ranks, env.pop("CUDA_VISIBLE_DEVICES", ""), gpu_count)
    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(devices)}).encode()).decode()
    launch = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", QUIET, f"--world_info={world}"]
    return launch + ["--master_addr=127.0.0.1", f"--master_port={port}"]


# DeepSpeed's launcher's own lines (its world, CUDA_VISIBLE_DEVICES even on CPU, pids, "[ERROR] ... exits with return
# code = 1" after a rank's own message) tell a user nothing: `supervise` speaks when a rank failed without saying why.
QUIET = "--log_level=critical"


def local_gpus(num_ranks: int, visible: str, count) -> list[int]:
    """The GPUs of this machine's ranks: the first `num_ranks` visible ones (all of them given 0), as the
    servers take theirs from the visible GPUs too (a colocated server must sit on its trainer rank's GPU)."""
    gpus = [int(g) for g in visible.split(",")] if visible else list(range(count()))
    if num_ranks > len(gpus):
        raise SystemExit(f"dsrl train: trainer.num_ranks={num_ranks}, but this machine has {len(gpus)} GPUs"
                         + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else ""))  # fmt: skip
    return gpus[:num_ranks] if num_ranks else gpus


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def fleet(argv: list[str]) -> int:
    """Change a live run's rollout servers; applied at its next weight update."""
    from dsrl.serving.control import call, wait_applied

    parser = Parser(prog="dsrl fleet", description=fleet.__doc__)
    parser.add_argument("action", choices=["add", "remove", "list"])
    parser.add_argument("--run", required=True, help="The live run's --logging.run_dir.")
    parser.add_argument("--count", type=int, help="add: start this many servers (fleet local or ray).")
    parser.add_argument("--url", help="add: a running server to take in (fleet external); remove: the server.")
    parser.add_argument("--wait", type=float, default=0, help="Seconds to wait until the run has applied it.")
    args = parser.parse_args(argv)
    if args.action == "list":
        print(json.dumps(call(args.run, "GET", "/fleet"), indent=2))
        return 0
    if args.action == "remove" and not args.url:
        parser.error("remove needs --url")
    body = {"url": args.url} if args.url else {"count": args.count or 1}
    reply = call(args.run, "POST", f"/fleet/{args.action}", body)
    print(json.dumps(reply))
    if args.wait:
        outcome = wait_applied(args.run, reply["id"], args.wait)
        print(outcome)
        return 0 if outcome == "done" else 1
    return 0


def evaluate(argv: list[str]) -> int:
    """`dsrl eval`: the train flags (a run's config.yaml works) with --eval.path set; --checkpoint DIR
    scores a training checkpoint (exported to <run_dir>/hf_<step> first), else --model.path's weights."""
    parser = build_parser("dsrl eval")
    parser.description = evaluate.__doc__.replace("`dsrl eval`: ", "Score a model: ")
    parser.add_argument("--checkpoint", type=str | None, default=None, help="A checkpoint directory to score.")
    ns = parser.parse_args(argv)
    cfg = to_config(parser, ns)
    problems = [] if cfg.eval.path else ["--eval.path: required, the prompts to score"]
    if cfg.model.init_from_config and not ns.checkpoint:
        problems.append("--model.init_from_config is set: give trained weights (--model.path, or --checkpoint)")
    try:
        validate(cfg, world=1)
        if problems:
            raise ConfigError(problems)
    except ConfigError as e:
        print(f"dsrl eval: error: {e}", file=sys.stderr)
        return 2
    from dsrl.evaluate import evaluate_model

    model_dir = cfg.model.path
    if ns.checkpoint:
        model_dir = str(export_to_hf(Path(ns.checkpoint), None, overwrite=True))  # <run_dir>/hf_step_<N>: dsrl's own
    cuda = trainer_on_cuda(cfg.trainer, cuda_available)
    engine = rollout_engine(cfg, cuda)
    metrics = evaluate_model(cfg, model_dir, engine)
    print(json.dumps(metrics, indent=1, sort_keys=True))
    return 0


def export(argv: list[str]) -> int:
    """`dsrl export`: a training checkpoint as a Hugging Face model directory (sharded safetensors, config,
    tokenizer), loadable by transformers and SGLang."""
    parser = Parser(prog="dsrl export", description=export.__doc__)
    parser.add_argument("--checkpoint", required=True, help="<run_dir>/checkpoints/step_<N>")
    parser.add_argument("--out", default=None, help="Default: <run_dir>/hf_step_<N>.")
    parser.add_argument("--shard-gb", type=float, default=2.0, help="Size of each safetensors file.")
    parser.add_argument(
        "--overwrite", action="store_true", help="Replace a previous dsrl export in --out (nothing else is replaced)."
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s [dsrl] %(message)s")  # the export's progress
    out = Path(args.out) if args.out else None
    try:
        out = export_to_hf(Path(args.checkpoint), out, int(args.shard_gb * (1 << 30)), args.overwrite)
    except (ExportTargetError, WriteError) as e:
        print(f"dsrl export: error: {e}", file=sys.stderr)
        return 2
    print(f"dsrl export: {out}")
    return 0


def export_to_hf(checkpoint: Path, out: Path | None, shard_bytes: int = 2 << 30, overwrite: bool = False) -> Path:
    """`dsrl export`'s work; the checkpoint's run tells which model (and tokenizer) its weights belong to."""
    import yaml

    from dsrl.zero.checkpoint import export_checkpoint

    run_dir = checkpoint.resolve().parent.parent
    config = run_dir / "config.yaml"
    if not (checkpoint / "dsrl_state.json").is_file() or not config.is_file():
        raise SystemExit(f"dsrl: {checkpoint} is not a checkpoint of a dsrl run (<run_dir>/checkpoints/step_<N>)")
    model = yaml.safe_load(config.read_text())["model"]
    model_dir = str(run_dir / "init_model") if model.get("init_from_config") else model["path"]
    out = out or run_dir / f"hf_{checkpoint.name}"
    export_checkpoint(checkpoint, model_dir, out, shard_bytes, overwrite)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command in ("eval", "export") and not cuda_available():  # DeepSpeed would warn that it found no GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        pin_cpu_kernels(os.environ)  # for the servers `dsrl eval` starts: the kernels of `dsrl train`'s
    if command == "serve":
        from dsrl.serving.embedded import main as serve

        serve(rest)
        return 0
    commands = {"train": train, "fleet": fleet, "eval": evaluate, "export": export}
    if command in commands:
        return commands[command](rest)
    near = difflib.get_close_matches(command, [*commands, "serve"], n=1)
    hint = f"did you mean `dsrl {near[0]}`?" if near else "`dsrl --help` lists the commands"
    print(f"dsrl: error: unknown command {command!r}\ndsrl: {hint}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
