"""Drive one SGLang server through every call dsrl makes, one at a time, and report which step fails.

python tools/gpu_sglang_smoke.py /tmp/models/0.5b [--no-memory-saver]
"""

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsrl.config import RolloutConfig  # noqa: E402
from dsrl.serving.client import RolloutClient  # noqa: E402
from dsrl.serving.fleet import start_fleet  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="other --flags go to SGLang as true")
    p.add_argument("model", help="a model directory (tools/gpu_models.py)")
    p.add_argument("--no-memory-saver", action="store_true", help="disaggregated: no release and resume of memory")
    args, extra = p.parse_known_args()
    model, saver = args.model, not args.no_memory_saver
    cfg = RolloutConfig(engine="sglang", placement="colocate" if saver else "disaggregate", startup_timeout_s=600)
    cfg.mem_fraction_static = 0.4
    cfg.server_args = {"attention_backend": "triton", "sampling_backend": "pytorch", "disable_cuda_graph": True}
    for flag in [a for a in extra if a.startswith("--")]:
        cfg.server_args[flag[2:].replace("-", "_")] = True
    with start_fleet(cfg, model, Path(tempfile.mkdtemp(prefix="smoke_")), 0, "sglang") as fleet:
        c = RolloutClient(fleet.urls, timeout_s=120)

        def gen(n):
            async def go():
                body = {"input_ids": [5, 11, 6, 12], "sampling_params": {"max_new_tokens": 16}, "return_logprob": True}
                return await asyncio.gather(*(c.generate(body) for _ in range(n)))

            return c.run(go())

        def step(name, fn):
            t = time.perf_counter()
            try:
                out = fn()
                print(f"OK   {name} ({(time.perf_counter() - t) * 1e3:.0f} ms) {str(out)[:160]}", flush=True)
                return out
            except Exception as e:
                print(f"FAIL {name}: {e!r}"[:400], flush=True)
                print(Path(fleet.processes[0].log_path).read_text()[-3000:], flush=True)
                sys.exit(1)

        step("generate 1", lambda: len(gen(1)))
        step("generate 64", lambda: len(gen(64)))
        step("pause abort", lambda: c.call_all("/pause_generation", {"mode": "abort"}))
        step("flush", lambda: c.call_all("/flush_cache"))
        step("continue", lambda: c.call_all("/continue_generation", {}))
        step("generate 64 after continue", lambda: len(gen(64)))

        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        from dsrl.sync.ipc import serialize

        monkey_patch_torch_reductions()
        state = {}
        for f in sorted(Path(model).glob("*.safetensors")):
            state.update(load_file(f, device="cuda"))
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
        meta, off = [], 0
        for name, t in state.items():
            n = t.numel() * t.element_size()
            meta.append(FlattenedTensorMetadata(name, t.shape, t.dtype, off, off + n, n))
            off += n
        torch.cuda.synchronize()
        payload = {
            "serialized_named_tensors": [serialize({"flattened_tensor": flat, "metadata": meta})],
            "load_format": "flattened_bucket",
            "flush_cache": True,
            "weight_version": "1",
        }
        step("update_weights_from_tensor", lambda: c.call_all("/update_weights_from_tensor", payload))
        step("generate 64 after ipc", lambda: len(gen(64)))
        step("model_info version", lambda: c.weight_versions())
        step("release", lambda: c.call_all("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}))
        step("resume weights", lambda: c.call_all("/resume_memory_occupation", {"tags": ["weights"]}))
        step("update after resume weights", lambda: c.call_all("/update_weights_from_tensor", payload))
        step("resume kv", lambda: c.call_all("/resume_memory_occupation", {"tags": ["kv_cache"]}))
        step("generate 64 after wake", lambda: len(gen(64)))
        for _ in range(3):
            t = time.perf_counter()
            c.call_all("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
            t1 = time.perf_counter()
            c.call_all("/resume_memory_occupation", {"tags": ["weights"]})
            c.call_all("/resume_memory_occupation", {"tags": ["kv_cache"]})
            print(f"sleep {1e3 * (t1 - t):.0f} ms, wake {1e3 * (time.perf_counter() - t1):.0f} ms", flush=True)
        step("generate 64 at the end", lambda: len(gen(64)))
        c.close()
    print("SMOKE PASSED", flush=True)


if __name__ == "__main__":
    main()
