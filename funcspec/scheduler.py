"""Scheduling, on the host only: requests, slots, admission, stop rules and detokenization.

Nothing here touches a tensor. The scheduler decides *which* request sits in
*which* KV slot and *when* a request is done; the runner (``runner.py``) owns
the device state that those decisions address. Running requests always fill
slots ``0..n-1``: a retirement moves the last running request into the freed
slot, and returns that move for the runner to apply to the state, so a batch
of ``n`` rows is a view of the first ``n`` slots and row ``i`` is slot ``i``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from typing import Any, Optional

from funcspec.config import SamplingParams
from funcspec.config.checks import FLOAT32_TINY, short

_NORMALIZE_SLACK = 8
"""Characters a normalizer may merge across the cut of a prompt's prefix (a base and its combining marks)."""


class Detokenizer:
    """The text of one request's output, grown by O(1) work per token.

    NOTE: re-decoding the whole output after every token (to look for stop
    strings) costs O(n²) per request. A fast tokenizer streams through
    ``tokenizers``' ``DecodeStream``, which buffers ids until they form whole
    UTF-8 characters, as vLLM's incremental detokenizer does. A slow tokenizer
    (no Rust backend) re-decodes a short window of ids instead.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self.backend, self.stream = backend, DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.prefix = self.read = 0  # slow path: the decoded window is ids[prefix:]
        self.chunks: list[str] = []

    def step(self, token_id: int) -> str:
        """Append one id; return the new text it completes ("" while a character is split)."""
        self.ids.append(token_id)
        if self.stream is not None:
            chunk = self.stream.step(self.backend, token_id) or ""
        else:
            chunk = self._window_step()
        self.chunks.append(chunk)
        return chunk

    def _window_step(self) -> str:
        """vLLM's offsets: decode ids[prefix:] and ids[prefix:read]; the difference is the new text.

        The window starts one emitted chunk back (so a merge across the boundary
        decodes as in the full text) and grows while a character is split.
        """
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # a split character (or nothing visible yet): wait for more ids
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self.chunks)


class StopStrings:
    """Find the first stop string in a growing text, looking only at what each chunk can complete."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.keep = max(len(s) for s in stops) - 1  # a stop string can start this far back
        self.tail = ""  # the last `keep` characters seen
        self.offset = 0  # position of `tail` in the whole text

    def feed(self, chunk: str) -> Optional[tuple[int, str]]:
        """(position in the whole text, stop string) of the earliest stop string that ends inside
        ``chunk``, or ``None``. As in vLLM, a stop string that ended in earlier text is not found again."""
        window = self.tail + chunk
        hits = [(i, s) for s in self.stops if (i := window.find(s, max(len(self.tail) - len(s) + 1, 0))) >= 0]
        hit = (self.offset + min(hits)[0], min(hits)[1]) if hits else None
        cut = max(len(window) - self.keep, 0)
        self.tail, self.offset = window[cut:], self.offset + cut
        return hit


@dataclasses.dataclass
class Request:
    """Host-side bookkeeping of one sequence: a request, or one completion of a request with ``n`` > 1.

    The ``n`` completions of a request share its ``request_id`` and ``prompt``;
    each has its own ``index``, slot, output, stop state, logprobs and counters,
    and ``group`` lists all of them (completion 0 first; ``[self]`` when n = 1).
    """

    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    error: Optional[str] = None  # why it failed alone (finish_reason "error")
    text: Optional[str] = None
    steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    extra: dict = dataclasses.field(default_factory=dict)
    detok: Optional[Detokenizer] = None
    stops: Optional[StopStrings] = None
    index: int = 0
    group: list = dataclasses.field(default_factory=list)
    logprobs: Optional[list] = None  # one dict per output token (SamplingParams.logprobs set)
    prompt_logprobs: Optional[list] = None  # completion 0 only (SamplingParams.prompt_logprobs set)
    accepted_per_pos: list = dataclasses.field(default_factory=list)  # steps that accepted the draft at i

    @property
    def total_len(self) -> int:
        """Prompt plus generated tokens so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def seq_id(self) -> str:
        """A name unique to this sequence: the request id, ``.index`` appended for completions after the first."""
        return self.request_id if self.index == 0 else f"{self.request_id}.{self.index}"


class Scheduler:
    """Waiting and running requests over ``num_slots`` KV slots.

    Args:
        num_slots: KV slots (the engine's ``max_num_seqs``).
        max_model_len: prompt + output limit.
        model: the target checkpoint: its vocabulary size, tokenizer and EOS ids.
        max_new_tokens: a cap on every request's output, whatever its
            ``max_tokens`` (``extract_hidden_states`` emits one token).
    """

    def __init__(self, num_slots: int, max_model_len: int, model, max_new_tokens: Optional[int] = None):
        self.num_slots, self.max_model_len, self.model, self.max_new_tokens = \
            num_slots, max_model_len, model, max_new_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}  # slot -> request; slots 0..n-1
        self.free_slots = list(range(num_slots))
        self.counter = 0

    @property
    def tokenizer(self):
        """The target's tokenizer (``None`` if the checkpoint ships none)."""
        return self.model.tokenizer

    # ------------------------------------------------------------ admission
    def make_request(self, prompt, params: SamplingParams) -> Request:
        """A validated request for ``prompt`` (text, token ids or a vLLM prompt dict); nothing is queued.

        Everything the request will write to the device is checked here, so that no step can fail on it: the
        prompt's ids are in the vocabulary and leave room in the context, and ``params`` are checked again as the
        engine runs them (:meth:`engine_params`).
        """
        text, ids = _prompt_parts(prompt)
        params = self.engine_params(params)
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; this checkpoint has none")
            self.check_context(self.token_floor(text), at_least=True)  # type: ignore[arg-type]  # no ids: a text. NOTE: before tokenizing it
            ids = self.tokenizer(text)["input_ids"]
        if not ids:
            raise ValueError("prompt must not be empty")
        self.check_context(len(ids), params)
        vocab = self.model.cfg.vocab_size
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids must be in [0, {vocab}), got {short(ids[bad])} at position {bad}")
        if params.n > self.num_slots:
            raise ValueError(f"SamplingParams.n={short(params.n)} must be <= max_num_seqs={self.num_slots}: "
                             "each completion holds a KV slot, and a request's completions run together")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; this checkpoint has none")
        self.counter += 1
        group = [Request(str(self.counter - 1), text, ids, params, index=i) for i in range(params.n)]
        for req in group:
            req.group = group
            if params.stop:
                req.detok, req.stops = Detokenizer(self.tokenizer), StopStrings(params.stop)
            if params.logprobs is not None:
                req.logprobs = []
        return group[0]

    def engine_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` as this engine runs them, every field checked again (a frozen dataclass can still be
        changed with ``object.__setattr__``), so the row prefill writes holds only checked values.

        A ``top_k`` at or above the vocabulary size is off (0), as vLLM's sampler treats it, so the row needs no
        sort; a ``top_p`` below float32's smallest normal runs as it (``FLOAT32_TINY``): both keep the same tokens.
        """
        params = dataclasses.replace(params)  # re-runs SamplingParams' checks
        top_k = 0 if params.top_k >= self.model.cfg.vocab_size else params.top_k
        return dataclasses.replace(params, top_k=top_k, top_p=max(params.top_p, FLOAT32_TINY))

    def check_context(self, prompt_len: int, params: Optional[SamplingParams] = None, at_least: bool = False) -> None:
        """Refuse a prompt of ``prompt_len`` tokens (``at_least``: a lower bound) that leaves no room for an
        output token, or whose ``params.max_tokens`` reach past ``max_model_len`` (vLLM's 400, in its words)."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise ValueError(f"prompt of {'at least ' if at_least else ''}{prompt_len} tokens does not fit "
                             f"max_model_len={limit} (it needs room for at least one output token)")
        cap = self.output_cap(params) if params is not None else None
        if cap is not None and prompt_len + cap > limit:
            raise ValueError(f"This model's maximum context length (max_model_len) is {limit} tokens. However, you "
                             f"requested {short(prompt_len + cap)} tokens ({prompt_len} in the prompt, {short(cap)} "
                             f"in the completion: SamplingParams.max_tokens). Please reduce the length of the prompt "
                             f"or of the completion.")

    def output_cap(self, params: SamplingParams) -> Optional[int]:
        """The most tokens a request may emit: its ``max_tokens`` and the engine's own cap (``None``: the context)."""
        return min((c for c in (params.max_tokens, self.max_new_tokens) if c is not None), default=None)

    def token_floor(self, text: str) -> int:
        """A lower bound on the tokens of ``text``, found without tokenizing it (0 where the tokenizer gives none).

        A token stands for at most :func:`token_span` characters of the normalized text, so a long prompt is
        refused in microseconds; only a bounded prefix is normalized (NFC may merge characters).
        """
        if "_span" not in self.__dict__:
            self._span = token_span(self.tokenizer)
        if self._span is None:
            return 0
        normalizer = self.tokenizer.backend_tokenizer.normalizer
        if normalizer is None:
            chars = len(text)
        else:
            cut = text[: (self.max_model_len + 1) * self._span + _NORMALIZE_SLACK]
            chars = max(len(normalizer.normalize_str(cut)) - _NORMALIZE_SLACK, 0)
        return -(-chars // self._span)

    def add(self, reqs: list[Request]) -> None:
        """Queue validated requests (each with all its completions), first come first served."""
        self.waiting.extend(seq for req in reqs for seq in (req.group or [req]))

    def admit(self) -> list[Request]:
        """Move waiting requests into the lowest free slots, all completions of a request at once.

        NOTE: a request with ``n`` completions is admitted only when ``n`` slots are
        free (its prompt is prefilled once and copied to all of them); until then it
        and everything queued behind it wait (first come, first served).
        """
        admitted = []
        while self.waiting:
            n = len(self.waiting[0].group or [self.waiting[0]])
            if n > len(self.free_slots):
                break
            for _ in range(n):
                req = self.waiting.popleft()
                req.slot, req.t_start = self.free_slots.pop(0), time.perf_counter()
                self.running[req.slot] = req
                admitted.append(req)
        return admitted

    def rows(self) -> list[Request]:
        """The running requests in row order: row i is slot i."""
        return [self.running[slot] for slot in range(len(self.running))]

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------- stop rules
    def append(self, req: Request, new: list[int]) -> None:
        """Append emitted tokens one by one, stopping at the first stop rule that fires."""
        p = req.params
        eos = () if p.ignore_eos else self.model.eos_token_ids
        cap = self.output_cap(p)
        for t in new:
            req.output_ids.append(t)
            n_out = len(req.output_ids)
            stops, detok = req.stops, req.detok  # set together, or neither
            hit = stops.feed(detok.step(t)) if stops is not None and detok is not None else None  # fed every token
            if n_out > p.min_tokens and (t in eos or t in (p.stop_token_ids or ())):
                req.finish_reason, req.stop_reason = "stop", (None if t in eos else t)
            elif hit is not None and n_out > p.min_tokens:
                req.text, req.stop_reason = req.detok.text[:hit[0]], hit[1]  # type: ignore[union-attr]  # a hit: set
                req.finish_reason = "stop"
            elif cap is not None and n_out >= cap:
                req.finish_reason = "length"
            elif req.total_len >= self.max_model_len:
                req.finish_reason = "length"
            if req.finish_reason:
                return

    def retire(self, req: Request) -> Optional[tuple[int, int]]:
        """Free ``req``'s slot; returns the (src, dst) slot move that keeps slots 0..n-1 filled, if any."""
        del self.running[req.slot]
        free, move = req.slot, None
        last = max(self.running, default=-1)
        if last > free:
            moved = self.running.pop(last)
            moved.slot, self.running[free] = free, moved
            move, free = (last, free), last
        self.free_slots.append(free)
        self.free_slots.sort()
        req.t_end = time.perf_counter()
        return move

    def final_text(self, req: Request) -> str:
        """The output text: cut at the stop string that fired, else the whole decode."""
        if req.text is not None:
            return req.text
        return self.tokenizer.decode(req.output_ids, skip_special_tokens=True) if self.tokenizer is not None else ""


def token_span(tokenizer) -> Optional[int]:
    """The most characters of normalized text that one token of ``tokenizer`` stands for, where that bounds
    the token count from below: a BPE model (byte-level or SentencePiece; unknown characters never fused into
    one token) behind a pre-tokenizer that only splits. ``None`` otherwise (a slow tokenizer; WordPiece makes
    a whole long word one unknown token). A byte-level token of n bytes is n characters of its vocabulary."""
    backend: Any = getattr(tokenizer, "backend_tokenizer", None)
    model: Any = getattr(backend, "model", None)
    if type(model).__name__ != "BPE" or (model.unk_token is not None and model.fuse_unk and not model.byte_fallback):
        return None
    pre = backend.pre_tokenizer
    if pre is not None and not _keeps_text(json.loads(pre.__getstate__())):
        return None
    return max(map(len, backend.get_vocab(with_added_tokens=True)))


def _keeps_text(pre: dict) -> bool:
    """Whether a pre-tokenizer (its JSON) hands on every character, only splitting (Whitespace drops them)."""
    if pre["type"] == "Sequence":
        return all(_keeps_text(p) for p in pre["pretokenizers"])
    splits = ("ByteLevel", "Metaspace", "Split", "Punctuation", "Digits", "UnicodeScripts")
    return pre["type"] in splits and pre.get("behavior") != "Removed"


def _prompt_parts(prompt) -> tuple[Optional[str], Optional[list[int]]]:
    """(text, token ids) of a prompt; either may be ``None``."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], None
        raise ValueError("prompt dict needs 'prompt_token_ids' or 'prompt'")
    if isinstance(prompt, str):
        return prompt, None
    return None, [int(t) for t in prompt]
