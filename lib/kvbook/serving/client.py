"""A small client for any OpenAI-compatible chat completions API: this project's server, vLLM, or a hosted one.

It reads the base URL, the endpoint and the name of the key's environment variable from config.toml's
[server] section; the key itself comes only from that environment variable. Explained in chapter 10.

    from kvbook.serving.client import chat, stream_chat
    result = chat([{"role": "user", "content": "Hi"}], model="qwen3-3layer-demo", max_tokens=16)
    print(result.status, result.usage, result.elapsed_s)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import requests

from ..config import Config, ServerConfig


@dataclass
class ChatResult:
    status: int
    elapsed_s: float
    body: dict

    @property
    def usage(self) -> dict | None:
        return self.body.get("usage")

    @property
    def text(self) -> str:
        return self.body["choices"][0]["message"]["content"] if self.status == 200 else ""


@dataclass
class StreamResult:
    status: int
    started: float  # time.perf_counter() when the request was sent
    arrivals: list[float] = field(default_factory=list)  # seconds after `started`, one per content chunk
    pieces: list[str] = field(default_factory=list)
    usage: dict | None = None
    finish_reason: str | None = None
    error: dict | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def ttft_s(self) -> float | None:
        """Time to the first chunk that carries text: prefill, plus the trip there and back."""
        return self.arrivals[0] if self.arrivals else None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, as the client sees it: from the first content chunk to the last,
        over the tokens generated after the first (usage's completion_tokens - 1, as kvbook.serving.loadgen and
        vLLM's benchmark count it). Not over the chunks: the server holds back a token whose text is not complete
        yet (a split UTF-8 character), so there may be fewer chunks than tokens, and the gaps between chunks
        would overstate the time per token. Without usage, the chunks are all there is to count."""
        if len(self.arrivals) < 2:
            return None
        return time_per_token(self.arrivals, max((self.usage or {}).get("completion_tokens") or 0,
                                                 len(self.arrivals)))


def time_per_token(arrivals: list[float], tokens: int) -> float | None:
    """A stream's mean time per token after the first: from its first text to its last, over tokens - 1 (the
    tokens generated, not the chunks that carried them); None without two tokens and a text."""
    if tokens < 2 or not arrivals:
        return None
    return (arrivals[-1] - arrivals[0]) / (tokens - 1)


def _endpoint_and_headers(server: ServerConfig, api_base: str | None) -> tuple[str, dict]:
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(server.api_key_env)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return (api_base or server.api_base).rstrip("/") + server.model_endpoint, headers


def chat(messages: list[dict], model: str, max_tokens: int = 128, temperature: float = 0.0,
         config: Config | None = None, api_base: str | None = None, timeout: float = 120.0,
         **extra) -> ChatResult:
    """One non-streaming request, as the source article's verification script sends it."""
    url, headers = _endpoint_and_headers((config or Config()).server, api_base)
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
               "stream": False, **extra}
    started = time.perf_counter()
    response = requests.post(url, headers=headers, json=payload, timeout=timeout)
    return ChatResult(response.status_code, time.perf_counter() - started, response.json())


def stream_chat(messages: list[dict], model: str, max_tokens: int = 128, temperature: float = 0.0,
                config: Config | None = None, api_base: str | None = None, timeout: float = 120.0,
                **extra) -> StreamResult:
    """A streaming request with usage, recording when each chunk arrives (timeout applies per chunk)."""
    url, headers = _endpoint_and_headers((config or Config()).server, api_base)
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
               "stream": True, "stream_options": {"include_usage": True}, **extra}
    started = time.perf_counter()
    with requests.post(url, headers=headers, json=payload, timeout=timeout, stream=True) as response:
        result = StreamResult(response.status_code, started)
        if response.status_code != 200:
            result.error = response.json().get("error")
            return result
        for line in response.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:  # the server failed after the stream had started
                result.error = chunk["error"]
                break
            if chunk.get("usage"):
                result.usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    result.arrivals.append(time.perf_counter() - started)
                    result.pieces.append(choice["delta"]["content"])
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
    return result
