"""``funcspec serve`` against a hostile client: no request can hurt another.

185 malformed, extreme and valid-but-odd requests, each answered with its
status in OpenAI's error shape (``param`` naming the field) on one pooled
keep-alive connection that stays usable, while two long streams (one greedy,
one seeded-sampled) run beside them and end with exactly their solo output;
values only the engine bounds (a temperature past float32, max_tokens past the
context) are held to the same rule. Then disconnects and broken HTTP, after which the server serves on; the
server logs no traceback for any of it. Then the process level: a port in
use, an empty API key, and SIGINT / SIGTERM shutdowns (drain, deadline, second
signal), each ending every request with a proper answer, closing the engine and
exiting with the code that says whether work was lost.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import pytest

pytest.importorskip("fastapi")

from funcspec import zoo  # noqa: E402
from funcspec.serve.args import api_key  # noqa: E402
from served import JSON, Served, openai_error, post, sse_events  # noqa: E402

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN, MAX_NUM_SEQS, BODY_LIMIT = 1024, 4, 1 << 20
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4})
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
WITNESSES = [  # two long streams that run while the hostile requests arrive
    {"prompt": "import os\nimport sys\n", "max_tokens": 300, "temperature": 0, "ignore_eos": True},
    {"prompt": "class Stack:\n    def __init__(self):\n", "max_tokens": 300, "temperature": 0.8, "top_p": 0.9,
     "seed": 7, "ignore_eos": True},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The zoo target with n-gram speculation, eager; the API key from FUNCSPEC_API_KEY (kept out of ``ps``)."""
    served = Served([str(zoo.model_path("target")), "--speculative-config", NGRAM, "--enforce-eager",
                     "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
                     "--served-model-name", "zoo", "--chat-template", TEMPLATE, "--max-request-body-bytes",
                     str(BODY_LIMIT)], tmp_path_factory.mktemp("hostile") / "server.log",
                    env={"FUNCSPEC_API_KEY": KEY})
    yield served
    served.stop()


@pytest.fixture(scope="module")
def solo(server):
    """Each witness's output run alone on the idle server: its token ids."""
    conn = server.connection()
    outs = []
    for body in WITNESSES:
        status, raw, _ = post(conn, "/v1/completions", dict(body, return_token_ids=True), {**AUTH, **JSON})
        assert status == 200, raw
        outs.append(json.loads(raw)["choices"][0]["token_ids"])
    return outs


class Witnesses:
    """The witness streams, run again and again on their own connections while the ``with`` block sends hostile
    requests, so one is always in flight beside them; every run must end with its solo tokens."""

    def __init__(self, server: Served):
        self.server, self.stop = server, threading.Event()
        self.runs: list[list] = [[] for _ in WITNESSES]  # per witness: (tokens, finish reason or error event)
        self.started = [threading.Event() for _ in WITNESSES]
        self.finished_at = [0.0] * len(WITNESSES)

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            self.runs[i].append(self._stream(i))
        self.finished_at[i] = time.monotonic()

    def _stream(self, i: int) -> tuple:
        conn = self.server.connection()
        conn.request("POST", "/v1/completions", json.dumps(dict(WITNESSES[i], stream=True, return_token_ids=True)),
                     {"Content-Type": "application/json", **AUTH})
        response, tokens, end = conn.getresponse(), [], None
        while line := response.readline():
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                tokens += event["choices"][0]["token_ids"] if "choices" in event else []
                end = event["choices"][0]["finish_reason"] if "choices" in event else event
                self.started[i].set()
        conn.close()
        return tokens, end

    def __enter__(self) -> "Witnesses":
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(WITNESSES))]
        for t in self.threads:
            t.start()
        for started in self.started:
            assert started.wait(60), "a witness stream never started"
        return self

    def __exit__(self, *exc) -> None:
        self.last_answer = time.monotonic()
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def check(self, solo: list) -> None:
        """Each witness ran beside every hostile request, and each of its runs ended with its solo tokens."""
        assert all(t > self.last_answer for t in self.finished_at), "a witness ended before the hostile requests did"
        for runs, want in zip(self.runs, solo):
            assert runs and all(run == (want, "length") for run in runs), [run[1] for run in runs]


@dataclasses.dataclass(frozen=True)
class Case:
    """One hostile request: its body (bytes as sent, else JSON), the status and ``param`` it gets, and a piece of
    its message."""

    name: str
    body: Any
    status: int
    param: Optional[str] = None
    match: str = ""
    path: str = "/v1/completions"
    headers: tuple = ()


def ok(name: str, body: Any, path: str = "/v1/completions", headers: tuple = ()) -> Case:
    """A request that looks hostile and is valid: answered 200."""
    return Case(name, body, 200, path=path, headers=headers)


def bad(name: str, field: str, value: Any, status: int = 400, match: str = "") -> Case:
    """A completion request whose ``field`` has ``value``: refused, naming the field."""
    return Case(name, {"model": "zoo", "prompt": "x", "max_tokens": 2, field: value}, status, field, match)


def chat(name: str, status: int, param: Optional[str], match: str = "", **fields) -> Case:
    body = {"model": "zoo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return Case(name, body, status, param, match, "/v1/chat/completions")


X = {"prompt": "x", "max_tokens": 2}
DEEP = 100_000
ENCODINGS = [
    Case("not json", b"{not json", 400, None, "not valid JSON"),
    Case("empty body", b"", 400, None, "not valid JSON"),
    Case("trailing garbage", b'{"prompt": "x"} x', 400, None, "not valid JSON"),
    Case("truncated", b'{"prompt": "x", "max_tok', 400, None, "not valid JSON"),
    Case("single quotes", b"{'prompt': 'x'}", 400, None, "not valid JSON"),
    Case("null", b"null", 422, None, "must be a JSON object"),
    Case("array", b"[1, 2]", 422, None, "must be a JSON object"),
    Case("string", b'"prompt"', 422, None, "must be a JSON object"),
    Case("number", b"7", 422, None, "must be a JSON object"),
    Case("lone high surrogate", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt",
         r"lone surrogate \ud800 at character 1"),
    Case("lone low surrogate", b'{"prompt": "\\udfff", "max_tokens": 2}', 400, "prompt", "lone surrogate"),
    Case("reversed pair", b'{"prompt": "\\ude00\\ud83d", "max_tokens": 2}', 400, "prompt", "lone surrogate"),
    Case("surrogate in a prompt list", b'{"prompt": ["ok", "\\ud800"], "max_tokens": 2}', 400, "prompt"),
    Case("surrogate in stop", b'{"prompt": "x", "stop": ["\\udc00"], "max_tokens": 2}', 400, "stop"),
    Case("surrogate in model", b'{"model": "\\ud800", "prompt": "x"}', 400, "model"),
    Case("surrogate in a field name", b'{"\\ud800": 1, "prompt": "x"}', 400, None, "a field name is not valid"),
    Case("surrogate deep in an unknown field", b'{"prompt": "x", "extra": {"a": ["\\ud800"]}}', 400, "extra"),
    Case("surrogate in chat content", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages",
         path="/v1/chat/completions"),
    Case("surrogate in chat role", b'{"messages": [{"role": "\\udbff", "content": "x"}]}', 400, "messages",
         path="/v1/chat/completions"),
    ok("a surrogate pair (an emoji)", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}'),
    ok("an escaped backslash before u", b'{"prompt": "\\\\ud800", "max_tokens": 2}'),
    Case("100k-deep array", b"[" * DEEP + b"]" * DEEP, 400, None, "deeper than 64 levels"),
    Case("100k-deep prompt", b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400, None, "deeper than 64"),
    Case("100k-deep objects", b'{"a":' * DEEP + b"1" + b"}" * DEEP, 400, None, "deeper than 64"),
    Case("65 levels in a field", {"prompt": "x", "extra": json.loads("[" * 65 + "]" * 65)}, 400, "extra",
         "extra nests arrays or objects deeper than 64 levels"),
    ok("60 levels in an unknown field", {"prompt": "x", "max_tokens": 2, "extra": json.loads("[" * 60 + "]" * 60)}),
    Case("invalid UTF-8", b'{"prompt": "\xff\xfe"}', 400, None, "not valid JSON"),
    Case("latin-1", b'{"prompt": "caf\xe9"}', 400, None, "not valid JSON"),
    Case("overlong UTF-8", b'{"prompt": "\xc0\xaf"}', 400, None, "not valid JSON"),
    Case("a 5000-digit integer", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None,
         "a number has too many digits"),
    ok("UTF-8 with a BOM", b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 2}'),
    ok("UTF-16", json.dumps(X).encode("utf-16")),
    ok("duplicate keys (the last wins)", b'{"prompt": "x", "prompt": "y", "max_tokens": 2}'),
    ok("a NUL character", {"prompt": "a\u0000b", "max_tokens": 2}),
    ok("control characters and RTL marks", {"prompt": "\u202e\u0007\t\r\n", "max_tokens": 2}),
    ok("whitespace only", {"prompt": "   ", "max_tokens": 2}),
    ok("astral-plane text", {"prompt": "\U0001f600\U00010348", "max_tokens": 2}),
    Case("NaN temperature", b'{"prompt": "x", "temperature": NaN}', 400, "temperature", "finite"),
    Case("Infinity top_p", b'{"prompt": "x", "top_p": Infinity}', 400, "top_p", "finite"),
    Case("1e400 temperature (inf)", b'{"prompt": "x", "temperature": 1e400}', 400, "temperature", "finite"),
    Case("-Infinity temperature", b'{"prompt": "x", "temperature": -Infinity}', 400, "temperature"),
]

TYPES = [
    Case("prompt missing", {"model": "zoo"}, 422, "prompt", "prompt is required"),
    Case("prompt a number", {"prompt": 5}, 422, "prompt"),
    Case("prompt a bool", {"prompt": True}, 422, "prompt"),
    Case("prompt an object", {"prompt": {}}, 422, "prompt"),
    Case("prompt null", {"prompt": None}, 422, "prompt"),
    Case("prompt float ids", {"prompt": [1.5]}, 422, "prompt"),
    Case("prompt bool ids", {"prompt": [True, False]}, 422, "prompt"),
    Case("prompt null id", {"prompt": [None]}, 422, "prompt"),
    Case("prompt mixed list", {"prompt": ["a", 1]}, 422, "prompt"),
    Case("prompt nested three deep", {"prompt": [[["a"]]]}, 422, "prompt"),
    Case("prompt empty string", {"prompt": ""}, 400, "prompt", "must not be empty"),
    Case("prompt empty list", {"prompt": []}, 400, "prompt", "must not be empty"),
    Case("prompt empty id list in a list", {"prompt": [[]]}, 400, "prompt", "must not be empty"),
    Case("prompt empty string in a list", {"prompt": ["a", ""]}, 400, "prompt", "must not be empty"),
    Case("model a number", {"model": 5, "prompt": "x"}, 422, "model"),
    Case("model a list", {"model": ["zoo"], "prompt": "x"}, 422, "model"),
    Case("model unknown", {"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    Case("model empty", {"model": "", "prompt": "x"}, 404, "model"),
    Case("model unknown beats a bad field", {"model": "nope", "prompt": "x", "max_tokens": -1}, 404, "model"),
    ok("model null (the first served)", {"model": None, "prompt": "x", "max_tokens": 2}),
    bad("max_tokens a string", "max_tokens", "5", match="must be an integer"),
    bad("max_tokens a float", "max_tokens", 5.5),
    bad("max_tokens a whole float", "max_tokens", 5.0),
    bad("max_tokens a bool", "max_tokens", True),
    bad("max_tokens a list", "max_tokens", [5]),
    bad("max_tokens an object", "max_tokens", {"n": 5}),
    bad("temperature a string", "temperature", "hot", match="finite number"),
    bad("temperature a bool", "temperature", True),
    bad("temperature a list", "temperature", [0.5]),
    bad("top_p a string", "top_p", "0.5"),
    bad("top_p a bool", "top_p", False),
    bad("top_k a string", "top_k", "5"),
    bad("top_k a float", "top_k", 1.5),
    bad("seed a string", "seed", "a"),
    bad("seed a float", "seed", 1.5),
    bad("seed a bool", "seed", True),
    bad("n a string", "n", "2"),
    bad("n a float", "n", 1.5),
    bad("stop a number", "stop", 5),
    bad("stop a list of numbers", "stop", [5]),
    bad("stop an object", "stop", {"a": 1}),
    bad("stop nested lists", "stop", [["a"]]),
    bad("stop_token_ids a string", "stop_token_ids", "7"),
    bad("stop_token_ids floats", "stop_token_ids", [1.5]),
    bad("ignore_eos a string", "ignore_eos", "yes"),
    bad("ignore_eos a number", "ignore_eos", 1),
    bad("min_tokens a string", "min_tokens", "1"),
    bad("logprobs a string", "logprobs", "1"),
    bad("logprobs a bool", "logprobs", True),
    bad("prompt_logprobs a string", "prompt_logprobs", "1"),
    bad("stream a string", "stream", "yes", 422),
    bad("stream a number", "stream", 1, 422),
    bad("stream_options a list", "stream_options", [1], 422),
    bad("stream_options a string", "stream_options", "usage", 422),
    bad("return_token_ids a string", "return_token_ids", "yes", 422),
    bad("echo", "echo", True, match="not supported by funcspec yet"),
    bad("best_of", "best_of", 2),
    bad("suffix", "suffix", "x"),
    bad("logit_bias", "logit_bias", {"1": 5}),
    bad("include_stop_str_in_output", "include_stop_str_in_output", True),
    bad("skip_special_tokens off", "skip_special_tokens", False),
    bad("presence_penalty", "presence_penalty", 0.5, match="not supported"),
    bad("frequency_penalty", "frequency_penalty", 0.5),
    bad("repetition_penalty", "repetition_penalty", 1.1),
    bad("min_p", "min_p", 0.1),
    ok("every neutral penalty", {"prompt": "x", "max_tokens": 2, "presence_penalty": 0, "frequency_penalty": 0,
                                 "repetition_penalty": 1, "min_p": 0, "echo": False, "best_of": 1, "logit_bias": {}}),
    ok("nulls everywhere (clients send them)", {"prompt": "x", "max_tokens": None, "temperature": None,
                                                "top_p": None, "top_k": None, "seed": None, "stop": None,
                                                "n": None, "logprobs": None, "stream": None, "user": None}),
    ok("an unknown field", {"prompt": "x", "max_tokens": 2, "frobnicate": [1, {"a": None}]}),
    Case("messages missing", {"model": "zoo", "max_tokens": 2}, 422, "messages", "messages is required",
         "/v1/chat/completions"),
    chat("messages a string", 422, "messages", messages="hi"),
    chat("messages empty", 400, "messages", "must not be empty", messages=[]),
    chat("a message not an object", 422, "messages", messages=[1]),
    chat("a message without a role", 422, "messages", messages=[{"content": "x"}]),
    chat("a role a number", 422, "messages", messages=[{"role": 5, "content": "x"}]),
    chat("content a number", 422, "messages", messages=[{"role": "user", "content": 5}]),
    chat("content an image", 400, "messages", "only text parts",
         messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    chat("content a text part without text", 400, "messages", messages=[{"role": "user", "content": [{"type": "text"}]}]),
    chat("top_logprobs without logprobs", 400, "top_logprobs", top_logprobs=2),
    chat("logprobs a string", 422, "logprobs", logprobs="yes"),
    chat("tools", 400, "tools", tools=[{"type": "function", "function": {"name": "f"}}]),
    chat("response_format json", 400, "response_format", response_format={"type": "json_object"}),
    chat("max_completion_tokens a string", 400, "max_tokens", max_completion_tokens="5"),
    chat("unknown model", 404, "model", model="other"),
]

INT64 = 1 << 63
RANGES = [
    bad("max_tokens 0", "max_tokens", 0, match=">= 1"),
    bad("max_tokens negative", "max_tokens", -3),
    bad("max_tokens beyond int64", "max_tokens", 10 ** 30, match="int64"),
    bad("temperature negative", "temperature", -0.5),
    bad("top_p 0", "top_p", 0),
    bad("top_p above 1", "top_p", 1.01),
    bad("top_p negative", "top_p", -1),
    bad("top_k below -1", "top_k", -2),
    bad("top_k 2**63 (the poisoned request)", "top_k", INT64, match="int64"),
    bad("top_k below int64", "top_k", -INT64 - 1, match="int64"),
    bad("seed 2**64", "seed", 1 << 64, match="int64"),
    bad("seed below int64", "seed", -INT64 - 1, match="int64"),
    bad("n 0", "n", 0),
    bad("n negative", "n", -1),
    bad("n above max_num_seqs", "n", MAX_NUM_SEQS + 1, match="max_num_seqs"),
    bad("n beyond int64", "n", 10 ** 30, match="int64"),
    bad("stop an empty string", "stop", ""),
    bad("stop with an empty string", "stop", ["a", ""]),
    bad("stop_token_ids negative", "stop_token_ids", [-1]),
    bad("stop_token_ids beyond int64", "stop_token_ids", [1 << 64], match="int64"),
    bad("min_tokens negative", "min_tokens", -1),
    bad("min_tokens above max_tokens", "min_tokens", 3, match="max_tokens"),
    bad("logprobs 21", "logprobs", 21, match="<= 20"),
    bad("logprobs negative", "logprobs", -1),
    bad("logprobs beyond int64", "logprobs", 10 ** 30, match="int64"),
    bad("prompt_logprobs negative", "prompt_logprobs", -1),
    Case("prompt_logprobs streamed", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    Case("a prompt as long as max_model_len", {"prompt": [5] * MAX_MODEL_LEN}, 400, "prompt", "max_model_len"),
    Case("a token id past the vocabulary", {"prompt": [4096]}, 400, "prompt_token_ids"),
    Case("a negative token id", {"prompt": [-1]}, 400, "prompt_token_ids"),
    Case("a token id beyond int64", {"prompt": [1 << 70]}, 400, "prompt_token_ids"),
    Case("a body over the limit", b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}', 413, None, "--max-request-body-bytes"),
    ok("max_tokens 1", {"prompt": "x", "max_tokens": 1}),
    ok("logprobs 20 (the maximum)", {"prompt": "x", "max_tokens": 2, "logprobs": 20}),
    ok("n = 2 (the slots the witnesses leave)", {"prompt": "x", "max_tokens": 2, "n": MAX_NUM_SEQS - 2, "seed": 1}),
    ok("top_k -1 and top_p 1", {"prompt": "x", "max_tokens": 2, "top_k": -1, "top_p": 1}),
    ok("the largest int64 seed", {"prompt": "x", "max_tokens": 2, "seed": INT64 - 1, "temperature": 1}),
    ok("the smallest int64 seed", {"prompt": "x", "max_tokens": 2, "seed": -INT64, "temperature": 1}),
    ok("a prompt one short of max_model_len", {"prompt": [5] * (MAX_MODEL_LEN - 1), "max_tokens": 1}),
    ok("a body just under the limit (JSON whitespace)", b'{"prompt": "x", "max_tokens": 1' + b" " * (BODY_LIMIT - 40)
       + b"}"),
    bad("a thousand stop strings", "stop", [f"s{i}" for i in range(1000)], match="at most 256"),
    ok("a long stop string", {"prompt": "x", "max_tokens": 2, "stop": ["y" * 5000]}),
    ok("stop_token_ids past the vocabulary", {"prompt": "x", "max_tokens": 2, "stop_token_ids": [10 ** 9]}),
]

HTTP = [
    Case("no key", X, 401, None, "API key", headers=(("Authorization", ""),)),
    Case("a wrong key", X, 401, None, headers=(("Authorization", "Bearer wrong"),)),
    Case("the key's prefix", X, 401, None, headers=(("Authorization", f"Bearer {KEY[:-1]}"),)),
    Case("the key and more", X, 401, None, headers=(("Authorization", f"Bearer {KEY}x"),)),
    Case("Basic scheme", X, 401, None, headers=(("Authorization", f"Basic {KEY}"),)),
    Case("the scheme alone", X, 401, None, headers=(("Authorization", "Bearer"),)),
    Case("the key alone", X, 401, None, headers=(("Authorization", KEY),)),
    ok("bearer in lower case (RFC 7235)", X, headers=(("Authorization", f"bearer {KEY}"),)),
    ok("BEARER in upper case", X, headers=(("Authorization", f"BEARER {KEY}"),)),
    ok("two spaces after the scheme", X, headers=(("Authorization", f"Bearer  {KEY}"),)),
    ok("a text/plain content type", X, headers=(("Content-Type", "text/plain"),)),
    ok("no content type", X, headers=(("Content-Type", ""),)),
    Case("an unknown route", X, 404, None, "Not Found", path="/v1/nothing"),
    Case("an unknown route without a key", X, 401, None, path="/v1/nothing", headers=(("Authorization", ""),)),
    Case("a model route by POST", X, 405, None, "Method Not Allowed", path="/v1/models"),
    Case("a path traversal", X, 404, None, path="/v1/../../etc/passwd"),
    Case("a 10 kB path", X, 404, None, path="/v1/" + "a" * 10_000),
    Case("a query string", X, 200, path="/v1/completions?stream=true&model=other"),
]


def check(conn, case: Case) -> None:
    """Send ``case`` on the pooled connection ``conn``; its status, OpenAI's shape, ``param`` and message, and the
    connection kept open for the next request."""
    headers = {**AUTH, "Content-Type": "application/json", **dict(case.headers)}
    headers = {k: v for k, v in headers.items() if v}  # an empty value: the header left out
    status, raw, response = post(conn, case.path, case.body, headers)
    assert status == case.status, (case.name, raw[:300])
    assert not response.will_close, f"{case.name}: the server closed the pooled connection"
    if status == 200:
        assert json.loads(raw)["choices"], case.name
        return
    err = openai_error(raw)
    assert err["code"] == status and err["param"] == case.param, (case.name, err)
    assert case.match in err["message"], (case.name, err)
    assert "Traceback" not in err["message"] and "Error:" not in err["message"], (case.name, err)


@pytest.mark.parametrize("cases", [ENCODINGS, TYPES, RANGES, HTTP], ids=["encodings", "types", "ranges", "http"])
def test_hostile_requests_get_openai_errors_and_hurt_no_other(server, solo, cases):
    """Every case answers its status and OpenAI's error shape on one keep-alive connection, while the witness
    streams run on unharmed; the server logs no traceback."""
    conn = server.connection()
    with Witnesses(server) as witnesses:
        for case in cases:
            check(conn, case)
    witnesses.check(solo)
    assert "Traceback" not in server.log.read_text()


def _raw(server: Served, data: bytes, close_after: float = 0.0) -> bytes:
    """Send raw bytes on a new socket: what comes back until the server closes it, or nothing when the client
    closes it ``close_after`` seconds after sending."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(data)
        if close_after:
            time.sleep(close_after)
            return b""
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_disconnects_and_broken_http_leave_no_trace(server, solo):
    """A client that leaves mid-body (ClientDisconnect), mid-headers or mid-stream, HTTP that is not HTTP, a
    pipelined pair: the witnesses run on, nothing is logged as a traceback, and the server serves on."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\n")
    body = json.dumps(X).encode()
    with Witnesses(server) as witnesses:
        _raw(server, (head + "Content-Length: 1000\r\n\r\n").encode() + b'{"prompt": "x"', close_after=0.3)
        _raw(server, head.encode()[:40], close_after=0.1)
        _raw(server, (head + "Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro").encode(), close_after=0.3)
        stream = (head + f"Content-Length: {len(body) + 16}\r\n\r\n").encode() + body[:-1] + b', "stream": true}'
        _raw(server, stream, close_after=0.05)  # a stream whose client leaves at once
        assert _raw(server, b"\x16\x03\x01\x02\x00garbage\r\n\r\n").startswith(b"HTTP/1.1 400")  # TLS at plain HTTP
        pipelined = _raw(server, ((head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body) * 2
                         + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert pipelined.count(b"HTTP/1.1 200") == 3
    witnesses.check(solo)
    log = server.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log
    assert server.status("GET", "/health") == 200


def test_a_poisoned_top_k_hurts_no_other(server, solo):
    """The issue's repro: two long streams, then top_k = 2**63 (which overflowed an int64 in the engine's step and
    failed every request in it): a 400 naming top_k, and both streams end with their solo output."""
    conn = server.connection()
    with Witnesses(server) as witnesses:
        check(conn, Case("poisoned", {"prompt": "hello", "max_tokens": 5, "temperature": 1, "top_k": INT64}, 400,
                         "top_k", "int64"))
    witnesses.check(solo)


ENGINE_BOUNDED = [  # refused by the engine's own checks (SamplingParams, the context limit)
    Case("temperature 1e39 (past float32)", {"prompt": "hello", "max_tokens": 5, "temperature": 1e39}, 400,
         "temperature"),
    Case("max_tokens past the context", {"prompt": "hello", "max_tokens": 100_000}, 400, "max_tokens",
         "max_model_len"),
    Case("chat max_tokens past the context", {"messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 100_000}, 400, "max_tokens", path="/v1/chat/completions"),
]


@pytest.mark.parametrize("case", ENGINE_BOUNDED, ids=[c.name for c in ENGINE_BOUNDED])
def test_values_the_engine_bounds_hurt_no_other(server, solo, case):
    """The other poisoned request, ``temperature: 1e39``, and a max_tokens past the context (vLLM's 400): refused
    naming the field while two streams run, which end with their solo output."""
    conn = server.connection()
    with Witnesses(server) as witnesses:
        check(conn, case)
    witnesses.check(solo)


# ------------------------------------------------------------------ process level
def test_a_port_in_use_fails_before_the_model_is_read(tmp_path):
    """The socket is bound first: with the port taken, serving a model that does not exist fails on the port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "funcspec.cli", "serve", str(tmp_path / "no-such-model"),
                               "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"funcspec serve: cannot listen on 127.0.0.1:{port}: Address already in use (another process holds it: "
        "stop that, or choose another --port)")


@pytest.mark.parametrize(("argv", "env", "source"), [
    (["--api-key", ""], {}, "--api-key"),
    ([], {"FUNCSPEC_API_KEY": ""}, "FUNCSPEC_API_KEY"),
])
def test_an_empty_api_key_is_refused(tmp_path, argv, env, source):
    """``--api-key "$KEY"`` with KEY unset used to serve without authentication."""
    import os

    done = subprocess.run([sys.executable, "-m", "funcspec.cli", "serve", str(tmp_path), *argv],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"funcspec serve: error: {source} is empty: give a key, or leave {source} unset to serve without one")


def test_the_api_key_comes_from_the_flag_then_funcspec_then_vllm():
    assert api_key("a", {"FUNCSPEC_API_KEY": "b", "VLLM_API_KEY": "c"}) == "a"
    assert api_key(None, {"FUNCSPEC_API_KEY": "b", "VLLM_API_KEY": "c"}) == "b"
    assert api_key(None, {"VLLM_API_KEY": "c"}) == "c"
    assert api_key(None, {}) is None
    for bad_key in (" key", "key\n", "kéy"):
        with pytest.raises(ValueError, match="^--api-key must be printable ASCII without spaces around it"):
            api_key(bad_key, {})


LONG = {"prompt": "def main():\n", "max_tokens": 900, "temperature": 0, "ignore_eos": True}


def _serve_plain(tmp_path, *extra: str) -> Served:
    """The zoo target without speculation, three slots, for the shutdown tests."""
    return Served([str(zoo.model_path("target")), "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
                   "--max-num-seqs", "3", *extra], tmp_path / "server.log")


class Clients:
    """Long requests in flight: ``streams`` streamed and ``plain`` not, each on its own connection and thread."""

    def __init__(self, server: Served, streams: int, plain: int, max_tokens: int):
        self.server, self.results = server, {}
        jobs = [(f"stream{i}", True) for i in range(streams)] + [(f"plain{i}", False) for i in range(plain)]
        self.threads = [threading.Thread(target=self._one, args=(name, stream, max_tokens), daemon=True)
                        for name, stream in jobs]
        for t in self.threads:
            t.start()

    def _one(self, name: str, stream: bool, max_tokens: int) -> None:
        status, raw, _ = post(self.server.connection(), "/v1/completions",
                              dict(LONG, max_tokens=max_tokens, stream=stream))
        self.results[name] = (status, sse_events(raw) if stream else json.loads(raw))

    def wait_running(self, running: int, waiting: int) -> None:
        """Until the server's gauges show the requests admitted and queued."""
        deadline = time.monotonic() + 60
        while (gauges := self._gauges()) != (running, waiting):
            assert time.monotonic() < deadline, gauges
            time.sleep(0.02)

    def _gauges(self) -> tuple:
        conn = self.server.connection()
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        value = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("funcspec:num_requests_")}
        return value["funcspec:num_requests_running"], value["funcspec:num_requests_waiting"]

    def join(self) -> dict:
        for t in self.threads:
            t.join(120)
        return self.results


def test_a_first_sigterm_drains_every_request_then_closes_the_engine(tmp_path):
    """Two streams and a plain request running, one queued: SIGTERM stops new connections, every request ends in
    full (the queued one too), ``close()`` runs, and the exit code is 0."""
    server = _serve_plain(tmp_path)
    clients = Clients(server, streams=2, plain=2, max_tokens=300)
    clients.wait_running(3, 1)
    server.signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while server.status("GET", "/health") != -1:  # the listening socket closes first
        assert time.monotonic() < deadline
        time.sleep(0.02)
    results = clients.join()
    assert server.wait() == 0
    for name, (status, body) in results.items():
        assert status == 200, (name, body)
        if name.startswith("stream"):
            assert body[-1] == "[DONE]" and body[-2]["choices"][0]["finish_reason"] == "length"
        else:
            assert body["usage"]["completion_tokens"] == 300
    log = server.log.read_text()
    assert "funcspec serve: engine closed" in log and "Traceback" not in log


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_ends_every_request_with_an_openai_error(tmp_path, sig):
    """Streams end with an error event, then ``data: [DONE]``; plain requests (running or queued) with a 503 in
    OpenAI's shape; ``close()`` runs and the exit code is 1: work was lost."""
    server = _serve_plain(tmp_path)
    clients = Clients(server, streams=2, plain=2, max_tokens=MAX_MODEL_LEN - 10)
    clients.wait_running(3, 1)
    server.signal(sig)
    time.sleep(0.2)
    server.signal(sig)
    results = clients.join()
    assert server.wait() == 1
    name = signal.Signals(sig).name
    for client, (status, body) in results.items():
        if client.startswith("stream"):
            assert status == 200 and body[-1] == "[DONE]", (client, body[-2:])
            err = body[-2]["error"]
        else:
            assert status == 503, (client, body)
            err = body["error"]
        assert err == {"message": f"the server is shutting down: a second {name}", "type": "ServiceUnavailableError",
                       "param": None, "code": 503}
    log = server.log.read_text()
    assert "funcspec serve: engine closed" in log and "Traceback" not in log


def test_a_shutdown_timeout_of_0_ends_the_requests_at_once(tmp_path):
    """vLLM's ``--shutdown-timeout 0``: the first signal's drain has no time at all."""
    server = _serve_plain(tmp_path, "--shutdown-timeout", "0")
    clients = Clients(server, streams=1, plain=1, max_tokens=MAX_MODEL_LEN - 10)
    clients.wait_running(2, 0)
    server.signal(signal.SIGTERM)
    results = clients.join()
    assert server.wait() == 1
    assert results["stream0"][1][-2]["error"]["message"] == \
        "the server is shutting down: --shutdown-timeout 0 s passed"
    assert results["plain0"][0] == 503 and "--shutdown-timeout 0 s passed" in results["plain0"][1]["error"]["message"]
    assert "funcspec serve: engine closed" in server.log.read_text()
