"""Adam's moments off the GPU and back (`--trainer.offload_states moments`, the plan's share): one rank, ZeRO-3, one
update on synthetic samples so Adam has its moments, then a move per share. Each move must take the share's moment
tensors to the host (the GPU's allocated memory falls by their bytes), keep pinned buffers for that share alone, and
bring every moment back equal to its value before, bit for bit, also when all left first and a share is asked
before they came back (a resumed run's start-up and first sync); an update after the moves must still step them.
Prints a line per move and `moments check: ok` or what failed (exit status 1).

    python tools/gpu_moments.py --model /tmp/models/1.5b          # one GPU
"""

import argparse
import os
import time

import torch
from bench_trainer import synthetic  # (tools/ is first on sys.path when run as a script)

from dsrl.auto import make_plan, use_cuda
from dsrl.config import Config, DataConfig, ModelConfig
from dsrl.zero.actor import update_actor
from dsrl.zero.engine import adam_moments, init_distributed, load_engine, offload_states, reload_states

GB = 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--shares", type=float, nargs="+", default=[0.3, 1.0, 0.3, 0.6])
    args = p.parse_args()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29536")
    cfg = Config(model=ModelConfig(path=args.model), data=DataConfig(train_path="unused.jsonl"))
    cfg.trainer.lr, cfg.rollout.max_new_tokens, cfg.rollout.n_samples, cfg.rollout.prompts_per_step = 1e-5, 256, 1, 32
    init_distributed(use_cuda(cfg))
    engine = load_engine(cfg, args.model, 1, train=True, plan=make_plan(cfg, args.model, 1))
    vocab = engine.module.config.vocab_size
    update_actor(engine, synthetic(32, "longtail", 256, vocab, 32, seed=0), cfg, pad_id=0, kl_coef=0.0)
    moments = adam_moments(engine)
    sizes = [m.numel() * m.element_size() for m in moments]
    print(f"{len(moments)} moment tensors, {sum(sizes) / GB:.2f} GB: {', '.join(f'{b / GB:.2f}' for b in sizes)} GB; "
          f"norms {', '.join(f'{m.float().norm():.3g}' for m in moments)}", flush=True)  # fmt: skip
    failures = [] if all(m.abs().sum() > 0 for m in moments) else ["a moment is all zeros after the update"]
    before = [m.clone() for m in moments]
    for share in args.shares:
        torch.cuda.synchronize()
        held, start = torch.cuda.memory_allocated(), time.perf_counter()
        offload_states(engine, "moments", params=False, share=share)
        off = time.perf_counter() - start
        away = [m.device.type == "cpu" for m in moments]
        moved = sum(b for b, a in zip(sizes, away, strict=True) if a)
        freed = held - torch.cuda.memory_allocated()
        pinned = sum(t.numel() * t.element_size() for t in engine.dsrl_host_moments.values())
        start = time.perf_counter()
        reload_states(engine)
        back = time.perf_counter() - start
        equal = all(m.is_cuda and torch.equal(m, b) for m, b in zip(moments, before, strict=True))
        print(f"share {share}: {sum(away)} of {len(moments)} tensors, {moved / GB:.2f} GB moved in {off:.2f} s "
              f"({moved / GB / off:.1f} GB/s), back in {back:.2f} s; GPU freed {freed / GB:.2f} GB; pinned kept "
              f"{pinned / GB:.2f} GB; every moment back, bit for bit: {equal}", flush=True)  # fmt: skip
        if not equal:
            failures.append(f"share {share}: a moment came back changed")
        if moved < share * sum(sizes) or freed < 0.99 * moved or pinned != moved:
            sums = f"{moved / GB:.2f}, {freed / GB:.2f}, {pinned / GB:.2f} GB"
            failures.append(f"share {share}: moved, freed, pinned {sums}")
    offload_states(engine, "moments", params=False, share=1.0)  # a resumed run: all leave at start-up, and its first
    offload_states(engine, "moments", params=False, share=args.shares[0])  # sync asks for the share before a reload
    reload_states(engine)
    equal = all(m.is_cuda and torch.equal(m, b) for m, b in zip(moments, before, strict=True))
    print(f"resumed (1.0, then {args.shares[0]} before a reload): every moment back, bit for bit: {equal}", flush=True)
    if not equal:
        failures.append("resumed: a moment stayed on the host or came back changed")
    update_actor(engine, synthetic(32, "longtail", 256, vocab, 32, seed=1), cfg, pad_id=0, kl_coef=0.0)
    if all(torch.equal(m, b) for m, b in zip(moments, before, strict=True)):
        failures.append("the update after the moves left every moment as it was")
    print(f"moments check: {'; '.join(failures) or 'ok'}", flush=True)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
