"""A reward model for the toy task, trained on synthetic preferences: of two responses to a prompt, the one with more
of the prompt's digits in place (`dsrl.tasks.toy:reward`) is preferred (Bradley-Terry). A Qwen2 sequence classifier
with one label, on the toy tokenizer, scoring at the last token as SGLang's reward models do: 15-40 s on two CPU
cores, 0.85 of held-out pairs right.

    python tools/toy_reward_model.py runs/toy_rm/reward_model      # then configs/toy_cpu_rm.yaml
"""

import argparse
import os
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForSequenceClassification

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsrl.tasks import toy  # noqa: E402

EOS = toy.VOCAB.index("<eos>")
TOKENS = [i for i in range(len(toy.VOCAB)) if i != EOS]


def response(answer: str, share: float | None, rng: random.Random) -> list[int]:
    """What a policy on its way to the task samples: up to 5 tokens, end-of-sequence included unless cut there;
    any tokens at all (`share` None; none too), or the answer with a `share` of it replaced and maybe more after
    it. A policy trained against the model finds the kinds of responses it was never taught to score low (without
    empty responses here, it learned to say nothing)."""
    if share is None:
        ids = [rng.choice(TOKENS) for _ in range(rng.randrange(6))]
    else:
        ids = [int(c) + 2 if rng.random() > share else rng.choice(TOKENS) for c in answer]
        ids += [rng.choice(TOKENS) for _ in range(rng.choice([0, 0, 1, 2, 4]))]
    return ids[:5] if len(ids) >= 5 else ids + [EOS]


def pairs(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(chosen, rejected) conversations: prompt tokens + response tokens, as dsrl sends them to a reward model. Both
    responses of a pair are of one kind (as alike as a group of samples is), so that fine differences are taught."""
    rng, tokenizer, out = random.Random(seed), toy.build_tokenizer(), []
    while len(out) < n:
        row = toy.make_rows(1, rng.randrange(1 << 30))[0]
        prompt, share = tokenizer(row["prompt"])["input_ids"], None if rng.random() < 0.4 else rng.random()
        a, b = response(row["answer"], share, rng), response(row["answer"], share, rng)
        ra, rb = (
            toy.reward(row["prompt"], tokenizer.decode(r, skip_special_tokens=True), row["answer"]) for r in (a, b)
        )
        if ra != rb:
            out.append((prompt + a, prompt + b) if ra > rb else (prompt + b, prompt + a))
    return out


def scores(model: Qwen2ForSequenceClassification, seqs: list[list[int]]) -> torch.Tensor:
    """The score at each sequence's last token (left padding)."""
    width = max(map(len, seqs))
    ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
    mask = (torch.arange(width) >= torch.tensor([width - len(s) for s in seqs])[:, None]).long()
    hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    return model.score(hidden.last_hidden_state[:, -1])[:, 0]


def train(out: Path, steps: int = 150, batch: int = 256, seed: int = 0) -> float:
    """Train and save the reward model (with the toy tokenizer) to `out`; returns its accuracy on held-out pairs."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(toy.VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_labels=1, pad_token_id=0, eos_token_id=EOS,
        bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2ForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    data, held_out = pairs(batch * steps, seed), pairs(512, seed + 1)
    for step in range(steps):
        chosen, rejected = zip(*data[step * batch : (step + 1) * batch])
        loss = -F.logsigmoid(scores(model, list(chosen)) - scores(model, list(rejected))).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        chosen, rejected = zip(*held_out)
        accuracy = (scores(model, list(chosen)) > scores(model, list(rejected))).float().mean().item()
    model.save_pretrained(out)
    toy.build_tokenizer().save_pretrained(out)
    return accuracy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, nargs="?", default=Path("runs/toy_rm/reward_model"), help="where it is saved")
    target = p.parse_args().out
    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # save_pretrained asks DeepSpeed, which would warn it found no GPU
    print(f"{target}: held-out preference accuracy {train(target):.3f}")


if __name__ == "__main__":
    main()
