"""``funcspec serve``'s command line: vLLM's flag names, mapped onto ``LLM(...)``'s arguments.

The engine flags are generated from :class:`~funcspec.args.EngineArgs`' fields
(:func:`add_engine_flags`: ``max_num_seqs`` is ``--max-num-seqs``), so every
engine argument has its flag and none is spelled twice. Every other ``--flag [VALUE]`` is
handed to :class:`~funcspec.LLM` as a keyword, so the vLLM flags that have no
effect here (``--gpu-memory-utilization 0.9``, ``--no-enable-prefix-caching``,
``--trust-remote-code``, ...) are accepted with ``LLM``'s one warning, and a
flag that is no engine argument at all is refused by the same check as
``LLM(unknown=...)``. Nothing here imports FastAPI.

The listening socket is bound before the model loads (a port in use fails at
once), and the API key comes from ``--api-key``, else ``FUNCSPEC_API_KEY``,
else vLLM's ``VLLM_API_KEY`` (an environment variable keeps it out of ``ps``).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import socket
import time
from typing import Any, Optional

from funcspec.args import EngineArgs
from funcspec.serve.protocol import MAX_BODY_BYTES

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
"""Seconds a first SIGINT / SIGTERM lets the requests in flight finish. NOTE: vLLM's default is 0 (abort them at
once); funcspec drains, as it always did, but no longer without limit."""
API_KEY_SOURCES = ("--api-key", "FUNCSPEC_API_KEY", "VLLM_API_KEY")

ENGINE_FLAGS = tuple(f.name for f in dataclasses.fields(EngineArgs) if f.metadata["cli"] != "positional")
"""The fields of :class:`~funcspec.args.EngineArgs` that are flags (every one but the model): given ones become
``LLM(...)`` keywords, absent ones keep its defaults."""

ALIASES = {"speculative_config": ("-sc",), "tensor_parallel_size": ("-tp",), "quantization": ("-q",)}
"""vLLM's short flags."""


def json_flag(name: str):
    """An argparse type for a flag whose value is a JSON object (the error names the flag)."""
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise argparse.ArgumentTypeError(f"{name} must be a JSON object: {err}") from err
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{name} must be a JSON object, got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``funcspec serve`` (flags it does not know are kept for :func:`extra_engine_args`)."""
    p = argparse.ArgumentParser(
        prog="funcspec serve",
        description="An OpenAI-compatible server (vLLM's `vllm serve`): /v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /version, /metrics. Other vLLM engine flags are accepted; those with "
                    "no effect in funcspec are named in one warning.")
    p.add_argument("model", help="the target checkpoint (as LLM's model)")
    add_engine_flags(p.add_argument_group("engine (vLLM's names; EngineArgs' fields)"))
    server = p.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST, help="default %(default)s (loopback only)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT)
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                             "$FUNCSPEC_API_KEY, else $VLLM_API_KEY; unset: no key)")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model name(s) requests may give (default: the model argument)")
    server.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one (default: the tokenizer's own)")
    server.add_argument("--max-request-body-bytes", type=int, default=MAX_BODY_BYTES,
                        help="larger request bodies get 413 (default %(default)s)")
    server.add_argument("--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT,
                        help="seconds a first SIGINT/SIGTERM lets the requests in flight finish before they are ended "
                             "with 503 (0: at once; a second signal ends them at once; default %(default)s)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"))
    return p


def add_engine_flags(group) -> None:
    """One flag per :data:`ENGINE_FLAGS` field, read as its metadata says (an integer, a string, a JSON object,
    integers, or ``--x`` / ``--no-x``); every default is ``None``, so an absent flag keeps ``EngineArgs``'
    default (named in the help)."""
    for f in dataclasses.fields(EngineArgs):
        kind, text = f.metadata["cli"], f.metadata["help"]
        if kind == "positional":
            continue
        name = "--" + f.name.replace("_", "-")
        if f.default is not None:
            text += f" (default: {f.default})"
        kw: dict[str, Any] = {"default": None, "help": text}
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif kind == "json":
            kw["type"], kw["help"] = json_flag(name), text + ", as a JSON object"
        elif kind == "ints":
            kw["type"], kw["nargs"] = int, "+"
        elif kind == "int":
            kw["type"] = int
        group.add_argument(name, *ALIASES.get(f.name, ()), **kw)


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def api_key(flag: Optional[str], environ=os.environ) -> Optional[str]:
    """The API key: ``--api-key``, else ``FUNCSPEC_API_KEY``, else ``VLLM_API_KEY``; ``None`` when none is set.

    An empty key is refused (``--api-key "$KEY"`` with ``KEY`` unset would turn
    authentication off without a word), and so is one no client can send in a
    header: with spaces around it, or not printable ASCII.
    """
    for source, value in zip(API_KEY_SOURCES, (flag, *(environ.get(name) for name in API_KEY_SOURCES[1:]))):
        if value is None:
            continue
        if not value:
            raise ValueError(f"{source} is empty: give a key, or leave {source} unset to serve without one")
        if value != value.strip() or not (value.isascii() and value.isprintable()):
            raise ValueError(f"{source} must be printable ASCII without spaces around it (a header carries it)")
        return value
    return None


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound to ``host:port`` (listening starts with uvicorn).

    NOTE: bound before the model loads, so a port in use fails at once rather
    than after minutes of loading; until uvicorn listens, connections are refused.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may reuse a port in TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        hint = " (another process holds it: stop that, or choose another --port)" if err.errno == errno.EADDRINUSE \
            else ""
        raise SystemExit(f"funcspec serve: cannot listen on {host}:{port}: {err.strerror or err}{hint}") from None
    return sock


def extra_engine_args(tokens: list[str]) -> dict[str, Any]:
    """Flags the parser did not know, as ``LLM`` keywords: ``--a-b V`` / ``--a-b=V`` -> ``a_b=V`` (V read as
    JSON when it is JSON, else kept as a string), ``--a-b`` -> ``True``, ``--no-a-b`` -> ``a_b=False``."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            raise ValueError(f"unexpected argument {token!r} (the model is the only positional argument)")
        name, eq, text = token[2:].partition("=")
        if not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            eq, text, i = "=", tokens[i + 1], i + 1
        if eq:
            value = _json_or_text(text)
        elif name.startswith("no-"):
            name, value = name[3:], False
        else:
            value = True
        out[name.replace("-", "_")] = value
        i += 1
    return out


def _json_or_text(text: str) -> Any:
    """A flag's value: JSON (numbers, booleans, objects) when it parses, else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def engine_kwargs(args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    """``LLM(args.model, **engine_kwargs(...))``: the given engine flags, then the unknown ones as they came."""
    given = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    clash = sorted(set(given) & set(extra))
    if clash:
        raise ValueError(f"flags given twice: {clash}")
    return {**given, **extra}


def chat_template(value: Optional[str]) -> Optional[str]:
    """``--chat-template``: a file's contents when the value names a file, else the value itself (vLLM's rule)."""
    if value is None:
        return None
    from pathlib import Path

    try:
        path = Path(value)
        if path.is_file():
            return path.read_text()
    except OSError:  # a template too long to be a file name
        pass
    return value


def main(argv: list[str]) -> None:
    """``funcspec serve ...``: parse, bind the port, build the engine as ``LLM(...)`` does, and serve it until a
    signal; exits 1 when the shutdown cut requests short (:class:`funcspec.serve.app.Shutdown`)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        kwargs = engine_kwargs(args, extra_engine_args(rest))
        key = api_key(args.api_key)
    except ValueError as err:
        parser.error(str(err))
    try:
        from funcspec.serve import app
    except ImportError as err:  # FastAPI, uvicorn or prometheus_client missing
        raise SystemExit(f"funcspec serve needs the serve extra (pip install 'funcspec[serve]'): {err}") from err
    sock = listen(args.host, args.port)
    from funcspec import LLM

    # NOTE: a server must not stall a request on a compile, so its start-up also captures the logprobs graphs
    kwargs["compilation_config"] = {"capture_logprobs": True, **(kwargs.get("compilation_config") or {})}
    t0 = time.perf_counter()
    try:
        llm = LLM(args.model, **kwargs)  # NOTE: LLM's own warning names the vLLM flags with no effect here
    except ValueError as err:  # a bad flag value or an unknown flag: the message names it
        raise SystemExit(f"funcspec serve: {err}") from err
    names = tuple(args.served_model_name or [args.model])
    settings = app.Settings(names, args.model, key, chat_template(args.chat_template), args.max_request_body_bytes)
    engine = llm.engine
    host, port = sock.getsockname()[:2]
    print(f"funcspec serve: engine ready in {time.perf_counter() - t0:.1f}s (backend={engine.backend}, "
          f"max_num_seqs={engine.num_slots}, max_model_len={engine.max_model_len}); serving {list(names)} "
          f"on http://{host}:{port}", flush=True)

    def close() -> None:
        llm.close()
        print("funcspec serve: engine closed", flush=True)

    raise SystemExit(app.run(app.build_app(engine, settings, on_shutdown=close), sock, args.uvicorn_log_level,
                             args.shutdown_timeout))
