"""Request bodies in, OpenAI-shaped JSON out: validation, errors, response and chunk shapes, streamed text.

Pure functions over dicts (nothing here imports FastAPI): a route reads the
body, calls :func:`completion_request` or :func:`chat_request`, and answers
with the ``*_response`` / ``*_chunk`` shapes, which are vLLM's.

Statuses: a body that is not JSON (or not Unicode text, or nested deeper
than :data:`MAX_JSON_DEPTH`), or a field with a bad value, is 400
(``BadRequestError``); a JSON body that is not a request at all (not an
object, a required field missing, a field of the wrong kind) is 422; an unknown
model 404; a body over the size limit 413. Sampling values are checked by
:class:`~funcspec.SamplingParams` itself, whose messages name the field; an
integer outside int64 is refused here first, as vLLM's API layer does.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Any, Optional

from funcspec.config import SamplingParams
from funcspec.config.checks import is_int
from funcspec.scheduler import Detokenizer

MAX_BODY_BYTES = 4 << 20  # default limit on a request body: a larger one is refused (413) before it is parsed
MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a request body may have (a real request has about 5 levels)."""
INT64 = (-(1 << 63), (1 << 63) - 1)
"""The range of every integer request field: the engine keeps them in int64 tensors (vLLM refuses a seed outside it)."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a surrogate code point can get into a JSON string

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError", 422: "UnprocessableEntityError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}

# Request fields that map one to one onto SamplingParams (vLLM's extra sampling fields included).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "n",
                   "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p")

# Fields funcspec cannot honour yet, with the values that mean "off" (what clients send by default).
NOT_YET = "is not supported by funcspec yet"
COMPLETION_UNSUPPORTED = {
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
    "logit_bias": (None, {}), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
}
CHAT_UNSUPPORTED = {
    "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}), "prompt_logprobs": (None,),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True), "echo": (None, False),
}


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        """The JSON body, in vLLM's shape (``code`` is the HTTP status)."""
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}


INTERNAL_ERROR = "the server failed on this request (an internal error: the server's log has the details)"
"""A 500's message: a server fault is answered without its internal text, which the server logs."""


@dataclasses.dataclass(frozen=True)
class GenRequest:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` request.

    ``prompts`` are the completion prompts (each a string or a list of token
    ids; several make one choice each); a chat request has ``messages``
    instead (role and text content, normalised), rendered by :func:`render_chat`.
    """

    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    prompts: tuple = ()
    messages: tuple = ()


# ------------------------------------------------------------------ parsing
def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object: 400 if it is not JSON, nests deeper than :data:`MAX_JSON_DEPTH` or holds
    text that is not Unicode (a lone surrogate such as ``"\\ud800"``); 422 if it is JSON but not an object."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    except ValueError:  # NOTE: Python refuses to parse an integer of more than 4300 digits
        raise APIError(400, "the request body is not valid JSON: a number has too many digits") from None
    if not isinstance(body, dict):
        raise APIError(422, f"the request body must be a JSON object, got {type(body).__name__}")
    # NOTE: the walk costs a Python step per JSON value, so it runs only where the raw bytes say it can find something
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH or _SURROGATE_ESCAPE.search(raw):
        for key, value in body.items():
            _check_values(key, None, 1)
            _check_values(value, key, 1)
    return body


def _check_values(value: Any, field: Optional[str], depth: int) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` and strings that are not Unicode text, naming the
    top-level ``field`` that holds them (``None``: a top-level field's own name, never echoed). Such text would
    fail later, in the tokenizer, a stop-string match or the response's JSON."""
    where = field if field is not None else "a field name"
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"{where} nests arrays or objects deeper than {MAX_JSON_DEPTH} levels", field)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise APIError(400, f"{where} is not valid Unicode text: a lone surrogate \\u{ord(value[err.start]):04x} "
                                f"at character {err.start}", field) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_values(key, field, depth + 1)
            _check_values(item, field, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_values(item, field, depth + 1)


def completion_request(body: dict) -> GenRequest:
    """``/v1/completions``: the prompt(s) and sampling parameters (``max_tokens`` defaults to 16, as OpenAI's)."""
    _refuse_unsupported(body, COMPLETION_UNSUPPORTED)
    if "prompt" not in body:
        raise APIError(422, "prompt is required", "prompt")
    # NOTE: the completions API's logprobs is already the count of top tokens
    return GenRequest(prompts=completion_prompts(body["prompt"]),
                      params=sampling_params(body, 16, logprobs=body.get("logprobs")), **_common(body))


def chat_request(body: dict) -> GenRequest:
    """``/v1/chat/completions``: the messages and sampling parameters (``max_completion_tokens`` or
    ``max_tokens``; none means up to ``max_model_len``)."""
    _refuse_unsupported(body, CHAT_UNSUPPORTED)
    if "messages" not in body:
        raise APIError(422, "messages is required", "messages")
    body = dict(body)
    if body.get("max_completion_tokens") is not None:
        body["max_tokens"] = body["max_completion_tokens"]
    return GenRequest(messages=chat_messages(body["messages"]),
                      params=sampling_params(body, None, logprobs=_chat_logprobs(body)),
                      **_common(body))


def _chat_logprobs(body: dict) -> Optional[int]:
    """The chat API's ``logprobs: true`` with ``top_logprobs: k`` as a count of top tokens (None: off)."""
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise APIError(422, f"logprobs must be a boolean, got {on!r}", "logprobs")
    if top is not None and not on:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (0 if top is None else top) if on else None


def _common(body: dict) -> dict:
    """The fields both endpoints share: stream, stream_options.include_usage, return_token_ids."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(422, "stream_options must be an object", "stream_options")
    return {"stream": _flag(body, "stream"), "include_usage": bool(options.get("include_usage")),
            "return_token_ids": _flag(body, "return_token_ids")}


def _flag(body: dict, name: str) -> bool:
    """A boolean field (absent or null is False)."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise APIError(422, f"{name} must be a boolean, got {value!r}", name)
    return bool(value)


def _refuse_unsupported(body: dict, fields: dict) -> None:
    """A clear 400 naming the first field set to something funcspec cannot do yet."""
    for name, off in fields.items():
        if name in body and body[name] not in off:
            raise APIError(400, f"{name}={json.dumps(body[name])} {NOT_YET}: leave it unset", name)


def sampling_params(body: dict, default_max_tokens: Optional[int], logprobs: Any = None) -> SamplingParams:
    """The request's :class:`SamplingParams`; its checks' ValueErrors become 400s naming the field.

    A null field takes SamplingParams' default, as an absent one does (OpenAI
    clients send nulls). ``n`` completions of a prompt are choices
    ``prompt_index * n + i``, as in vLLM.
    ``logprobs`` is the endpoint's count of top tokens (completions'
    ``logprobs``, chat's ``top_logprobs`` under ``logprobs: true``); vLLM's
    ``prompt_logprobs`` passes through (refused with ``stream`` for now).
    """
    kwargs = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", body.get("prompt_logprobs"))):
        if value is not None:
            if name == "prompt_logprobs" and body.get("stream"):
                raise APIError(400, "prompt_logprobs with stream: true is not served yet: leave one unset", name)
            kwargs[name] = value
    kwargs["max_tokens"] = body["max_tokens"] if body.get("max_tokens") is not None else default_max_tokens
    for name, value in kwargs.items():
        _check_int64(name, value)
    try:
        return SamplingParams(**kwargs)
    except ValueError as err:
        raise bad_value(err) from err


def _check_int64(name: str, value: Any) -> None:
    """400 naming ``name`` for an integer (or an integer of a list) outside :data:`INT64`."""
    for v in value if isinstance(value, list) else (value,):
        if is_int(v) and not INT64[0] <= v <= INT64[1]:
            raise APIError(400, f"{name} must be an integer in [-2**63, 2**63 - 1] (int64), got {v}", name)


def bad_value(err: ValueError) -> APIError:
    """A funcspec ValueError as a 400: its message names the field (``SamplingParams.top_p must be ...``,
    ``prompt must not be empty``, vLLM's context-length sentence naming ``SamplingParams.max_tokens``); the
    request field is the ``SamplingParams`` field it names, else its first word."""
    message = re.sub(r"^SamplingParams\.", "", str(err))
    field = re.search(r"SamplingParams\.(\w+)", str(err)) or re.match(r"(\w+)", message)
    return APIError(400, message, field.group(1) if field else None)


def completion_prompts(prompt: Any) -> tuple:
    """A completion ``prompt`` as prompts: a string, a list of token ids, or a list of either (one choice each)."""
    if isinstance(prompt, str) or _is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        prompts = prompt
    else:
        raise APIError(422, "prompt must be a string, a list of token ids, or a list of strings or token-id "
                            "lists", "prompt")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "prompt must not be empty", "prompt")
    return tuple(p if isinstance(p, str) else tuple(p) for p in prompts)


def _is_token_list(value: Any) -> bool:
    """A list of ints (a prompt already tokenized; an empty one is refused as an empty prompt)."""
    return isinstance(value, list) and all(is_int(t) for t in value)


def chat_messages(messages: Any) -> tuple:
    """Chat ``messages`` as ``{"role", "content"}`` dicts with text content (text parts joined)."""
    if not isinstance(messages, list):
        raise APIError(422, "messages must be a list of {role, content} objects", "messages")
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(422, f"messages[{i}] must be an object with a string role", "messages")
        out.append({"role": m["role"], "content": _text_content(m.get("content"), i)})
    return tuple(out)


def _text_content(content: Any, i: int) -> str:
    """A message's content as text: a string, null, or a list of ``{"type": "text", "text"}`` parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise APIError(400, f"messages[{i}].content: only text parts are supported by funcspec", "messages")
        return "".join(p["text"] for p in content)
    raise APIError(422, f"messages[{i}].content must be a string or a list of text parts", "messages")


def check_model(body: dict, served: tuple[str, ...]) -> str:
    """The served name a request addresses (the first when it names none); 404 for any other name.

    Checked before anything else in the body, as vLLM does: a request for
    another model is answered 404 whatever else is wrong with it.
    """
    requested = body.get("model")
    if requested is None:
        return served[0]
    if not isinstance(requested, str):
        raise APIError(422, f"model must be a string, got {type(requested).__name__}", "model")
    if requested not in served:
        raise APIError(404, f"The model `{requested}` does not exist (this server serves {list(served)}).",
                       "model")
    return requested


# ----------------------------------------------------------------- prompts
def tokenize(tokenizer, prompt) -> dict:
    """One completion prompt as the engine's ``{"prompt", "prompt_token_ids"}`` (a text prompt is tokenized
    as the engine would, special tokens included)."""
    if not isinstance(prompt, str):
        return {"prompt_token_ids": list(prompt)}
    if tokenizer is None:
        raise APIError(400, "prompt: text prompts need a tokenizer; this model has none (send token ids)",
                       "prompt")
    return {"prompt": prompt, "prompt_token_ids": tokenizer(prompt)["input_ids"]}


def render_chat(tokenizer, messages, template: Optional[str] = None) -> dict:
    """Chat messages as an engine prompt, through the chat template (``template``, else the tokenizer's own).

    The template writes the special tokens itself, so the rendered text is
    tokenized without adding them again (vLLM does the same).
    """
    template = template or getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not template:
        raise APIError(400, "this model has no chat template, so /v1/chat/completions cannot render messages: "
                            "use /v1/completions, or start the server with --chat-template", "messages")
    try:
        text = tokenizer.apply_chat_template(list(messages), chat_template=template, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as err:  # a template raises what it likes, e.g. jinja's "roles must alternate"
        raise APIError(400, f"the chat template refused these messages: {err}", "messages") from err
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}


# ----------------------------------------------------------------- answers
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, text: str, finish_reason=None, stop_reason=None, token_ids=None,
                      prompt_token_ids=None, logprobs=None, prompt_logprobs=None, kv_transfer_params=None) -> dict:
    """One choice of a completion (or of a streamed chunk: ``text`` is then the delta); ``logprobs`` and
    ``prompt_logprobs`` are :func:`completion_logprobs`' and :func:`prompt_logprobs_json`'s;
    ``kv_transfer_params``: where ``extract_hidden_states`` saved this choice's prompt (None leaves it out)."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
              "stop_reason": stop_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    if kv_transfer_params is not None:
        choice["kv_transfer_params"] = kv_transfer_params
    return _with_ids(choice, token_ids, prompt_token_ids)


def chat_choice(index: int, text: str, finish_reason=None, stop_reason=None, token_ids=None,
                logprobs=None, kv_transfer_params=None) -> dict:
    """One choice of a chat completion (``logprobs``: :func:`chat_logprobs`'; ``kv_transfer_params`` as in
    :func:`completion_choice`)."""
    choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
              "finish_reason": finish_reason, "stop_reason": stop_reason}
    if kv_transfer_params is not None:
        choice["kv_transfer_params"] = kv_transfer_params
    return _with_ids(choice, token_ids, None)


# NOTE: JSON has no -inf; vLLM writes -9999.0 for a token the target rules out.
def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)


def _text(entry, token_id: int) -> str:
    """A logprob entry's token text (its id as text when the model has no tokenizer)."""
    return entry.decoded_token if entry.decoded_token is not None else str(token_id)


def completion_logprobs(entries, token_ids, k: int, offset: int = 0) -> dict:
    """The completions API's ``logprobs`` from the engine's per-token dicts (``CompletionOutput.logprobs``):
    ``tokens``, ``token_logprobs``, ``top_logprobs`` (the generated token and the top ``k``, text -> logprob)
    and ``text_offset`` (where each token's text starts in the completion; a streamed chunk's tokens start at
    ``offset``, the length of the token texts before them)."""
    tokens = [_text(d[t], t) for d, t in zip(entries, token_ids)]
    offsets = [offset + sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
    return {"text_offset": offsets, "token_logprobs": [_finite(d[t].logprob) for d, t in zip(entries, token_ids)],
            "tokens": tokens,
            "top_logprobs": [{_text(v, i): _finite(v.logprob) for i, v in d.items()} if k else None
                             for d in entries]}


def chat_logprobs(entries, token_ids, k: int) -> dict:
    """The chat API's ``logprobs``: ``content``, one object per token with its ``top_logprobs`` (ranks 1..k)."""
    def one(entry, token_id):
        text = _text(entry, token_id)
        return {"token": text, "logprob": _finite(entry.logprob), "bytes": list(text.encode())}

    return {"content": [dict(one(d[t], t), top_logprobs=[one(v, i) for i, v in
                                                           sorted(d.items(), key=lambda x: x[1].rank)
                                                           if v.rank <= k][:k])
                        for d, t in zip(entries, token_ids)]}


def prompt_logprobs_json(entries) -> list:
    """vLLM's ``prompt_logprobs`` of a choice: ``None`` for the first token, then token id -> logprob entry."""
    return [None if d is None else {str(i): {"logprob": _finite(v.logprob), "rank": v.rank,
                                             "decoded_token": v.decoded_token} for i, v in d.items()}
            for d in entries]


def chat_delta(index: int, delta: dict, finish_reason=None, stop_reason=None, token_ids=None,
               logprobs=None) -> dict:
    """One choice of a streamed chat chunk (``delta``: the role first, then content; ``logprobs``: the chunk's
    tokens', :func:`chat_logprobs`')."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
              "stop_reason": stop_reason}
    return _with_ids(choice, token_ids, None)


def _with_ids(choice: dict, token_ids, prompt_token_ids) -> dict:
    """vLLM's ``return_token_ids`` fields, only when asked for (``None`` leaves them out)."""
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = list(prompt_token_ids)
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def envelope(kind: str, request_id: str, model: str, choices: list, created: Optional[int] = None, **extra) -> dict:
    """A response or chunk: ``kind`` is ``text_completion``, ``chat.completion`` or ``chat.completion.chunk``."""
    out = {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model,
           "choices": choices}
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def sse(data: dict) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


class TextStream:
    """The text a stream sends, chunk by chunk, so that its chunks join to the non-streamed text.

    Tokens are detokenized incrementally (the engine's :class:`~funcspec.scheduler.Detokenizer`).
    While the request has stop strings, the last ``len(longest) - 1``
    characters are held back: they may be the start of a stop string that the
    final text cuts off, and a sent chunk cannot be taken back. :meth:`finish`
    sends the rest of the final text.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text, self.sent = "", 0

    def feed(self, token_ids) -> str:
        """New tokens in; the text that may be sent now out."""
        if self.detok is None:
            return ""
        self.text += "".join(self.detok.step(t) for t in token_ids)
        end = max(len(self.text) - self.hold, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self, final_text: str) -> str:
        """What is left to send of ``final_text`` (the engine's output text, cut at a stop string): call it
        instead of :meth:`feed` with the last tokens, which may complete the stop string."""
        out, self.sent = final_text[self.sent:], max(len(final_text), self.sent)
        return out
