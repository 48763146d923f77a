"""A soak with faults on a tiny model: a few hundred short requests from concurrent clients, streaming or not, with
random max_tokens, and clients that hang up at random points (before the first byte comes back, during a chunked
prefill, mid-stream). Afterwards nothing is lost: every cache the engine handed out is released and every block
is back in the pool, no thread or asyncio task is left behind, resident memory is within a stated margin of where
it was after a warm-up round, and every completed answer is the one the same request gets alone."""

import asyncio
import concurrent.futures
import gc
import json
import random
import socket
import threading
import time
import weakref

import pytest
import requests
from kvbook.runtime.engine import Engine
from kvbook.serving.server import BackgroundServer
from kvbook.tokenizer import EOS_IDS, get_default_tokenizer

from .conftest import small_config, wait_until
from .test_server import KEY_ENV, MODEL

REQUESTS = 200  # after a warm-up round of 30
WARM_UP = 30
CLIENTS = 10
MAX_TOKENS = 8
RSS_MARGIN_MIB = 32  # allocator noise; a cache kept per request shows first in the weakref check
PROMPTS = [f"Question {i}: " + "why does decode read every weight? " * (i % 4 * 6) for i in range(12)]


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def raw_request(server, payload: dict) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    data = json.dumps(payload)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall((f"POST /api/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n{data}").encode())
    return sock


def one_client_request(server, rng: random.Random) -> tuple[str, int, str | None]:
    """A random request; (prompt, max_tokens, the answer's text or None when the client hung up)."""
    prompt, max_tokens = rng.choice(PROMPTS), rng.randint(1, MAX_TOKENS)
    fault = rng.random()
    if fault < 0.15:  # hangs up right after sending, or a few ms later: while queued or prefilling
        sock = raw_request(server, body(prompt, max_tokens, rng.random() < 0.5))
        time.sleep(rng.choice([0, 0.002, 0.01, 0.03]))
        sock.close()
        return prompt, max_tokens, None
    if fault < 0.30:  # reads part of a stream and hangs up
        with raw_request(server, body(prompt, MAX_TOKENS + 8, True)) as sock:
            received, wanted = b"", rng.randint(1, 4)
            while received.count(b"chat.completion.chunk") < wanted:
                data = sock.recv(4096)
                if not data:
                    break
                received += data
        return prompt, max_tokens, None
    stream = rng.random() < 0.5
    url = server.api_base + "/v1/chat/completions"
    response = requests.post(url, json=body(prompt, max_tokens, stream), timeout=120, stream=stream)
    assert response.status_code == 200, response.text
    if not stream:
        reply = response.json()
        assert reply["usage"]["completion_tokens"] == max_tokens
        return prompt, max_tokens, reply["choices"][0]["message"]["content"]
    events = [line[len("data: "):] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    return prompt, max_tokens, "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


def server_tasks(server) -> int:
    loop = server.server.servers[0].get_loop()

    async def count():
        return len(asyncio.all_tasks())

    return asyncio.run_coroutine_threadsafe(count(), loop).result(10)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_soak_with_clients_that_hang_up(tmp_path, monkeypatch, layout):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(KEY_ENV, raising=False)
    kv = {"layout": "paged", "prefix_caching": True} if layout == "paged" else {}
    config = small_config(vocab=151936, max_cache_len=256).replace(
        kv_cache=kv, server={"max_num_seqs": 4, "prefill_chunk": 16, "max_waiting": 1000})
    engine = Engine(config, progress=False)
    tokenizer = get_default_tokenizer()
    prompt_ids = {p: tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS}
    alone = {p: engine.generate(ids, MAX_TOKENS, ignore_eos=True).output_ids for p, ids in prompt_ids.items()}

    caches, new_cache = [], engine.new_cache
    monkeypatch.setattr(engine, "new_cache", lambda **kw: caches.append(weakref.ref(c := new_cache(**kw))) or c)
    threads_before = set(threading.enumerate())
    rng = random.Random(16)
    with BackgroundServer(engine) as server:
        tasks_before = server_tasks(server)

        def run(count: int) -> list:
            seeds = [rng.getrandbits(32) for _ in range(count)]
            with concurrent.futures.ThreadPoolExecutor(CLIENTS) as clients:
                return list(clients.map(lambda seed: one_client_request(server, random.Random(seed)), seeds))

        run(WARM_UP)
        idle = lambda: not server.scheduler.has_work and not server.app.state.scheduler.busy  # noqa: E731
        wait_until(idle)
        gc.collect()
        rss_before = rss_mib()
        results = run(REQUESTS)
        wait_until(idle)
        wait_until(lambda: server_tasks(server) == tasks_before)  # connection tasks end with their connections
        health = requests.get(server.url + "/health", timeout=10).json()
    gc.collect()
    rss_after = rss_mib()

    completed = [(p, n, text) for p, n, text in results if text is not None]
    aborted = server.app.state.metrics.request_success.labels(model_name=MODEL, finished_reason="abort")._value.get()
    print(f"soak ({layout}): {len(completed)} completed, {REQUESTS - len(completed)} hung up ({aborted:.0f} seen "
          f"as aborted by the server, with the warm-up's), {len(caches)} caches; RSS {rss_before:.0f} -> "
          f"{rss_after:.0f} MiB")
    assert REQUESTS * 0.6 < len(completed) < REQUESTS  # both kinds happened
    for prompt, max_tokens, text in completed:  # each answer is the request's answer alone
        assert text == tokenizer.decode([t for t in alone[prompt][:max_tokens] if t not in EOS_IDS])
    assert health["running"] == health["waiting"] == 0
    assert len(caches) >= WARM_UP + len(completed)
    # every cache released: the engine keeps the last one given back for the next sequence (kvbook.runtime.engine)
    assert {id(c) for ref in caches if (c := ref()) is not None} <= {id(engine.spare_cache)}
    if layout == "paged":
        assert engine.pool.used_blocks == 0 and sorted(engine.pool.free_blocks) == list(range(engine.pool.num_blocks))
        assert all(count == 0 for count in engine.pool.ref_count)
    wait_until(lambda: set(threading.enumerate()) <= threads_before)  # the server's and the scheduler's threads
    assert rss_after - rss_before < RSS_MARGIN_MIB, (rss_before, rss_after)
