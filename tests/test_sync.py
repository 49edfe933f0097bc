"""Weight sync under real ZeRO-3 (2 gloo ranks) into real embedded servers: equal weights after every sync."""

import json
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_ranks


@pytest.fixture(scope="module", params=[2, 1], ids=["2ranks", "1rank"])
def sync_results(request, toy_weights, tmp_path_factory):
    out = tmp_path_factory.mktemp("sync") / "results.json"
    port = run_ranks(request.param, ROOT / "tests/_sync_worker.py", toy_weights, ROOT / "examples/toy/train.jsonl", out)
    return {**json.loads(out.read_text()), "port": port, "ranks": request.param}


def case(results, transport, bucket_bytes):
    return next(c for c in results["cases"] if c["transport"] == transport and c["bucket_bytes"] == bucket_bytes)


def test_bucket_smaller_than_any_tensor(sync_results):
    c = case(sync_results, "broadcast", 1)
    assert c["buckets"] == sync_results["num_params"]  # one tensor per bucket
    assert c["bytes"] == sync_results["model_bytes"]
    assert c["versions"] == ["1", "1"]


def test_bucket_equal_to_one_tensor(sync_results):
    c = case(sync_results, "broadcast", sync_results["embed_bytes"])
    assert 1 < c["buckets"] < sync_results["num_params"]
    assert c["versions"] == ["2", "2"]


def test_bucket_larger_than_the_model(sync_results):
    c = case(sync_results, "broadcast", 1 << 30)
    assert c["buckets"] == 1 and c["bytes"] == sync_results["model_bytes"]
    assert c["versions"] == ["3", "3"]


def test_disk_transport(sync_results):
    assert case(sync_results, "disk", 4096)["versions"] == ["4", "4"]


def test_verification_names_the_differing_parameter(sync_results):
    assert sync_results["world"] == sync_results["ranks"]
    message = sync_results["corrupt_detected"]
    assert message is not None and "model.layers.0.self_attn.k_proj.weight" in message and "differs" in message


def test_gather_to_every_rank_matches_gathered_parameters(sync_results):
    """The CUDA IPC transport's gather (run here over gloo): every rank's flat buckets hold the exact bytes."""
    assert sync_results["flat_to_all"] == {k: True for k in ("1", str(sync_results["embed_bytes"]), str(1 << 30))}


def test_gather_to_every_rank_with_padded_partitions(sync_results):
    """Odd tensor sizes: the last rank's partition is padded; the flat buckets still hold the exact bytes."""
    padded = sync_results["flat_to_all_padded"]
    assert padded["padded_tensors"] > 0 or sync_results["ranks"] == 1
    assert padded["1"] and padded[str(1 << 30)]


def test_one_rank_sends_buckets_from_the_parameters_own_memory(sync_results):
    """With one rank the flat buckets are views of DeepSpeed's parameter buffer: no gather, no copy."""
    assert sync_results["zero_copy"] == (sync_results["ranks"] == 1)


def test_no_shared_memory_left_behind(sync_results):
    """DeepSpeed's CPU all-reduce leaves a 69 MB /dev/shm file per rank unless dsrl unlinks it."""
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{sync_results['port']}_*"))


def test_update_calls_the_servers_in_order_per_mode(sync_results):
    """WeightSync.update, one method, one order: colocated servers wake their weights before the send and
    their KV cache before the probe; every probe runs in the background, beside the rollout's requests and
    without a flush (SGLang refuses one while they run); paused servers pause and continue around the
    send."""
    seq = sync_results["sequences"]
    group = ["/server_info", "/init_weights_update_group"]  # the first send of a transport forms its group
    assert seq["colocate"] == [
        "/release_memory_occupation",
        "/resume_memory_occupation ['weights']",
        *group,
        "/update_weights_from_distributed",
        "/model_info",
        "/resume_memory_occupation ['kv_cache']",
        "/generate",
    ]
    assert seq["disaggregate"] == ["/update_weights_from_distributed", "/model_info", "/generate"]
    assert seq["pause"] == [
        "/pause_generation",
        "/update_weights_from_distributed",
        "/continue_generation",
        "/model_info",
        "/generate",
    ]


def test_a_failure_on_rank_0_surfaces_on_every_rank(sync_results):
    """Only rank 0 talks to the servers; a refused update must fail every rank (after the retries: the second
    replaces the server that refused twice, and the other refuses too), or the others would wait forever in the
    next collective."""
    outcomes = sync_results["failure_on_rank0"]
    assert len(outcomes) == sync_results["ranks"]
    assert all(o.startswith("SyncError: weight sync to version 99 failed three times") for o in outcomes), outcomes


def test_token_mean_gradient_over_ranks_equals_the_whole_batch_gradient(sync_results):
    """loss_agg token_mean is the mean over every response token of the mini-batch, however the tokens
    fall on the ranks (here 3 on rank 0 and 16 on rank 1): equal to one process's gradient to 1e-6."""
    grad = sync_results["gradient"]
    assert grad["max_abs_grad"] > 1e-3, grad  # a gradient worth comparing
    assert grad["max_abs_diff"] < 1e-6, grad
    # Packed by 12 tokens: 2 micro-batches on both ranks (rank 0 splits its one), 3 for all four samples on one.
    assert grad["micro_batches"] == {2: 2, 1: 3}[sync_results["ranks"]], grad
    assert grad["layer_forwards"] == grad["micro_batches"]


def test_old_logprobs_from_the_update_give_the_same_gradient_and_are_kept(sync_results):
    """trainer.old_logprobs auto (one optimizer step per batch): no pass before the update, the ratio 1 from the
    update's own forward pass, the same gradient as with the pass; the logprobs it keeps for the metrics after
    the update are the pass's. It runs after the skipped step below: none of that step's gradients stayed."""
    grad = sync_results["gradient_fused"]
    assert grad["max_abs_grad"] > 1e-3 and grad["max_abs_diff"] < 1e-6, grad
    assert grad["old_max_abs_diff"] < 1e-5, grad


def test_an_update_with_non_finite_logprobs_or_gradients_is_skipped_on_every_rank(sync_results):
    """One sample's NaN (rank 0's) makes the gradient norm NaN: DeepSpeed skips the optimizer step on every rank,
    the weights stay as they were, and the update says so (`steps_skipped`, which `update` counts as a bad step)."""
    assert sync_results["non_finite_update"] == {"steps_skipped": 1.0, "unchanged": True}


def test_gradient_checkpointing_recomputes_each_layer_and_keeps_the_gradient(sync_results):
    """--model.gradient_checkpointing true under ZeRO-3: in training mode (as `run_updates` puts the engine) each
    decoder layer runs twice per micro-batch, its forward recomputed in the backward pass, and the gradient
    is the same. (It once did nothing: from_pretrained leaves a model in eval mode, where transformers skips
    checkpointing, and nothing switched the engine to training mode.)"""
    grad = sync_results["gradient_checkpointed"]
    assert grad["max_abs_diff"] < 1e-6 and grad["max_abs_grad"] > 1e-3, grad
    assert grad["layer_forwards"] == 2 * grad["micro_batches"], grad


def test_every_rank_sends_its_own_partition(sync_results):
    """--sync.senders all: each rank broadcasts its ZeRO-3 partition in a group of its own and the servers assemble
    them (the worker compared every server parameter with the trainer's); together the ranks send the model once."""
    for version, bucket_bytes in enumerate((1, sync_results["embed_bytes"], 1 << 30), start=5):
        c = case(sync_results, "all", bucket_bytes)
        assert c["bytes"] == sync_results["model_bytes"]
        assert c["versions"] == [str(version)] * 2


def test_200_delta_syncs_leave_the_servers_weights_equal_to_the_trainers(sync_results):
    """--sync.delta: the first sync in full, then 199 deltas of about 1 % of each rank's words (none at some, all at
    one), and the servers' weights equal the trainer's bit for bit at the end (the worker raises otherwise). With one
    rank, 20 syncs (the CI's time)."""
    d = sync_results["delta"]
    assert d["delta"] == [0.0] + [1.0] * (199 if sync_results["ranks"] == 2 else 19)
    heads = 16 * d["buckets"] * sync_results["ranks"]  # each rank's [count, checksum] per bucket
    for i, (changed, sent) in enumerate(zip(d["changed"][1:], d["bytes"][1:]), start=1001):
        if i % 10 == 3:  # nothing changed: the checksums alone
            assert changed == 0 and sent == heads
        elif i != 1100:  # 1 % of the elements, about 1 % of the 2-byte words: 6 bytes each
            assert 0.005 < changed < 0.02 and sent < 0.07 * d["full_bytes"]
    if sync_results["ranks"] == 2:  # every element changed at version 1100: over a third of the words, all sent
        assert d["changed"][100] > 0.5 and d["delta"][100] == 1.0 and d["bytes"][100] == d["full_bytes"] + heads


def test_a_server_corrupted_in_place_is_restored_by_the_next_sync(sync_results):
    """A server's weights changed behind the trainer's back: the next delta fails that bucket's checksum, says so in
    one line and sends everything in full; a full sync restores them too (each compared bit for bit after)."""
    d = sync_results["delta"]["corrupt_then_delta"]
    assert d["delta"] == 1.0 and d["checksum_failed"] == 1.0
    buckets = sync_results["delta"]["buckets"]
    assert len(d["lines"]) == 1 and f"1 of {buckets} buckets on http" in d["lines"][0], d["lines"]
    assert "failed the checksum after the delta; sending every weight in full" in d["lines"][0]
    full = sync_results["delta"]["corrupt_then_full"]
    assert full == {"delta": 0.0, "checksum_failed": 0.0, "lines": []}
