"""`python -m kvbook bench --load RATE1,RATE2,...`: the server under an open-loop load, as vLLM's benchmark_serving
and guidellm's Poisson profile drive it.

For each offered rate (requests per second) the client sends N streaming requests whose arrival gaps are drawn
from an exponential distribution (a Poisson process, seeded), through the official `openai` AsyncOpenAI client,
without waiting for earlier answers. Per rate it reports the achieved requests/s and output tokens/s, TTFT (from
the request's scheduled arrival to its first text) and ITL (a request's mean gap between tokens after the first,
(last - first) / (completion_tokens - 1), as guidellm computes it) at p50, p90 and p99, and the errors. The knee
is the lowest rate whose median TTFT exceeds twice the median TTFT of the lowest rate: past it requests queue.

The server runs in a process of its own (`python -m kvbook serve` with the same --config and --set), so the
client's event loop does not share the server's interpreter; or pass --url to load a running server.
How it is run: BENCHMARKS.md ("How each figure is measured").
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..config import Config, ConfigError
from .client import time_per_token

PROMPTS = [f"Request {i}: explain what a KV cache stores during decoding, and why it saves time." for i in range(64)]


@dataclass
class Outcome:
    scheduled: float  # seconds after the rate's start when the request was due
    ttft_s: float | None = None
    itl_s: float | None = None
    done_s: float | None = None  # seconds after the rate's start
    completion_tokens: int = 0
    error: str | None = None


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """count arrival times (seconds from 0) of a Poisson process with `rate` events per second."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def _one(client, model: str, prompt: str, max_tokens: int, start: float, due: float) -> Outcome:
    outcome = Outcome(due)
    await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
    arrivals = []
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter())
            if chunk.usage is not None:
                outcome.completion_tokens = chunk.usage.completion_tokens
    except Exception as err:  # noqa: BLE001 - a refused or failed request is counted, not fatal
        outcome.error = f"{type(err).__name__}: {err}"
        return outcome
    outcome.done_s = time.perf_counter() - start
    if arrivals:
        outcome.ttft_s = arrivals[0] - (start + due)
    outcome.itl_s = time_per_token(arrivals, outcome.completion_tokens)
    return outcome


async def _run_rate(base_url: str, model: str, rate: float, count: int, max_tokens: int, seed: int,
                    api_key_env: str) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=os.environ.get(api_key_env, "unused"), max_retries=0,
                         timeout=600)
    due = poisson_arrivals(rate, count, seed)
    start = time.perf_counter() + 0.1
    try:
        outcomes = await asyncio.gather(*(_one(client, model, PROMPTS[i % len(PROMPTS)], max_tokens, start, t)
                                          for i, t in enumerate(due)))
    finally:
        await client.close()
    ok = [o for o in outcomes if o.error is None]
    span = max(o.done_s for o in ok) - min(o.scheduled for o in ok) if ok else float("nan")

    def percentiles(values: list[float]) -> dict:
        values = [v * 1e3 for v in values if v is not None]
        if not values:
            return {"p50": None, "p90": None, "p99": None}
        return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}

    return {"rate": rate, "requests": count, "ok": len(ok), "errors": sorted({o.error for o in outcomes if o.error}),
            "requests_per_s": len(ok) / span, "output_tokens_per_s": sum(o.completion_tokens for o in ok) / span,
            "ttft_ms": percentiles([o.ttft_s for o in ok]), "itl_ms": percentiles([o.itl_s for o in ok])}


def knee(rows: list[dict]) -> float | None:
    """The lowest rate whose median TTFT is more than twice the lowest rate's."""
    base = rows[0]["ttft_ms"]["p50"]
    for row in rows[1:]:
        if base is not None and row["ttft_ms"]["p50"] is not None and row["ttft_ms"]["p50"] > 2 * base:
            return row["rate"]
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _unhealthy(url: str, timeout: float) -> str | None:
    """Why the server at url does not answer /health ok, or None when it does."""
    import requests

    try:
        return None if requests.get(url.rstrip("/") + "/health", timeout=timeout).ok else \
            "it answered /health with an error"
    except (requests.RequestException, ValueError) as err:  # no server there (yet), or not a URL at all
        return type(err).__name__


def _start_server(config_path: str, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    command = [sys.executable, "-m", "kvbook", "serve", "--config", config_path, "--port", str(port),
               "--log-level", "warning", *[arg for o in overrides for arg in ("--set", o)]]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server did not start: {process.communicate()[1].strip()}")
        if _unhealthy(f"http://127.0.0.1:{port}", timeout=1) is None:
            break
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("the server did not answer /health within 15 minutes")
        time.sleep(0.5)
    return process, f"http://127.0.0.1:{port}"


def check_server(url: str) -> None:
    """A server given by --url must answer /health before any load is offered: a wrong address is one error line,
    not a table of failed requests."""
    reason = _unhealthy(url, timeout=10)
    if reason:
        raise ConfigError(f"--url {url}: no kvbook server answers there ({reason}); start one with python -m kvbook "
                          "serve, or leave out --url and the bench starts its own")


def run_load(config: Config, config_path: str, overrides: list[str], rates: list[float], count: int,
             max_tokens: int, url: str | None = None, seed: int = 0, progress=print) -> dict:
    from urllib.parse import urlparse

    process = None
    if url is None:
        progress(f"kvbook bench: starting the server ({config.model.num_hidden_layers} layers) ...")
        process, url = _start_server(config_path, overrides)
    else:
        check_server(url)
    base_url = url.rstrip("/") + urlparse(config.server.api_base).path.rstrip("/") + "/v1"
    rows = []
    try:
        key_env = config.server.api_key_env
        asyncio.run(_run_rate(base_url, config.model.name, rates[0], 2, 2, seed, key_env))  # warm-up
        for rate in rates:
            progress(f"kvbook bench: {count} requests at {rate:g} requests/s (Poisson) ...")
            rows.append(asyncio.run(_run_rate(base_url, config.model.name, rate, count, max_tokens, seed, key_env)))
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=120)
    return {"max_num_seqs": config.server.max_num_seqs, "max_waiting": config.server.max_waiting,
            "max_tokens": max_tokens, "requests_per_rate": count, "rates": rows, "knee_rate": knee(rows)}


def format_load(result: dict) -> str:
    def ms(value):
        return f"{value:8.0f}" if value is not None else f"{'-':>8s}"

    lines = [f"Poisson load: {result['requests_per_rate']} streaming requests per rate, {result['max_tokens']} new "
             f"tokens each (ignore_eos), max_num_seqs {result['max_num_seqs']}, max_waiting {result['max_waiting']}",
             f"{'rate/s':>7s}{'ok':>4s}{'req/s':>7s}{'tok/s':>7s}  {'TTFT p50':>8s}{'p90':>8s}{'p99':>8s}  "
             f"{'ITL p50':>8s}{'p90':>8s}{'p99':>8s}  (ms)"]
    for r in result["rates"]:
        t, i = r["ttft_ms"], r["itl_ms"]
        lines.append(f"{r['rate']:7g}{r['ok']:4d}{r['requests_per_s']:7.2f}{r['output_tokens_per_s']:7.1f}  "
                     f"{ms(t['p50'])}{ms(t['p90'])}{ms(t['p99'])}  {ms(i['p50'])}{ms(i['p90'])}{ms(i['p99'])}"
                     + (f"  errors: {'; '.join(r['errors'])}" if r["errors"] else ""))
    knee_rate = result["knee_rate"]
    lines.append(f"knee: TTFT p50 more than doubles from {knee_rate:g} requests/s" if knee_rate is not None else
                 "knee: not reached (TTFT p50 stays within 2x of the lowest rate's)")
    return "\n".join(lines)
