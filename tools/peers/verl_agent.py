"""verl 0.9.1's single-turn agent loop, taking each row's own sampling parameters: the harness's long-tail workload
gives each prompt its own `max_new_tokens` (with `ignore_eos`, so every sample runs to it), as dsrl takes them from a
row's `sampling_params`. verl builds one set of sampling parameters for the batch
(`AgentLoopWorker.generate_sequences`) and hands each row's columns to its agent loop as keyword arguments; its SGLang
server honours a `max_new_tokens` in them (`async_sglang_server.generate`). So the row's
`extra_info.sampling_params` is merged in here (a top-level `sampling_params` column would collide with `run`'s own
argument). Registered by tools/peers/verl_agent_loops.yaml (`actor_rollout_ref.rollout.agent.agent_loop_config_path`)
and made the default loop (`agent.default_agent_loop`) for the workloads whose rows carry their own."""

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop


def row_sampling_params(sampling_params: dict, extra_info: dict | None) -> dict:
    """The batch's sampling parameters with the row's own on top (numpy scalars made plain for the HTTP body)."""
    row = (extra_info or {}).get("sampling_params") or {}
    return {**sampling_params, **{k: v.item() if hasattr(v, "item") else v for k, v in row.items()}}


class RowSamplingAgentLoop(SingleTurnAgentLoop):
    async def run(self, sampling_params: dict, **kwargs):
        return await super().run(row_sampling_params(sampling_params, kwargs.get("extra_info")), **kwargs)
