"""An OpenAI-compatible chat completions server for the engine (FastAPI + uvicorn).

    python -m kvbook serve [--config config.toml] [--set ...] [--host 127.0.0.1] [--port 8000]

Routes, under the path of [server].api_base ("/api" for "http://127.0.0.1:8000/api"):
  POST {path}{model_endpoint}   chat completions, streaming (SSE) or not
  GET  {path}/v1/models         the one model, named by [model].name
  GET  /health                  liveness, never needs a key

Requests are batched continuously (kvbook.scheduler, in a thread of its own): a request joins the running batch
after its prefill and leaves it when it finishes; up to [server].max_num_seqs decode together, the rest wait in
arrival order at no cost. With [kv_cache] prefix_caching, a prompt that starts like an earlier one (a shared
system prompt) reuses its blocks, and usage.prompt_tokens_details.cached_tokens says how many positions.
When the environment variable named by [server].api_key_env is set, every request but /health needs
"Authorization: Bearer <key>".

Logging (logger "kvbook.server", level INFO by default, `--log-level` to change): one line per decode step with
the request id, the step, every layer's cache length and the step's milliseconds; one line per request with
prompt and completion tokens, TTFT (from arrival) and mean TPOT as the request saw them, and the engine's own
prefill and mean decode-step times. Explained in
chapters 9 ("Serving") and 11 ("Tuning the service").
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlparse

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .config import Config
from .engine import Engine
from .kv_cache import CacheFullError
from .scheduler import Scheduler, Sequence
from .tokenizer import EOS_IDS, ROLES, Tokenizer, get_default_tokenizer

log = logging.getLogger("kvbook.server")


class RequestError(Exception):
    """A bad request: becomes OpenAI's error JSON with this status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind


def error_response(err: RequestError) -> JSONResponse:
    return JSONResponse({"error": {"message": err.message, "type": err.kind, "param": err.param,
                                   "code": err.code}}, status_code=err.status)


@dataclass
class ChatRequest:
    messages: list[dict]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False


def _text_content(content, index: int) -> str:
    """String content, or OpenAI's list-of-parts form with text parts only."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"messages[{index}].content: only text parts are supported, got {kind!r}",
                                   f"messages[{index}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"messages[{index}].content must be a string or a list of text parts",
                       f"messages[{index}].content")


def _number(body: dict, key: str, kind, default, low=None, high=None, low_open=False):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise RequestError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}", key)
    if low is not None and (value <= low if low_open else value < low):
        raise RequestError(f"{key} = {value!r} is too small: must be {'>' if low_open else '>='} {low}", key)
    if high is not None and value > high:
        raise RequestError(f"{key} = {value!r} is too large: must be <= {high}", key)
    return value


def parse_chat_request(body, model_name: str, default_max_tokens: int) -> ChatRequest:
    """Validate an OpenAI chat completions body; every problem is a RequestError naming the field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("model") != model_name:
        raise RequestError(f"The model {body.get('model')!r} does not exist; this server serves {model_name!r}",
                           "model", status=404, code="model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object with role and content", f"messages[{i}]")
        if message.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role = {message.get('role')!r}: use one of {', '.join(ROLES)}",
                               f"messages[{i}].role")
        parsed.append({"role": message["role"], "content": _text_content(message.get("content"), i)})
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a non-empty string or a list of up to 4 of them", "stop")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    for flag in ("stream", "ignore_eos"):
        if not isinstance(body.get(flag, False), bool):
            raise RequestError(f"{flag} must be true or false", flag)
    return ChatRequest(
        messages=parsed,
        max_tokens=_number(body, "max_tokens", int, default_max_tokens, low=1),
        temperature=float(_number(body, "temperature", (int, float), 1.0, low=0, high=2)),
        top_p=float(_number(body, "top_p", (int, float), 1.0, low=0, high=1, low_open=True)),
        seed=_number(body, "seed", int, None),
        stop=stop,
        stream=body.get("stream", False),
        include_usage=bool(options.get("include_usage", False)),
        ignore_eos=body.get("ignore_eos", False),
    )


class TextStream:
    """Turns generated token ids into text pieces: holds back an incomplete UTF-8 character and anything that
    could still become a stop string, and reports a stop string once it appears."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0  # characters already given out
        self.stopped = False

    def add(self, token_id: int) -> str:
        if token_id not in EOS_IDS:
            self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        for s in self.stop:
            if s in text:
                self.stopped = True
                text = text[:text.index(s)]
                return self._emit(text, len(text))
        safe = len(text.rstrip("\ufffd"))  # an incomplete multi-byte character decodes as U+FFFD
        if self.stop:
            safe = min(safe, len(text) - max(len(s) for s in self.stop) + 1)
        return self._emit(text, safe)

    def finish(self) -> str:
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids)
        return self._emit(text, len(text))

    def _emit(self, text: str, upto: int) -> str:
        piece = text[self.sent:max(upto, self.sent)]
        self.sent += len(piece)
        return piece


@dataclass(eq=False)
class Ticket:
    """A request handed to the scheduler thread: its Steps come back on `steps` (None after the last one, an
    exception if its forward pass failed)."""

    input_ids: list[int]
    chat: ChatRequest
    deliver: object  # puts an item on the request's asyncio queue, from the scheduler thread
    steps: asyncio.Queue
    sequence: Sequence | None = None


class SchedulerThread:
    """Runs the scheduler's forward passes in a thread, so the event loop keeps serving while the model computes.
    The event loop only puts tickets and aborts in the inbox; the thread alone touches the scheduler."""

    def __init__(self, engine: Engine, record_timeline: bool = False):
        server = engine.config.server
        self.scheduler = Scheduler(engine, server.max_num_seqs, record_timeline, server.prefill_chunk)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.tickets: dict[Sequence, Ticket] = {}
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="kvbook-scheduler", daemon=True)
        self.thread.start()

    def submit(self, input_ids: list[int], chat: ChatRequest) -> Ticket:
        loop = asyncio.get_running_loop()
        steps: asyncio.Queue = asyncio.Queue()
        ticket = Ticket(input_ids, chat, lambda item: loop.call_soon_threadsafe(steps.put_nowait, item), steps)
        self.inbox.put(("add", ticket))
        return ticket

    def abort(self, ticket: Ticket) -> None:
        """The client went away or stopped listening: the sequence leaves at the next step (no-op once done)."""
        self.inbox.put(("abort", ticket))

    def close(self) -> None:
        self.closed = True
        self.thread.join(timeout=10)

    def _loop(self) -> None:
        while not self.closed:
            self._read_inbox(wait=not self.scheduler.has_work)
            try:
                stepped = self.scheduler.step()
            except Exception as err:  # noqa: BLE001 - a bug outside the forward pass: fail the requests, never hang
                log.exception("scheduler step failed; failing every request in flight")
                for seq, ticket in self.tickets.items():
                    ticket.deliver(err)
                    self.scheduler.abort(seq)
                continue
            for seq in stepped:
                ticket = self.tickets[seq]
                ticket.deliver(seq.error if seq.error is not None else seq.steps[-1])
            for seq in [seq for seq in self.tickets if seq.finished]:
                self.tickets.pop(seq).deliver(None)

    def _read_inbox(self, wait: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.1) if wait else self.inbox.get_nowait()
            while True:
                kind, ticket = item
                if kind == "abort" and ticket.sequence is not None:
                    self.scheduler.abort(ticket.sequence)
                elif kind == "add":
                    self._add(ticket)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _add(self, ticket: Ticket) -> None:
        chat = ticket.chat
        try:
            ticket.sequence = self.scheduler.add(ticket.input_ids, chat.max_tokens, temperature=chat.temperature,
                                                 top_p=chat.top_p, seed=chat.seed, ignore_eos=chat.ignore_eos)
        except Exception as err:  # noqa: BLE001 - checked before submission; reported, never lost
            ticket.deliver(err)
            ticket.deliver(None)
            return
        self.tickets[ticket.sequence] = ticket


def create_app(engine: Engine, tokenizer: Tokenizer | None = None, record_timeline: bool = False) -> FastAPI:
    """record_timeline: keep every forward pass in app.state.scheduler.scheduler.timeline (chapter 11, tests)."""
    config: Config = engine.config
    tokenizer = tokenizer or get_default_tokenizer()
    prefix = urlparse(config.server.api_base).path.rstrip("/")
    model_name = config.model.name
    app = FastAPI(title="kvbook", docs_url=None, redoc_url=None, openapi_url=None)
    runner = app.state.scheduler = SchedulerThread(engine, record_timeline)

    def authorized(request: Request) -> bool:
        key = os.environ.get(config.server.api_key_env)
        if not key:
            return True
        sent = request.headers.get("authorization", "")
        return hmac.compare_digest(sent.encode(), f"Bearer {key}".encode())

    def unauthorized() -> JSONResponse:
        return error_response(RequestError(
            f"Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key from the "
            f"environment variable {config.server.api_key_env}", status=401, code="invalid_api_key"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "device": str(engine.device),
                "running": len(runner.scheduler.running), "waiting": len(runner.scheduler.waiting)}

    @app.get(prefix + "/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return unauthorized()
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "kvbook"}]}

    @app.post(prefix + config.server.model_endpoint)
    async def chat_completions(request: Request):
        if not authorized(request):
            return unauthorized()
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return error_response(RequestError(f"the request body is not valid JSON: {err}"))
        try:
            chat = parse_chat_request(body, model_name, config.inference.output_len)
            input_ids = tokenizer.apply_chat_template(chat.messages)
            room = min(config.model.max_position_embeddings,
                       config.kv_cache.max_cache_len if config.kv_cache.enable else 1 << 62)
            if len(input_ids) >= room:
                raise RequestError(f"the prompt has {len(input_ids)} tokens; this server holds at most {room} "
                                   "positions per sequence (prompt + max_tokens - 1); shorten the messages",
                                   "messages")
            engine.check_request(len(input_ids), chat.max_tokens)
        except RequestError as err:
            return error_response(err)
        except (ValueError, CacheFullError) as err:  # max_tokens does not fit after this prompt
            return error_response(RequestError(str(err), "max_tokens"))
        run = Run(f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), model_name, chat, input_ids)
        if chat.stream:
            return StreamingResponse(stream_chunks(run, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            async for _ in generate(run, request):
                pass
        except Exception as err:  # noqa: BLE001 - the forward pass failed: say so, the server keeps serving
            return error_response(RequestError(f"generation failed: {err}", status=500, kind="server_error"))
        if run.disconnected:
            return JSONResponse({}, status_code=499)
        return {"id": run.id, "object": "chat.completion", "created": run.created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": run.text},
                             "finish_reason": run.finish_reason}],
                "usage": run.usage()}

    async def generate(run: Run, request: Request):
        """Yield each new piece of text as the scheduler thread delivers the request's tokens. Stops early (and
        frees the sequence's cache) when the client goes away or a stop string appears."""
        chat = run.chat
        ticket = runner.submit(run.input_ids, chat)
        text = TextStream(tokenizer, chat.stop)
        try:
            while True:
                step = await ticket.steps.get()
                if step is None:
                    break
                if isinstance(step, Exception):
                    raise step
                run.record(step, ticket.sequence)
                piece = text.add(step.token_id)
                if step.token_id in EOS_IDS and not chat.ignore_eos:
                    run.finish_reason = "stop"
                if text.stopped:
                    run.finish_reason = "stop"
                if piece:
                    run.text += piece
                    yield piece
                if text.stopped:
                    break
                if await request.is_disconnected():
                    run.went_away()
                    break
            tail = text.finish()
            if tail and not run.disconnected:
                run.text += tail
                yield tail
        except asyncio.CancelledError:  # the server noticed the disconnect first and cancelled this response
            run.went_away()
            raise
        finally:
            runner.abort(ticket)  # frees the sequence's cache if it is still running
            run.log_summary()

    async def stream_chunks(run: Run, request: Request):
        def chunk(delta: dict, finish_reason=None, usage=None) -> str:
            data = {"id": run.id, "object": "chat.completion.chunk", "created": run.created, "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
            if usage is not None:
                data["choices"], data["usage"] = [], usage
            elif run.chat.include_usage:
                data["usage"] = None
            return f"data: {json.dumps(data)}\n\n"

        yield chunk({"role": "assistant", "content": ""})
        try:
            async for piece in generate(run, request):
                yield chunk({"content": piece})
        except Exception as err:  # noqa: BLE001 - headers are sent: the error goes in the stream, as OpenAI does
            error = {"message": f"generation failed: {err}", "type": "server_error"}
            yield f"data: {json.dumps({'error': error})}\n\n"
            return
        if run.disconnected:
            return
        yield chunk({}, run.finish_reason)
        if run.chat.include_usage:
            yield chunk({}, usage=run.usage())
        yield "data: [DONE]\n\n"

    return app


@dataclass
class Run:
    """One request's generation: its tokens, text and timings."""

    id: str
    created: int
    model: str
    chat: ChatRequest
    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    disconnected: bool = False
    arrived: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)  # when each token reached this request's handler
    step_ms: list[float] = field(default_factory=list)  # the engine's own time of each forward pass
    cached_tokens: int = 0

    def record(self, step, sequence: Sequence) -> None:
        self.output_ids.append(step.token_id)
        self.token_times.append(time.perf_counter())
        self.step_ms.append(step.ms)
        if step.phase == "decode":
            log.info("%s step %d cache_len per layer %s %.1f ms", self.id, step.index, list(step.cache_lens),
                     step.ms)
        else:
            self.cached_tokens = sequence.cached_positions
            log.info("%s prefill %d tokens (%d from the prefix cache) cache_len %d %.1f ms", self.id,
                     len(self.input_ids), self.cached_tokens, step.cache_len, step.ms)

    def went_away(self) -> None:
        self.disconnected = True
        log.info("%s client disconnected after %d tokens; generation stopped", self.id, len(self.output_ids))

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.input_ids), "completion_tokens": len(self.output_ids),
                "total_tokens": len(self.input_ids) + len(self.output_ids),
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def log_summary(self) -> None:
        times = self.token_times
        ttft = (times[0] - self.arrived) * 1e3 if times else 0.0
        tpot = (times[-1] - times[0]) * 1e3 / (len(times) - 1) if len(times) > 1 else 0.0
        prefill = self.step_ms[0] if self.step_ms else 0.0
        decode = sum(self.step_ms[1:]) / (len(self.step_ms) - 1) if len(self.step_ms) > 1 else 0.0
        log.info("%s done prompt_tokens %d completion_tokens %d finish_reason %s TTFT %.1f ms TPOT %.1f ms "
                 "(engine: prefill %.1f ms, decode step %.1f ms)", self.id, len(self.input_ids),
                 len(self.output_ids), self.finish_reason, ttft, tpot, prefill, decode)


class BackgroundServer:
    """uvicorn in a thread of this process (the serving chapter and the tests): port 0 picks a free port."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 record_timeline: bool = False):
        import uvicorn

        self.app = create_app(engine, record_timeline=record_timeline)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="kvbook-server", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server could not start on {host}:{port}")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        path = urlparse(engine.config.server.api_base).path.rstrip("/")
        self.url = f"http://{host}:{port}"
        self.scheduler = self.app.state.scheduler.scheduler  # read its timeline only while no request runs
        self.api_base = self.url + path

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.app.state.scheduler.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
