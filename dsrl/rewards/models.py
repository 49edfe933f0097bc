"""Rewards from models: a reward model (SGLang's /classify, served with --is-embedding) or an LLM judge (/generate,
greedy and seeded, its verdict read by `reward_model.judge_parse_fn`), on servers of their own that the rollout
servers' machinery starts (`start_fleet(role="reward")`), restarts, puts to sleep and wakes. The rewarder sends one
request per group, as the group's last sample returns (`Rewarder.score_group`)."""

import asyncio
import threading
import time

from dsrl.config import Config, DistillConfig, RewardModelConfig, RolloutConfig, beside_rollouts, side_rollout
from dsrl.data import Sample
from dsrl.rewards.rules import load_function
from dsrl.serving.client import RolloutClient, ServerError
from dsrl.serving.fleet import start_fleet_for_ranks
from dsrl.serving.servers import Fleet, answers


class ServedModel:
    """One trainer rank's view of the servers of a model beside the policy (`group`: its config, `reward_model` or
    `distill`); rank 0 also owns them (restart, sleep, wake)."""

    timing = "reward/model"
    """The prefix of its timing metrics (`take_timing`)."""

    def __init__(self, cfg: Config, group: RewardModelConfig | DistillConfig, client: RolloutClient, fleet: Fleet,
                 rank0: bool):  # fmt: skip
        self.client, self.fleet, self.rank0, self.timeout_s = client, fleet, rank0, group.timeout_s
        self.colocated = beside_rollouts(cfg, group)
        self.startup_timeout_s = cfg.rollout.startup_timeout_s
        self.released: tuple[str, ...] = ()  # (rank 0) what the servers released, colocated
        self.restarting = threading.Lock()  # one restart of a server, however many groups saw it die
        self.busy, self.busy_since, self.busy_s, self.asked, self.answered = 0, 0.0, 0.0, 0.0, 0.0

    async def post(self, path: str, body: dict, key: int) -> list[dict]:
        """One group's request. A server that stops answering is restarted (rank 0; it keeps its URL, so every
        rank's requests find it again) and the request sent again; one that answers but fails, or does not answer
        within its timeout_s, fails the group."""
        deadline, attempt, urls = time.perf_counter() + self.startup_timeout_s, 0, self.fleet.urls
        self._busy(1)
        try:
            while True:
                url = urls[(key + attempt) % len(urls)]
                try:
                    return await self.client.request(url, path, body, timeout_s=self.timeout_s)
                except ServerError as e:
                    if not e.down or time.perf_counter() > deadline or await asyncio.to_thread(answers, url):
                        raise
                attempt += 1
                if self.rank0:
                    await asyncio.to_thread(self.restart, url)
                else:
                    await asyncio.sleep(1.0)
        finally:
            self._busy(-1)

    def restart(self, url: str) -> None:
        with self.restarting:
            if url in (self.fleet.exited() or ()):  # (external servers: None, wait for them)
                self.fleet.replace({url})

    def _busy(self, delta: int) -> None:
        now = time.perf_counter()
        if self.busy == 0:
            self.busy_since = now
        self.busy += delta
        if self.busy == 0:
            self.busy_s, self.answered = self.busy_s + now - self.busy_since, now

    def take_timing(self) -> dict[str, float]:
        """Seconds with a request out since the last call, and of those the ones after the last group was asked
        for (the scoring generation did not hide)."""
        exposed = max(0.0, self.answered - self.asked)
        timing = {f"{self.timing}_seconds": self.busy_s, f"{self.timing}_exposed_s": exposed}
        self.busy_s = 0.0
        return timing

    def release(self, tags: tuple[str, ...]) -> None:
        """Colocated (rank 0), a tenant of the GPU (`dsrl.lending`): the servers release `tags` with the rollout
        servers (dsrl starts them with a host copy of their weights, which come back with their contents)."""
        if self.colocated:
            self.client.run(
                self.client.all_servers("/release_memory_occupation", {"tags": list(tags)}, urls=self.fleet.urls)
            )
            self.released = tuple(tags)

    def resume(self, tag: str) -> None:
        """Colocated (rank 0): with the KV cache, all that `release` released comes back (once the trainers'
        memory has gone); a server that died meanwhile is restarted, awake."""
        if tag == "kv_cache" and self.released:
            dead = self.fleet.exited() or set()
            if dead:
                self.fleet.replace(dead)
            urls = [url for url in self.fleet.urls if url not in dead]
            self.client.run(
                self.client.all_servers("/resume_memory_occupation", {"tags": list(self.released)}, urls=urls)
            )
            self.released = ()


class RewardModel(ServedModel):
    """The reward model's or judge's servers."""

    def __init__(self, cfg: Config, tokenizer, client: RolloutClient, fleet: Fleet, rank0: bool):
        from transformers import AutoConfig, AutoTokenizer

        super().__init__(cfg, cfg.reward_model, client, fleet, rank0)
        m = self.cfg = cfg.reward_model
        self.policy, self.prompt_key = tokenizer, cfg.data.prompt_key
        self.tokenizer = AutoTokenizer.from_pretrained(m.path, trust_remote_code=cfg.model.trust_remote_code)
        self.parse = load_function(m.judge_parse_fn, "reward_model.judge_parse_fn") if m.judge_template else None
        self.token_ids = sends_token_ids(m, tokenizer, self.tokenizer)
        context = getattr(AutoConfig.from_pretrained(m.path), "max_position_embeddings", None) or 1 << 30
        self.max_length = min(m.max_length or context, context - (m.judge_max_new_tokens if self.parse else 0))

    async def score(self, samples: list[Sample]) -> list[tuple[float | None, str | None]]:
        """The group's scores in one request, or why they failed (per sample)."""
        self.asked = time.perf_counter()  # the group's last sample just returned
        inputs = [self.conversation(s) for s in samples]
        try:
            if self.parse is None:
                replies = await self.post("/classify", {"input_ids": inputs}, samples[0].prompt.index)
                return [(reply["embedding"][0], None) for reply in replies]
            params = {"temperature": 0.0, "max_new_tokens": self.cfg.judge_max_new_tokens, "sampling_seed": 0}
            body = {"input_ids": inputs, "sampling_params": params}
            replies = await self.post("/generate", body, samples[0].prompt.index)
            return [self.verdict(reply) for reply in replies]
        except (ServerError, KeyError, IndexError, TypeError) as e:  # (a reply of another shape: not a reward model's)
            return [(None, f"--reward_model.path={self.cfg.path!r}: {e!r}")] * len(samples)

    def conversation(self, s: Sample) -> list[int]:
        """What the model reads: the policy's tokens as they are (prompt and response, or a whole episode), or
        the conversation rendered by the reward model's chat template (the judge's template filled in); cut to
        max_length at truncate_side."""
        response = self.policy.decode(s.response_ids, skip_special_tokens=True)
        if self.parse is not None:
            text = self.cfg.judge_template
            for key, value in (("prompt", s.prompt.text), ("response", response), ("answer", s.prompt.answer)):
                text = text.replace("{" + key + "}", str(value))
            ids = self.render([{"role": "user", "content": text}], text, generation_prompt=True)
        elif self.token_ids:
            ids = s.prompt.prompt_ids + s.response_ids
        else:
            raw = s.prompt.row.get(self.prompt_key, s.prompt.text)
            messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
            ids = self.render(messages + [{"role": "assistant", "content": response}], s.prompt.text + response)
        n = self.max_length
        return ids if len(ids) <= n else ids[-n:] if self.cfg.truncate_side == "left" else ids[:n]

    def render(self, messages: list[dict], plain: str, generation_prompt: bool = False) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer(plain)["input_ids"]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def verdict(self, reply: dict) -> tuple[float | None, str | None]:
        text = self.tokenizer.decode(reply["output_ids"], skip_special_tokens=True)
        try:
            return self.parse(text), None
        except Exception as e:  # noqa: BLE001 -- reported naming the row
            why = f"--reward_model.judge_parse_fn={self.cfg.judge_parse_fn} raised on the verdict {text!r}: {e!r}"
            return None, why


def start_reward_model(
    cfg: Config, tokenizer, client: RolloutClient, run_dir, rank0: bool, cuda: bool
) -> RewardModel | None:
    """With --reward_model.path: its servers, started beside the rollouts' (by rank 0; every rank learns their URLs;
    `cuda`: the trainer's, `Plan.cuda`)."""
    if not cfg.reward_model.path:
        return None
    servers, multi_node = side_servers(cfg, cfg.reward_model, cuda), bool(cfg.trainer.hostfile)
    path, engine = cfg.reward_model.path, cfg.rollout.engine
    fleet = start_fleet_for_ranks(servers, path, run_dir, cfg.seed, engine, multi_node, role="reward")
    return RewardModel(cfg, tokenizer, client, fleet, rank0)


def side_servers(cfg: Config, group: RewardModelConfig | DistillConfig, cuda: bool) -> RolloutConfig:
    """The servers' config of the reward model or the teacher. SGLang fills its GPU up to mem_fraction_static, so
    colocated on a GPU their share counts what the other tenants hold when they start (`side_rollout`)."""
    used = 0.0
    if cuda and beside_rollouts(cfg, group):
        import torch

        free, total = torch.cuda.mem_get_info()
        used = 1 - free / total
    return side_rollout(cfg, group, used)


def sends_token_ids(m: RewardModelConfig, policy, own) -> bool:
    """--reward_model.input resolved against the two tokenizers (a judge always reads its own rendering)."""
    same = policy.get_vocab() == own.get_vocab()
    if m.input == "token_ids" and not same and not m.judge_template:
        raise ValueError(
            f"--reward_model.input=token_ids: the vocabulary of --reward_model.path={m.path!r} ({len(own)} tokens) "
            f"differs from the policy's ({len(policy)}), so its token ids mean other tokens there: use --reward_model."
            "input text (the conversation re-rendered with the reward model's chat template) or auto"
        )
    return not m.judge_template and (m.input == "token_ids" or (m.input == "auto" and same))
