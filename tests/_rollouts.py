"""Custom rollout functions (`--rollout.rollout_fn`) for the tests, importable by name."""

from dsrl.data import Sample


async def two_pieces(engine, prompt, sampling):
    """One response in two requests: its first 2 tokens, then the rest from prompt + those (as a multi-turn
    rollout or a resumed request would). Greedy, it equals one request's response."""
    first = await engine.generate(prompt.prompt_ids, {**sampling, "max_new_tokens": 2})
    sample = Sample(prompt, first.output_ids, first.logprobs, first.finish_reason, first.weight_version,
                    spans=[(0, first.weight_version)])  # fmt: skip
    if first.finish_reason == "length" and sampling["max_new_tokens"] > 2:
        rest = await engine.generate(prompt.prompt_ids + first.output_ids,
                                     {**sampling, "max_new_tokens": sampling["max_new_tokens"] - 2})  # fmt: skip
        sample.spans.append((len(sample.response_ids), rest.weight_version))
        sample.response_ids = sample.response_ids + rest.output_ids
        sample.engine_logprobs = sample.engine_logprobs + rest.logprobs
        sample.finish_reason, sample.weight_version = rest.finish_reason, rest.weight_version
    return sample


async def not_a_sample(engine, prompt, sampling):
    return (await engine.sample(prompt, sampling)).response_ids
