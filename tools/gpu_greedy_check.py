"""Greedy generation from an SGLang server vs transformers' greedy generation from the same weights.

python tools/gpu_greedy_check.py runs/toy_gpu/hf --prompts 16 --new-tokens 8
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsrl.config import RolloutConfig  # noqa: E402
from dsrl.serving.client import RolloutClient  # noqa: E402
from dsrl.serving.fleet import start_fleet  # noqa: E402
from dsrl.tasks.toy import make_rows  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--engine", default="sglang")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=4)
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in make_rows(args.prompts, seed=5)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.model).to(device).eval()
    want = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids], device=device),
            max_new_tokens=args.new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=model.config.eos_token_id,
        )
        want.append(out[0, len(ids) :].tolist())
    del model
    torch.cuda.empty_cache() if device == "cuda" else None
    cfg = RolloutConfig(engine=args.engine, placement="disaggregate", startup_timeout_s=600, mem_fraction_static=0.3)
    if args.engine == "sglang":
        cfg.server_args = {"attention_backend": "triton", "sampling_backend": "pytorch", "disable_cuda_graph": True}
    with start_fleet(cfg, args.model, Path(tempfile.mkdtemp(prefix="dsrl_greedy_")), 0, args.engine) as fleet:
        client = RolloutClient(fleet.urls)
        client.call_all("/flush_cache")
        body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 0}}
        got = [o["output_ids"] for o in client.call_all("/generate", body)[0]]
        client.close()
    # transformers stops at eos and pads after it; SGLang stops at eos and keeps it
    same = sum(
        g == w[: len(g)] and (len(g) == len(w) or w[len(g) :] == [tokenizer.pad_token_id] * (len(w) - len(g)))
        for g, w in zip(got, want)
    )
    print(f"greedy: {same}/{len(prompts)} prompts identical between {args.engine} and transformers ({args.model})")
    for g, w in list(zip(got, want))[:4]:
        print(f"  {args.engine} {g}  transformers {w}")
    sys.exit(0 if same == len(prompts) else 1)


if __name__ == "__main__":
    main()
