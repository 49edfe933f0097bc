"""The embedded engine's command line, apart from the engine: dsrl checks --rollout.server_args against it
before any server starts, without importing torch (2 s of every `dsrl train` start-up)."""

import argparse

import yaml


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="The embedded rollout engine: SGLang's HTTP endpoints on CPU.")
    parser.add_argument("--model-path", required=True, help="Hugging Face model directory.")
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default: loopback only).")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--seed", type=int, default=0, help="Seed for sampling and for random init.")
    parser.add_argument("--max-batch-tokens", type=int, default=16384, help="Tokens per decode step, at most.")
    parser.add_argument("--decode-delay-ms", type=float, default=0.0, help="Sleep per decode step (slower engine).")
    parser.add_argument("--enable-deterministic-inference", action="store_true", help="Batch-invariant results "
                        "(each request's forward alone), as SGLang's flag of that name.")  # fmt: skip
    parser.add_argument("--crash-marker", default=None, help="Fault injection for tests: exit during a weight update "
                        "if this file exists (removing it first); if it says `fail`, fail that update and every "
                        "later one with an error instead.")  # fmt: skip
    parser.add_argument("--api-key", default=None, help="Refuse requests without `Authorization: Bearer <key>`.")
    parser.add_argument("--config", default=None,
                        help="A YAML file of these flags, as SGLang's (the command line wins).")  # fmt: skip
    parser.add_argument("--enable-lora", action="store_true", help="Serve LoRA adapters (/load_lora_adapter).")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="The largest adapter rank accepted.")
    parser.add_argument("--lora-target-modules", nargs="*", default=None, help="Layer names adapters may adapt.")
    parser.add_argument("--is-embedding", action="store_true", help="Serve a sequence classifier on /classify.")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="Released weights come back with their contents.")  # fmt: skip
    parser.add_argument("--max-loras-per-batch", type=int, default=8, help="Accepted as SGLang's; no slots here.")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="Weights' and activations' dtype (auto: float32; SGLang's is bfloat16).")  # fmt: skip
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="A mixture of experts: requests may ask for their tokens' routed experts.")  # fmt: skip
    parser.add_argument("--custom-weight-loader", nargs="*", default=[], help="Import paths of functions that "
                        "/update_weights_from_tensor may load through (its load_format), as SGLang's.")  # fmt: skip
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with those of --config FILE under the command line's (how dsrl passes --api-key: not in ps)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        with open(args.config) as f:
            parser.set_defaults(**{key.replace("-", "_"): value for key, value in yaml.safe_load(f).items()})
        args = parser.parse_args(argv)
    return args
