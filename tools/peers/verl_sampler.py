"""verl 0.9.1's replay buffers with a shorter poll: its built-in ones wait for a batch in fixed 2 s sleeps
(`ReplayBuffer.poll_interval`, `_wait_for_next_poll` in verl/trainer/ppo/v1/replay_buffer.py), up to 2 s a step
inside its `gen` timer. verl takes a replay buffer of the user's own through
`trainer.v1.sampler.custom_sampler.{path,name}`, with `trainer.v1.sampler.sampler_kwargs` handed to it: these are
its own classes, with `sampler_kwargs.poll_interval` (seconds, default POLL_S) in place of the 2 s. The harness
(tools/peers/peers.py) passes this file for every verl run; `--verl-poll 2` is verl's own poll, to time it as a phase
of its own."""

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

POLL_S = 0.05
"""Seconds between two looks at the TransferQueue's metadata: each look is one Ray call to its controller."""


class QuickPollReplayBuffer(ReplayBuffer):
    """The synchronous trainer's buffer (trainer.v1.trainer_mode=sync)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.poll_interval = float((self.sampler_kwargs or {}).get("poll_interval", POLL_S))


class QuickPollReplayBufferAsync(ReplayBufferAsync):
    """The asynchronous trainers' buffer (colocate_async, separate_async)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.poll_interval = float((self.sampler_kwargs or {}).get("poll_interval", POLL_S))
