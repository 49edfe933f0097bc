"""How long `from_pretrained` takes under ZeRO-3's zero.Init on CPU (2 gloo ranks): a MoE against a dense model of the
same bytes, and 128 experts a layer against 8 at 48 layers (per-tensor cost), twice each in turn. Issue 63: the
Qwen3-30B-A3B shape loaded in 305 s on 2 H200 ranks; the dense 32B took 12 s on 4 (another day's host).

    python tools/bench_load.py    # "<model>: load N s" a run (docs/benchmarks/moe.md)
"""

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

SMALL = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=32, num_hidden_layers=48,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip
"""48 layers of small experts: the per-tensor cost, 8 experts a layer against 128 (the 30B-A3B's count)."""
MODELS = {  # name: (config class, its fields)
    "dense": ("Qwen2Config", dict(hidden_size=512, intermediate_size=16384, num_hidden_layers=8)),
    "moe": ("Qwen3MoeConfig", dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=128, num_experts=128,
                                   num_hidden_layers=8, head_dim=64)),
    "experts8": ("Qwen3MoeConfig", SMALL | dict(num_experts=8)),
    "experts128": ("Qwen3MoeConfig", SMALL | dict(num_experts=128)),
}  # fmt: skip


def build(out: Path, name: str) -> None:
    import torch
    import transformers

    cls, fields = MODELS[name]
    base = dict(vocab_size=1024, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    if cls == "Qwen3MoeConfig":
        base["num_experts_per_tok"] = 8
    config = getattr(transformers, cls)(**(base | fields))
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)


def load(path: str) -> None:  # (one rank of the launcher's two)
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed("gloo")
    conf = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    keep = HfDeepSpeedConfig(conf)  # noqa: F841 (from_pretrained builds under zero.Init while it lives)
    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    if os.environ.get("RANK", "0") == "0":
        print(f"{Path(path).name}: load {time.perf_counter() - start:.2f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", help="(one rank of the launcher's, which this script starts) the model to load")
    args = p.parse_args()
    if args.load:
        return load(args.load)
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            build(Path(tmp) / name, name)
        for name in [*MODELS, *MODELS]:
            cmd = ["deepspeed", "--num_accelerators", "2", "--no_local_rank", __file__, "--load", str(Path(tmp) / name)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True).stdout
            print(next((line for line in out.splitlines() if ": load " in line), f"{name}: failed"), flush=True)


if __name__ == "__main__":
    main()
