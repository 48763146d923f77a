"""The OpenAI-compatible server on a tiny model, started by the test in this process: the official openai
client (plain and streaming), a requests call shaped like the article's, every bad input, auth, 8 concurrent
requests, and a client that disconnects mid-stream."""

import concurrent.futures
import logging
import socket

import openai
import pytest
import requests
from kvbook.runtime.engine import Engine
from kvbook.serving.client import StreamResult, chat, stream_chat
from kvbook.serving.server import BackgroundServer

from .conftest import small_config

KEY_ENV = "TAOTOKEN_API_KEY"
MODEL = "tiny"
HELLO = [{"role": "user", "content": "Explain in 128 characters the role of the KV cache."}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    import os
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg"))
    try:
        cfg = small_config(vocab=151936, max_cache_len=256).replace(inference={"output_len": 8})
        yield Engine(cfg, progress=False)
    finally:
        if old is None:
            os.environ.pop("XDG_CACHE_HOME")
        else:
            os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture
def server(engine, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with BackgroundServer(engine, record_timeline=True) as running:
        yield running


def post(server, body, **kwargs):
    return requests.post(server.api_base + "/v1/chat/completions", json=body, timeout=60, **kwargs)


def test_routes_follow_api_base(server):
    assert server.api_base.endswith("/api")
    assert requests.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    models = requests.get(server.api_base + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_official_openai_client_plain_and_streaming(server, engine):
    client = openai.OpenAI(base_url=server.api_base + "/v1", api_key="unused")
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    prompt_tokens = reply.usage.prompt_tokens
    assert reply.object == "chat.completion" and reply.choices[0].finish_reason == "length"
    assert (reply.usage.completion_tokens, reply.usage.total_tokens) == (6, prompt_tokens + 6)
    alone = engine.generate(engine_prompt(), 6, ignore_eos=True)
    assert reply.choices[0].message.content == text_of(alone.output_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == prompt_tokens + 6 and chunks[-1].choices == []


def test_sse_ends_with_done(server):
    response = post(server, {"model": MODEL, "messages": HELLO, "max_tokens": 3, "stream": True,
                             "temperature": 0}, stream=True)
    lines = [line for line in response.iter_lines(decode_unicode=True) if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_the_articles_request_with_the_client_module(server):
    result = chat(HELLO, MODEL, max_tokens=8, temperature=0.0, api_base=server.api_base, ignore_eos=True)
    assert result.status == 200 and result.elapsed_s > 0
    assert result.usage["completion_tokens"] == 8
    assert result.usage["total_tokens"] == result.usage["prompt_tokens"] + 8
    streamed = stream_chat(HELLO, MODEL, max_tokens=8, api_base=server.api_base, ignore_eos=True)
    assert streamed.status == 200 and streamed.usage == result.usage and streamed.text == result.text
    assert streamed.ttft_s > 0 and streamed.tpot_s is not None and streamed.finish_reason == "length"

    # the time per token counts the tokens after the first, not the chunks (a held-back token makes fewer chunks)
    chunks = len(streamed.arrivals)
    assert streamed.tpot_s == pytest.approx((streamed.arrivals[-1] - streamed.arrivals[0]) / (8 - 1))
    assert chunks <= 8


def test_a_streams_time_per_token_divides_by_its_tokens_not_its_chunks():
    held_back = StreamResult(200, 0.0, arrivals=[1.0, 1.2, 1.4], usage={"completion_tokens": 5})
    assert held_back.tpot_s == pytest.approx(0.4 / 4)  # 3 chunks for 5 tokens: 4 steps after the first token
    assert StreamResult(200, 0.0, arrivals=[1.0, 1.2, 1.4]).tpot_s == pytest.approx(0.2)  # no usage: the chunks
    assert StreamResult(200, 0.0, arrivals=[1.0], usage={"completion_tokens": 5}).tpot_s is None


def engine_prompt():
    from kvbook.tokenizer import get_default_tokenizer
    return get_default_tokenizer().apply_chat_template(HELLO)


def text_of(ids):
    from kvbook.tokenizer import get_default_tokenizer
    return get_default_tokenizer().decode(ids)


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "gpt-9", "messages": HELLO}, 404, "The model 'gpt-9' does not exist"),
    ({"model": MODEL}, 400, "messages is required: a non-empty list"),
    ({"model": MODEL, "messages": []}, 400, "messages must be a non-empty list"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role = 'robot'"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "only text parts are supported, got 'image_url'"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content must be a string or a non-empty list of text parts"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": 0}, 400, "max_tokens = 0 is too small"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": "5"}, 400, "max_tokens must be an integer"),
    ({"model": MODEL, "messages": HELLO, "max_completion_tokens": 0}, 400, "max_completion_tokens = 0 is too small"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": 10000}, 400, "need 10022 positions but max_position_embeddings "
     "is 256; shorten the prompt or max_tokens"),
    ({"model": MODEL, "messages": HELLO, "n": 2}, 400, "n = 2 is too large"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 300}]}, 400,
     "the prompt has 309 tokens; this server holds at most 256 positions"),
    ({"model": MODEL, "messages": HELLO, "temperature": -1}, 400, "temperature = -1 is too small"),
    ({"model": MODEL, "messages": HELLO, "top_p": 0}, 400, "top_p = 0 is too small"),
    ({"model": MODEL, "messages": HELLO, "stop": [""]}, 400, "stop must be"),
    ({"model": MODEL, "messages": HELLO, "seed": 2**70}, 400, "seed = 1180591620717411303424 is too large"),
    ({"model": MODEL, "messages": HELLO, "stream": "yes"}, 400, "stream must be true or false, got 'yes'"),
    ({"model": MODEL, "messages": HELLO, "stop": ["a"] * 5}, 400, "stop must be a non-empty string or a list of up"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_working(server, body, status, fragment):
    response = post(server, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    assert post(server, {"model": MODEL, "messages": HELLO, "max_tokens": 2}).status_code == 200


def test_invalid_json_is_a_400(server):
    response = requests.post(server.api_base + "/v1/chat/completions", data=b"{not json", timeout=10,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_auth_needs_the_key_and_never_leaks_it(engine, monkeypatch, caplog):
    secret = "sk-test-7f3a9c-secret"
    monkeypatch.setenv(KEY_ENV, secret)
    caplog.set_level(logging.INFO, logger="kvbook.serving.server")
    with BackgroundServer(engine) as server:
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
        missing = post(server, body)
        wrong = post(server, body, headers={"Authorization": "Bearer sk-wrong"})
        right = post(server, body, headers={"Authorization": f"Bearer {secret}"})
        via_client = chat(HELLO, MODEL, max_tokens=2, api_base=server.api_base)  # reads the env var
        health = requests.get(server.url + "/health", timeout=10)
    assert missing.status_code == wrong.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key" and KEY_ENV in missing.json()["error"]["message"]
    assert right.status_code == 200 and via_client.status == 200 and health.status_code == 200
    for text in (missing.text, wrong.text, right.text, caplog.text):
        assert secret not in text


def test_eight_concurrent_requests_are_each_answered_as_if_alone(server):
    bodies = [{"model": MODEL, "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 5,
               "temperature": 0, "ignore_eos": True} for i in range(8)]
    alone = [post(server, body).json()["choices"][0]["message"]["content"] for body in bodies]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda body: post(server, body), bodies))
    assert all(r.status_code == 200 for r in together)
    assert [r.json()["choices"][0]["message"]["content"] for r in together] == alone
    decode_batches = [len(step.seq_ids) for step in server.scheduler.timeline if step.phase == "decode"]
    assert max(decode_batches) > 1  # they shared decode steps: continuous batching, not a queue
    assert decode_batches.count(1) >= 8 * 4  # the eight runs alone: one sequence per step


@pytest.mark.parametrize("method, error", [
    ("_run", RuntimeError("out of memory (simulated)")),  # inside a forward pass: that pass's requests fail
    ("_record", KeyError("bookkeeping bug (simulated)")),  # a bug after it: every request in flight fails
])
def test_a_failure_in_the_scheduler_is_a_500_and_the_server_keeps_serving(server, monkeypatch, method, error):
    def broken(*args):
        raise error

    monkeypatch.setattr(server.app.state.scheduler.scheduler, method, broken)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "ignore_eos": True}
    reply = post(server, body)
    assert reply.status_code == 500
    assert reply.json()["error"]["message"] == f"generation failed: {error}"
    streamed = post(server, {**body, "stream": True}).text
    assert f"generation failed: {error}" in streamed and "[DONE]" not in streamed
    monkeypatch.undo()
    assert post(server, body).json()["usage"]["completion_tokens"] == 4
    assert not server.scheduler.running and not server.scheduler.waiting  # the failed requests left


def test_a_shared_system_prompt_is_prefilled_once(engine, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    cached = Engine(engine.config.replace(kv_cache={"layout": "paged", "prefix_caching": True}), model=engine.model,
                    progress=False)
    system = {"role": "system", "content": "You are a terse assistant. " * 12}
    bodies = [{"model": MODEL, "messages": [system, {"role": "user", "content": q}], "max_tokens": 5,
               "temperature": 0, "ignore_eos": True} for q in ("What is a KV cache?", "Why is decode slow?")]
    with BackgroundServer(engine) as plain_server, BackgroundServer(cached) as cached_server:
        plain = [post(plain_server, b).json() for b in bodies]
        reused = [post(cached_server, b).json() for b in bodies]
    cached_tokens = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in reused]
    prompt_tokens = reused[1]["usage"]["prompt_tokens"]
    assert cached_tokens[0] == 0 and 16 <= cached_tokens[1] < prompt_tokens and cached_tokens[1] % 16 == 0
    assert [r["choices"][0]["message"]["content"] for r in reused] == \
        [r["choices"][0]["message"]["content"] for r in plain]
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in plain] == [0, 0]


def test_a_client_that_disconnects_mid_stream_frees_the_server(server, caplog):
    caplog.set_level(logging.INFO, logger="kvbook.serving.server")
    host, port = server.url.removeprefix("http://").split(":")
    body = ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, '
            '"stream": true, "ignore_eos": true}')
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall((f"POST /api/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                      f"\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        received = b""
        while b"chat.completion.chunk" not in received:  # wait until the stream has started
            data = sock.recv(4096)
            assert data, "the server closed the stream before its first chunk"
            received += data
    reply = post(server, {"model": MODEL, "messages": HELLO, "max_tokens": 3, "ignore_eos": True})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    done = [r.getMessage() for r in caplog.records if " done " in r.getMessage()]
    assert any("finish_reason abort" in m and "completion_tokens 200" not in m for m in done[:1])
    assert any("disconnected" in r.getMessage() for r in caplog.records)


def test_logs_show_each_layers_cache_growing(server, caplog):
    caplog.set_level(logging.INFO, logger="kvbook.serving.server")
    reply = post(server, {"model": MODEL, "messages": HELLO, "max_tokens": 4, "ignore_eos": True}).json()
    prompt = reply["usage"]["prompt_tokens"]
    steps = [r.getMessage() for r in caplog.records if " cache_len per layer " in r.getMessage()]
    assert [s.split("cache_len per layer ")[1].split("]")[0] + "]" for s in steps] == [
        str([prompt + i, prompt + i]) for i in (1, 2, 3)]
    summary = [r.getMessage() for r in caplog.records if " done " in r.getMessage()][-1]
    assert f"prompt_tokens {prompt} completion_tokens 4" in summary and "TTFT" in summary and "TPOT" in summary


def test_max_completion_tokens_is_max_tokens_newer_name(server):
    body = {"model": MODEL, "messages": HELLO, "ignore_eos": True}
    assert post(server, {**body, "max_completion_tokens": 3}).json()["usage"]["completion_tokens"] == 3
    both = post(server, {**body, "max_completion_tokens": 2, "max_tokens": 5}).json()
    assert both["usage"]["completion_tokens"] == 2


def test_stop_strings_end_the_reply_before_them(server, engine):
    full = post(server, {"model": MODEL, "messages": HELLO, "max_tokens": 8, "temperature": 0,
                         "ignore_eos": True}).json()["choices"][0]["message"]["content"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop
    cut = post(server, {"model": MODEL, "messages": HELLO, "max_tokens": 8, "temperature": 0, "stop": stop,
                        "ignore_eos": True}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["message"]["content"] == full[:full.index(stop)]


def test_serve_command_starts_a_working_server(tmp_path):
    import os
    import subprocess
    import sys
    import time

    from .test_cli import TINY

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop(KEY_ENV, None)
    process = subprocess.Popen([sys.executable, "-m", "kvbook", "serve", "--port", str(port), *TINY],
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        for _ in range(300):
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                    break
            except requests.ConnectionError:
                time.sleep(0.2)
        reply = requests.post(f"http://127.0.0.1:{port}/api/v1/chat/completions", timeout=60,
                              json={"model": "qwen3-3layer-demo", "messages": HELLO, "max_tokens": 3,
                                    "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        process.terminate()
        stderr = process.communicate(timeout=30)[1]
    assert f"at http://127.0.0.1:{port}/api/v1/chat/completions (API key not required" in stderr
    assert "up to 8 requests decoded together; prefix caching off" in stderr
    assert "cache_len per layer" in stderr  # the step log, at the default level
