"""One engine loop for every connection.

A dedicated thread owns the :class:`~funcspec.Engine`: only it calls
``add_request``, ``abort_request`` and ``step``, one call at a time, so the
engine needs no lock, and the event loop never waits on a step. The thread
steps as long as requests run, without waiting for the event loop::

    in the engine thread: wait until a request is queued, aborted or running;
                          add the queued requests, abort the aborted ones,
                          step once, read every request's new tokens,
                          hand them to the event loop (call_soon_threadsafe), and go on
    on the event loop:    push each request's new tokens (and its finish) to its batch's queue

NOTE: the event loop is not on the path from one step to the next: a step
starts as soon as the last one's tokens are read (no round trip through the
event loop, and the loop's own work, streaming the last step's chunks, overlaps
the next step instead of delaying it; graphs/results/notes/code-notes.md).

A step that raises fails the requests it was running (each gets an error
update: a 500 whose message is generic; the traceback goes to the log) and the
loop goes on with the rest (a request the engine finished alone, with
``finish_reason="error"``, is answered the same way); only when the engine cannot even drop those
requests is it dead, and every request then fails. :meth:`EngineLoop.cut_off`
ends every request at once with a 503 (the server is shutting down).

Nothing here imports FastAPI: the loop is plain asyncio over the public
engine API (``running``, ``step``'s outputs, each request's counters).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Any, Optional

log = logging.getLogger("funcspec.serve")

STEP_FAILED = "the engine failed on a step this request was in (an internal error: the server's log has the details)"
FAILED_ALONE = "the engine failed on this request's own work (an internal error: the server's log has the details)"
DEAD = "the engine failed and cannot serve (an internal error: the server's log has the details)"


class Unavailable(RuntimeError):
    """The server takes no request now (it answers 503)."""


class EngineDead(Unavailable):
    """The engine failed in a way that a request cannot be served any more."""


class ShuttingDown(Unavailable):
    """The server is shutting down: :meth:`EngineLoop.cut_off` ended the request, or refused it."""


@dataclasses.dataclass(frozen=True)
class Finish:
    """How a request ended: the engine's finish reason and stop reason, its output text and tokens."""

    reason: str
    stop_reason: Any
    text: str
    token_ids: tuple
    prompt_token_ids: tuple
    logprobs: Optional[tuple] = None  # CompletionOutput.logprobs, when the request asked
    prompt_logprobs: Optional[tuple] = None  # RequestOutput.prompt_logprobs, when the request asked
    kv_transfer_params: Optional[dict] = None  # RequestOutput.kv_transfer_params: extract_hidden_states' file


@dataclasses.dataclass(frozen=True)
class Update:
    """One step's news for one request: its new tokens, and its :class:`Finish` or error (a message for the client
    and the HTTP ``status`` it is answered with) when it ended."""

    token_ids: tuple = ()
    finish: Optional[Finish] = None
    error: Optional[str] = None
    logprobs: Optional[tuple] = None  # CompletionOutput.logprobs of token_ids, when the request asked
    status: int = 500

    @property
    def final(self) -> bool:
        """Whether nothing follows this update."""
        return self.finish is not None or self.error is not None


@dataclasses.dataclass
class SpecDelta:
    """One step's speculative-decoding counts, vLLM's: drafts made, tokens drafted, tokens accepted (and at which
    position: ``per_pos[j]`` counts the drafts whose first j + 1 tokens were accepted)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list = dataclasses.field(default_factory=list)

    def add_row(self, draft_tokens: int, accepted: int) -> None:
        """One request's row-step: it drafted ``draft_tokens`` and ``accepted`` of them were kept."""
        if draft_tokens > 0:
            self.drafts += 1
        self.draft_tokens += draft_tokens
        self.accepted += accepted
        for j in range(min(accepted, len(self.per_pos))):
            self.per_pos[j] += 1


class Batch:
    """The engine requests of one HTTP request; iterate it for ``(index, Update)`` until each has ended (a
    one-request batch whose reader fell behind gets the queued steps' news merged into one update)."""

    def __init__(self, request_ids: list[str], prompt_token_ids: list[tuple]):
        self.request_ids, self.prompt_token_ids = request_ids, prompt_token_ids
        self.queue: asyncio.Queue = asyncio.Queue()
        self.open = set(range(len(request_ids)))

    @property
    def finished(self) -> bool:
        """Whether every request of the batch has ended."""
        return not self.open

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, Update]:
        if not self.open:
            raise StopAsyncIteration
        index, update = await self.queue.get()
        # NOTE: a consumer that fell behind the engine (more steps' news queued than it has read) gets them as
        # one update: one chunk and one write for several steps, so an overloaded event loop catches up.
        while not update.final and len(self.request_ids) == 1 and not self.queue.empty():
            _, later = self.queue.get_nowait()
            lps = None if update.logprobs is None else update.logprobs + (later.logprobs or ())
            update = Update(update.token_ids + later.token_ids, later.finish, later.error, lps, later.status)
        if update.final:
            self.open.discard(index)
        return index, update


@dataclasses.dataclass
class _Job:
    """Prompts queued by a handler, and the future its :class:`Batch` (or the refusal) goes to."""

    prompts: list[dict]
    params: Any
    arrival: float
    future: asyncio.Future


@dataclasses.dataclass
class _Track:
    """What the event loop keeps about one live engine request (timings for the metrics)."""

    batch: Batch
    index: int
    arrival: float
    prompt_len: int
    t_first: Optional[float] = None
    n_out: int = 0


@dataclasses.dataclass
class _Seen:
    """What the engine thread has already reported of one request."""

    tokens: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    decode_seconds: float = 0.0  # Engine.step time of the steps after the one that gave its first token


@dataclasses.dataclass
class _StepResult:
    """What one hop to the engine thread brings back."""

    added: list = dataclasses.field(default_factory=list)  # (job, request ids or None, error or None)
    updates: dict = dataclasses.field(default_factory=dict)  # request id -> Update
    spec: Optional[SpecDelta] = None
    running: int = 0
    busy: bool = False
    step_seconds: Optional[float] = None  # the Engine.step call's wall time (None: no step ran)
    engine_tpot: list = dataclasses.field(default_factory=list)  # per request ended by the step: see _collect


class EngineLoop:
    """Every request of the server through one :class:`~funcspec.Engine`, stepped by one engine thread.

    ``await submit(prompts, params)`` queues engine prompts (``{"prompt",
    "prompt_token_ids"}`` dicts) and returns their :class:`Batch` once the
    engine has accepted them (a ``ValueError`` from its checks otherwise);
    :meth:`abort` drops a batch's unfinished requests before the next step.
    ``metrics`` (optional) receives the counts (:class:`~funcspec.serve.metrics.Metrics`).
    """

    def __init__(self, engine, metrics=None):
        self.engine, self.metrics = engine, metrics
        self._positions = len(engine.stats()["per_position_acceptance"])
        # Handed from the event loop to the engine thread, under _lock; _wake tells the thread.
        self._lock, self._wake = threading.Lock(), threading.Event()
        self._jobs: list[_Job] = []
        self._aborts: set[str] = set()
        self._calls: list[tuple] = []  # (function, future): run in the engine thread between two steps
        self._stopping = False
        self.closed: Optional[str] = None  # why cut_off ended every request (event loop only)
        self.cut = 0  # requests cut_off ended or refused
        self._tracks: dict[str, _Track] = {}  # event loop only
        self._seen: dict[str, _Seen] = {}  # engine thread only
        # NOTE: one thread, always the same: the engine is driven by one caller, and torch's per-thread state
        # (grad mode, streams) stays put.
        self._thread: Optional[threading.Thread] = None
        self._aloop: Optional[asyncio.AbstractEventLoop] = None
        self.dead: Optional[BaseException] = None

    # ------------------------------------------------------------ event loop
    def start(self) -> None:
        """Start the engine thread (call from inside the running event loop, which receives its results)."""
        self._aloop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._engine_main, name="funcspec-engine", daemon=True)
        self._thread.start()

    @property
    def event_loop(self) -> Optional[asyncio.AbstractEventLoop]:
        """The event loop :meth:`start` ran in (``None`` before)."""
        return self._aloop

    async def stop(self) -> None:
        """Stop the engine thread; a step under way finishes first."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def submit(self, prompts: list[dict], params, arrival: Optional[float] = None) -> Batch:
        """Queue ``prompts`` with ``params``; their :class:`Batch` once the engine took them all.

        Raises the engine's ``ValueError`` when it refuses one (then none of
        them runs), :class:`EngineDead` when the engine is gone, :class:`ShuttingDown` after :meth:`cut_off`.
        """
        if self.dead is not None:
            raise EngineDead(DEAD)
        if self.closed is not None:
            raise ShuttingDown(self.closed)
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._jobs.append(_Job(list(prompts), params, arrival or time.perf_counter(), future))
        self._wake.set()
        return await future

    async def graph_counts(self) -> tuple[int, int]:
        """The engine's compiled graphs (an eager "graph" compiles nothing and is not counted) and their
        recompiles, read in the engine thread between two steps (never while a step runs or compiles).

        NOTE: ``Engine.stats`` takes a median per graph and per bucket, each over a bounded window of recent
        steps, so a scrape's cost stays flat however long the server has run (the engine waits for it).
        Raises ``RuntimeError`` when the engine thread is not running (stopped, or the engine died).
        """
        def count() -> tuple[int, int]:
            graphs = self.engine.stats()["graphs"].values()
            return sum(g["backend"] != "eager" for g in graphs), sum(g["recompiles"] for g in graphs)

        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._stopping or self.dead is not None or self._thread is None or not self._thread.is_alive():
                raise RuntimeError("the engine thread is not running")
            self._calls.append((count, future))
        self._wake.set()
        return await future

    def abort(self, batch: Batch) -> None:
        """Drop ``batch``'s unfinished requests; their slots are freed before the next step."""
        ids = []
        for rid in batch.request_ids:
            track = self._tracks.pop(rid, None)
            if track is not None:
                ids.append(rid)
                self._count_finish(track, "abort")
        self._queue_aborts(ids)

    def cut_off(self, reason: str) -> None:
        """End every request now, each with a 503 carrying ``reason`` (the server is shutting down), and refuse
        later ones; the engine thread aborts them before its next step."""
        self.closed = reason
        with self._lock:
            jobs, self._jobs = self._jobs, []
        for job in jobs:
            self._refuse(job)
        tracks, self._tracks = self._tracks, {}
        for track in tracks.values():
            track.batch.queue.put_nowait((track.index, Update(error=reason, status=503)))
            self._count_finish(track, "abort")
        self.cut += len(tracks)
        self._queue_aborts(list(tracks))

    def _refuse(self, job: _Job) -> None:
        """Answer a job that :meth:`cut_off` stopped with :class:`ShuttingDown`."""
        if not job.future.done():
            job.future.set_exception(ShuttingDown(self.closed))
            self.cut += 1

    def _queue_aborts(self, ids) -> None:
        """Have the engine thread abort ``ids`` before its next step."""
        if ids:
            with self._lock:
                self._aborts.update(ids)
            self._wake.set()

    def _dispatch(self, result: _StepResult) -> None:
        """Hand each job its batch (or refusal), then each request its update; count what happened."""
        now = time.perf_counter()
        for job, ids, err in result.added:
            if err is not None:
                if not job.future.done():
                    job.future.set_exception(err)
            elif job.future.done() or self.closed is not None:  # the handler went away, or cut_off ran, meanwhile
                self._refuse(job)
                self._queue_aborts(ids)
            else:
                n = job.params.n  # choice i is completion i % n of prompt i // n
                batch = Batch(ids, [tuple(p["prompt_token_ids"]) for p in job.prompts for _ in range(n)])
                for i, rid in enumerate(ids):
                    self._tracks[rid] = _Track(batch, i, job.arrival, len(batch.prompt_token_ids[i]))
                if self.metrics is not None:
                    self.metrics.prompt_tokens.inc(sum(len(p["prompt_token_ids"]) for p in job.prompts))
                job.future.set_result(batch)
        for rid, update in result.updates.items():
            track = self._tracks.get(rid)
            if track is None:  # aborted by its handler while this step ran
                continue
            self._count_tokens(track, update, now)
            if update.final:
                del self._tracks[rid]
                self._count_finish(track, update.finish.reason if update.finish else "error", now)
            track.batch.queue.put_nowait((track.index, update))
        if self.metrics is not None:
            self.metrics.step(result.spec, result.running, len(self._tracks) - result.running,
                              result.step_seconds, result.engine_tpot)

    def _count_tokens(self, track: _Track, update: Update, now: float) -> None:
        """Tokens and time to first token, as the client sees them (from the request's arrival)."""
        if not update.token_ids:
            return
        if track.t_first is None:
            track.t_first = now
            if self.metrics is not None:
                self.metrics.ttft.observe(now - track.arrival)
        track.n_out += len(update.token_ids)
        if self.metrics is not None:
            self.metrics.generation_tokens.inc(len(update.token_ids))

    def _count_finish(self, track: _Track, reason: str, now: Optional[float] = None) -> None:
        """A request ended: its reason, end-to-end latency and time per output token after the first."""
        if self.metrics is None:
            return
        now = now or time.perf_counter()
        per_token = (now - track.t_first) / (track.n_out - 1) if track.n_out > 1 and track.t_first else None
        self.metrics.finished(reason, now - track.arrival, per_token)

    def _die(self, err: BaseException, jobs: list[_Job]) -> None:
        """The engine is unusable: fail every live request and every queued job."""
        log.error("the engine failed and cannot serve", exc_info=err)
        self.dead, message = err, DEAD
        with self._lock:
            queued, self._jobs = self._jobs, []
            calls, self._calls = self._calls, []
        for job in jobs + queued:
            if not job.future.done():
                job.future.set_exception(EngineDead(message))
        for _, future in calls:
            if not future.done():
                future.set_exception(RuntimeError(message))
        for track in list(self._tracks.values()):
            track.batch.queue.put_nowait((track.index, Update(error=message)))
            self._count_finish(track, "error")
        self._tracks.clear()

    # ---------------------------------------------------------- engine thread
    def _engine_main(self) -> None:
        """The engine thread: the loop of the module docstring, until :meth:`stop` or the engine dies."""
        busy = False
        while True:
            if not busy:
                self._wake.wait()
            with self._lock:
                self._wake.clear()  # NOTE: under the lock: anything queued after this sets it again
                if self._stopping:
                    return
                jobs, self._jobs = self._jobs, []
                aborts, self._aborts = self._aborts, set()
                calls, self._calls = self._calls, []
            for fn, future in calls:
                self._run_call(fn, future)
            if not (busy or jobs or aborts):
                continue
            try:
                result = self._work(jobs, aborts)
            except BaseException as err:  # noqa: BLE001 (the engine cannot drop a failed step's requests)
                self._post(self._die, err, jobs)
                return
            busy = result.busy
            self._post(self._dispatch, result)

    def _post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the event loop (in order with everything posted before)."""
        assert self._aloop is not None, "posted before start()"
        try:
            self._aloop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the server is gone, nobody waits
            pass

    def _run_call(self, fn, future: asyncio.Future) -> None:
        """``fn()`` here; its result (or exception) to ``future`` on the event loop."""
        try:
            value, error = fn(), None
        except Exception as err:  # noqa: BLE001 (handed to the caller)
            value, error = None, err

        def settle():
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(value)

        self._post(settle)

    def _work(self, jobs: list[_Job], aborts: set[str]) -> _StepResult:
        """In the engine thread: add, abort, step once, and read what every request got."""
        engine, result = self.engine, _StepResult()
        result.added = [self._add(job) for job in jobs]
        if aborts:
            self._drop(aborts)
        if engine.has_unfinished_requests():
            t0 = time.perf_counter()
            try:
                finished = engine.step()
            except Exception:  # a failed step fails its requests, not the server (logged)
                log.exception("an engine step failed: its requests get a 500")
                result.updates = self._fail_step()
            else:
                result.step_seconds = time.perf_counter() - t0
                result.updates, result.spec, result.engine_tpot = self._collect(finished, result.step_seconds)
        result.running, result.busy = len(engine.running), engine.has_unfinished_requests()
        return result

    def _add(self, job: _Job) -> tuple:
        """Add a job's prompts, all or none: ``(job, ids, None)``, or ``(job, None, error)``."""
        ids: list[str] = []
        try:
            for prompt in job.prompts:
                rid = self.engine.add_request(prompt, job.params)
                for i in range(job.params.n):  # one entry per completion; the first is the request id itself
                    ids.append(seq_key(rid, i))
                    self._seen[ids[-1]] = _Seen()
        except Exception as err:  # noqa: BLE001 (a ValueError is the client's 400; anything else its 500)
            self._drop(ids)
            return job, None, err
        return job, ids, None

    def _drop(self, ids) -> None:
        """Abort requests in the engine and forget them."""
        if ids:
            self.engine.abort_request(list(ids))
        for rid in ids:
            self._seen.pop(rid, None)

    def _fail_step(self) -> dict:
        """A step raised: abort every request it may have touched (all but the waiting ones) and fail them.

        NOTE: the step may have finished some requests before it raised; their
        outputs are lost with the exception, so they fail too rather than hang.
        """
        waiting = self.engine.waiting_ids()
        failed = [rid for rid in self._seen if rid not in waiting]
        self._drop(failed)  # if this raises too, the engine is dead (_run)
        return {rid: Update(error=STEP_FAILED) for rid in failed}

    def _collect(self, finished, seconds: float) -> tuple[dict, SpecDelta, list]:
        """Every request's new tokens since the last step, the finished ones' ends, the step's spec counts, and
        each finished request's time per output token in Engine.step time (``seconds``: this step's).

        That time is a request's TPOT as the client measures it (from its first token to its last, over its
        tokens after the first), with the wall time replaced by the Engine.step calls in between: what the
        request would see if the server and the client cost nothing.
        """
        updates, spec, engine_tpot = {}, SpecDelta(per_pos=[0] * self._positions), []
        for req in self.engine.running.values():
            seen = self._seen[req.seq_id]  # NOTE: one per completion: an n > 1 request's share its request_id
            if seen.tokens:
                seen.decode_seconds += seconds
            spec.add_row(*self._advance(seen, req.num_draft_tokens, req.num_accepted_tokens))
            if len(req.output_ids) > seen.tokens:
                lps = None if req.logprobs is None else tuple(req.logprobs[seen.tokens:])
                updates[req.seq_id] = Update(tuple(req.output_ids[seen.tokens:]), logprobs=lps)
                seen.tokens = len(req.output_ids)
        for out in finished:
            for done in out.outputs:  # NOTE: an n > 1 request ends once all its completions have
                key = seq_key(out.request_id, done.index)
                seen = self._seen.pop(key)
                if seen.tokens:
                    seen.decode_seconds += seconds
                if len(done.token_ids) > 1:
                    engine_tpot.append(seen.decode_seconds / (len(done.token_ids) - 1))
                spec.add_row(*self._advance(seen, done.metrics["num_draft_tokens"],
                                            done.metrics["num_accepted_tokens"]))
                finish = Finish(done.finish_reason, done.stop_reason, done.text, tuple(done.token_ids),
                                tuple(out.prompt_token_ids), _maybe_tuple(done.logprobs),
                                _maybe_tuple(out.prompt_logprobs), out.kv_transfer_params)
                lps = None if done.logprobs is None else tuple(done.logprobs[seen.tokens:])
                if done.finish_reason == "error":  # it failed alone: its client gets a 500, the log the reason
                    log.error("request %s failed alone: %s", out.request_id, done.error)
                    updates[key] = Update(error=FAILED_ALONE)
                else:
                    updates[key] = Update(tuple(done.token_ids[seen.tokens:]), finish, logprobs=lps)
        return updates, spec, engine_tpot

    @staticmethod
    def _advance(seen: _Seen, draft_tokens: int, accepted: int) -> tuple[int, int]:
        """This step's (drafted, accepted) tokens of one request, from its running totals."""
        delta = (draft_tokens - seen.draft_tokens, accepted - seen.accepted)
        seen.draft_tokens, seen.accepted = draft_tokens, accepted
        return delta


def seq_key(request_id: str, index: int) -> str:
    """The loop's name of completion ``index`` of an engine request: ``scheduler.Request.seq_id``'s."""
    return request_id if index == 0 else f"{request_id}.{index}"


def _maybe_tuple(x) -> Optional[tuple]:
    return None if x is None else tuple(x)
