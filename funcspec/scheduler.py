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
import time
from typing import Any, Optional

from funcspec.config import SamplingParams
from funcspec.outputs import Logprob


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


def logprob_dict(token: int, logprob: float, rank: int, top_logprobs, top_ids, k: int, decode) -> dict:
    """vLLM's per-position dict: the chosen ``token`` first, then the ``k`` most likely (ranks 1..k).

    ``decode(id) -> str | None`` gives each entry's ``decoded_token``.
    """
    out = {token: Logprob(logprob, rank, decode(token))}
    for r, (lp, tid) in enumerate(zip(top_logprobs[:k], top_ids[:k]), start=1):
        if tid not in out:
            out[tid] = Logprob(lp, r, decode(tid))
    return out


class Scheduler:
    """Waiting and running requests over ``num_slots`` KV slots.

    Args:
        num_slots: KV slots (the engine's ``max_batch_size``).
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
        """A validated request for ``prompt`` (text, token ids or a vLLM prompt dict); nothing is queued."""
        text, ids = _prompt_parts(prompt)
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; this checkpoint has none")
            ids = self.tokenizer(text)["input_ids"]
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens does not fit max_model_len={self.max_model_len} "
                "(it needs room for at least one output token)"
            )
        if params.n > self.num_slots:
            raise ValueError(f"SamplingParams.n={params.n} must be <= max_num_seqs={self.num_slots}: "
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
        cap = min((c for c in (p.max_tokens, self.max_new_tokens) if c is not None), default=None)
        for t in new:
            req.output_ids.append(t)
            n_out = len(req.output_ids)
            hit = req.stops.feed(req.detok.step(t)) if req.stops is not None else None  # fed every token
            if n_out > p.min_tokens and (t in eos or t in (p.stop_token_ids or ())):
                req.finish_reason, req.stop_reason = "stop", (None if t in eos else t)
            elif hit is not None and n_out > p.min_tokens:
                req.text, req.stop_reason = req.detok.text[:hit[0]], hit[1]
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
