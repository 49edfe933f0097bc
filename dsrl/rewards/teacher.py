"""On-policy distillation's teacher (`--distill.teacher_path`): its logprobs of the student's sampled tokens, one
/generate request per group as the group's last sample returns (SGLang's prompt logprobs of prompt + response, from
`logprob_start_len` = the prompt's length), on servers of its own that the reward model's machinery starts, restarts,
puts to sleep and wakes. `dsrl.advantages` turns them into the per-token reverse KL."""

import time

from dsrl.config import Config
from dsrl.data import Sample
from dsrl.rewards.models import ServedModel, side_servers
from dsrl.serving.client import RolloutClient, ServerError
from dsrl.serving.fleet import start_fleet_for_ranks
from dsrl.serving.servers import Fleet


class Teacher(ServedModel):
    timing = "distill/teacher"

    def __init__(self, cfg: Config, tokenizer, client: RolloutClient, fleet: Fleet, rank0: bool):
        from transformers import AutoTokenizer

        super().__init__(cfg, cfg.distill, client, fleet, rank0)
        self.path = cfg.distill.teacher_path
        own = AutoTokenizer.from_pretrained(self.path, trust_remote_code=cfg.model.trust_remote_code)
        check_vocabulary(self.path, tokenizer, own)

    async def score(self, samples: list[Sample]) -> list[tuple[float | None, str | None]]:
        """Each sample's `teacher_logprobs`, one per response token (an episode's environment tokens too: the loss
        mask leaves them out), or why the group's failed. A group's samples share their prompt."""
        self.asked = time.perf_counter()
        start = len(samples[0].prompt.prompt_ids)
        body = {"input_ids": [s.prompt.prompt_ids + s.response_ids for s in samples], "return_logprob": True,
                "logprob_start_len": start, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}  # fmt: skip
        try:
            replies = await self.post("/generate", body, samples[0].prompt.index)
            for s, reply in zip(samples, replies, strict=True):
                s.teacher_logprobs = [float(lp) for lp, _, _ in reply["meta_info"]["input_token_logprobs"]]
                if len(s.teacher_logprobs) != len(s.response_ids):
                    raise IndexError(f"{len(s.teacher_logprobs)} logprobs of {len(s.response_ids)} response tokens")
        except (ServerError, KeyError, IndexError, TypeError, ValueError) as e:
            return [(None, f"--distill.teacher_path={self.path!r}: {e!r}")] * len(samples)
        return [(0.0, None)] * len(samples)


def check_vocabulary(path: str, policy, teacher) -> None:
    """The teacher scores the student's token ids: they must mean the same tokens to both."""
    if policy.get_vocab() != teacher.get_vocab():
        raise ValueError(
            f"--distill.teacher_path={path!r}: its tokenizer ({len(teacher)} tokens) is not the policy's "
            f"({len(policy)}): the teacher scores the student's token ids, which must mean the same tokens to both"
        )


def start_teacher(cfg: Config, tokenizer, client: RolloutClient, run_dir, rank0: bool, cuda: bool) -> Teacher | None:
    """With --distill.teacher_path: its servers, started by rank 0 (every rank learns their URLs; `cuda`: the plan's)"""
    d = cfg.distill
    if not d.teacher_path:
        return None
    servers = side_servers(cfg, d, cuda)
    multi_node = bool(cfg.trainer.hostfile)
    fleet = start_fleet_for_ranks(servers, d.teacher_path, run_dir, cfg.seed, cfg.rollout.engine, multi_node, "teacher")
    return Teacher(cfg, tokenizer, client, fleet, rank0)
