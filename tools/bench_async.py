"""Asynchronous rollout on a long-tail workload: wall time for the same trained samples, and final reward.

The toy task, but one prompt in ten must generate --long-tokens tokens, 12x (CPU) or 20x (GPU) the
others' 5 (its row carries sampling_params {max_new_tokens: N, ignore_eos: true}), and the embedded
engine is slowed to --decode-delay-ms per decode step so that generation, as on GPUs, is the long
pole. Each schedule trains the same number of steps on the same data; time is the sum of the steps
(start-up excluded). A tail longer than the toy model's 64-token context runs on a copy of the toy
model with a longer one.

    python tools/bench_async.py                    # CPU, embedded engine
    python tools/bench_async.py --steps 150 --decode-delay-ms 8
    python tools/bench_async.py --gpu --steps 60   # 2 GPUs: trainer on GPU 0, SGLang on GPU 1
    python tools/bench_async.py --gpu --steps 60 --schedules 0 4 --rollout.max_concurrency 768
    python tools/bench_async.py --gpu --steps 60 --schedules 0 6 7   # SGLang's pause instead of aborts
    python tools/bench_async.py --gpu --steps 60 --schedules 0 7 9 10   # admitting 4 batches ahead, 1 or 2
    python tools/bench_async.py --schedules 0 4 --seed 1 --trainer.lr 1e-3   # other flags go to dsrl train

On GPUs (configs/toy_gpu_async.yaml: max_concurrency 768) SGLang runs at its own speed: no decode delay.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsrl.tasks.toy import make_rows  # noqa: E402

SCHEDULES = [  # (label, max_staleness, interrupt, pause_mode, max_ahead); 5- are not in the default set
    ("synchronous", 0, "wait", None, None),
    ("one-step-off", 1, "wait", None, None),
    ("one-step-off + partial", 1, "partial", None, None),
    ("async k=4", 4, "wait", None, None),
    ("async k=4 + partial", 4, "partial", None, None),
    ("async k=8 + partial", 8, "partial", None, None),  # for tails that outlast 4 trainer steps
    ("async k=4 + pause in place", 4, "pause", "in_place", None),  # requests stay on the server through updates
    ("async k=4 + pause retract", 4, "pause", "retract", None),
    ("async k=2 + pause retract", 2, "pause", "retract", None),
    ("async k=4 + pause retract, 1 ahead", 4, "pause", "retract", 1),  # short groups wait less in the queue
    ("async k=4 + pause retract, 2 ahead", 4, "pause", "retract", 2),
]


def long_tail_rows(n: int, seed: int, long_tokens: int) -> list[dict]:
    rows = make_rows(n, seed)
    for i, row in enumerate(rows):
        if i % 10 == 0:
            row["sampling_params"] = {"max_new_tokens": long_tokens, "ignore_eos": True}
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--decode-delay-ms", type=float, default=5.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--gpu", action="store_true", help="SGLang on GPU 1, the trainer on GPU 0")
    p.add_argument("--long-tokens", type=int, help="length of the long responses (default: 60 on CPU, 100 on GPU)")
    p.add_argument("--schedules", nargs="*", type=int, help="indices into SCHEDULES (default: 0-4)")
    p.add_argument("--seed", type=int, default=0, help="dsrl's --seed (sampling, shuffling, init); repeat for noise")
    args, extra = p.parse_known_args()  # the rest goes to every `dsrl train`, e.g. --trainer.lr 1e-3
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dsrl_bench_async_"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "long_tail.jsonl"
    long_tokens = args.long_tokens or (100 if args.gpu else 60)  # the others get the config's max_new_tokens, 5
    data.write_text("".join(json.dumps(r) + "\n" for r in long_tail_rows(4096, 0, long_tokens)))
    # The final weights are scored on the toy test prompts, without the forced tail: the training reward of
    # the last steps comes from policies up to max_staleness versions older, and is noisier.
    held_out = work / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in make_rows(256, 1)))
    results = []
    config = ROOT / ("configs/toy_gpu_async.yaml" if args.gpu else "configs/toy_cpu_async.yaml")
    model = ROOT / "examples/toy/model"
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    if long_tokens + 32 > context:  # room for the prompt, and SGLang refuses inputs within 6 tokens of the context
        model = work / "toy_model_long_context"
        shutil.copytree(ROOT / "examples/toy/model", model, dirs_exist_ok=True)
        model_config = json.loads((model / "config.json").read_text())
        model_config["max_position_embeddings"] = 2 ** (long_tokens + 32).bit_length()
        (model / "config.json").write_text(json.dumps(model_config, indent=2))
    schedules = [SCHEDULES[i] for i in args.schedules] if args.schedules else SCHEDULES[:5]
    for label, k, interrupt, pause_mode, ahead in schedules:
        run_dir = work / f"k{k}_{interrupt}{'_' + pause_mode if pause_mode else ''}{f'_ahead{ahead}' if ahead else ''}"
        cmd = [sys.executable, "-m", "dsrl.cli", "train", "--config", str(config)]
        cmd += ["--model.path", str(model), "--data.train_path", str(data), "--trainer.total_steps", str(args.steps)]
        cmd += ["--rollout.max_staleness", str(k), "--rollout.interrupt", interrupt]
        cmd += ["--rollout.pause_mode", pause_mode] if pause_mode else []
        cmd += ["--rollout.max_ahead", "null" if ahead is None else str(ahead)]  # null: max_staleness ahead
        if not args.gpu:
            cmd += ["--rollout.server_args", json.dumps({"decode_delay_ms": args.decode_delay_ms})]
        cmd += ["--logging.run_dir", str(run_dir), "--logging.export_hf", "false", "--seed", str(args.seed)]
        cmd += ["--eval.path", str(held_out), "--eval.n_samples", "4", "--eval.temperature", "1.0"]
        cmd += extra
        print(f"== {label}: {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            continue
        events = EventAccumulator(str(run_dir / "tensorboard"))
        events.Reload()
        values = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
        reward = values["reward/mean"]
        results.append(
            {
                "label": label,
                "seconds": sum(values["timing/step"]),
                "final_reward": sum(reward[-10:]) / 10,
                "eval_reward": values["eval/reward_mean"][-1],
                "staleness_max": max(values["rollout/staleness_max"]),
                "trainer_idle_s": sum(values["rollout/trainer_idle_s"]),
                "resumed": sum(values["rollout/resumed"]),
            }
        )
        print(json.dumps(results[-1]), flush=True)
        timing = {tag: round(sum(v) / len(v), 4) for tag, v in sorted(values.items()) if tag.startswith("timing/")}
        print(f"mean per step: {json.dumps(timing)}", flush=True)
    base = results[0]["seconds"] if results and results[0]["label"] == "synchronous" else None
    engine = "SGLang on GPU" if args.gpu else f"embedded engine, decode delay {args.decode_delay_ms} ms"
    print(f"\n{args.steps} steps x 256 samples, long tail 1 in 10 x{long_tokens // 5}, {engine}")
    print("final weights: 256 toy test prompts x 4 samples at temperature 1, no forced tail")
    print(
        "schedule | wall s (steps) | speed-up | train reward (last 10) | final weights' reward | max staleness | "
        "trainer idle s | resumed"
    )
    for r in results:
        speedup = f"{base / r['seconds']:.2f}x" if base else "-"
        print(
            f"{r['label']} | {r['seconds']:.1f} | {speedup} | {r['final_reward']:.3f} | {r['eval_reward']:.3f} | "
            f"{r['staleness_max']:.0f} | {r['trainer_idle_s']:.1f} | {r['resumed']:.0f}"
        )


if __name__ == "__main__":
    main()
