"""Datasets and reward functions: formats, chat templates, bad rows named, rewards checked."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from dsrl.config import DataConfig
from dsrl.data import DatasetError, PromptDataset
from dsrl.rewards.rules import extract_final_number, load_reward_fn, math_reward
from dsrl.tasks import toy


@pytest.fixture(scope="module")
def tokenizer():
    return toy.build_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_and_parquet_give_the_same_prompts(tmp_path, tokenizer):
    rows = toy.make_rows(10, seed=3)
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    a = PromptDataset(DataConfig(train_path=jsonl), tokenizer)
    b = PromptDataset(DataConfig(train_path=str(tmp_path / "d.parquet")), tokenizer)
    assert [p.prompt_ids for p in a.prompts] == [p.prompt_ids for p in b.prompts]
    assert a.prompts[0].answer == rows[0]["answer"]


def test_configurable_field_names(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "12=", "label": "12"}])
    ds = PromptDataset(DataConfig(train_path=path, prompt_key="question", answer_key="label"), tokenizer)
    assert ds.prompts[0].text == "12=" and ds.prompts[0].answer == "12"


def test_missing_prompt_field_names_the_row(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1="}, {"prompt": "2="}, {"question": "3="}])
    with pytest.raises(DatasetError, match=r"row 2: no field 'prompt'"):
        PromptDataset(DataConfig(train_path=path), tokenizer)


def test_a_bad_row_of_the_evaluation_set_names_that_file(tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1="}])
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "2="}, {"question": "3="}])
    with pytest.raises(DatasetError, match=r"eval.jsonl, row 1: no field 'prompt'"):
        PromptDataset(DataConfig(train_path=train), tokenizer, path=held_out)


def test_invalid_json_names_the_line(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1="}\n{"prompt": \n')
    with pytest.raises(DatasetError, match="line 2: not valid JSON"):
        PromptDataset(DataConfig(train_path=str(path)), tokenizer)


def test_too_long_prompts_are_skipped_and_counted(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1="}, {"prompt": "123456="}])
    ds = PromptDataset(DataConfig(train_path=path, max_prompt_tokens=4), tokenizer)
    assert len(ds) == 1 and ds.too_long == 1


def test_chat_template_is_applied(tmp_path, tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(str(toy_model_dir()))
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "12"}, {"prompt": [{"role": "user", "content": "3"}]}])
    ds = PromptDataset(DataConfig(train_path=path), tokenizer)
    assert [p.text for p in ds.prompts] == ["12=", "3="]


def test_verl_parquet_and_reward_function_as_they_are(tmp_path):
    """verl's files: chat-message prompts, the answer at reward_model.ground_truth, data_source and extra_info;
    its compute_score(data_source, solution_str, ground_truth, extra_info) and its dict result work as they are."""
    from dsrl.rewards.pool import call_reward

    tokenizer = AutoTokenizer.from_pretrained(str(toy_model_dir()))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = [{"role": "user", "content": "12="}]
    answer, extra = {"style": "rule", "ground_truth": "12"}, {"index": 7, "split": "train"}
    rows = [{"data_source": "toy", "prompt": chat, "ability": "copy", "reward_model": answer, "extra_info": extra}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "verl.parquet")
    cfg = DataConfig(train_path=str(tmp_path / "verl.parquet"), answer_key="reward_model.ground_truth")
    prompt = PromptDataset(cfg, tokenizer).prompts[0]
    assert (prompt.text, prompt.answer, prompt.prompt_ids) == ("12=", "12", tokenizer("12=")["input_ids"])

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str == ground_truth and data_source == "toy"), "index": extra_info["index"]}

    assert call_reward(compute_score, prompt.text, "12", prompt.answer, prompt.row) == 1.0
    assert call_reward(compute_score, prompt.text, "13", prompt.answer, prompt.row) == 0.0


def toy_model_dir():
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "examples/toy/model"


def test_batches_are_deterministic_and_cover_an_epoch(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", toy.make_rows(8, seed=0))
    ds = PromptDataset(DataConfig(train_path=path), tokenizer, seed=1)
    epoch = [p.index for step in range(2) for rank in range(2) for p in ds.batch(step, 4, rank, 2)]
    assert sorted(epoch) == list(range(8))
    assert [p.index for p in ds.batch(1, 4, 1, 2)] == [p.index for p in ds.batch(1, 4, 1, 2)]


def test_extract_final_number():
    assert extract_final_number("so 3 + 4 = 7.\n#### 1,234") == 1234.0
    assert extract_final_number("the answer is \\boxed{42}") == 42.0
    assert extract_final_number("first 3 then -5.5") == -5.5
    assert extract_final_number("no digits") is None


def test_math_reward():
    assert math_reward("q", "... so the total is 18", "Janet sells 16 - 3 - 4 = 9 ... #### 18") == 1.0
    assert math_reward("q", "the total is 17", "#### 18") == 0.0
    assert math_reward("q", "no idea", "#### 18") == 0.0


def test_toy_reward():
    assert toy.reward("394=", "394", "394") == 1.0
    assert toy.reward("394=", "3 9 4", "394") == 1.0
    assert toy.reward("394=", "39", "394") == pytest.approx(2 / 3)
    assert toy.reward("1=", "11", "1") == 0.5


def test_load_reward_fn_errors_name_the_flag():
    assert load_reward_fn("dsrl.rewards:math_reward") is math_reward
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        load_reward_fn("no_such_mod:f")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_reward_fn("dsrl.rewards:nope")


def test_reward_workers_survive_a_hang_a_crash_and_garbage():
    """Each call has its own outcome: a hung call times out and its process is replaced, a process that
    exits fails only its row, and the pool goes on serving the rows after them."""
    from dsrl.rewards.pool import WorkerPool

    pool = WorkerPool("tests._bad_rewards:by_row_kind", workers=2, timeout_s=2.0)
    kinds = ["ok", "hang", "crash", "string", "raise", "ok"]
    try:
        results = pool.submit([("p", "r", None, {"kind": k}) for k in kinds]).result()
        again = pool.submit([("p", "r", None, {"kind": "ok"})] * 3).result()  # the replaced processes serve
    finally:
        pool.close()
    assert results[0] == (1.0, None) and results[5] == (1.0, None)
    assert results[1][1].startswith("took longer than --algorithm.reward_timeout_s=2s")
    assert results[2][1].startswith("its process exited (code 3)")
    assert results[3] == ("good", None)  # the trainer refuses it (check_reward), naming the row
    assert results[4][1] == "ValueError('no answer here')"
    assert again == [(1.0, None)] * 3


def test_rewards_that_take_the_row_are_batched_or_async():
    """A reward may take `row=` (the whole dataset row), be marked batched (lists in, a list out), or be a
    coroutine function; the in-process path and the workers call them the same way."""
    import asyncio

    from dsrl.rewards.pool import call_reward
    from dsrl.rewards.rules import batched

    def with_row(prompt, response, answer, row):
        return float(row["weight"])

    async def later(prompt, response, answer):
        await asyncio.sleep(0)
        return 0.5

    @batched
    def many(prompts, responses, answers):
        return [float(len(r)) for r in responses]

    assert call_reward(with_row, "p", "r", None, {"weight": 3}) == 3.0
    assert call_reward(later, "p", "r", None, {}) == 0.5
    assert many.dsrl_batched and many(["p", "q"], ["ab", "c"], [None, None]) == [2.0, 1.0]
