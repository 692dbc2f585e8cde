"""``funcspec bench serve``: a load and fault run of ``funcspec serve`` on loopback, per concurrency level.

For each configuration (the zoo target with its EAGLE-3 head, ``spec``, and
the target alone, ``ar``) one ``funcspec serve`` subprocess is started (the
default backend unless ``--enforce-eager``; ``TORCHINDUCTOR_CACHE_DIR`` points
at a persistent directory, so a second start of the same configuration is warm)
and driven from this process by ``httpx`` clients:

0. **in-process engine**: before the server starts, an ``LLM`` with the same
   arguments in this process runs every distinct request of a fixed pool
   (prompts of mixed lengths; greedy and seeded sampled; ``max_tokens`` 16 to
   128; some with a stop string) alone, twice, stepping the engine here; the
   second pass gives the engine's own time per output token of each, timed as
   the clients time it (from the end of the step that gave its first token to
   the end of its last step, over its tokens after the first): the clients'
   TPOT with no server at all (this also warms the inductor cache for the
   server), and the engine's own tokens/s with 1 and 8 requests always in it;
1. **reference**: every request of the pool is sent alone, streamed, one after
   another: its tokens are the reference every later run of it must equal
   (funcspec's greedy and seeded sampling are batch-invariant by design), and
   they must equal the in-process ones;
2. **overhead**: the pool again, alone and streamed: the clients' mean TPOT
   against the in-process engine's on the same requests (the goal: within
   10%), and beside the server's own measure,
   ``funcspec:engine_time_per_output_token_seconds``, which counts only the
   ``Engine.step`` calls inside the server between a request's first token and
   its last (the engine slowed by sharing the process and the cores with the
   server, without the time outside ``Engine.step``);
3. **levels**: for each concurrency C, C clients take jobs from a shuffled
   list until it is empty or the level's time is up. A job is one pool request
   sent as a plain completion, as a stream, as a stream the client drops once
   it has half its ``max_tokens``, or an invalid request (unknown model, bad
   sampling values, empty or too long prompt, malformed JSON, no prompt) that
   must get its OpenAI-shaped 4xx.

Checks per level: every completed request's tokens equal its reference (a
dropped stream's tokens are a prefix of it); nothing lost or duplicated (every
job got its expected answer, response ids are unique, and the server's
``request_success`` counts grew by exactly the requests that reached the
engine, none with an error); the server's RSS (``/proc/<pid>/status``) is
sampled throughout, and memory is flat when the mean of the last quarter of a
level is within 5% of the mean of its second quarter; the compiled graphs and
recompiles (``/metrics``) do not grow after start-up.

Results go to ``graphs/results/<device>/serve-<time>.json`` and ``.md``, with
the CPU and its ISA flags.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from funcspec.bench.capture import write_result

try:  # NOTE: the openai package brings httpx2 (httpx's API); plain httpx serves as well
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx  # type: ignore[no-redef]  # the same API under its own name

MODEL_NAME = "zoo"
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
    '"""Utilities for parsing configuration files."""\n\nimport re\nimport json\n\n\ndef load(path):\n',
    "def parse(x):\n    ",
    "import collections\n\n\nclass LRUCache:\n    \"\"\"A least-recently-used cache.\"\"\"\n\n"
    "    def __init__(self, capacity):\n        self.capacity = capacity\n        self.data = "
    "collections.OrderedDict()\n\n    def get(self, key):\n",
    "def f(a, b):\n    return a + b\n" * 30,  # a long prompt (~300 tokens)
]
LENGTHS = (16, 48, 128)
KINDS = {"plain": 0.35, "stream": 0.40, "disconnect": 0.12, "invalid": 0.13}
INVALID = ("unknown_model", "max_tokens_0", "temperature", "top_p", "empty_prompt", "too_long", "not_json",
           "no_prompt")
LEVEL_TIMEOUT_S = 120.0  # one request's limit: past it, the request counts as lost


# ----------------------------------------------------------------- the pool
def pool(size: int) -> list[dict]:
    """``size`` distinct completion bodies: prompts of mixed lengths, greedy and seeded sampled (top-p, or plain
    temperature), ``max_tokens`` in :data:`LENGTHS`, most with ``ignore_eos``, one in six with a stop string."""
    out = []
    for i in range(size):
        body = {"model": MODEL_NAME, "prompt": PROMPTS[i % len(PROMPTS)],
                "max_tokens": LENGTHS[(i + i // len(PROMPTS)) % len(LENGTHS)], "return_token_ids": True,
                "ignore_eos": i % 3 != 0}
        if i % 2 == 0:
            body["temperature"] = 0.0
        else:
            body.update(temperature=0.8, seed=1000 + i)
            if i % 4 == 1:
                body["top_p"] = 0.95
        if i % 6 == 0:
            body["stop"] = ["\n\n\n"]
        out.append(body)
    return out


def jobs(n: int, bodies: list[dict], seed: int) -> list[tuple[str, int]]:
    """``n`` jobs ``(kind, pool index or invalid variant)``: :data:`KINDS` in proportion (each at least once
    when ``n >= 4``), shuffled with ``seed``. A dropped stream takes a request that runs to its ``max_tokens``
    of 48 or more (``ignore_eos``), so that it is dropped halfway; the others take any."""
    rng = random.Random(seed)
    long = [i for i, b in enumerate(bodies) if b.get("ignore_eos") and b["max_tokens"] >= 48] or range(len(bodies))
    counts = {k: max(1 if n >= len(KINDS) else 0, round(w * n)) for k, w in KINDS.items()}
    while sum(counts.values()) > n:
        counts[max(counts, key=counts.__getitem__)] -= 1
    counts["stream"] += n - sum(counts.values())
    kinds = [k for k, c in counts.items() for _ in range(c)]
    rng.shuffle(kinds)
    return [(k, rng.randrange(len(INVALID)) if k == "invalid" else rng.choice(long) if k == "disconnect"
             else rng.randrange(len(bodies))) for k in kinds]


def invalid_body(variant: str, max_model_len: int) -> tuple[object, int]:
    """An invalid request and the status it must get."""
    base = {"model": MODEL_NAME, "prompt": "def f(x):\n", "max_tokens": 8}
    return {
        "unknown_model": (dict(base, model="no-such-model"), 404),
        "max_tokens_0": (dict(base, max_tokens=0), 400),
        "temperature": (dict(base, temperature=-1.0), 400),
        "top_p": (dict(base, temperature=0.8, top_p=1.5), 400),
        "empty_prompt": (dict(base, prompt=""), 400),
        "too_long": (dict(base, prompt=[5] * max_model_len), 400),
        "not_json": (b'{"model": "zoo", "prompt": ', 400),
        "no_prompt": ({"model": MODEL_NAME, "max_tokens": 8}, 422),
    }[variant]


# ------------------------------------------------------------------ clients
async def send(client, kind: str, body, expect: Optional[int] = None) -> dict:
    """One request; its outcome: ``status`` is ``ok``, ``disconnected``, ``rejected`` (an invalid request that got
    its expected error) or ``failed``, with the tokens received and the times of the first and last of them."""
    out = {"kind": kind, "status": "failed", "tokens": [], "t0": time.perf_counter(), "t_first": None,
           "t_last": None, "finish_reason": None, "id": None, "error": None}
    try:
        if kind == "invalid":
            kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                else {"json": body}
            r = await client.post("/v1/completions", **kw)
            err = r.json().get("error", {})
            ok = r.status_code == expect and set(err) == {"message", "type", "param", "code"}
            out.update(status="rejected" if ok else "failed", http=r.status_code,
                       error=None if ok else f"{r.status_code}: {r.text[:200]}")
        elif kind == "plain":
            r = await client.post("/v1/completions", json=body)
            data = r.json()
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
            choice = data["choices"][0]
            out.update(status="ok", tokens=list(choice["token_ids"]), finish_reason=choice["finish_reason"],
                       id=data["id"])
        else:
            await _stream(client, body, out, (body["max_tokens"] + 1) // 2 if kind == "disconnect" else None)
    except Exception as err:  # noqa: BLE001 (any transport or protocol failure is a lost request)
        out.update(status="failed", error=f"{type(err).__name__}: {err}")
    out["t_end"] = time.perf_counter()
    return out


async def _stream(client, body: dict, out: dict, leave_at: Optional[int]) -> None:
    """A streamed request, read chunk by chunk; with ``leave_at``, the client drops the connection once it holds
    that many tokens (before the end: a request that ends first is simply ``ok``)."""
    async with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["status"] = "ok" if out["finish_reason"] else "failed"
                return
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            out["id"] = out["id"] or chunk["id"]
            if chunk["id"] != out["id"]:
                raise RuntimeError(f"a chunk of another request: {chunk['id']} in {out['id']}")
            choice = chunk["choices"][0]
            if choice.get("token_ids"):
                now = time.perf_counter()
                out["t_first"] = out["t_first"] or now
                out["t_last"] = now
                out["tokens"] += choice["token_ids"]
            if choice.get("finish_reason"):
                out["finish_reason"] = choice["finish_reason"]
            if leave_at is not None and len(out["tokens"]) >= leave_at and not out["finish_reason"]:
                out["status"] = "disconnected"
                return  # NOTE: leaving the block closes the connection mid-stream: the server must abort
    raise RuntimeError("the stream ended without [DONE]")


async def run_jobs(url: str, todo: Sequence[tuple[str, object, Optional[int]]], concurrency: int,
                   seconds: float) -> tuple[list[dict], int]:
    """``concurrency`` clients work through ``todo`` (``(kind, body, expected status)``) until it is done or
    ``seconds`` have passed; the outcomes in job order, and how many jobs were not started."""
    queue = list(enumerate(todo))[::-1]
    results: list = [None] * len(todo)
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=LEVEL_TIMEOUT_S, limits=limits) as client:
        async def worker():
            while queue and time.perf_counter() < deadline:
                i, (kind, body, expect) = queue.pop()
                results[i] = await send(client, kind, body, expect)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None], sum(r is None for r in results)


# ----------------------------------------------------------------- in-process
def sampling_params(body: dict):
    """The :class:`~funcspec.SamplingParams` a pool body asks for (as the server builds them)."""
    from funcspec import SamplingParams

    keys = ("max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos")
    return SamplingParams(**{k: body[k] for k in keys if k in body})


def closed_loop(engine, prompts: list[dict], bodies: list[dict], concurrency: int, n: int) -> dict:
    """The engine alone with ``concurrency`` requests always in it (a finished one replaced at once), ``n``
    requests from the pool in turn: output tokens/s, the ceiling a server at that concurrency can reach."""
    issued = done = tokens = 0
    t0 = time.perf_counter()
    while done < n:
        while issued < n and issued - done < concurrency:
            engine.add_request(prompts[issued % len(prompts)], sampling_params(bodies[issued % len(bodies)]))
            issued += 1
        for out in engine.step():
            done += 1
            tokens += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": n, "seconds": seconds, "output_tokens_per_s": tokens / seconds}


def solo_timed(engine, prompt: dict, params) -> tuple[list[int], Optional[float]]:
    """One request alone through ``engine``, stepped here: its tokens, and its time per output token measured
    as a client measures it, from the end of the step that gave its first token to the end of the step that
    finished it, over its tokens after the first (``None`` for a single token)."""
    rid = engine.add_request(prompt, params)
    t_first = None
    while True:
        done = engine.step()
        now = time.perf_counter()
        if done:
            tokens = list(done[0].outputs[0].token_ids)
            t_first = t_first or now
            return tokens, (now - t_first) / (len(tokens) - 1) if len(tokens) > 1 else None
        if t_first is None and any(r.request_id == rid and r.output_ids for r in engine.running.values()):
            t_first = now


def in_process(model: str, spec: Optional[dict], max_num_seqs: int, eager: bool, threads: int,
               bodies: list[dict], concurrencies: list[int]) -> dict:
    """Each pool request alone through an in-process ``LLM`` with the server's arguments, twice; the second
    pass's tokens and the engine's time per output token of each request (:func:`solo_timed`: the clients' TPOT
    with no server); then the engine's own output tokens/s at each of ``concurrencies`` (:func:`closed_loop`,
    2 pools' worth)."""
    import gc

    import torch

    from funcspec import LLM

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    llm = LLM(model, speculative_config=spec, max_num_seqs=max_num_seqs, enforce_eager=eager)
    build_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok(b["prompt"])["input_ids"]} for b in bodies]  # as the server tokenizes
    for _ in range(2):
        outs = [solo_timed(llm.engine, p, sampling_params(b)) for p, b in zip(prompts, bodies)]
    tpot = [t for _, t in outs if t is not None]
    engine = [closed_loop(llm.engine, prompts, bodies, c, 2 * len(bodies)) for c in concurrencies]
    stats = llm.engine.stats()
    llm.close()
    del llm
    gc.collect()
    p50 = _pct(tpot, 0.5)
    return {"build_s": build_s, "backend": stats["backend"], "tokens": [tokens for tokens, _ in outs],
            "tpot_mean_ms": statistics.mean(tpot) * 1e3 if tpot else None,
            "tpot_p50_ms": p50 and p50 * 1e3, "requests": len(tpot), "engine_alone": engine,
            "recompiles_during": stats["recompiles"]}


# ------------------------------------------------------------------- server
class Server:
    """``funcspec serve`` in a subprocess on a free loopback port."""

    def __init__(self, model: str, spec: Optional[dict], max_num_seqs: int, eager: bool, threads: int,
                 cache_dir: str, log: Path, start_timeout: float = 900.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "funcspec.cli", "serve", model, "--port", str(self.port),
               "--max-num-seqs", str(max_num_seqs), "--served-model-name", MODEL_NAME,
               "--uvicorn-log-level", "warning"]
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        if eager:
            cmd.append("--enforce-eager")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TORCHINDUCTOR_CACHE_DIR=cache_dir,
                   TOKENIZERS_PARALLELISM="false")
        self.log = log
        t0 = time.perf_counter()
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + start_timeout
            while not self._healthy():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"funcspec serve did not start:\n{log.read_text()[-4000:]}")
                time.sleep(0.25)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        m = re.search(r"engine ready in ([\d.]+)s \(backend=(\w+)", log.read_text())
        self.engine_s: Optional[float] = float(m.group(1)) if m else None
        self.backend: str = m.group(2) if m else "unknown"

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def rss_mib(self) -> float:
        """The server's resident set (``VmRSS`` of ``/proc/<pid>/status``) in MiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples by name and labels (``model_name`` left out)."""
        from funcspec.serve.metrics import samples

        return samples(httpx.get(self.url + "/metrics", timeout=30).text)

    def idle_metrics(self, timeout: float = 60.0) -> dict[str, float]:
        """The metrics once no request runs or waits (every abort and finish counted)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m.get("funcspec:num_requests_running", 0) == 0 and m.get("funcspec:num_requests_waiting", 0) == 0:
                return m
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not go idle: {m.get('funcspec:num_requests_running')} running")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server by its PID (SIGTERM, then SIGKILL)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


REASONS = ("stop", "length", "abort", "error")


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _ended(after: dict, before: dict) -> dict:
    return {r: int(_delta(after, before, f'funcspec:request_success_total{{finished_reason="{r}"}}'))
            for r in REASONS}


def _pct(xs: list, q: float) -> Optional[float]:
    """The ``q`` quantile (nearest rank) of ``xs``; ``None`` for none."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


# ------------------------------------------------------------------ phases
async def _sampled(server: Server, work, period: float = 0.2):
    """Run ``work`` while sampling the server's RSS every ``period`` seconds; ``(its result, [(t, MiB)])``."""
    samples, t0 = [], time.perf_counter()

    async def sample():
        while True:
            samples.append((time.perf_counter() - t0, server.rss_mib()))
            await asyncio.sleep(period)

    task = asyncio.ensure_future(sample())
    try:
        result = await work
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    samples.append((time.perf_counter() - t0, server.rss_mib()))
    return result, samples


def memory(samples: list[tuple[float, float]]) -> dict:
    """RSS at the start and end of a run, the means of its second and last quarters (by time) and their growth."""
    end = samples[-1][0]
    q2 = [m for t, m in samples if end / 4 <= t < end / 2]
    q4 = [m for t, m in samples if t >= 3 * end / 4]
    q2m, q4m = (statistics.mean(q2) if q2 else None), (statistics.mean(q4) if q4 else None)
    growth = (q4m - q2m) / q2m if q2m and q4m else None
    return {"rss_start_mib": samples[0][1], "rss_end_mib": samples[-1][1], "rss_max_mib": max(m for _, m in samples),
            "q2_mean_mib": q2m, "q4_mean_mib": q4m, "growth_q2_to_q4": growth, "samples": len(samples),
            "flat": growth is not None and growth < 0.05}


def check_tokens(results: list[dict], index: Sequence[int], refs: list[list[int]]) -> list[dict]:
    """The outcomes whose tokens differ from their reference (a dropped stream's must be a prefix of it): the
    pool index, the kind, where they part and the tokens from there."""
    bad = []
    for r, i in zip(results, index):
        if r["status"] not in ("ok", "disconnected"):  # NOTE: an invalid job's index is its variant, not the pool's
            continue
        got, want = r["tokens"], refs[i]
        if r["status"] == "disconnected":
            want = want[:len(got)]
        if got != want:
            at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            bad.append({"pool": i, "kind": r["kind"], "at": at, "got_len": len(got), "want_len": len(want),
                        "got": got[at:at + 8], "want": want[at:at + 8]})
    return bad


def summarize(results: list[dict], seconds: float, before: dict, after: dict) -> dict:
    """Throughput, latency percentiles and the lost / duplicated accounting of one set of outcomes."""
    by = {s: [r for r in results if r["status"] == s] for s in ("ok", "disconnected", "rejected", "failed")}
    streamed = [r for r in results if r["kind"] in ("stream", "disconnect") and r["t_first"] is not None]
    ttft = [r["t_first"] - r["t0"] for r in streamed]
    tpot = [(r["t_last"] - r["t_first"]) / (len(r["tokens"]) - 1) for r in streamed
            if r["status"] == "ok" and len(r["tokens"]) > 1]
    tokens = sum(len(r["tokens"]) for r in by["ok"] + by["disconnected"])
    ended = _ended(after, before)
    reached = len(by["ok"]) + len(by["disconnected"])  # requests the engine took (an invalid one never is)
    ids = [r["id"] for r in by["ok"] + by["disconnected"]]
    ms = lambda x: None if x is None else x * 1e3  # noqa: E731 (a local one-liner)
    return {
        "completed": len(by["ok"]), "disconnected": len(by["disconnected"]), "rejected": len(by["rejected"]),
        "failed": len(by["failed"]), "failures": [r["error"] for r in by["failed"]][:5], "seconds": seconds,
        "requests_per_s": len(by["ok"]) / seconds, "output_tokens_per_s": tokens / seconds, "output_tokens": tokens,
        "server_generation_tokens": int(_delta(after, before, "funcspec:generation_tokens_total")),
        "ttft_p50_ms": ms(_pct(ttft, 0.5)), "ttft_p99_ms": ms(_pct(ttft, 0.99)),
        "tpot_p50_ms": ms(_pct(tpot, 0.5)), "tpot_p99_ms": ms(_pct(tpot, 0.99)),
        "tpot_mean_ms": ms(statistics.mean(tpot)) if tpot else None, "streamed": len(streamed),
        "server_ended": ended,
        "engine_steps": int(_delta(after, before, "funcspec:engine_step_seconds_count")),
        "engine_step_ms_mean": ms(_delta(after, before, "funcspec:engine_step_seconds_sum")
                                  / max(1, _delta(after, before, "funcspec:engine_step_seconds_count"))),
        "engine_busy": _delta(after, before, "funcspec:engine_step_seconds_sum") / seconds,
        "lost": len(by["failed"]) + max(0, reached - sum(ended.values())),
        "duplicated": (len(ids) - len(set(ids))) + max(0, sum(ended.values()) - reached),
        "server_errors": ended["error"],
    }


def graphs(m: dict) -> dict:
    return {"compiled_graphs": int(m["funcspec:engine_compiled_graphs"]),
            "recompiles": int(m["funcspec:engine_recompiles"])}


async def serve_run(server: Server, bodies: list[dict], levels: list[tuple[int, int]], level_seconds: float,
                    seed: int, alone: dict) -> dict:
    """The reference, overhead and level phases against one started server (see the module docstring);
    ``alone``: :func:`in_process`'s result on the same ``bodies``."""
    size = len(bodies)
    max_model_len = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    start, rss_start = server.idle_metrics(), server.rss_mib()
    solo = [("stream", b, None) for b in bodies]
    ref_out, _ = await run_jobs(server.url, solo, 1, 1e9)
    if any(r["status"] != "ok" for r in ref_out):
        raise RuntimeError(f"a reference request failed: {[r['error'] for r in ref_out if r['status'] != 'ok']}")
    refs = [r["tokens"] for r in ref_out]
    differ_in_process = [i for i in range(size) if refs[i] != alone["tokens"][i]]

    before = server.idle_metrics()
    t0 = time.perf_counter()
    again, _ = await run_jobs(server.url, solo, 1, 1e9)
    seconds = time.perf_counter() - t0
    after = server.idle_metrics()
    over = summarize(again, seconds, before, after)
    n = _delta(after, before, "funcspec:engine_time_per_output_token_seconds_count")
    engine_tpot = _delta(after, before, "funcspec:engine_time_per_output_token_seconds_sum") / n if n else None
    steps = _delta(after, before, "funcspec:engine_step_seconds_sum")
    over.update(mismatches=len(check_tokens(again, range(size), refs)), engine_requests=int(n),
                in_server_engine_tpot_mean_ms=engine_tpot and engine_tpot * 1e3,
                in_server_engine_step_ms_per_token=steps / max(1, over["server_generation_tokens"]) * 1e3,
                in_process_engine_tpot_mean_ms=alone["tpot_mean_ms"],
                in_process_engine_tpot_p50_ms=alone["tpot_p50_ms"],
                server_overhead=over["tpot_mean_ms"] / alone["tpot_mean_ms"] - 1 if alone["tpot_mean_ms"] else None,
                outside_step_overhead=over["tpot_mean_ms"] / (engine_tpot * 1e3) - 1 if engine_tpot else None)

    out_levels = []
    for concurrency, count in levels:
        plan = jobs(count, bodies, seed + concurrency)
        todo = [(k, *invalid_body(INVALID[i], max_model_len)) if k == "invalid" else (k, bodies[i], None)
                for k, i in plan]
        before = server.idle_metrics()
        t0 = time.perf_counter()
        (results, skipped), samples = await _sampled(server, run_jobs(server.url, todo, concurrency, level_seconds))
        seconds = max(r["t_end"] for r in results) - t0
        after = server.idle_metrics()
        row = {"concurrency": concurrency, "planned": count, "skipped": skipped,
               **summarize(results, seconds, before, after)}
        bad = check_tokens(results, [i for _, i in plan[:len(results)]], refs)
        row.update(mismatches=len(bad), mismatch_examples=bad[:3], memory=memory(samples))
        out_levels.append(row)
        print(f"  concurrency {concurrency}: {row['completed']} completed, {row['disconnected']} disconnected, "
              f"{row['rejected']} rejected, {row['failed']} failed in {seconds:.1f}s; "
              f"{row['requests_per_s']:.1f} req/s, {row['output_tokens_per_s']:.0f} tok/s; lost {row['lost']}, "
              f"mismatches {row['mismatches']}", flush=True)
    end = server.idle_metrics()
    return {"reference_tokens": sum(map(len, refs)), "reference_differs_from_in_process": differ_in_process,
            "overhead": over, "levels": out_levels,
            "graphs_start": graphs(start), "graphs_end": graphs(end),
            "recompiles_after_startup": (graphs(end)["compiled_graphs"] - graphs(start)["compiled_graphs"])
            + (graphs(end)["recompiles"] - graphs(start)["recompiles"]),
            "rss_start_mib": rss_start, "rss_end_mib": server.rss_mib()}


# ---------------------------------------------------------------------- run
def configs(names: list[str], k: int) -> list[tuple[str, str, Optional[dict]]]:
    """(name, target checkpoint, speculative_config or None) for ``spec`` (the zoo's EAGLE-3 head) and ``ar``."""
    from funcspec import zoo

    table = {"spec": ("zoo-eagle3", zoo.speculative_config("eagle3", k)), "ar": ("zoo-ar", None)}
    unknown = sorted(set(names) - set(table))
    if unknown:
        raise ValueError(f"--configs: unknown {unknown}; choose from {sorted(table)}")
    return [(table[n][0], str(zoo.model_path("target")), table[n][1]) for n in names]


def parse_levels(text: str) -> list[tuple[int, int]]:
    """``"1:48,4:160"`` -> ``[(1, 48), (4, 160)]`` (concurrency: requests)."""
    out = []
    for item in text.split(","):
        c, _, n = item.partition(":")
        if not (c.strip().isdigit() and n.strip().isdigit()) or int(c) < 1 or int(n) < 1:
            raise ValueError(f"--levels: {item!r} is not CONCURRENCY:REQUESTS")
        out.append((int(c), int(n)))
    return out


def goals(rows: list[dict]) -> dict:
    """The issue's goals, from the rows: 8 vs 1 on the spec config, and the overhead at concurrency 1."""
    out = {}
    for row in rows:
        levels = {lv["concurrency"]: lv for lv in row["levels"]}
        g = {"tpot_c1_over_engine": row["overhead"]["server_overhead"]}
        if 1 in levels and 8 in levels:
            g["tokens_c8_over_c1"] = levels[8]["output_tokens_per_s"] / levels[1]["output_tokens_per_s"]
            alone = {e["concurrency"]: e["output_tokens_per_s"] for e in row["in_process"]["engine_alone"]}
            if 1 in alone and 8 in alone:
                g["engine_alone_c8_over_c1"] = alone[8] / alone[1]
        big = max(levels.values(), key=lambda lv: (lv["concurrency"], lv["planned"]))
        g["largest_level"] = {"concurrency": big["concurrency"], "requests": big["planned"],
                              "lost": big["lost"], "duplicated": big["duplicated"],
                              "mismatches": big["mismatches"], "memory_flat": big["memory"]["flat"],
                              "recompiles_after_startup": row["recompiles_after_startup"]}
        out[row["config"]] = g
    return out


def run(args) -> Path:
    """``funcspec bench serve``: one server per configuration; writes JSON and markdown."""
    from funcspec.bench.scale import machine_info

    levels = parse_levels(args.levels)
    cache = args.inductor_cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(
        Path.home() / ".cache" / "funcspec" / "inductor")
    Path(cache).mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="funcspec-bench-serve-"))
    rows, t_run, load_start = [], time.perf_counter(), loadavg()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # NOTE: the in-process engine's too (it warms the server's)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the server is started after this process tokenized
    bodies = pool(args.pool)
    for name, model, spec in configs(args.configs.split(","), args.k):
        cache_files = sum(1 for _ in Path(cache).rglob("*"))
        print(f"{name}: in-process engine (TORCHINDUCTOR_CACHE_DIR={cache}, {cache_files} files)", flush=True)
        alone = in_process(model, spec, args.max_num_seqs, args.enforce_eager, args.threads, bodies,
                           sorted({1, 8} & {c for c, _ in levels}))
        print(f"{name}: in-process engine built in {alone['build_s']:.1f}s (backend {alone['backend']}); TPOT "
              f"alone {alone['tpot_mean_ms']:.3f} ms; starting funcspec serve", flush=True)
        server = Server(model, spec, args.max_num_seqs, args.enforce_eager, args.threads, cache,
                        logs / f"{name}.log")
        try:
            print(f"{name}: ready in {server.startup_s:.1f}s (backend {server.backend})", flush=True)
            out = asyncio.run(serve_run(server, bodies, levels, args.level_seconds, args.seed, alone))
        finally:
            server.stop()
        o = out["overhead"]
        print(f"{name}: at concurrency 1, client TPOT {o['tpot_mean_ms']:.3f} ms, in-process engine "
              f"{o['in_process_engine_tpot_mean_ms']:.3f} ms ({o['server_overhead']:+.1%}), Engine.step in the server "
              f"{o['in_server_engine_tpot_mean_ms']:.3f} ms; recompiles after start-up "
              f"{out['recompiles_after_startup']}", flush=True)
        rows.append({"config": name, "model": model, "speculative_config": spec, "backend": server.backend,
                     "startup_s": server.startup_s, "engine_build_s": server.engine_s,
                     "inductor_cache_files_before": cache_files,
                     "in_process": {k: v for k, v in alone.items() if k != "tokens"}, **out})
    result = {"bench": "serve", "time": time.strftime("%Y%m%d-%H%M%S"), "machine": machine_info(),
              "server_threads": args.threads, "requests": bodies, "max_num_seqs": args.max_num_seqs, "k": args.k,
              "pool": args.pool, "levels": levels, "level_seconds": args.level_seconds,
              "wall_s": time.perf_counter() - t_run, "loadavg_start": load_start, "loadavg_end": loadavg(),
              "rows": rows}
    result["goals"] = goals(rows)
    path = write_result(result, args.out, markdown)
    print(f"wrote {path} and .md ({result['wall_s']:.0f}s)")
    return path


def loadavg() -> Optional[list[float]]:
    """The machine's 1, 5 and 15 minute load averages (other work on the cores shows here)."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# funcspec bench serve", "",
             f"`funcspec serve` on loopback, `--max-num-seqs {result['max_num_seqs']}`, "
             f"OMP_NUM_THREADS={result['server_threads']} in the server; clients (httpx, one asyncio process) on "
             f"the same machine. A pool of {result['pool']} distinct requests (greedy and seeded sampled, "
             f"max_tokens {'/'.join(map(str, LENGTHS))}, prompts of 4 to ~300 tokens) is run alone first: "
             "the reference. Each level then runs a shuffled mix: "
             + ", ".join(f"{k} {w:.0%}" for k, w in KINDS.items())
             + " (disconnect: a stream dropped at half its max_tokens; invalid: 8 kinds of bad request). "
               "Requests/s counts completed requests; output tokens/s every token the clients received. TTFT and "
               "TPOT are measured by the clients on streamed requests.", ""]
    for row in result["rows"]:
        spec = row["speculative_config"]
        lines += [f"## {row['config']}: backend {row['backend']}"
                  + (f", EAGLE-3 K={spec['num_speculative_tokens']}" if spec else ", autoregressive"), "",
                  f"Start-up {row['startup_s']:.1f}s (inductor cache files before: "
                  f"{row['inductor_cache_files_before']}); compiled graphs {row['graphs_start']['compiled_graphs']} "
                  f"-> {row['graphs_end']['compiled_graphs']}, recompiles after start-up: "
                  f"{row['recompiles_after_startup']}; server RSS {row['rss_start_mib']:.0f} MiB at start, "
                  f"{row['rss_end_mib']:.0f} MiB at end.", "",
                  "| concurrency | completed / dropped / invalid / failed | req/s | output tok/s | TTFT p50 / p99 ms "
                  "| TPOT p50 / p99 ms | lost | dup | differ from solo | RSS MiB start -> end (Q2 -> Q4) "
                  "| Engine.step ms (busy) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for lv in row["levels"]:
            mem = lv["memory"]
            skipped = f" ({lv['skipped']} not started: time)" if lv["skipped"] else ""
            lines.append(
                f"| {lv['concurrency']} | {lv['completed']} / {lv['disconnected']} / {lv['rejected']} / "
                f"{lv['failed']}{skipped} | "
                f"{lv['requests_per_s']:.1f} | {lv['output_tokens_per_s']:.0f} | {_f(lv['ttft_p50_ms'])} / "
                f"{_f(lv['ttft_p99_ms'])} | {_f(lv['tpot_p50_ms'], '.2f')} / {_f(lv['tpot_p99_ms'], '.2f')} | "
                f"{lv['lost']} | {lv['duplicated']} | {lv['mismatches']} | {mem['rss_start_mib']:.0f} -> "
                f"{mem['rss_end_mib']:.0f} ({_f(mem['q2_mean_mib'], '.0f')} -> {_f(mem['q4_mean_mib'], '.0f')}, "
                f"{_f(mem['growth_q2_to_q4'] and mem['growth_q2_to_q4'] * 100, '+.1f')}%) | "
                f"{_f(lv['engine_step_ms_mean'], '.2f')} ({lv['engine_busy']:.0%}) |")
        o, alone = row["overhead"], row["in_process"]
        if alone["engine_alone"]:
            lines += ["", "The engine alone in this process (same arguments, no server; a finished request replaced at "
                          "once): " + ", ".join(f"{e['output_tokens_per_s']:.0f} output tok/s at concurrency "
                                                f"{e['concurrency']}" for e in alone["engine_alone"]) + "."]
        lines += ["", f"Overhead at concurrency 1 (the pool again, alone, streamed; {o['engine_requests']} requests "
                      f"of 2 tokens or more): client TPOT mean {_f(o['tpot_mean_ms'], '.3f')} ms (p50 "
                      f"{_f(o['tpot_p50_ms'], '.3f')}); the same requests alone through an in-process `LLM` "
                      f"(built in {alone['build_s']:.1f}s, backend {alone['backend']}), timed the same way: "
                      f"{_f(o['in_process_engine_tpot_mean_ms'], '.3f')} ms (p50 "
                      f"{_f(o['in_process_engine_tpot_p50_ms'], '.3f')}): the server and the client add "
                      f"{_f(o['server_overhead'] and o['server_overhead'] * 100, '+.1f')}%. Inside the server, "
                      f"`Engine.step` alone took {_f(o['in_server_engine_tpot_mean_ms'], '.3f')} ms per token "
                      f"(`funcspec:engine_time_per_output_token_seconds`; the client's TPOT is "
                      f"{_f(o['outside_step_overhead'] and o['outside_step_overhead'] * 100, '+.1f')}% over it). "
                      f"Reference tokens differing from the in-process engine's: "
                      f"{len(row['reference_differs_from_in_process'])}; overhead pass differing from the "
                      f"reference: {o['mismatches']}.", ""]
    lines += ["## Goals", ""]
    for name, g in result["goals"].items():
        big = g["largest_level"]
        parts = [f"concurrency {big['concurrency']} x {big['requests']} requests: lost {big['lost']}, duplicated "
                 f"{big['duplicated']}, differing from solo {big['mismatches']}, recompiles "
                 f"{big['recompiles_after_startup']}, memory flat {big['memory_flat']}"]
        if "tokens_c8_over_c1" in g:
            parts.append(f"output tok/s at 8 over 1: {g['tokens_c8_over_c1']:.2f}x (goal 5x: "
                         f"{'met' if g['tokens_c8_over_c1'] >= 5 else 'not met'}"
                         + (f"; the engine alone, in process: {g['engine_alone_c8_over_c1']:.2f}x)"
                            if "engine_alone_c8_over_c1" in g else ")"))
        if g["tpot_c1_over_engine"] is not None:
            parts.append(f"TPOT at 1 over the in-process engine's: {1 + g['tpot_c1_over_engine']:.3f}x (goal <= 1.10: "
                         f"{'met' if g['tpot_c1_over_engine'] <= 0.10 else 'not met'})")
        lines.append(f"- {name}: " + "; ".join(parts))
    lines += ["", f"Wall time of the whole run: {result['wall_s']:.0f}s. Load average (1, 5, 15 min) before it "
                  f"started: {result['loadavg_start']} (other work on the machine); at its end: "
                  f"{result['loadavg_end']}.", "", "## Machine", "",
              f"- CPU: {m['cpu']} ({m['cores']} logical cores)",
              "- ISA: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in m["flags"].items()),
              f"- torch {m['torch']}, CPU capability {m['cpu_capability']}", ""]
    return "\n".join(lines)


def add_parser(kinds) -> None:
    p = kinds.add_parser("serve", help="load and fault run of funcspec serve: throughput, TTFT/TPOT, checks")
    p.add_argument("--configs", default="spec,ar", help="comma-separated: spec (zoo EAGLE-3 head), ar")
    p.add_argument("--levels", default="1:48,4:160,8:240,16:1000", help="CONCURRENCY:REQUESTS,...")
    p.add_argument("--level-seconds", type=float, default=180.0, help="no job starts after this (per level)")
    p.add_argument("--pool", type=int, default=24, help="distinct requests (each has a solo reference)")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens of the spec config")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    p.add_argument("--enforce-eager", action="store_true", help="serve on the eager backend (no compile)")
    p.add_argument("--inductor-cache-dir", default=None,
                   help="TORCHINDUCTOR_CACHE_DIR of the server (default: $TORCHINDUCTOR_CACHE_DIR or "
                        "~/.cache/funcspec/inductor), kept between runs")
    p.add_argument("--seed", type=int, default=0, help="shuffles the jobs")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)
