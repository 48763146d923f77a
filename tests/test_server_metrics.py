"""The server's limits and what it publishes, on a tiny model: the waiting limit (503 at once, the model not touched),
the room of a sequence with the paged layout, /metrics read back with prometheus_client's parser, /openapi.json."""

import threading

import pytest
import requests
from kvbook.runtime.engine import Engine
from kvbook.serving.server import BackgroundServer
from prometheus_client.parser import text_string_to_metric_families

from .conftest import small_config, wait_until
from .test_server import HELLO, KEY_ENV, MODEL, engine_prompt, post


@pytest.fixture(scope="module")
def xdg(tmp_path_factory):
    import os
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME")
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="module")
def engine(xdg):
    cfg = small_config(vocab=151936, max_cache_len=256).replace(inference={"output_len": 8})
    return Engine(cfg, progress=False)


@pytest.fixture(autouse=True)
def no_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)


def scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: {(name, ((label, value), ...) without model_name): value}."""
    response = requests.get(server.url + "/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            assert sample.labels.get("model_name") == MODEL
            samples[(sample.name, labels)] = sample.value
    return samples


def test_past_max_waiting_a_request_gets_503_at_once_without_touching_the_model(engine):
    limited = Engine(engine.config.replace(server={"max_num_seqs": 1, "max_waiting": 1}), model=engine.model,
                     progress=False)
    with BackgroundServer(limited) as server:
        scheduler = server.scheduler
        release, prefills = threading.Event(), []
        original = scheduler._run

        def held_prefill(batch, phase):  # the running request holds the scheduler until the test lets it go
            if phase == "prefill":
                prefills.append(batch[0].seq_id)
                assert release.wait(60)
            return original(batch, phase)

        scheduler._run = held_prefill
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 3, "ignore_eos": True}
        answers = []
        clients = [threading.Thread(target=lambda: answers.append(post(server, body))) for _ in range(2)]
        clients[0].start()
        wait_until(lambda: prefills == [0], timeout=30)  # the first request runs
        clients[1].start()
        wait_until(lambda: requests.get(server.url + "/health", timeout=10).json()["waiting"] == 1, timeout=30)
        refused = post(server, body)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "overloaded" and error["type"] == "server_error"
        assert "1 requests are already waiting ([server] max_waiting = 1)" in error["message"]
        assert prefills == [0]  # refused without a forward pass
        release.set()
        for client in clients:
            client.join(60)
        assert [a.status_code for a in answers] == [200, 200] and prefills == [0, 1]
        metrics = scrape(server)
    assert metrics[("kvbook:request_rejected_total", (("reason", "queue_full"),))] == 1
    assert metrics[("kvbook:request_success_total", (("finished_reason", "length"),))] == 2


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_metrics_count_the_requests_that_were_sent(engine, layout):
    keys = {"layout": layout, "prefix_caching": layout == "paged"}
    served = Engine(engine.config.replace(kv_cache=keys), model=engine.model, progress=False)
    system = {"role": "system", "content": "You are a terse assistant. " * 12}
    bodies = [{"model": MODEL, "messages": [system, {"role": "user", "content": f"question {i}"}],
               "max_tokens": 2 + i, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 1,
               "stream_options": {"include_usage": True} if i % 2 else None} for i in range(5)]
    with BackgroundServer(served) as server:
        before = scrape(server)
        usages = []
        for body in bodies:
            reply = post(server, body, stream=body["stream"])
            assert reply.status_code == 200
            usages.append(reply.json()["usage"] if not body["stream"] else streamed_usage(reply))
        assert post(server, {"model": MODEL, "messages": []}).status_code == 400
        after = scrape(server)
    assert before[("kvbook:num_requests_running", ())] == 0 and after[("kvbook:num_requests_waiting", ())] == 0
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == sum(b["max_tokens"] for b in bodies)
    assert after[("kvbook:prompt_tokens_total", ())] == prompt
    assert after[("kvbook:generation_tokens_total", ())] == generated
    assert after[("kvbook:request_success_total", (("finished_reason", "length"),))] == len(bodies)
    assert after[("kvbook:request_rejected_total", (("reason", "invalid"),))] == 1
    assert after[("kvbook:time_to_first_token_seconds_count", ())] == len(bodies)
    assert after[("kvbook:e2e_request_latency_seconds_count", ())] == len(bodies)
    assert after[("kvbook:inter_token_latency_seconds_count", ())] == generated - len(bodies)
    assert after[("kvbook:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == len(bodies)
    assert after[("kvbook:kv_cache_usage_perc", ())] == 0 and after[("kvbook:kv_cache_reserved_bytes", ())] == 0
    if layout == "paged":  # the shared system prompt's blocks were found by every request after the first
        hits = after[("kvbook:prefix_cache_hits_total", ())]
        assert after[("kvbook:prefix_cache_queries_total", ())] == prompt
        assert hits == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) and hits >= 4 * 16


def streamed_usage(reply) -> dict:
    import json
    events = [line[len("data: "):] for line in reply.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


def test_kv_cache_usage_while_a_request_runs(engine):
    paged = Engine(engine.config.replace(kv_cache={"layout": "paged"}), model=engine.model, progress=False)
    with BackgroundServer(paged) as server:
        scheduler, release, seen = server.scheduler, threading.Event(), threading.Event()
        original = scheduler._run

        def held_decode(batch, phase):
            if phase == "decode":
                seen.set()
                assert release.wait(60)
            return original(batch, phase)

        scheduler._run = held_decode
        client = threading.Thread(target=post, args=(server, {"model": MODEL, "messages": HELLO, "max_tokens": 2,
                                                              "ignore_eos": True}))
        client.start()
        assert seen.wait(60)
        during = scrape(server)
        release.set()
        client.join(60)
    pool = paged.pool
    blocks = -(-len(engine_prompt()) // pool.block_size)  # the prompt's positions, before the first decode step
    assert during[("kvbook:num_requests_running", ())] == 1
    assert during[("kvbook:kv_cache_usage_perc", ())] == pytest.approx(blocks / pool.num_blocks)
    per_block = 2 * 2 * pool.block_size * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16 float32s
    assert during[("kvbook:kv_cache_reserved_bytes", ())] == blocks * per_block


def test_a_paged_server_holds_prompts_up_to_its_pool_not_max_cache_len(xdg):
    # 64 positions in a contiguous cache; a pool of 1 MiB = 128 blocks of 16 = 2048 positions with the paged one
    base = small_config(vocab=151936, max_cache_len=64, max_positions=1024).replace(inference={"output_len": 4})
    long_prompt = [{"role": "user", "content": "word " * 300}]  # 309 tokens
    contiguous = Engine(base, progress=False)
    paged = Engine(base.replace(kv_cache={"layout": "paged", "pool_mib": 1}), model=contiguous.model, progress=False)
    assert paged.pool.num_blocks * paged.pool.block_size == 2048
    with BackgroundServer(contiguous) as small, BackgroundServer(paged) as large:
        refused = post(small, {"model": MODEL, "messages": long_prompt, "max_tokens": 2})
        served = post(large, {"model": MODEL, "messages": long_prompt, "max_tokens": 2, "ignore_eos": True})
        too_long = post(large, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 1100}]})
    assert refused.status_code == 400
    assert "the prompt has 309 tokens; this server holds at most 64 positions" in refused.json()["error"]["message"]
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2
    assert too_long.status_code == 400 and "holds at most 1024 positions" in too_long.json()["error"]["message"]


def test_openapi_describes_the_real_request(engine):
    with BackgroundServer(engine) as server:
        schema = requests.get(server.url + "/openapi.json", timeout=10).json()
    route = schema["paths"]["/api/v1/chat/completions"]["post"]
    assert route["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    request = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert request["required"] == ["model", "messages"]
    assert request["properties"]["messages"]["minItems"] == 1
    assert {"type": "integer", "minimum": 1} in request["properties"]["max_tokens"]["anyOf"]
    assert {"ignore_eos", "stop", "stream", "stream_options", "temperature", "top_p", "seed"} < set(
        request["properties"])
    assert schema["components"]["schemas"]["ChatMessage"]["properties"]["role"]["enum"] == [
        "system", "user", "assistant"]
    assert set(route["responses"]) >= {"200", "400", "401", "404", "503"}
    assert route["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
