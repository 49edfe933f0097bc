"""verl 0.9.1's single-turn agent loop, taking each row's own sampling parameters: the harness's long-tail workload
gives each prompt its own `max_new_tokens` (with `ignore_eos`, so every sample runs to it), as dsrl takes them from a
row's `sampling_params`. verl builds one set of sampling parameters for the batch
(`AgentLoopWorker.generate_sequences`) and hands each row's columns to its agent loop as keyword arguments; its SGLang
server honours a `max_new_tokens` in them (`async_sglang_server.generate`). So the row's
`extra_info.sampling_params` is merged in here (a top-level `sampling_params` column would collide with `run`'s own
argument). Registered by tools/peers/verl_agent_loops.yaml (`actor_rollout_ref.rollout.agent.agent_loop_config_path`)
and made the default loop (`agent.default_agent_loop`) for the workloads whose rows carry their own."""

import json
import os
import time

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

TRACE = "PEERS_AGENT_TRACE"
"""The environment variable naming a file each sample appends one JSON line to (set by peers.verl_env): its step,
when its loop started and ended (time.time(): one clock for the host's processes), its request's seconds (verl's own
`generate_sequences` timer: the balancer, the server's actor, SGLang), its cap and tokens. report.trace_steps places
them inside verl's `gen` (docs/benchmarks/verl.md, "Where verl's generate time goes")."""


def plain(value):
    """A numpy scalar as Python's own (for JSON), anything else as it is."""
    return value.item() if hasattr(value, "item") else value


def row_sampling_params(sampling_params: dict, extra_info: dict | None) -> dict:
    """The batch's sampling parameters with the row's own on top (numpy scalars made plain for the HTTP body)."""
    row = (extra_info or {}).get("sampling_params") or {}
    return {**sampling_params, **{k: plain(v) for k, v in row.items()}}


class RowSamplingAgentLoop(SingleTurnAgentLoop):
    async def run(self, sampling_params: dict, **kwargs):
        params = row_sampling_params(sampling_params, kwargs.get("extra_info"))
        start = time.time()
        output = await super().run(params, **kwargs)
        if os.environ.get(TRACE):  # a few hundred short appends a step; O_APPEND keeps the workers' lines whole
            request_s = getattr(getattr(output, "metrics", None), "generate_sequences", None)
            line = {"step": plain(kwargs.get("global_steps")), "start": start, "end": time.time(),
                    "request_s": request_s, "cap": params.get("max_new_tokens"),
                    "tokens": len(getattr(output, "response_ids", ()))}  # fmt: skip
            with open(os.environ[TRACE], "a") as f:
                f.write(json.dumps(line) + "\n")
        return output
