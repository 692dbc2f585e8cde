"""The FastAPI app (routes, API key, body limit, OpenAI-shaped errors, server-sent events), run on uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream``
as server-sent events in vLLM's chunk shapes, ending ``data: [DONE]``),
``GET /v1/models``, ``GET /health``, ``GET /version``, ``GET /metrics``.
Every request goes through the one :class:`~funcspec.serve.loop.EngineLoop`;
a client that disconnects has its requests aborted (a stream when its
connection drops, a plain request by a watcher on the connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import time
import uuid
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from funcspec.serve import protocol as P
from funcspec.serve.loop import Batch, EngineDead, EngineLoop
from funcspec.serve.metrics import Metrics

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
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # NOTE: constant time: no key guessing by timing
                err = P.APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                response = JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(engine, settings: Settings, on_shutdown: Optional[Callable[[], None]] = None) -> FastAPI:
    """The app over ``engine``; its engine loop runs while the app does (``app.state.loop``)."""
    metrics = Metrics(settings.served_names[0], len(engine.stats["per_position_acceptance"]))
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
    app.state.loop, app.state.metrics = loop, metrics
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, key=settings.api_key)
    _error_handlers(app)
    created = int(time.time())

    @app.get("/health")
    async def health():
        if loop.dead is not None:
            raise P.APIError(503, f"the engine failed: {loop.dead}")
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
    async def internal_error(request, err: Exception):
        return JSONResponse(P.APIError(500, f"{type(err).__name__}: {err}").body(), 500)


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 when it is over ``limit`` bytes (told by Content-Length or counted)."""
    declared = request.headers.get("content-length", "")
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > DRAIN_BYTES or (declared.isdigit() and int(declared) > DRAIN_BYTES):
            break  # NOTE: past this the client may see a reset instead of the 413; it sent too much
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
    except EngineDead as err:
        raise P.APIError(503, str(err)) from err
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if req.stream:
        events = (_chat_events if chat else _completion_events)(loop, batch, req, rid, model, tokenizer)
        return StreamingResponse(events, media_type="text/event-stream")
    ends = await _unless_disconnected(request, _collect(loop, batch))
    if ends is None:
        return Response(status_code=499)  # the client is gone: nobody reads this
    ids, k = req.return_token_ids, req.params.logprobs
    lps = [None if e.logprobs is None else (P.chat_logprobs if chat else P.completion_logprobs)(
        e.logprobs, e.token_ids, k) for e in ends]
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
                raise P.APIError(500, update.error)
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
                yield P.sse(P.APIError(500, update.error).body()) + P.DONE  # vLLM's way: an error event, then DONE
                return
            end = update.finish  # NOTE: the final text, not the tokens, ends a stream: it is cut at a stop string
            text = texts[i].finish(end.text) if end else texts[i].feed(update.token_ids)
            counts[i] += len(update.token_ids)
            ids = update.token_ids if req.return_token_ids else None
            prompt_ids = batch.prompt_token_ids[i] if req.return_token_ids and fresh[i] else None
            lps = None
            if update.logprobs:  # NOTE: a chunk's logprobs are its tokens', whatever text a stop string holds back
                lps = P.completion_logprobs(update.logprobs, update.token_ids, req.params.logprobs, offsets[i])
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
                yield P.sse(P.APIError(500, update.error).body()) + P.DONE  # vLLM's way: an error event, then DONE
                return
            end = update.finish
            text = texts[i].finish(end.text) if end else texts[i].feed(update.token_ids)
            count += len(update.token_ids)
            ids = update.token_ids if req.return_token_ids else None
            lps = P.chat_logprobs(update.logprobs, update.token_ids, req.params.logprobs) if update.logprobs else None
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


def run(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve ``app`` on uvicorn until interrupted (the lifespan then stops the engine loop)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)
