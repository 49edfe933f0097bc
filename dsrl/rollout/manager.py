"""Asynchronous rollout with bounded staleness: generation keeps running while the trainer trains.

The manager lives on the rollout client's event loop. It admits one GRPO group (a prompt and its
n samples) at a time, as long as

    groups admitted so far  <=  (weight version + max_ahead + 1) * groups per step

(AReaL's rule, in groups so GRPO groups stay whole, with max_ahead = max_staleness by default).
Admission is what keeps generation from running ahead; a check at consumption is what makes the
bound a guarantee: a group whose oldest token span is more than `max_staleness` versions behind
the trainer is dropped and its prompt generated again, never trained on. So that this is rare, a
batch takes the oldest finished groups first, and waits for a group still generating that started
`max_staleness` versions ago (the bound on admission means there are at most a batch of those):
later, it would be too stale.

Around a weight update the in-flight requests are handled by `rollout.interrupt`:
  wait     stop admitting, let every in-flight request finish, then sync;
  abort    abort them before the sync; each sample restarts from its prompt once the new weights are live;
  partial  abort them before the sync; each resumes from prompt + tokens so far under the new weights.
  pause    the servers pause them (SGLang's /pause_generation, `rollout.pause_mode`) around the sync and
           then carry on: nothing comes back to the client or is sent again, so an update costs no
           more with a thousand requests in flight than with one.
Every sample records the weight version of each token span (with `pause`, where a later span
starts is not seen: a request's reply only says the version it finished under). A group already
past the edge of the bound at an update (it could only be dropped) is restarted from scratch.

A sample is an episode (`dsrl.rollout.episode`): one model turn, or an agent's turns and observations. What is
said above of a request holds for each model turn's; an episode between turns (its environment or tools
running) sends its next turn only once the update is over, and goes on from exactly where it was.
"""

import asyncio
import io
import logging
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field

from dsrl.config import Config
from dsrl.data import Prompt, PromptDataset, Sample
from dsrl.rewards.rewarder import Rewarder
from dsrl.rollout.episode import Episode, EpisodeRunner
from dsrl.rollout.rollouts import (
    Batch,
    Generation,
    Rollouts,
    SyncRollouts,
    generate_one,
    request_of,
    request_seed,
    sampling_params,
    with_baseline,
)
from dsrl.serving.client import RolloutClient

log = logging.getLogger(__name__)

STOP_S = 30.0
"""How long a stop waits for the cancelled rollout tasks (they end at once unless something holds them)."""


def schedule(client: RolloutClient, cfg: Config, dataset: PromptDataset, rewarder: Rewarder, rank: int, world: int,
             runner: EpisodeRunner, colocated: bool, state: dict | None = None, version: int = 0,
             ) -> Rollouts:  # fmt: skip
    """The run's rollout schedule, as a checkpoint (this rank's `state`, of weight `version`) left it: `colocated`
    (`Plan.colocated`), each batch generated at its step (`SyncRollouts`); disaggregated, ahead of training by up to
    max_staleness versions (`RolloutManager`)."""
    if colocated:
        rollouts = SyncRollouts(client, cfg, dataset, rewarder, rank, world, runner)
    else:
        stream = PromptStream(dataset, cfg.rollout.prompts_per_step, rank, world)
        rollouts = RolloutManager(client, cfg, stream, rewarder, runner)
    if state is not None:
        rollouts.restore(state["rollouts"], version)
    return rollouts


class Restarted(Exception):
    """An episode's group started over from scratch (too stale): the episode is dropped."""


class PromptStream:
    """This rank's prompts in the order the synchronous loop would use them; returned prompts go first."""

    def __init__(self, dataset: PromptDataset, prompts_per_step: int, rank: int, world: int, position: int = 0):
        self.dataset, self.per_rank = dataset, prompts_per_step // world
        self.prompts_per_step, self.rank = prompts_per_step, rank
        self.position = position  # prompts of this rank handed out so far
        self.returned: deque[Prompt] = deque()

    def next(self) -> Prompt:
        if self.returned:
            return self.returned.popleft()
        step, j = divmod(self.position, self.per_rank)
        self.position += 1
        return self.dataset.batch(step, self.prompts_per_step, self.rank, self.prompts_per_step // self.per_rank)[j]


@dataclass
class Group:
    gid: int
    prompt: Prompt
    samples: list[Sample | None]
    pending: int
    version: int  # the weight version it started generating under (restarting resets it)
    started: dict[str, int] = field(default_factory=dict)  # rid in flight -> oldest version of its tokens
    restarts: int = 0  # times it started over from scratch: its older episodes' coroutines stop

    @property
    def oldest_version(self) -> int:
        return min(s.oldest_version for s in self.samples)

    def oldest_so_far(self, default: int | None = None) -> int:
        """The oldest weight version among finished samples and requests in flight."""
        versions = [s.oldest_version for s in self.samples if s is not None] + list(self.started.values())
        return min(versions) if versions else default


@dataclass
class ManagerStats:
    interrupted: int = 0
    resumed: int = 0
    restarted: int = 0
    dropped_stale: int = 0
    filtered: int = 0
    gen_idle_s: float = 0.0


class RolloutManager(Rollouts):
    def __init__(self, client: RolloutClient, cfg: Config, stream: PromptStream, rewarder: Rewarder,
                 runner: EpisodeRunner | None = None):  # fmt: skip
        self.client, self.cfg, self.stream, self.rewarder = client, cfg, stream, rewarder
        self.runner = runner or EpisodeRunner()
        r = cfg.rollout
        self.n_samples, self.max_staleness, self.interrupt = r.n_samples, r.max_staleness, r.interrupt
        self.n_samples += cfg.algorithm.advantage == "remax"  # (its last slot: a greedy response, ReMax's baseline)
        # Admitting fewer batches ahead than the bound keeps a group that finishes fast from waiting
        # max_staleness versions in the queue; a slow one still has that many versions to finish in.
        self.max_ahead = r.max_staleness if r.max_ahead is None else r.max_ahead
        self.groups_per_step = stream.per_rank
        self.rid_prefix = f"dsrl-r{stream.rank}"
        self.version = 0  # the weight version the servers hold (or are about to)
        self.admitted = 0  # groups admitted; drops give their slot back
        self.in_flight = 0  # requests out at the servers
        self.ready: deque[Group] = deque()  # finished groups, waiting to be trained on
        self.generating: dict[int, Group] = {}  # gid -> group with samples still out
        self.interrupted: list[tuple[Group, int, Episode | None]] = []  # resubmitted once the new weights are live
        self.doomed: set[int] = set()  # groups past the staleness edge: restarted from scratch
        self.next_gid = 0
        self.failed_seen = 0  # the rewarder's failures counted into a batch's metrics so far
        self.filtered_rows: list[int] = []  # skipped by dynamic sampling since the last batch (for the trace)
        self.paused = False  # no admissions while a weight update is prepared
        self.stopped = False
        self.error: BaseException | None = None
        self.stats = ManagerStats()
        self.idle_since: float | None = None
        self.cond: asyncio.Condition | None = None
        self.tasks: set[asyncio.Task] = set()

    # -- called from the trainer thread --------------------------------------------------------

    def start(self) -> None:
        self.client.run(self._start())

    def stop(self) -> None:
        if self.cond is not None:
            self.client.run(self._stop())

    def collect(self, step: int) -> Batch:
        """The next batch: groups_per_step complete groups within the staleness bound (trainer version = step)."""
        start = time.perf_counter()
        groups = self.client.run(self._next_batch(step))
        waited = time.perf_counter() - start
        metrics = {f"rollout/{name}": float(v) for name, v in asdict(self.take_stats()).items()}
        metrics.update({"rollout/trainer_idle_s": waited, "rollout/queue_depth": float(len(self.ready))})
        filtered, self.filtered_rows = self.filtered_rows, []
        metrics["reward/failed"] = float(self.rewarder.failed - self.failed_seen)
        self.failed_seen = self.rewarder.failed
        return Batch([s for g in groups for s in g.samples], metrics, filtered)

    def before_update(self) -> None:
        """Stop admitting; in `wait` mode also let every in-flight request finish."""
        self.client.run(self._before_update())

    def after_update(self, version: int) -> None:
        self.client.run(self._after_update(version))

    def take_stats(self) -> ManagerStats:
        stats, self.stats = self.stats, ManagerStats()
        if self.idle_since is not None:  # count the idle time so far into this step
            now = time.perf_counter()
            stats.gen_idle_s += now - self.idle_since
            self.idle_since = now
        return stats

    def state(self) -> dict:
        """What a checkpoint needs: the stream position and the rows handed out but not trained on yet."""
        return {"position": self.stream.position, "outstanding": self.outstanding()}

    def restore(self, state: dict, version: int) -> None:
        """Continue after a restart: outstanding rows are generated again (partial rollouts are not kept),
        and admission counts only what was trained, so the staleness bound holds from the first batch."""
        by_row = {p.index: p for p in self.stream.dataset.prompts}
        self.stream.position = state["position"]
        self.stream.returned = deque(by_row[row] for row in state["outstanding"])
        self.version = version
        self.admitted = version * self.groups_per_step

    def outstanding(self) -> list[int]:
        """Dataset rows handed out but not yet trained on: generating, queued, or waiting to be generated again."""
        groups = list(self.generating.values()) + list(self.ready)
        return [g.prompt.index for g in groups] + [p.index for p in self.stream.returned]

    # -- on the event loop ---------------------------------------------------------------------

    async def _start(self) -> None:
        self.cond = asyncio.Condition()
        self.idle_since = time.perf_counter()
        self._spawn(self._admit_loop())

    async def _stop(self) -> None:
        async with self.cond:
            self.stopped = True
            self.cond.notify_all()
        for task in list(self.tasks):
            task.cancel()
        if not self.tasks:
            return
        _, left = await asyncio.wait(list(self.tasks), timeout=STOP_S)
        for task in left:  # (the run ends anyway: a close never waits on them for ever)
            stack = io.StringIO()
            task.print_stack(file=stack)
            log.warning("a rollout task did not stop within %.0fs of its cancel; left running: %s", STOP_S,
                        stack.getvalue().strip())  # fmt: skip

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
            asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    def _capacity_left(self) -> bool:
        return self.admitted < (self.version + self.max_ahead + 1) * self.groups_per_step

    async def _admit_loop(self) -> None:
        while True:
            async with self.cond:
                await self.cond.wait_for(lambda: self.stopped or (not self.paused and self._capacity_left()))
                if self.stopped:
                    return
                self.admitted += 1
                group = Group(self.next_gid, self.stream.next(), [None] * self.n_samples, self.n_samples, self.version)
                self.next_gid += 1
                self.generating[group.gid] = group
            for slot in range(self.n_samples):
                self._spawn(self._run_sample(group, slot, None))

    async def _run_sample(self, group: Group, slot: int, episode: Episode | None) -> None:
        """One episode of the group (a response, without an environment), from its start or from where a
        weight update interrupted it; its turns' requests wait while an update is being prepared."""
        restarts = group.restarts
        params = sampling_params(self.cfg.rollout, greedy=slot == self.cfg.rollout.n_samples)
        episode = episode or self.runner.new(group.prompt, params, self.version)
        prompt = group.prompt

        async def request(episode: Episode, params: dict) -> tuple[Generation, int]:
            async with self.cond:  # a turn after the first may come while a weight update is prepared
                await self.cond.wait_for(lambda: not self.paused or self.stopped)
            if group.restarts != restarts:
                raise Restarted
            s = episode.sample
            params["sampling_seed"] = request_seed(self.cfg.seed, prompt.index, slot, self.version, len(s.response_ids))
            # The version of the request's oldest tokens decides whether a weight update interrupts it.
            own = s.oldest_version if s.spans else self.version
            oldest = min(own, group.oldest_so_far(default=self.version))
            rid = f"{self.rid_prefix}-v{oldest}-g{group.gid}-s{slot}-{uuid.uuid4().hex[:8]}"
            sent_under = self.version  # its first token's version, or older than it (when it waits for a slot)
            group.started[rid] = oldest
            self._request_started()
            try:
                # Older groups first where the server schedules by priority (the embedded engine; SGLang with
                # --enable-priority-scheduling, else ignored): a group near the staleness bound holds up the next batch.
                (ids, images), route = request_of(prompt, s.response_ids), (self.rid_prefix, group.gid)
                reply = await generate_one(self.client, ids, params, route, rid=rid, priority=-oldest, **images)
            finally:
                group.started.pop(rid)
                await self._request_finished()
            return reply, sent_under

        try:
            finished = await self.runner.run(episode, request)
        except Restarted:  # its group was too stale to train on and started over without it
            return
        if group.restarts != restarts:
            return
        if not finished:  # a weight update (or its server leaving) aborted a model turn
            self.stats.interrupted += 1
            resume = episode if self.interrupt == "partial" and episode.sample.response_ids else None
            if self.paused:  # resubmitted by _after_update, under the new weights
                self.interrupted.append((group, slot, resume))
            else:  # aborted between updates (its server left the fleet): sent again now
                self._resubmit(group, slot, resume)
            return
        group.samples[slot] = episode.sample
        group.pending -= 1
        if group.pending == 0:
            await self._group_done(group)

    def _resubmit(self, group: Group, slot: int, partial: Episode | None) -> None:
        """An interrupted sample sent again: from its tokens so far (`partial`), or from its prompt."""
        self.stats.resumed += partial is not None
        self.stats.restarted += partial is None
        self._spawn(self._run_sample(group, slot, partial))

    def _request_started(self) -> None:
        if self.in_flight == 0 and self.idle_since is not None:
            self.stats.gen_idle_s += time.perf_counter() - self.idle_since
            self.idle_since = None
        self.in_flight += 1

    async def _request_finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle_since = time.perf_counter()
            async with self.cond:
                self.cond.notify_all()

    async def _group_done(self, group: Group) -> None:
        await self.rewarder.score_group(group.samples)  # in worker processes: requests in flight go on meanwhile
        if self.n_samples > self.cfg.rollout.n_samples:
            group.samples = with_baseline(group.samples)
        async with self.cond:
            del self.generating[group.gid]
            if self.cfg.rollout.dynamic_sampling and len({s.reward for s in group.samples}) == 1:
                self.stats.filtered += 1  # no learning signal: skip this prompt and admit another
                self.filtered_rows.append(group.prompt.index)
                self.admitted -= 1
            else:
                self.ready.append(group)
            self.cond.notify_all()

    async def _next_batch(self, trainer_version: int) -> list[Group]:
        """groups_per_step finished groups, oldest first; one still generating that must be in it is waited for."""
        last_chance = trainer_version - self.max_staleness  # a group started under it is too stale for the next batch
        async with self.cond:
            while True:
                if self.error is not None:
                    raise RuntimeError(f"rollout failed: {self.error!r}") from self.error
                for group in [g for g in self.ready if trainer_version - g.oldest_version > self.max_staleness]:
                    self.ready.remove(group)  # finished too late: never train on it; generate the prompt again
                    self.stats.dropped_stale += 1
                    self.stream.returned.append(group.prompt)
                    self.admitted -= 1
                    self.cond.notify_all()
                ready = sorted(self.ready, key=lambda g: g.oldest_version)
                if len(ready) >= self.groups_per_step:
                    batch = ready[: self.groups_per_step]
                    waiting = any(g.version <= last_chance for g in self.generating.values())
                    if batch[-1].oldest_version <= last_chance or not waiting:
                        taken = {g.gid for g in batch}
                        self.ready = deque(g for g in self.ready if g.gid not in taken)
                        return batch
                await self.cond.wait()

    async def _before_update(self) -> None:
        async with self.cond:
            self.paused = True
            if self.interrupt == "wait":
                await self.cond.wait_for(lambda: self.in_flight == 0 or self.error is not None)
                return
            # The next batch is trained at version + 1: a group whose oldest tokens are older than `edge`
            # can only be dropped, so it restarts from scratch; every other sample resumes (or restarts).
            edge = self.version + 1 - self.max_staleness
            doomed = [g for g in self.generating.values() if g.oldest_so_far(edge) < edge]
            self.doomed |= {g.gid for g in doomed}
            if self.interrupt == "pause":  # the rest stay on the servers, which the sync pauses
                await self.client.abort([rid for g in doomed for rid in g.started])
                await self.cond.wait_for(lambda: not any(g.started for g in doomed) or self.error is not None)
                return
            await self.client.abort_all()
            await self.cond.wait_for(lambda: self.in_flight == 0 or self.error is not None)

    async def _after_update(self, version: int) -> None:
        async with self.cond:
            self.version = version
            self.paused = False
            self.cond.notify_all()
        interrupted, self.interrupted = self.interrupted, []
        restart = {g.gid: g for g, _, _ in interrupted if g.gid in self.doomed}
        self.doomed = set()
        for group, slot, partial in interrupted:
            if group.gid not in restart:
                self._resubmit(group, slot, partial)
        for group in restart.values():  # too stale to train on: every sample from scratch
            self.stats.restarted += self.n_samples
            group.samples, group.pending, group.version = [None] * self.n_samples, self.n_samples, version
            group.restarts += 1
            for slot in range(self.n_samples):
                self._spawn(self._run_sample(group, slot, None))
