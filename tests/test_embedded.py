"""The embedded engine over HTTP, through dsrl's client: SGLang's fields, control endpoints, weight updates."""

import asyncio
import socket
import subprocess
import threading
import time

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from dsrl.collectives import init_weight_update_group
from dsrl.config import RolloutConfig
from dsrl.serving.client import NoServerLeft, RolloutClient, ServerError
from dsrl.serving.fleet import start_fleet
from dsrl.serving.servers import ServerFleet, ServerProcess, embedded_command, free_port

PROMPT = [5, 11, 6, 12]  # "394="
EOS = 1


@pytest.fixture(scope="module")
def server(toy_weights, tmp_path_factory):
    cfg = RolloutConfig(num_servers=1, server_args={"decode_delay_ms": 5})  # long requests stay in flight a while
    fleet = start_fleet(cfg, str(toy_weights), tmp_path_factory.mktemp("run"), 0, "embedded")
    client = RolloutClient(fleet.urls, timeout_s=60)
    yield client
    client.close()
    fleet.stop()


def gen(client, params, **extra):
    return client.run(
        client.generate({"input_ids": PROMPT, "sampling_params": params, "return_logprob": True, **extra})
    )


def test_generate_returns_sglang_fields(server):
    out = gen(server, {"max_new_tokens": 4, "temperature": 1.0})
    # no "text": token-in/token-out like --skip-tokenizer-init; "server" is added by dsrl's client
    assert set(out) == {"output_ids", "meta_info", "server"} and out["server"] == server.urls[0]
    meta = out["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version"} <= set(meta)
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == len(out["output_ids"])
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    reason = meta["finish_reason"]
    assert reason == {"type": "length", "length": 4} or (reason["type"] == "stop" and out["output_ids"][-1] == EOS)


def test_batched_input_ids_return_a_list(server):
    out = server.run(
        server.generate({"input_ids": [PROMPT, PROMPT[:2]], "sampling_params": {"max_new_tokens": 2}, "rid": "b"})
    )
    assert [o["meta_info"]["id"] for o in out] == ["b_0", "b_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [4, 2]


def test_engine_logprobs_match_a_plain_forward(server, toy_weights):
    """The logprobs the engine reports are those of the model's own forward pass (temperature-scaled)."""
    out = gen(server, {"max_new_tokens": 6, "temperature": 0.7, "ignore_eos": True})
    model = AutoModelForCausalLM.from_pretrained(toy_weights)
    ids = torch.tensor([PROMPT + out["output_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1] / 0.7
    want = torch.log_softmax(logits, -1).gather(-1, ids[0, len(PROMPT) :, None]).squeeze(-1)
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, want, atol=1e-5)


def test_greedy_is_deterministic_and_stops_at_stop_tokens(server):
    first = gen(server, {"max_new_tokens": 6, "temperature": 0})
    assert gen(server, {"max_new_tokens": 6, "temperature": 0})["output_ids"] == first["output_ids"]
    stop_at = first["output_ids"][2]
    stopped = gen(server, {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop_at]})
    cut = first["output_ids"].index(stop_at) + 1
    assert stopped["output_ids"] == first["output_ids"][:cut]  # the matched stop token is kept, as SGLang does
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_sampling_seed_reproduces(server):
    params = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
    assert gen(server, params)["output_ids"] == gen(server, params)["output_ids"]


def test_bad_requests_are_400_with_a_message(server):
    with pytest.raises(ServerError, match="unknown sampling_params"):
        gen(server, {"max_new_token": 3})
    with pytest.raises(ServerError, match="maximum context length"):
        gen(server, {"max_new_tokens": 1000})
    with pytest.raises(ServerError, match="send input_ids"):
        server.run(server.generate({"text": "hello"}))
    with pytest.raises(ServerError, match=r"input_ids\[1\] = -3 is outside the vocabulary"):
        server.run(server.generate({"input_ids": [PROMPT[0], -3], "sampling_params": {"max_new_tokens": 2}}))
    assert len(gen(server, {"max_new_tokens": 2, "ignore_eos": True})["output_ids"]) == 2  # and it goes on serving


def test_an_engine_failure_is_a_500_naming_it(server, tmp_path):
    """Not aiohttp's bare "500 Internal Server Error": the trainer's error says what failed (CI once saw only that)."""
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ServerError, match=r"HTTP 500: SafetensorError: .*header"):
        server.call_all("/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert len(gen(server, {"max_new_tokens": 2, "ignore_eos": True})["output_ids"]) == 2  # and it goes on serving


def test_pause_holds_requests_until_continue(server):
    server.call_all("/pause_generation", {"mode": "in_place"})
    pending = server.submit(server.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}))
    with pytest.raises(TimeoutError):
        pending.result(timeout=0.5)
    server.call_all("/continue_generation", {})
    assert len(pending.result(timeout=10)["output_ids"]) <= 2


def test_abort_returns_partial_output_with_abort_reason(server):
    params = {"max_new_tokens": 40, "ignore_eos": True}
    for delay in (0.05, 0.1, 0.2):  # longer where a loaded machine had not decoded a token by the abort
        body = {"input_ids": PROMPT, "sampling_params": params, "rid": f"x_{delay}", "return_logprob": True}
        pending = server.submit(server.generate(body))
        server.run(asyncio.sleep(delay))
        server.call_all("/abort_request", {"rid": f"x_{delay}"})
        out = pending.result(timeout=10)
        if out["output_ids"]:
            break
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 40
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def test_pause_abort_ends_requests_in_flight_and_holds_new_ones(server):
    params = {"max_new_tokens": 40, "ignore_eos": True}
    running = server.submit(server.generate({"input_ids": PROMPT, "sampling_params": params}))
    server.run(asyncio.sleep(0.05))
    server.call_all("/pause_generation", {"mode": "abort"})
    assert running.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "abort"
    waiting = server.submit(server.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}))
    server.call_all("/flush_cache")  # the waiting request is not in the scheduler, as in SGLang
    with pytest.raises(TimeoutError):
        waiting.result(timeout=0.3)
    server.call_all("/continue_generation", {})
    assert waiting.result(timeout=10)["meta_info"]["finish_reason"]["type"] in ("length", "stop")


def test_memory_release_rules(server, toy_weights):
    server.call_all("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
    with pytest.raises(ServerError, match="weights are released"):
        server.call_all("/update_weights_from_disk", {"model_path": "/nonexistent"})
    with pytest.raises(ServerError, match=r"\['cuda_graph'\] were not released"):
        server.call_all("/resume_memory_occupation", {"tags": ["cuda_graph"]})
    server.call_all("/resume_memory_occupation", {"tags": ["weights"]})
    with pytest.raises(ServerError, match=r"memory \['kv_cache'\] is released"):
        gen(server, {"max_new_tokens": 1})  # SGLang's scheduler crashes on this
    server.call_all("/resume_memory_occupation", {"tags": ["kv_cache"]})
    # As SGLang's memory saver: resumed weights have lost their contents until the next update
    rows = server.call_all("/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 1})[0]
    assert all(v != v for v in rows[0]), "NaN"
    server.call_all("/update_weights_from_disk", {"model_path": str(toy_weights)})
    assert len(gen(server, {"max_new_tokens": 1})["output_ids"]) == 1


def join_group(server, name: str):
    """Trainer rank 0's end of a gloo weight-update group with the one server."""
    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    joining = server.submit(
        server.all_servers("/init_weights_update_group", {**body, "group_name": name, "backend": "gloo"})
    )
    group = init_weight_update_group("127.0.0.1", port, 0, 2, name, "gloo", timeout_s=30)
    joining.result(30)
    return group


def bucket_of(params: list) -> dict:
    """The request fields of one flattened bucket holding these (name, parameter) pairs."""
    names = [n for n, _ in params]
    return {"names": names, "dtypes": ["float32"] * len(names), "shapes": [list(p.shape) for _, p in params],
            "load_format": "flattened_bucket"}  # fmt: skip


def send_bucket(server, group, name: str, params: list, version: str) -> None:
    """Every parameter in one flattened bucket: the server's request, and trainer rank 0's broadcast."""
    payload = {**bucket_of(params), "group_name": name, "weight_version": version}
    reply = server.submit(server.all_servers("/update_weights_from_distributed", payload))
    dist.broadcast(torch.cat([p.detach().view(-1).view(torch.uint8) for _, p in params]), group=group, group_src=0)
    reply.result(30)


def test_flattened_and_per_tensor_updates_over_gloo(server, toy_weights):
    group = join_group(server, "t")
    torch.manual_seed(1)
    fresh = list(AutoModelForCausalLM.from_pretrained(toy_weights).named_parameters())
    for _, p in fresh:
        p.data.normal_()
    names = [n for n, _ in fresh]
    send_bucket(server, group, "t", fresh, "5")
    for name, p in fresh:
        got = server.call_all("/get_weights_by_name", {"name": name, "truncate_size": 10_000})[0]
        assert torch.equal(torch.tensor(got), p.detach()), name
    assert server.weight_versions() == ["5"]

    one = fresh[0][1].detach() * 2
    payload = {"names": names[:1], "dtypes": ["float32"], "shapes": [list(one.shape)], "group_name": "t"}
    reply = server.submit(server.all_servers("/update_weights_from_distributed", payload))
    dist.broadcast(one.clone(), group=group, group_src=0)
    reply.result(30)
    got = server.call_all("/get_weights_by_name", {"name": names[0], "truncate_size": 10_000})[0]
    assert torch.equal(torch.tensor(got), one)
    assert server.weight_versions() == ["5"]  # no version given: unchanged

    # A failing collective names its own error (unregistered, torch's error logging raised "Group ... is
    # not registered" instead, which is all a failed NCCL broadcast on 2 H200s showed).
    # The logging needs a default group, which a trainer always has.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert dist.get_rank(group) == 0
        with pytest.raises(RuntimeError, match="invalid root rank"):
            dist.broadcast(one.clone(), group=group, group_src=5)
    finally:
        dist.destroy_process_group(dist.group.WORLD)


def test_a_receive_the_trainer_gave_up_on_ends_when_its_group_is_destroyed(server, toy_weights):
    """A trainer whose broadcast failed (a peer died first) leaves the servers waiting in the group's broadcast:
    /destroy_weights_update_group ends the wait at once, and the server generates and takes the next group's
    update. (Before, the wait held the weights' locks until the group's 600 s timeout, and the trainer's retry
    waited behind it: CI's async crash test died so.)"""

    fresh = list(AutoModelForCausalLM.from_pretrained(toy_weights).named_parameters())
    join_group(server, "abandoned")
    payload = {**bucket_of(fresh), "group_name": "abandoned"}
    waiting = server.submit(server.all_servers("/update_weights_from_distributed", payload))
    time.sleep(2)  # the server is in the broadcast now (its request arrived well before); the trainer sends nothing
    assert not waiting.done()
    server.call_all("/destroy_weights_update_group", {"group_name": "abandoned"})
    with pytest.raises(ServerError, match="'abandoned' was destroyed while this update waited"):
        waiting.result(10)
    assert len(gen(server, {"max_new_tokens": 2})["output_ids"]) >= 1

    group = join_group(server, "next")
    for _, p in fresh:
        p.data.uniform_()
    send_bucket(server, group, "next", fresh, "6")
    got = server.call_all("/get_weights_by_name", {"name": fresh[-1][0], "truncate_size": 10_000})[0]
    assert torch.equal(torch.tensor(got), fresh[-1][1].detach()) and server.weight_versions() == ["6"]
    with pytest.raises(ServerError, match="no weight update group named 'abandoned'"):
        server.call_all("/destroy_weights_update_group", {"group_name": "abandoned"})


def test_client_retries_idempotent_calls_then_names_the_server_unless_it_was_found_gone():
    url = f"http://127.0.0.1:{free_port()}"
    client = RolloutClient([url], timeout_s=5, retries=2)
    try:
        start = time.perf_counter()
        with pytest.raises(NoServerLeft, match=r"/model_info: connection failed.*is the server running"):
            client.weight_versions()
        assert time.perf_counter() - start >= 1.5  # the retries' back-off, 0.5 + 1 s
        client.mark_down(url, "a /generate failed")  # e.g. the rollout found it killed: an update's pause is not
        start = time.perf_counter()  # retried (its 3.5 s were the stall of the update after a death)
        with pytest.raises(ServerError, match="/pause_generation: connection failed"):
            client.run(client.request(url, "/pause_generation", {}))
        assert time.perf_counter() - start < 1.5
    finally:
        client.close()


def test_higher_priority_requests_are_scheduled_first(toy_weights, tmp_path):
    """With the batch full, a request with a higher `priority` (SGLang's field, honoured there with
    --enable-priority-scheduling) runs before one that came earlier."""
    cfg = RolloutConfig(num_servers=1, server_args={"decode_delay_ms": 5, "max_batch_tokens": 8})  # one request a step
    fleet = start_fleet(cfg, str(toy_weights), tmp_path, 0, "embedded")
    client = RolloutClient(fleet.urls, timeout_s=60)
    try:
        first = client.submit(
            client.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}})
        )
        time.sleep(0.05)
        params = {"max_new_tokens": 2, "ignore_eos": True}
        urgent = client.submit(client.generate({"input_ids": PROMPT, "sampling_params": params, "priority": 5}))
        urgent.result(timeout=10)
        assert not first.done(), "the earlier request finished first: priority was not honoured"
        assert len(first.result(timeout=10)["output_ids"]) == 40
    finally:
        client.close()
        fleet.stop()


def test_fleet_sees_a_dead_server_by_its_process_and_replaces_it_in_the_background(toy_weights, tmp_path):
    """The trainer finds dead servers it started by their process (no HTTP round trip per sync): a killed server
    shows in `exited()`; `heal` sets it aside at once, with no wait for its replacement (the update goes on with the
    survivor), and the replacement joins at the first `heal` after it answers, at a new address, with the number
    (and so the GPUs) of the server it replaced."""
    fleet = start_fleet(RolloutConfig(num_servers=2), str(toy_weights), tmp_path, 0, "embedded")
    try:
        assert fleet.exited() == set()
        victim, survivor = fleet.urls
        fleet.processes[0].proc.kill()
        deadline = time.monotonic() + 10
        while victim not in fleet.exited() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fleet.exited() == {victim}
        client = RolloutClient(fleet.urls, timeout_s=5, gone=fleet.gone)
        try:  # a refused connection to a server whose process exited is final: no retries' 3.5 s of back-off
            start = time.perf_counter()
            with pytest.raises(ServerError, match="/pause_generation: connection failed"):
                client.run(client.request(victim, "/pause_generation", {}))
            assert time.perf_counter() - start < 1.5
        finally:
            client.close()
        change = fleet.heal(fleet.exited())
        assert change.urls == [survivor] and change.joined == [] and change.numbers == [1]
        assert len(fleet.starting) == 1, "heal returned before the replacement answered"
        fleet.await_replacements(timeout_s=120)
        change = fleet.heal(set())
        urls = change.urls
        assert urls[0] == survivor and urls[1] != victim and change.joined == [urls[1]] and change.numbers == [1, 0]
        assert fleet.exited() == set() and (fleet.deaths, fleet.restarts) == (1, 1)
        client = RolloutClient(urls, timeout_s=60)
        try:
            client.run(client.request(urls[1], "/model_info", method="GET"))  # raises if it does not answer
            assert len(gen(client, {"max_new_tokens": 3, "ignore_eos": True})["output_ids"]) == 3
        finally:
            client.close()
    finally:
        fleet.stop()


def test_a_server_that_loses_its_port_while_starting_is_started_again(toy_weights, tmp_path):
    """Several runs on one host: a port free when picked can be taken before the server binds it. The
    server then exits while starting; the fleet starts it once more on a new port."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1], free_port()]
    cfg = RolloutConfig(num_servers=1)

    def launch(i: int) -> ServerProcess:
        port, log_path = ports[len(started)], tmp_path / "server_0.log"
        with open(log_path, "ab") as log_file:
            cmd = embedded_command(cfg, str(toy_weights), "127.0.0.1", port, seed=0)
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        started.append(ServerProcess(f"http://127.0.0.1:{port}", proc, log_path))
        return started[-1]

    started: list[ServerProcess] = []
    fleet = ServerFleet(urls=[""], processes=[launch(0)], launch=launch, startup_timeout_s=60)
    try:
        fleet.wait_started(0)
        assert len(started) == 2 and started[0].proc.poll() is not None, "the first start should have failed"
        assert fleet.urls == [f"http://127.0.0.1:{ports[1]}"]
        client = RolloutClient(fleet.urls, timeout_s=60)
        try:
            assert len(gen(client, {"max_new_tokens": 3, "ignore_eos": True})["output_ids"]) == 3
        finally:
            client.close()
    finally:
        fleet.stop()
        taken.close()


def test_with_an_api_key_every_request_but_health_needs_it(toy_weights, tmp_path):
    """SGLang's --api-key, as the embedded engine answers it: 401 without `Authorization: Bearer <key>`,
    /health open (the launcher polls it); dsrl's client sends the key on every request."""
    cfg = RolloutConfig(num_servers=1, api_key="s3cret")
    with start_fleet(cfg, str(toy_weights), tmp_path, 0, "embedded") as fleet:  # waited on /health: open
        anonymous = RolloutClient(fleet.urls, timeout_s=30)
        keyed = RolloutClient(fleet.urls, timeout_s=30, api_key="s3cret")
        try:
            with pytest.raises(ServerError, match="HTTP 401"):
                anonymous.run(anonymous.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}))
            out = keyed.run(keyed.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}))
            assert len(out["output_ids"]) == 2 and keyed.weight_versions() == ["default"]
        finally:
            anonymous.close()
            keyed.close()


def test_group_routing_keeps_a_prompts_samples_on_one_server(toy_weights, tmp_path):
    """route group: every request of one GRPO group goes where its first went (one prefix cached once);
    groups spread over the servers, least loaded first."""
    with start_fleet(RolloutConfig(num_servers=2), str(toy_weights), tmp_path, 0, "embedded") as fleet:
        client = RolloutClient(fleet.urls, timeout_s=30, route="group")
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}

        async def groups():
            return await asyncio.gather(*(client.generate(body, route_key=g) for g in range(4) for _ in range(4)))

        try:
            servers = [out["server"] for out in client.run(groups())]
        finally:
            client.close()
    by_group = [set(servers[g * 4 : (g + 1) * 4]) for g in range(4)]
    assert all(len(s) == 1 for s in by_group), by_group
    assert set.union(*by_group) == set(fleet.urls), "the groups all went to one server"


def test_a_request_on_a_connection_the_server_closes_is_sent_again_not_taken_for_a_dead_server():
    """SGLang's uvicorn closes a keep-alive connection idle for 5 s; a request sent on it as it closes is never read
    (aiohttp: ServerDisconnectedError). The client sends it again on a new connection, whatever its path, and does not
    mark the server down: taken for dead, a live server was set aside and killed (issue 60's "-9 exits")."""
    closed = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if not closed:  # the first connection closes unanswered, as a server closing an idle one does
            closed.append(True)
        else:
            body = b'{"ok": true}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n" + body)
            await writer.drain()
        writer.close()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(serve, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = RolloutClient([url], timeout_s=10)
    try:
        assert client.run(client.request(url, "/update_weights_from_tensor", {"x": 1})) == {"ok": True}
        assert closed and client.down == []
    finally:
        client.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
