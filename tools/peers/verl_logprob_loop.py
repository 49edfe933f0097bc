"""The per-row overhead of verl 0.9.1's log-prob fallback without flash-attn (`logprobs_from_logits_v2` in
verl/utils/torch_functional.py: for bf16 logits, log_softmax and gather one row at a time, over logits its FSDP engine
flattened to (tokens, vocab)), against one vectorised call. A small vocabulary on CPU, one thread: what is timed is
the loop's per-row dispatch and autograd cost, not the arithmetic, which a GPU adds kernel launches to.

    python tools/peers/verl_logprob_loop.py --rows 4096
"""

import argparse
import time

import torch
import torch.nn.functional as F


def loop(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # verl's bf16 branch, as it is written
    rows = [F.log_softmax(row, dim=-1).gather(-1, lab.unsqueeze(-1)).squeeze(-1) for row, lab in zip(logits, labels)]
    return torch.stack(rows)


def vectorised(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def per_row_us(fn, rows: int, vocab: int, grad: bool) -> float:
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=grad)
    labels = torch.randint(vocab, (rows,))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        out = fn(logits, labels) if grad else torch.no_grad()(fn)(logits, labels)
        if grad:
            out.sum().backward()
        best = min(best, time.perf_counter() - start)
    return best / rows * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--tokens", type=int, default=263_000, help="a step's tokens, to scale the loop's cost to")
    args = p.parse_args()
    torch.set_num_threads(1)
    for grad in (False, True):
        row, vec = (per_row_us(fn, args.rows, args.vocab, grad) for fn in (loop, vectorised))
        print(f"{'with' if grad else 'no'} grad: loop {row:.1f} us a row ({row * args.tokens / 1e6:.1f} s at "
              f"{args.tokens} tokens), vectorised {vec:.2f} us a row")  # fmt: skip


if __name__ == "__main__":
    main()
