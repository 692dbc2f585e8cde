"""The FastAPI app (routes, API key, body limit, OpenAI-shaped errors, server-sent events), run on uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream``
as server-sent events in vLLM's chunk shapes, ending ``data: [DONE]``),
``GET /v1/models``, ``GET /health``, ``GET /version``, ``GET /metrics``.
Every request goes through the one :class:`~funcspec.serve.loop.EngineLoop`;
a client that disconnects has its requests aborted (a stream when its
connection drops, a plain request by a watcher on the connection).

What the server trusts: nothing in a request. A client's mistake is a 4xx in
OpenAI's shape and one access-log line; a server fault is a 500 with a generic
message, its traceback logged once; either way the connection stays open for
the next request. :class:`Shutdown` is what SIGINT and SIGTERM do.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import hmac
import logging
import os
import signal
import socket
import time
import uuid
from typing import Callable, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from funcspec.serve import protocol as P
from funcspec.serve.loop import DEAD, Batch, EngineLoop, Unavailable
from funcspec.serve.metrics import Metrics

log = logging.getLogger("funcspec.serve")

DRAIN_BYTES = 64 << 20  # an over-limit body is read (and dropped) up to this, so the 413 reaches the client


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the routes need besides the engine."""

    served_names: tuple[str, ...]
    model_path: str
    api_key: Optional[str] = None
    chat_template: Optional[str] = None
    max_body_bytes: int = P.MAX_BODY_BYTES


def version() -> str:
    """funcspec's installed version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("funcspec")
    except PackageNotFoundError:
        return "unknown"


class APIKeyMiddleware:
    """401 on every path but ``/health`` without ``Authorization: Bearer KEY`` (plain ASGI: a streamed
    response passes through untouched, disconnects included)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and not self.authorized(scope["headers"]):
            err = P.APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
            response = JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)

    def authorized(self, headers) -> bool:
        """Whether ``headers`` carry the key under the Bearer scheme, whose name is case-insensitive (RFC 7235)."""
        scheme, _, token = dict(headers).get(b"authorization", b"").partition(b" ")
        # NOTE: the key is compared in constant time, and first, so the scheme's check cannot time it either
        return hmac.compare_digest(token.lstrip(b" "), self.key) and scheme.lower() == b"bearer"


class GuardedRoute(APIRoute):
    """A route whose unexpected exception is answered here: a 500 with a generic message, its traceback logged
    once.

    NOTE: Starlette's handler for ``Exception`` answers and then re-raises, so
    uvicorn logged the traceback a second time and closed the connection: the
    next request on a pooled keep-alive connection failed.
    """

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request):
            try:
                return await handler(request)
            except (P.APIError, StarletteHTTPException, RequestValidationError):
                raise
            except Exception:  # a server fault: logged, answered without its text
                log.exception("%s %s failed", request.method, request.url.path)
                return JSONResponse(P.APIError(500, P.INTERNAL_ERROR).body(), 500)
        return guarded


def build_app(engine, settings: Settings, on_shutdown: Optional[Callable[[], None]] = None) -> FastAPI:
    """The app over ``engine``; its engine loop runs while the app does (``app.state.loop``)."""
    metrics = Metrics(settings.served_names[0], len(engine.stats()["per_position_acceptance"]))
    loop = EngineLoop(engine, metrics)
    tokenizer = engine.model.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:
            await loop.stop()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="funcspec", version=version(), lifespan=lifespan)
    app.router.route_class = GuardedRoute
    app.state.loop, app.state.metrics = loop, metrics
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, key=settings.api_key)
    _error_handlers(app)
    created = int(time.time())

    @app.get("/health")
    async def health():
        if loop.dead is not None:
            raise P.APIError(503, DEAD)
        return Response(status_code=200)

    @app.get("/version")
    async def get_version():
        return {"version": version()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "funcspec", "root": settings.model_path,
             "parent": None, "max_model_len": engine.max_model_len, "permission": []}
            for name in settings.served_names]}

    @app.get("/metrics")
    async def get_metrics():
        if loop.dead is None:
            with contextlib.suppress(RuntimeError):  # the engine thread is shutting down: the gauges stay put
                metrics.engine(*await loop.graph_counts())
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        body = await read_json(request, settings.max_body_bytes)
        model = P.check_model(body, settings.served_names)
        req = P.completion_request(body)
        prompts = await asyncio.to_thread(lambda: [P.tokenize(tokenizer, p) for p in req.prompts])
        return await _generate(request, loop, req, prompts, model, arrival, tokenizer, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        body = await read_json(request, settings.max_body_bytes)
        model = P.check_model(body, settings.served_names)
        req = P.chat_request(body)
        prompt = await asyncio.to_thread(P.render_chat, tokenizer, req.messages, settings.chat_template)
        return await _generate(request, loop, req, [prompt], model, arrival, tokenizer, chat=True)

    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's ``{"error": {...}}``, FastAPI's own (404 route, 405 method) included."""
    @app.exception_handler(P.APIError)
    async def api_error(request, err: P.APIError):
        return JSONResponse(err.body(), err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, err: StarletteHTTPException):
        return JSONResponse(P.APIError(err.status_code, str(err.detail)).body(), err.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, err: RequestValidationError):
        return JSONResponse(P.APIError(422, str(err.errors())).body(), 422)

    @app.exception_handler(Exception)
    async def internal_error(request, err: Exception):  # outside the routes (a middleware): rare
        return JSONResponse(P.APIError(500, P.INTERNAL_ERROR).body(), 500)


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 when it is over ``limit`` bytes (told by Content-Length or counted), 400 when
    the client disconnects before sending all of it (nobody reads that answer: it keeps the log to one line)."""
    declared = request.headers.get("content-length", "")
    size, chunks = 0, []
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > DRAIN_BYTES or (declared.isdigit() and int(declared) > DRAIN_BYTES):
                break  # NOTE: past this the client may see a reset instead of the 413; it sent too much
    except ClientDisconnect:
        raise P.APIError(400, "the client disconnected before the request body was complete") from None
    if size > limit:
        raise P.APIError(413, f"the request body is {size if size <= DRAIN_BYTES else 'over ' + str(size)} bytes, "
                              f"over this server's limit of {limit} (--max-request-body-bytes)")
    return P.parse_json(b"".join(chunks))


async def _generate(request: Request, loop: EngineLoop, req: P.GenRequest, prompts: list[dict], model: str,
                    arrival: float, tokenizer, chat: bool):
    """Submit the prompts; answer with the whole completion, or stream it."""
    try:
        batch = await loop.submit(prompts, req.params, arrival)
    except ValueError as err:  # the engine's own checks (prompt length, token ids): they name the field
        raise P.bad_value(err) from err
    except Unavailable as err:  # the engine failed, or the server is shutting down
        raise P.APIError(503, str(err)) from err
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if req.stream:
        events = (_chat_events if chat else _completion_events)(loop, batch, req, rid, model, tokenizer)
        return StreamingResponse(_guarded(events), media_type="text/event-stream")
    ends = await _unless_disconnected(request, _collect(loop, batch))
    if ends is None:
        return Response(status_code=499)  # the client is gone: nobody reads this
    ids, k = req.return_token_ids, req.params.logprobs
    lps = [None if e.logprobs is None else (P.chat_logprobs if chat else P.completion_logprobs)(
        e.logprobs, e.token_ids, k) for e in ends]  # type: ignore[arg-type]  # logprobs asked for
    if chat:
        choices = [P.chat_choice(i, e.text, e.reason, e.stop_reason, e.token_ids if ids else None, lps[i],
                                 e.kv_transfer_params)
                   for i, e in enumerate(ends)]
    else:
        choices = [P.completion_choice(i, e.text, e.reason, e.stop_reason, e.token_ids if ids else None,
                                       e.prompt_token_ids if ids else None, lps[i],
                                       None if e.prompt_logprobs is None else P.prompt_logprobs_json(e.prompt_logprobs),
                                       e.kv_transfer_params)
                   for i, e in enumerate(ends)]
    # NOTE: vLLM's response carries the first request's kv_transfer_params; each choice carries its own here too
    body = P.envelope("chat.completion" if chat else "text_completion", rid, model, choices,
                      usage=P.usage(sum(len(e.prompt_token_ids) for e in ends[::req.params.n]),  # each prompt once
                                    sum(len(e.token_ids) for e in ends)),
                      prompt_token_ids=list(ends[0].prompt_token_ids) if chat and ids else None,
                      kv_transfer_params=ends[0].kv_transfer_params)
    return JSONResponse(body)


async def _collect(loop: EngineLoop, batch: Batch) -> list:
    """Wait for every request of ``batch`` to end; its :class:`~funcspec.serve.loop.Finish` list in order."""
    ends: list = [None] * len(batch.request_ids)
    try:
        async for i, update in batch:
            if update.error is not None:
                raise P.APIError(update.status, update.error)
            if update.finish is not None:
                ends[i] = update.finish
    finally:
        if not batch.finished:  # an error, or the client left: its other requests stop too
            loop.abort(batch)
    return ends


async def _unless_disconnected(request: Request, work):
    """``await work``, unless the client disconnects first: then the work is cancelled and ``None`` returned.

    NOTE: a plain (non-streamed) request learns of a disconnect only by
    listening for ASGI's ``http.disconnect``; without this, a request whose
    client left would hold its KV slot until it finished.
    """
    task = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping this handler: stop the work with it
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _completion_events(loop: EngineLoop, batch: Batch, req: P.GenRequest, rid: str, model: str, tokenizer):
    """``/v1/completions`` with ``stream``: a ``text_completion`` chunk per step with news, then ``[DONE]``."""
    created, n = int(time.time()), len(batch.request_ids)
    texts = [P.TextStream(tokenizer, req.params.stop) for _ in range(n)]
    counts, fresh, offsets = [0] * n, [True] * n, [0] * n
    try:
        async for i, update in batch:
            if update.error is not None:
                yield _error_event(update)
                return
            end = update.finish  # NOTE: the final text, not the tokens, ends a stream: it is cut at a stop string
            text = texts[i].finish(end.text) if end else texts[i].feed(update.token_ids)
            counts[i] += len(update.token_ids)
            ids = update.token_ids if req.return_token_ids else None
            prompt_ids = batch.prompt_token_ids[i] if req.return_token_ids and fresh[i] else None
            lps = None
            if update.logprobs:  # NOTE: a chunk's logprobs are its tokens', whatever text a stop string holds back
                lps = P.completion_logprobs(update.logprobs, update.token_ids, req.params.logprobs, offsets[i])  # type: ignore[arg-type]  # logprobs asked for
                offsets[i] += sum(len(x) for x in lps["tokens"])
            if text or end or ids or lps:
                fresh[i] = False
                choice = P.completion_choice(i, text, end and end.reason, end and end.stop_reason, ids, prompt_ids,
                                             lps)
                yield P.sse(P.envelope("text_completion", rid, model, [choice], created))
        if req.include_usage:
            yield P.sse(P.envelope("text_completion", rid, model, [], created,
                                   usage=P.usage(sum(map(len, batch.prompt_token_ids[::req.params.n])), sum(counts))))
        yield P.DONE
    finally:
        if not batch.finished:  # the client disconnected (or a step failed): free the slots
            loop.abort(batch)


async def _chat_events(loop: EngineLoop, batch: Batch, req: P.GenRequest, rid: str, model: str, tokenizer):
    """``/v1/chat/completions`` with ``stream``: the assistant role first, then content deltas, then ``[DONE]``."""
    created, n = int(time.time()), len(batch.request_ids)  # n choices: the request's completions
    texts, count = [P.TextStream(tokenizer, req.params.stop) for _ in range(n)], 0
    prompt_ids = list(batch.prompt_token_ids[0]) if req.return_token_ids else None
    first = [P.chat_delta(i, {"role": "assistant", "content": ""}) for i in range(n)]
    try:
        yield P.sse(P.envelope("chat.completion.chunk", rid, model, first, created, prompt_token_ids=prompt_ids))
        async for i, update in batch:
            if update.error is not None:
                yield _error_event(update)
                return
            end = update.finish
            text = texts[i].finish(end.text) if end else texts[i].feed(update.token_ids)
            count += len(update.token_ids)
            ids = update.token_ids if req.return_token_ids else None
            lps = P.chat_logprobs(update.logprobs, update.token_ids, req.params.logprobs) if update.logprobs else None  # type: ignore[arg-type]  # logprobs asked for
            if text or end or ids or lps:
                delta = P.chat_delta(i, {"content": text} if text else {}, end and end.reason,
                                     end and end.stop_reason, ids, lps)
                yield P.sse(P.envelope("chat.completion.chunk", rid, model, [delta], created))
        if req.include_usage:
            yield P.sse(P.envelope("chat.completion.chunk", rid, model, [], created,
                                   usage=P.usage(len(batch.prompt_token_ids[0]), count)))
        yield P.DONE
    finally:
        if not batch.finished:
            loop.abort(batch)


def _error_event(update) -> str:
    """A stream's end on an error: vLLM's error event (the update's status and message), then ``data: [DONE]``."""
    return P.sse(P.APIError(update.status, update.error).body()) + P.DONE


async def _guarded(events):
    """``events``, ended by an error event and ``data: [DONE]`` if they raise (a server fault, logged once): a
    stream always ends the way the client expects."""
    try:
        async for event in events:
            yield event
    except Exception:  # a server fault: logged, answered without its text
        log.exception("a stream failed")
        yield P.sse(P.APIError(500, P.INTERNAL_ERROR).body()) + P.DONE
    finally:
        await events.aclose()


SHUTDOWN_GRACE = 2.0
"""Seconds that handlers get to answer once their requests were cut off, before uvicorn's tasks still running
(a client still sending its body) are cancelled."""


class Shutdown:
    """What SIGINT and SIGTERM do (vLLM's ``--shutdown-timeout``).

    The first signal drains: uvicorn stops accepting connections and waits for
    the requests in flight, for at most ``timeout`` seconds (0: not at all).
    Then, or at a second signal, :meth:`~funcspec.serve.loop.EngineLoop.cut_off`
    ends every request left with a 503 (a stream: an error event, then
    ``data: [DONE]``), and the lifespan stops the engine loop and closes the
    engine. A third signal exits at once. :attr:`exit_code` is 1 when requests
    were cut short or a second signal forced the exit, else 0.
    """

    def __init__(self, loop: EngineLoop, timeout: float):
        self.loop, self.timeout = loop, timeout
        self.signals, self.forced = 0, False

    @property
    def exit_code(self) -> int:
        return 1 if self.forced or self.loop.cut else 0

    def on_signal(self, server: uvicorn.Server, sig: int) -> None:
        """The signal handler. It runs between two bytecodes of the event loop's thread, so it only sets flags and
        schedules (:meth:`_drain`, :meth:`end`) on the event loop."""
        self.signals += 1
        if self.signals > 2:
            os._exit(1)  # NOTE: a step that never returns must not make the server unkillable by ^C
        server.should_exit = True
        self.forced = self.signals == 2
        aloop, name = self.loop.event_loop, signal.Signals(sig).name
        if aloop is None:  # before the lifespan started: uvicorn stops before it serves
            return
        if self.forced:
            aloop.call_soon_threadsafe(self.end, server, f"a second {name}")
        else:
            aloop.call_soon_threadsafe(self._drain, server, name)

    def _drain(self, server: uvicorn.Server, name: str) -> None:
        """The first signal: let the requests in flight finish, until the deadline."""
        log.info("%s: draining the requests in flight for up to %g s (a second SIGINT or SIGTERM ends them now)",
                 name, self.timeout)
        asyncio.get_running_loop().call_later(self.timeout, self.end, server,
                                              f"--shutdown-timeout {self.timeout:g} s passed")

    def end(self, server: uvicorn.Server, reason: str) -> None:
        """End every request left, then cancel what still runs after :data:`SHUTDOWN_GRACE` seconds."""
        if self.loop.closed is None:
            self.loop.cut_off(f"the server is shutting down: {reason}")
            log.warning("%s: %d request(s) ended with 503", reason, self.loop.cut)
        asyncio.get_running_loop().call_later(SHUTDOWN_GRACE, _cancel_tasks, server)


def _cancel_tasks(server: uvicorn.Server) -> None:
    """Cancel uvicorn's request tasks still running (what its own graceful-shutdown timeout does)."""
    for task in list(server.server_state.tasks):
        task.cancel()


class _Server(uvicorn.Server):
    """uvicorn's server with :class:`Shutdown` as its SIGINT / SIGTERM handler."""

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown):
        super().__init__(config)
        self.shutdown_plan = shutdown

    def handle_exit(self, sig, frame) -> None:
        self.shutdown_plan.on_signal(self, sig)


def _log_config(level: str) -> dict:
    """uvicorn's logging configuration, with funcspec's server logger (``funcspec``) on the same handler."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["funcspec"] = {"handlers": ["default"], "level": uvicorn.config.LOG_LEVELS[level],
                                     "propagate": False}
    return config


def run(app: FastAPI, sock: socket.socket, log_level: str = "info", shutdown_timeout: float = 30.0) -> int:
    """Serve ``app`` on uvicorn over ``sock`` (bound by the caller before the model loaded) until a signal ends it
    (:class:`Shutdown`); returns the process's exit code."""
    config = uvicorn.Config(app, log_level=log_level, log_config=_log_config(log_level))
    server = _Server(config, Shutdown(app.state.loop, shutdown_timeout))
    server.run(sockets=[sock])
    return server.shutdown_plan.exit_code
