"""Rollout throughput through dsrl's client vs the same requests from a plain aiohttp client, and
what routing a GRPO group to one server saves (--routes).

Starts the servers (SGLang on GPU, the embedded engine on CPU), sends N single-sample /generate
requests with fixed lengths (ignore_eos) twice -- through RolloutClient (least-loaded routing,
concurrency limit, timeouts) and through a bare aiohttp gather, each with --max-concurrency requests in flight --
and prints tokens/s of each. Past SGLang's largest CUDA graph (`cuda_graph_max_bs`) it decodes without graphs: a
1.5B model on an H200 decoded 512 requests in flight so ("cuda graph: False" in its log), at half the tokens/s of
256 (with graphs).
With --routes: G groups of --n requests sharing a prompt, through dsrl's client with `route group`
(a group on one server) and `least_loaded` (each request on its own), the servers' caches flushed
before each; prints tokens/s and the fraction of prompt tokens SGLang found cached.

    python tools/bench_rollout.py --model /tmp/models/0.5b --engine sglang --requests 256
    python tools/bench_rollout.py --model /tmp/models/0.5b --servers 2 --routes --prompt-len 2048 --new-tokens 64
"""

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsrl.config import RolloutConfig  # noqa: E402
from dsrl.serving.client import RolloutClient  # noqa: E402
from dsrl.serving.fleet import start_fleet  # noqa: E402


def payloads(n: int, prompt_len: int, new_tokens: int, vocab: int, as_train: bool = False) -> list[dict]:
    """`n` requests of fixed lengths; `as_train`: with what dsrl's rollouts add to each (the tokens' logprobs, a
    sampling seed of its own), which SGLang computes and sends back."""
    low = min(20, vocab // 2)  # past the special tokens of a real vocabulary

    def request(i: int) -> dict:
        params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
        body = {"input_ids": [(7 * i + j) % (vocab - low) + low for j in range(prompt_len)], "sampling_params": params}
        if as_train:
            body["return_logprob"], params["sampling_seed"] = True, i
        return body

    return [request(i) for i in range(n)]


async def plain(url: str, reqs: list[dict], in_flight: int | None = None) -> list[dict]:
    """The requests from a bare aiohttp client, `in_flight` at most at once (all of them by default)."""
    # no connection cap (aiohttp's default is 100), as dsrl's client has none either
    connector = aiohttp.TCPConnector(limit=0)
    gate = asyncio.Semaphore(in_flight or len(reqs))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), connector=connector) as session:

        async def one(body):
            async with gate, session.post(url + "/generate", json=body) as resp:
                return await resp.json()

        return await asyncio.gather(*(one(r) for r in reqs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--engine", choices=["sglang", "embedded"], default="sglang")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--server-args", default="{}", help="JSON dict of extra server flags")
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--routes", action="store_true", help="compare route group with least_loaded")
    p.add_argument("--n", type=int, default=8, help="--routes: requests per group (one prompt)")
    p.add_argument("--plain-requests", action="store_true", help="without logprobs and seeds (as before 11-26)")
    p.add_argument("--max-concurrency", type=int, default=1024, help="dsrl client's requests in flight (train: 256)")
    args = p.parse_args()
    import json

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    cfg = RolloutConfig(engine=args.engine, placement="disaggregate", startup_timeout_s=900, num_servers=args.servers)
    cfg.server_args = json.loads(args.server_args)
    if args.routes:
        compare_routes(cfg, args, vocab)
        return
    run_dir, launched = Path(tempfile.mkdtemp(prefix="dsrl_bench_rollout_")), time.perf_counter()
    print(f"server log: {run_dir}/logs/server_0.log", flush=True)
    with start_fleet(cfg, args.model, run_dir, 0, args.engine) as fleet:
        print(f"server ready in {time.perf_counter() - launched:.0f} s", flush=True)
        client = RolloutClient(fleet.urls, max_concurrency=args.max_concurrency, timeout_s=3600)
        reqs = payloads(args.requests, args.prompt_len, args.new_tokens, vocab, not args.plain_requests)
        client.run(plain(fleet.urls[0], reqs[:8]))  # warm-up (JIT, graphs)
        print(f"warmed up at {time.perf_counter() - launched:.0f} s", flush=True)
        results = {"dsrl": [], "plain": []}
        for _ in range(args.rounds):
            for name in ("plain", "dsrl"):
                start = time.perf_counter()
                if name == "dsrl":

                    async def through_client():
                        return await asyncio.gather(*(client.generate(r) for r in reqs))

                    outs = client.run(through_client())
                else:
                    outs = client.run(plain(fleet.urls[0], reqs, args.max_concurrency))
                seconds = time.perf_counter() - start
                tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
                results[name].append(tokens / seconds)
                print(f"{name}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.0f} tok/s", flush=True)
        client.close()
    best = {k: max(v) for k, v in results.items()}
    print(
        f"rollout throughput, {args.requests} requests x {args.prompt_len} prompt -> {args.new_tokens} new tokens: "
        f"bare client {best['plain']:.0f} tok/s, dsrl client {best['dsrl']:.0f} tok/s, each {args.max_concurrency} "
        f"in flight, "
        f"ratio {best['dsrl'] / best['plain']:.3f} (goal >= 0.95)"
    )


def compare_routes(cfg: RolloutConfig, args, vocab: int) -> None:
    groups = max(1, args.requests // args.n)
    reqs = payloads(groups, args.prompt_len, args.new_tokens, vocab)
    with start_fleet(cfg, args.model, Path(tempfile.mkdtemp(prefix="dsrl_bench_rollout_")), 0, args.engine) as fleet:
        client = RolloutClient(fleet.urls, max_concurrency=args.max_concurrency, timeout_s=3600)
        client.run(plain(fleet.urls[0], reqs[:4]))  # warm-up (JIT, graphs)
        for _ in range(args.rounds):
            for route in ("least_loaded", "group"):
                client.route, client.routes = route, type(client.routes)()
                client.call_all("/flush_cache")

                async def grouped():
                    return await asyncio.gather(
                        *(client.generate(r, route_key=g) for g, r in enumerate(reqs) for _ in range(args.n))
                    )

                start = time.perf_counter()
                outs = client.run(grouped())
                seconds = time.perf_counter() - start
                tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
                cached = sum(o["meta_info"].get("cached_tokens", 0) for o in outs) / (len(outs) * args.prompt_len)
                print(
                    f"routes | {args.servers} servers | {groups} groups x {args.n} | prompt {args.prompt_len} -> "
                    f"{args.new_tokens} | route {route} | {tokens / seconds:.0f} tok/s | {seconds:.2f} s | "
                    f"prompt tokens cached {cached:.3f}",
                    flush=True,
                )
        client.close()


if __name__ == "__main__":
    main()
