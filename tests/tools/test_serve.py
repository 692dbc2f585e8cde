"""``funcspec serve``: one server subprocess (the zoo target with its EAGLE-3 head, eager) driven by the real
``openai`` client, beside an in-process ``LLM`` with the same engine arguments as the reference.

Greedy outputs equal ``LLM``'s token for token, streamed text equals the
non-streamed text, ``/metrics`` counts the accepted tokens the engine reports,
bad requests get OpenAI-shaped errors without disturbing a request in flight,
and a client that disconnects has its slot freed. The engine loop's failure
path and ``Engine.abort_request`` are tested in-process, on the reference engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from funcspec import LLM, SamplingParams, zoo  # noqa: E402
from funcspec.serve import protocol as P  # noqa: E402
from funcspec.serve.args import build_parser, engine_kwargs, extra_engine_args  # noqa: E402
from funcspec.serve.loop import FAILED_ALONE, STEP_FAILED, EngineLoop  # noqa: E402
from funcspec.serve.metrics import samples  # noqa: E402

KEY = "test-key"
MAX_MODEL_LEN, MAX_NUM_SEQS, BODY_LIMIT = 256, 2, 65536
SPEC = {"method": "eagle3", "model": str(zoo.model_path("eagle3")), "num_speculative_tokens": 3}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n"]
GREEDY = dict(temperature=0.0, max_tokens=20)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``funcspec serve`` in a subprocess on a free loopback port; its base URL once /health answers."""
    port, log = _free_port(), tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "funcspec.cli", "serve", str(zoo.model_path("target")),
           "--speculative-config", json.dumps(SPEC), "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
           "--max-num-seqs", str(MAX_NUM_SEQS), "--port", str(port), "--api-key", KEY, "--chat-template", TEMPLATE,
           "--max-request-body-bytes", str(BODY_LIMIT), "--served-model-name", "zoo", "--uvicorn-log-level",
           "warning", "--gpu-memory-utilization", "0.9", "--no-enable-prefix-caching"]
    # NOTE: one intra-op thread, as the test process: two processes on two cores must not fight over them.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while _status(url + "/health") != 200:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield url, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def llm():
    """The reference: ``LLM`` with the server's engine arguments, each prompt run alone."""
    return LLM(str(zoo.model_path("target")), speculative_config=SPEC, enforce_eager=True,
               max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def _solo(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params))[0]


def _status(url: str, headers=None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return -1


def _post(url: str, body, headers=None) -> tuple[int, dict]:
    """POST raw bytes (or JSON); (status, JSON body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _metrics(url: str) -> dict[str, float]:
    """``/metrics`` samples by name and labels (model_name left out)."""
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    return samples(urllib.request.urlopen(req, timeout=5).read().decode())


def _idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    """The metrics once no request runs or waits (aborts and finishes have been counted)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        if m["funcspec:num_requests_running"] == 0 and m["funcspec:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


# --------------------------------------------------------------- endpoints
def test_models_health_version_and_api_key(server, client):
    url, log = server
    assert [m.id for m in client.models.list().data] == ["zoo"]
    assert _status(url + "/health") == 200  # the one endpoint without a key
    for path in ("/v1/models", "/metrics", "/version"):
        assert _status(url + path) == 401
        assert _status(url + path, {"Authorization": "Bearer wrong"}) == 401
    assert _status(url + "/version", {"Authorization": f"Bearer {KEY}"}) == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).completions.create(
            model="zoo", prompt="x", max_tokens=1)
    assert "gpu_memory_utilization" in log.read_text()  # the vLLM flags with no effect: one warning


def test_greedy_completions_equal_llm_token_for_token(client, llm):
    for prompt in PROMPTS[:2]:
        ref = _solo(llm, prompt, **GREEDY)
        out = client.completions.create(model="zoo", prompt=prompt, extra_body={"return_token_ids": True}, **GREEDY)
        choice = out.choices[0]
        assert choice.token_ids == ref.outputs[0].token_ids and choice.text == ref.outputs[0].text
        assert choice.prompt_token_ids == ref.prompt_token_ids
        assert choice.finish_reason == ref.outputs[0].finish_reason == "length"
        assert out.usage.completion_tokens == 20 and out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streamed_text_equals_non_streamed_text(client, llm):
    for params in (GREEDY, dict(GREEDY, stop=["\n\n", "string"])):  # a stop string cuts the text
        plain = client.completions.create(model="zoo", prompt=PROMPTS[0], **params)
        chunks = list(client.completions.create(model="zoo", prompt=PROMPTS[0], stream=True,
                                                stream_options={"include_usage": True}, **params))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == plain.choices[0].text == _solo(llm, PROMPTS[0], **params).outputs[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].stop_reason in ("\n\n", "string")


def test_chat_through_the_template(client, llm, server):
    messages = [{"role": "user", "content": "Write a stack class."}]
    ids = P.render_chat(llm.get_tokenizer(), messages, TEMPLATE)["prompt_token_ids"]
    ref = _solo(llm, {"prompt_token_ids": ids}, **GREEDY)
    out = client.chat.completions.create(model="zoo", messages=messages, extra_body={"return_token_ids": True},
                                         **GREEDY)
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.choices[0].token_ids == ref.outputs[0].token_ids and out.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="zoo", messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_clients_at_once_equal_their_solo_runs(server, llm):
    """More requests than slots, streamed and not, greedy and seeded-sampled: each equals its solo LLM run."""
    jobs = [(p, dict(GREEDY), s) for p in PROMPTS for s in (False, True)]
    jobs.append((PROMPTS[1], dict(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=20), False))
    refs = [_solo(llm, p, **params).outputs[0] for p, params, _ in jobs]

    async def one(client, prompt, params, stream):
        extra = {k: params.pop(k) for k in ("top_k",) if k in params}
        extra["return_token_ids"] = True
        if not stream:
            out = await client.completions.create(model="zoo", prompt=prompt, extra_body=extra, **params)
            return out.choices[0].text, out.choices[0].token_ids
        chunks = [c async for c in await client.completions.create(model="zoo", prompt=prompt, stream=True,
                                                                      extra_body=extra, **params)]
        return "".join(c.choices[0].text for c in chunks), [t for c in chunks for t in c.choices[0].token_ids]

    async def main():
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, dict(params), s) for p, params, s in jobs))

    for (text, ids), ref in zip(asyncio.run(main()), refs):
        assert (text, ids) == (ref.text, ref.token_ids)


def test_metrics_count_the_accepted_tokens_the_engine_reports(server, client, llm):
    url = server[0]
    before = _idle(url)
    client.completions.create(model="zoo", prompt=PROMPTS[2], **GREEDY)
    after = _idle(url)
    ref = _solo(llm, PROMPTS[2], **GREEDY).metrics
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert d["funcspec:spec_decode_num_accepted_tokens_total"] == ref["num_accepted_tokens"] > 0
    assert d["funcspec:spec_decode_num_draft_tokens_total"] == ref["num_draft_tokens"]
    assert d["funcspec:spec_decode_num_drafts_total"] == ref["steps"]  # K = 3 every step: one draft per step
    per_pos = [d[f'funcspec:spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}}'] for j in range(3)]
    assert sum(per_pos) == ref["num_accepted_tokens"] and per_pos == sorted(per_pos, reverse=True)
    assert d["funcspec:generation_tokens_total"] == 20
    assert d['funcspec:request_success_total{finished_reason="length"}'] == 1
    assert d["funcspec:time_to_first_token_seconds_count"] == d["funcspec:time_per_output_token_seconds_count"] == 1


# ------------------------------------------------------------- bad requests
BAD = [  # (endpoint, body, status, param)
    ("completions", {"model": "nope", "prompt": "x", "max_tokens": 0}, 404, "model"),  # the model first
    ("completions", {"model": "zoo", "prompt": list(range(MAX_MODEL_LEN))}, 400, "prompt"),
    ("completions", {"model": "zoo", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": "zoo", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("completions", {"model": "zoo", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"model": "zoo", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"model": "zoo", "prompt": "x", "top_k": -2}, 400, "top_k"),
    ("completions", {"model": "zoo", "prompt": "x", "seed": "a"}, 400, "seed"),
    ("completions", {"model": "zoo", "prompt": "x", "n": MAX_NUM_SEQS + 1}, 400, "n"),
    ("completions", {"model": "zoo", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"model": "zoo", "prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("completions", {"model": "zoo", "prompt": ""}, 400, "prompt"),
    ("completions", {"model": "zoo", "prompt": []}, 400, "prompt"),
    ("completions", {"model": "zoo", "prompt": [5000]}, 400, "prompt_token_ids"),
    ("completions", {"model": "zoo"}, 422, "prompt"),
    ("completions", b"{not json", 400, None),
    ("completions", b"[1, 2]", 422, None),
    ("completions", b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}', 413, None),
    ("chat/completions", {"model": "zoo", "messages": []}, 400, "messages"),
    ("chat/completions", {"model": "zoo", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
]


def test_bad_requests_get_openai_errors_and_disturb_nothing(server, client, llm):
    """Every bad request answers its status and OpenAI's error shape while a stream runs, which is unharmed."""
    url = server[0]
    stream = client.completions.create(model="zoo", prompt=PROMPTS[1], stream=True,
                                       **dict(GREEDY, max_tokens=60))
    text = next(iter(stream)).choices[0].text
    for endpoint, body, status, param in BAD:
        code, err = _post(f"{url}/v1/{endpoint}", body)
        assert code == status, (body, err)
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["code"] == status
        assert err["error"]["param"] == param and err["error"]["message"], (body, err)
    text += "".join(c.choices[0].text for c in stream)
    assert text == _solo(llm, PROMPTS[1], **dict(GREEDY, max_tokens=60)).outputs[0].text
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="zoo", prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


def test_a_disconnected_client_frees_its_slot(server, client, llm):
    """Streams (all slots) and a plain request whose clients leave are aborted; the server then serves on."""
    url = server[0]
    before = _idle(url)
    long = dict(model="zoo", extra_body={"ignore_eos": True}, temperature=0.0, max_tokens=MAX_MODEL_LEN - 20)
    streams = [client.completions.create(prompt=p, stream=True, **long) for p in PROMPTS[:2]]
    for s in streams:
        next(iter(s))
    for s in streams:
        s.close()
    # a plain request whose client gives up: 50 ms, against >= 0.2 s for its 236 tokens (at 0.3 s a fast run
    # sometimes finished first)
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.05).completions.create(prompt=PROMPTS[2], **long)
    after = _idle(url)
    assert after['funcspec:request_success_total{finished_reason="abort"}'] - \
        before['funcspec:request_success_total{finished_reason="abort"}'] == 3
    generated = after["funcspec:generation_tokens_total"] - before["funcspec:generation_tokens_total"]
    assert generated < 3 * long["max_tokens"]  # they stopped early
    out = client.completions.create(model="zoo", prompt=PROMPTS[0], **GREEDY)
    assert out.choices[0].text == _solo(llm, PROMPTS[0], **GREEDY).outputs[0].text


# ------------------------------------------------------------- in-process
def test_engine_abort_request_frees_the_slot(llm):
    engine, greedy = llm.engine, SamplingParams(**GREEDY)
    a = engine.add_request(PROMPTS[0], greedy)
    b = engine.add_request(PROMPTS[1], greedy)
    c = engine.add_request(PROMPTS[2], greedy)  # waits: two slots
    engine.step()
    engine.abort_request(a)  # running in slot 0: b moves into it
    engine.abort_request([c, "no-such-id"])  # waiting; an unknown id is ignored
    assert [r.request_id for r in engine.running.values()] == [b] and list(engine.running) == [0]
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == [b]
    assert outs[0].outputs[0].token_ids == _solo(llm, PROMPTS[1], **GREEDY).outputs[0].token_ids


def test_a_failed_step_fails_its_requests_and_the_loop_serves_on(llm, monkeypatch, caplog):
    """The failed requests get a 500 with a generic message (no internal text); the traceback goes to the log."""
    engine, real_step, calls = llm.engine, llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    prompt = {"prompt_token_ids": llm.get_tokenizer()(PROMPTS[0])["input_ids"]}

    async def run(params):
        batch = await loop.submit([prompt], params)
        return [u async for _, u in batch]

    async def main():
        loop.start()
        try:
            failed = await run(SamplingParams(**GREEDY))
            with pytest.raises(ValueError, match="max_model_len"):
                await loop.submit([{"prompt_token_ids": [1] * MAX_MODEL_LEN}], SamplingParams())
            return failed, await run(SamplingParams(**GREEDY))
        finally:
            await loop.stop()

    loop = EngineLoop(engine)
    failed, served = asyncio.run(main())
    assert (failed[-1].error, failed[-1].status) == (STEP_FAILED, 500) and "injected" not in failed[-1].error
    assert "RuntimeError: injected" in caplog.text and loop.dead is None and not engine.has_unfinished_requests()
    assert list(served[-1].finish.token_ids) == _solo(llm, PROMPTS[0], **GREEDY).outputs[0].token_ids
    assert [t for u in served for t in u.token_ids] == list(served[-1].finish.token_ids)


def test_graph_counts_read_the_engines_stats_in_its_thread(llm, monkeypatch):
    """The ``/metrics`` graph gauges come from ``Engine.stats()``: an eager graph compiles nothing, a compiled
    one counts, with its recompiles; read in the engine thread, refused once it has stopped."""
    engine, real_stats = llm.engine, llm.engine.stats
    loop = EngineLoop(engine)

    async def main():
        loop.start()
        try:
            eager = await loop.graph_counts()
            monkeypatch.setattr(engine, "stats", lambda: {**real_stats(), "graphs": {
                "B1_K3_T259_greedy": {"backend": "eager", "recompiles": 0},
                "Bn_K3_T259_greedy": {"backend": "inductor", "recompiles": 2}}})
            return eager, await loop.graph_counts()
        finally:
            await loop.stop()

    assert asyncio.run(main()) == ((0, 0), (1, 2))
    with pytest.raises(RuntimeError, match="the engine thread is not running"):
        asyncio.run(loop.graph_counts())


def test_a_request_that_fails_alone_gets_a_500_and_the_others_run_on(llm, monkeypatch, caplog):
    """A request the engine finished with ``finish_reason="error"`` (its own stop rule raised) is answered as an
    error with a generic message, its reason in the log; the request beside it streams its solo tokens."""
    engine, real_add = llm.engine, llm.engine.add_request

    class Failing:
        def feed(self, chunk):
            raise RuntimeError("stop rule failed")

    def add_request(prompt, params, *args, **kwargs):
        rid = real_add(prompt, params, *args, **kwargs)
        if params.stop:  # the poisoned one
            engine.scheduler.waiting[-1].stops = Failing()
        return rid

    monkeypatch.setattr(engine, "add_request", add_request)
    ids = [{"prompt_token_ids": llm.get_tokenizer()(p)["input_ids"]} for p in PROMPTS[:2]]

    async def run(prompt, params):
        batch = await loop.submit([prompt], params)
        return [u async for _, u in batch]

    async def main():
        loop.start()
        try:
            return await asyncio.gather(run(ids[0], SamplingParams(**GREEDY, stop=["never"])),
                                        run(ids[1], SamplingParams(**GREEDY)))
        finally:
            await loop.stop()

    loop = EngineLoop(engine)
    with pytest.warns(UserWarning, match="stop rule failed"):
        failed, served = asyncio.run(main())
    assert (failed[-1].error, failed[-1].status) == (FAILED_ALONE, 500) and "stop rule" not in failed[-1].error
    assert "RuntimeError: stop rule failed" in caplog.text and loop.dead is None
    assert list(served[-1].finish.token_ids) == _solo(llm, PROMPTS[1], **GREEDY).outputs[0].token_ids


# ------------------------------------------------------------- pure parts
def test_unknown_vllm_flags_become_llm_keywords():
    args, rest = build_parser().parse_known_args(
        ["m", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.9", "--no-enable-prefix-caching",
         "--trust-remote-code", "--compilation-config", '{"capture": "lazy"}', "--block-size=16"])
    assert engine_kwargs(args, extra_engine_args(rest)) == {
        "max_num_seqs": 4, "compilation_config": {"capture": "lazy"}, "gpu_memory_utilization": 0.9,
        "enable_prefix_caching": False, "trust_remote_code": True, "block_size": 16}
    with pytest.raises(ValueError, match="unexpected argument"):
        extra_engine_args(["stray"])


def test_a_model_without_a_chat_template_is_a_clear_400(llm):
    tokenizer = llm.get_tokenizer()
    assert not getattr(tokenizer, "chat_template", None)  # the zoo target ships none
    with pytest.raises(P.APIError, match="no chat template") as err:
        P.render_chat(tokenizer, [{"role": "user", "content": "hi"}])
    assert err.value.status == 400 and err.value.param == "messages"


def test_streamed_text_holds_back_what_a_stop_string_may_cut(llm):
    """Until the token that completes a stop string, the last len("STOP") - 1 characters are held back."""
    tokenizer = llm.get_tokenizer()
    ids = tokenizer("import os, sys STOP def")["input_ids"]
    last = next(i for i in range(len(ids)) if "STOP" in tokenizer.decode(ids[:i + 1]))  # completes the stop string
    before = tokenizer.decode(ids[:last], skip_special_tokens=True)
    final = tokenizer.decode(ids[:last + 1], skip_special_tokens=True).split("STOP")[0]
    stream = P.TextStream(tokenizer, ("STOP", "x"))
    sent = "".join(stream.feed([t]) for t in ids[:last])
    assert sent == before[:-3] and final.startswith(sent)
    assert sent + stream.finish(final) == final == "import os, sys "


def test_a_server_fault_is_a_generic_500_on_a_connection_that_stays_open(llm, caplog):
    """A route that raises answers OpenAI's 500 without the exception's text, logs its traceback once, and the next
    request on the same keep-alive connection is served (Starlette's own handler re-raised: uvicorn closed it)."""
    import http.client
    import threading

    import uvicorn

    from funcspec.serve import app as server_app

    app = server_app.build_app(llm.engine, server_app.Settings(("zoo",), "zoo"))

    @app.get("/v1/fault")
    async def fault():
        raise KeyError("internal detail")

    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        conn = http.client.HTTPConnection(*sock.getsockname()[:2], timeout=10)
        conn.request("GET", "/v1/fault")
        response = conn.getresponse()
        assert response.status == 500 and json.loads(response.read()) == {"error": {
            "message": P.INTERNAL_ERROR, "type": "InternalServerError", "param": None, "code": 500}}
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        server.should_exit = True
        thread.join(30)
    assert caplog.text.count("Traceback") == 1 and "KeyError: 'internal detail'" in caplog.text


def test_a_stream_that_raises_still_ends_with_an_error_event_and_done():
    from funcspec.serve.app import _guarded

    async def events():
        yield "data: first\n\n"
        raise KeyError("internal detail")

    async def collect():
        return [e async for e in _guarded(events())]

    assert asyncio.run(collect()) == ["data: first\n\n", P.sse(P.APIError(500, P.INTERNAL_ERROR).body()) + P.DONE]


def test_the_core_package_never_imports_the_server_stack():
    """FastAPI, uvicorn and prometheus_client (the [serve] extra) are imported only by funcspec.serve.app and
    .metrics, which nothing outside funcspec.serve imports but `bench serve` (a client of the server, which
    reads /metrics with metrics.samples, and needs the extra anyway)."""
    root = Path(__file__).resolve().parents[2] / "funcspec"
    stack = re.compile(r"^\s*(from|import)\s+(fastapi|uvicorn|prometheus_client|starlette)\b", re.M)
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if stack.search(p.read_text()))
    assert users == ["serve/app.py", "serve/metrics.py"]
    server = re.compile(r"^\s*(from|import)\s+funcspec\.serve\.(app|metrics)\b", re.M)
    outside = [str(p.relative_to(root)) for p in root.rglob("*.py")
               if "serve" not in p.parts and server.search(p.read_text())]
    assert outside == ["bench/serve.py"]


def test_logprobs_are_the_engines_in_openais_shapes(server, client, llm):
    """Completions' logprobs (tokens, token_logprobs, top_logprobs, text_offset), vLLM's prompt_logprobs and
    chat's logprobs.content carry the engine's values, float for float."""
    want = _solo(llm, PROMPTS[0], logprobs=2, prompt_logprobs=1, **GREEDY)
    c = want.outputs[0]
    got = client.completions.create(model="zoo", prompt=PROMPTS[0], logprobs=2, extra_body={"prompt_logprobs": 1},
                                    **GREEDY).model_dump()["choices"][0]
    assert got["logprobs"]["token_logprobs"] == [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
    assert got["logprobs"]["tokens"] == [d[t].decoded_token for d, t in zip(c.logprobs, c.token_ids)]
    assert "".join(got["logprobs"]["tokens"]) == got["text"] and got["logprobs"]["text_offset"][0] == 0
    assert all(len(top) in (2, 3) for top in got["logprobs"]["top_logprobs"])
    assert got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == len(want.prompt_token_ids)
    assert [{int(i): v["logprob"] for i, v in d.items()} for d in got["prompt_logprobs"][1:]] == \
        [{i: v.logprob for i, v in d.items()} for d in want.prompt_logprobs[1:]]
    chat = client.chat.completions.create(model="zoo", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                          top_logprobs=3, **GREEDY).choices[0]
    assert len(chat.logprobs.content) == len(client.chat.completions.create(
        model="zoo", messages=[{"role": "user", "content": "hi"}], **GREEDY).choices[0].message.content and
        chat.logprobs.content) and all(len(t.top_logprobs) == 3 for t in chat.logprobs.content)
    assert all(t.top_logprobs[0].logprob >= t.logprob for t in chat.logprobs.content)
    # streamed: each chunk carries its tokens' logprobs; joined, they are the non-streamed ones
    chunks = list(client.completions.create(model="zoo", prompt=PROMPTS[0], logprobs=2, stream=True, **GREEDY))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((p.token_logprobs for p in parts), []) == got["logprobs"]["token_logprobs"]
    assert sum((p.text_offset for p in parts), []) == got["logprobs"]["text_offset"]
    stream = client.chat.completions.create(model="zoo", messages=[{"role": "user", "content": "hi"}],
                                            logprobs=True, top_logprobs=3, stream=True, **GREEDY)
    content = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.model_dump() for t in content] == [t.model_dump() for t in chat.logprobs.content]


def test_n_completions_are_choices_as_the_engine_returns_them(client, llm):
    """n = 2 seeded samples: the server's choices are LLM's completions (streamed or not), in vLLM's order."""
    sampled = dict(temperature=1.0, seed=5, max_tokens=12)
    want = [c.text for c in _solo(llm, PROMPTS[0], n=2, **sampled).outputs]
    assert len(set(want)) == 2
    got = client.completions.create(model="zoo", prompt=PROMPTS[0], n=2, **sampled)
    assert [c.index for c in got.choices] == [0, 1] and [c.text for c in got.choices] == want
    assert got.usage.prompt_tokens == len(llm.get_tokenizer()(PROMPTS[0])["input_ids"])
    streamed = ["", ""]
    for chunk in client.completions.create(model="zoo", prompt=PROMPTS[0], n=2, stream=True, **sampled):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == want
    chat = client.chat.completions.create(model="zoo", messages=[{"role": "user", "content": "hi"}], n=2, **sampled)
    assert [c.index for c in chat.choices] == [0, 1]
    streamed = ["", ""]
    for chunk in client.chat.completions.create(model="zoo", messages=[{"role": "user", "content": "hi"}], n=2,
                                                stream=True, **sampled):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in chat.choices]
