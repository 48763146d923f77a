"""An OpenAI-compatible chat completions server for the engine (FastAPI + uvicorn).

    python -m kvbook serve [--config config.toml] [--set ...] [--host 127.0.0.1] [--port 8000]
                           [--shutdown-grace SECONDS]

Routes, under the path of [server].api_base ("/api" for "http://127.0.0.1:8000/api"):
  POST {path}{model_endpoint}   chat completions, streaming (SSE) or not
  GET  {path}/v1/models         the one model, named by [model].name
  GET  /health                  liveness, never needs a key
  GET  /metrics                 Prometheus metrics (kvbook.serving.metrics), never needs a key
  GET  /openapi.json            the schema of every route, request and answer (kvbook.serving.protocol)

Bodies are the pydantic models of kvbook.serving.protocol; a bad body is answered 400 in OpenAI's error format.
Requests are batched continuously (kvbook.runtime.scheduler, in a thread of its own:
kvbook.serving.scheduler_thread): a request joins the running batch after its prefill and leaves it when it
finishes; up to [server].max_num_seqs decode together, up to [server].max_waiting wait in arrival order, and past
that a request is answered 503 at once with a Retry-After header. A request that could never fit (the positions,
max_cache_len or the whole block pool) is refused with 400 before it queues. On SIGTERM or Ctrl-C the server stops
accepting, lets running requests finish within a grace period and ends the rest with an error (GracefulServer).
With [kv_cache] prefix_caching, a prompt that starts like an earlier one (a shared system prompt) reuses its
blocks, and usage.prompt_tokens_details.cached_tokens says how many positions.
When the environment variable named by [server].api_key_env is set, the routes under api_base's path need
"Authorization: Bearer <key>" (/health, /metrics and /openapi.json never do).

Logging (logger "kvbook.serving.server", level INFO by default, `--log-level` to change): one line per decode step with
the request id, the step, every layer's cache length and the step's milliseconds; one line per request with
prompt and completion tokens, TTFT (from arrival) and mean TPOT as the request saw them, and the engine's own
prefill and mean decode-step times. Explained in
chapters 10 ("Serving") and 11 ("Tuning the service").
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlparse

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..cache.contiguous import CacheFullError
from ..cache.memory import kv_cache_bytes
from ..config import Config
from ..runtime.engine import Engine
from ..runtime.sequence import Sequence
from ..tokenizer import Tokenizer, get_default_tokenizer
from .metrics import ServerMetrics
from .protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
    explain_validation_error,
)
from .scheduler_thread import Sampling, SchedulerThread, ShutdownError
from .text_stream import TextStream

log = logging.getLogger("kvbook.serving.server")


class RequestError(Exception):
    """A refused request: becomes OpenAI's error JSON with this status (and these headers)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind
        self.headers = headers


def error_response(err: RequestError) -> JSONResponse:
    body = ErrorResponse(error={"message": err.message, "type": err.kind, "param": err.param, "code": err.code})
    return JSONResponse(body.model_dump(), status_code=err.status, headers=err.headers)


def positions_per_sequence(engine: Engine) -> int:
    """The most positions one sequence can hold: the model's positions, and the cache's room for one sequence
    (max_cache_len with the contiguous layout, the whole block pool with the paged one)."""
    kv = engine.config.kv_cache
    room = engine.config.model.max_position_embeddings
    if kv.enable and kv.layout == "paged":
        room = min(room, engine.pool.num_blocks * engine.pool.block_size)
    elif kv.enable:
        room = min(room, kv.max_cache_len)
    return room


def _metrics_for(engine: Engine, runner: SchedulerThread) -> ServerMetrics:
    config = engine.config
    scheduler = runner.scheduler
    per_sequence = kv_cache_bytes(config.model, config.kv_cache.max_cache_len, config.kv_cache.cache_dtype)
    pool = engine.pool

    if pool is not None:
        block_bytes = kv_cache_bytes(config.model, pool.block_size, config.kv_cache.cache_dtype)
        usage = lambda: pool.used_blocks / pool.num_blocks  # noqa: E731
        held = lambda: pool.used_blocks * block_bytes  # noqa: E731
    else:
        usage = lambda: len(scheduler.running) / scheduler.max_num_seqs  # noqa: E731
        held = lambda: len(scheduler.running) * per_sequence  # noqa: E731
    return ServerMetrics(lambda: runner.num_running, lambda: runner.num_waiting, usage, held, config.model.name)


def create_app(engine: Engine, tokenizer: Tokenizer | None = None, record_timeline: bool = False) -> FastAPI:
    """record_timeline: keep every forward pass in app.state.scheduler.scheduler.timeline (chapter 11a, tests).

    app.state: scheduler (the SchedulerThread), metrics (ServerMetrics), draining (set on shutdown: new requests
    are refused with 503)."""
    config: Config = engine.config
    tokenizer = tokenizer or get_default_tokenizer()
    prefix = urlparse(config.server.api_base).path.rstrip("/")
    model_name = config.model.name
    app = FastAPI(title="kvbook", version=_version(), docs_url=None, redoc_url=None,
                  description="An OpenAI-compatible chat completions server for the kvbook engine.")
    runner = app.state.scheduler = SchedulerThread(engine, record_timeline)
    metrics = app.state.metrics = _metrics_for(engine, runner)
    app.state.draining = False
    room = positions_per_sequence(engine)
    errors = {code: {"model": ErrorResponse} for code in (400, 401, 404, 500, 503)}

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        message, param = explain_validation_error(err.errors()[0], request.headers.get("content-type", ""))
        metrics.rejected("invalid")
        return error_response(RequestError(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return error_response(RequestError(f"{request.method} {request.url.path}: {err.detail}",
                                           status=err.status_code, kind=kind, headers=err.headers))

    def require_key(request: Request) -> None:
        key = os.environ.get(config.server.api_key_env)
        if not key:
            return
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {key}".encode()):
            raise RequestError(
                f"Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key from the "
                f"environment variable {config.server.api_key_env}", status=401, code="invalid_api_key")

    authorized = [Depends(require_key)]

    @app.get("/health")
    async def health():
        return {"status": "draining" if app.state.draining else "ok", "model": model_name,
                "device": str(engine.device), "running": runner.num_running, "waiting": runner.num_waiting}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(prefix + "/v1/models", dependencies=authorized, response_model=ModelList, responses={401: errors[401]})
    async def models():
        return ModelList(data=[ModelCard(id=model_name)])

    @app.post(prefix + config.server.model_endpoint, dependencies=authorized, response_model=ChatCompletion,
              responses={**errors, 200: {"content": {"text/event-stream": {}},
                                         "description": "a ChatCompletion, or with stream = true Server-Sent "
                                                        "Events of ChatCompletionChunk ending with [DONE]"}})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if body.model != model_name:
            raise RequestError(f"The model {body.model!r} does not exist; this server serves {model_name!r}",
                               "model", status=404, code="model_not_found")
        sampling = Sampling.of(body, config.inference.output_len)
        input_ids = tokenizer.apply_chat_template([{"role": m.role, "content": m.text} for m in body.messages])
        if len(input_ids) >= room:
            raise RequestError(f"the prompt has {len(input_ids)} tokens; this server holds at most {room} "
                               "positions per sequence (prompt + max_tokens - 1); shorten the messages", "messages")
        try:
            engine.check_request(len(input_ids), sampling.max_tokens, tokens_name="max_tokens")
        except (ValueError, CacheFullError) as err:  # max_tokens does not fit after this prompt
            raise RequestError(str(err), "max_tokens") from None
        if app.state.draining:
            metrics.rejected("shutting_down")
            raise RequestError("the server is shutting down; send the request to another instance", status=503,
                               kind="server_error", code="shutting_down")
        if runner.num_waiting >= config.server.max_waiting:
            metrics.rejected("queue_full")
            raise RequestError(
                f"the server is overloaded: {runner.num_waiting} requests are already waiting ([server] max_waiting "
                f"= {config.server.max_waiting}); retry later", status=503, kind="server_error", code="overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)})
        run = Run(f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), model_name, sampling,
                  body.include_usage, input_ids, metrics, engine.prefix_caching)
        if body.stream:
            return StreamingResponse(stream_chunks(run, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            async for _ in generate(run, request):
                pass
        except ShutdownError as err:
            return error_response(RequestError(str(err), status=503, kind="server_error", code="shutting_down"))
        except Exception as err:  # noqa: BLE001 - the forward pass failed: say so, the server keeps serving
            return error_response(RequestError(f"generation failed: {err}", status=500, kind="server_error"))
        if run.disconnected:
            return JSONResponse({}, status_code=499)
        return ChatCompletion(id=run.id, created=run.created, model=model_name,
                              choices=[Choice(message=AssistantMessage(content=run.text),
                                              finish_reason=run.finish_reason)],
                              usage=run.usage())

    async def generate(run: Run, request: Request):
        """Yield each new piece of text as the scheduler thread delivers the request's tokens. Stops early (and
        frees the sequence's cache) when the client goes away or a stop string appears."""
        sampling = run.sampling
        ticket = runner.submit(run.input_ids, sampling)
        text = TextStream(tokenizer, list(sampling.stop))
        try:
            while True:
                step = await ticket.steps.get()
                if step is None:
                    break
                if isinstance(step, Exception):
                    run.finish_reason = "error"
                    raise step
                run.record(step, ticket.sequence)
                piece = text.add(step.token_id)
                if ticket.sequence.stops_on(step.token_id):
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
        except (asyncio.CancelledError, GeneratorExit):  # the server noticed the disconnect and cancelled this
            run.went_away()
            raise
        finally:
            runner.abort(ticket)  # frees the sequence's cache if it is still running
            run.done()

    async def stream_chunks(run: Run, request: Request):
        def chunk(delta: Delta, finish_reason=None, usage: Usage | None = None) -> str:
            data = ChatCompletionChunk(id=run.id, created=run.created, model=model_name,
                                       choices=[] if usage is not None else
                                       [ChunkChoice(delta=delta, finish_reason=finish_reason)],
                                       usage=usage).model_dump(exclude_none=True)
            if run.include_usage and usage is None:
                data["usage"] = None
            for choice in data["choices"]:
                choice.setdefault("finish_reason", None)
            return f"data: {json.dumps(data)}\n\n"

        yield chunk(Delta(role="assistant", content=""))
        try:
            async for piece in generate(run, request):
                yield chunk(Delta(content=piece))
        except Exception as err:  # noqa: BLE001 - headers are sent: the error goes in the stream, as OpenAI does
            message = str(err) if isinstance(err, ShutdownError) else f"generation failed: {err}"
            error = {"message": message, "type": "server_error", "param": None,
                     "code": "shutting_down" if isinstance(err, ShutdownError) else None}
            yield f"data: {json.dumps({'error': error})}\n\n"
            return
        if run.disconnected:
            return
        yield chunk(Delta(), run.finish_reason)
        if run.include_usage:
            yield chunk(Delta(), usage=run.usage())
        yield "data: [DONE]\n\n"

    def openapi() -> dict:
        """FastAPI's schema without its 422 answers: validation errors are answered 400 (ErrorResponse) here."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for route in schema["paths"].values():
                for operation in route.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


RETRY_AFTER_S = 1  # a full queue drains by one request per finished request: ask clients to come back soon


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvbook")
    except Exception:  # noqa: BLE001 - not installed as a package: the schema still needs a version
        return "0"


@dataclass
class Run:
    """One request's generation: its tokens, text and timings."""

    id: str
    created: int
    model: str
    sampling: Sampling
    include_usage: bool
    input_ids: list[int]
    metrics: ServerMetrics
    prefix_caching: bool = False
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    disconnected: bool = False
    arrived: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)  # when each token reached this request's handler
    step_ms: list[float] = field(default_factory=list)  # the engine's own time of each forward pass
    cached_tokens: int = 0

    def record(self, step, sequence: Sequence) -> None:
        now = time.perf_counter()
        if self.token_times:
            self.metrics.next_token(now - self.token_times[-1])
        self.output_ids.append(step.token_id)
        self.token_times.append(now)
        self.step_ms.append(step.ms)
        if step.phase == "decode":
            log.info("%s step %d cache_len per layer %s %.1f ms", self.id, step.index, list(step.cache_lens),
                     step.ms)
        else:
            self.cached_tokens = sequence.cached_positions
            self.metrics.first_token(len(self.input_ids), self.cached_tokens, now - self.arrived,
                                     self.prefix_caching)
            log.info("%s prefill %d tokens (%d from the prefix cache) cache_len %d %.1f ms", self.id,
                     len(self.input_ids), self.cached_tokens, step.cache_len, step.ms)

    def went_away(self) -> None:
        if not self.disconnected:
            self.disconnected = True
            log.info("%s client disconnected after %d tokens; generation stopped", self.id, len(self.output_ids))

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.input_ids), completion_tokens=len(self.output_ids),
                     total_tokens=len(self.input_ids) + len(self.output_ids),
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens))

    def done(self) -> None:
        """The summary log line and the request's metrics."""
        times = self.token_times
        ttft = (times[0] - self.arrived) * 1e3 if times else 0.0
        tpot = (times[-1] - times[0]) * 1e3 / (len(times) - 1) if len(times) > 1 else None
        prefill = self.step_ms[0] if self.step_ms else 0.0
        decode = sum(self.step_ms[1:]) / (len(self.step_ms) - 1) if len(self.step_ms) > 1 else 0.0
        reason = "abort" if self.disconnected else self.finish_reason
        self.metrics.finished(reason, (times[-1] if times else time.perf_counter()) - self.arrived,
                              tpot / 1e3 if tpot is not None else None)
        log.info("%s done prompt_tokens %d completion_tokens %d finish_reason %s TTFT %.1f ms TPOT %.1f ms "
                 "(engine: prefill %.1f ms, decode step %.1f ms)", self.id, len(self.input_ids),
                 len(self.output_ids), reason, ttft, tpot or 0.0, prefill, decode)


class GracefulServer:
    """uvicorn for `python -m kvbook serve`, with a clean shutdown. On SIGTERM or Ctrl-C: stop accepting
    connections, answer new requests on open connections with 503, let running requests finish for up to
    `grace_s` seconds, then end the rest with an error (an error event in a stream, a 503 otherwise), and return
    normally (exit code 0). A second Ctrl-C quits at once."""

    def __init__(self, app: FastAPI, host: str, port: int, grace_s: float, log_level: str = "info"):
        import uvicorn

        runner: SchedulerThread = app.state.scheduler

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                app.state.draining = True
                super().handle_exit(sig, frame)
                self._captured_signals.clear()  # handled here: uvicorn would raise it again after shutdown

            async def shutdown(self, sockets=None) -> None:
                for server in self.servers:
                    server.close()  # stop accepting before waiting for the running requests
                deadline = time.monotonic() + grace_s
                while runner.busy and time.monotonic() < deadline and not self.force_exit:
                    await asyncio.sleep(0.05)
                if runner.busy:
                    log.warning("shutdown: ending the requests still running after the %g s grace period", grace_s)
                    runner.end_all(ShutdownError(
                        f"the server shut down before this request finished (grace period {grace_s:g} s)"))
                await super().shutdown(sockets)

        self.app = app
        # after end_all the handlers finish within a step; the timeout only guards against a stuck connection
        self.server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                            timeout_graceful_shutdown=10))

    def run(self) -> None:
        try:
            self.server.run()
        finally:
            self.app.state.scheduler.close()


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
