"""A clean shutdown of a real `python -m kvbook serve` process (tiny model): SIGTERM or Ctrl-C mid-stream stops
accepting connections, the running request finishes within the grace period (or, past it, ends with an error
event), and the process exits 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from .test_cli import TINY
from .test_server import HELLO, KEY_ENV

MODEL = "qwen3-3layer-demo"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(tmp_path, grace: float, port: int) -> subprocess.Popen:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop(KEY_ENV, None)
    process = subprocess.Popen([sys.executable, "-m", "kvbook", "serve", "--port", str(port), "--log-level", "warning",
                                "--shutdown-grace", str(grace), *TINY], stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, process.communicate()[1]
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                return process
        except requests.ConnectionError:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)


def stream_events(port: int, max_tokens: int, started: threading.Event, events: list) -> None:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with requests.post(f"http://127.0.0.1:{port}/api/v1/chat/completions", json=body, stream=True,
                       timeout=120) as response:
        for line in response.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if any('"content": "' in e and '"content": ""' not in e for e in events):
                    started.set()  # a token has arrived: the request is decoding


@pytest.mark.parametrize("sig, grace, max_tokens, finishes", [
    (signal.SIGTERM, 60.0, 100, True),
    (signal.SIGINT, 0.0, 1000, False),  # Ctrl-C
])
def test_a_signal_mid_stream_drains_then_exits_0(tmp_path, sig, grace, max_tokens, finishes):
    port = free_port()
    process = start_server(tmp_path, grace, port)
    try:
        started, events = threading.Event(), []
        client = threading.Thread(target=stream_events, args=(port, max_tokens, started, events))
        client.start()
        assert started.wait(60), "the stream did not start"
        process.send_signal(sig)
        time.sleep(0.5)  # the handler runs in the server's event loop, between two of its steps
        with pytest.raises(requests.ConnectionError):  # it stopped accepting connections
            requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
        client.join(120)
        assert not client.is_alive()
        stderr = process.communicate(timeout=60)[1]
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    if finishes:  # the running request went on to its last token and [DONE]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    else:  # past the grace period: an error event, no [DONE]
        assert "[DONE]" not in events
        error = json.loads(events[-1])["error"]
        assert error["code"] == "shutting_down" and "grace period 0 s" in error["message"]
        assert "ending the requests still running after the 0 s grace period" in stderr
