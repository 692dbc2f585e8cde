"""``GET /metrics``: vLLM's serving metrics under ``funcspec:`` names, through ``prometheus_client``.

Each server owns its registry (not the process-global one), so two servers in
one process, or a test, never share counts. ``prometheus_client`` appends
``_total`` to every counter's name in the text format (as vLLM's do):
``funcspec:spec_decode_num_accepted_tokens_total``.
"""

from __future__ import annotations

from typing import Optional, Sequence

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

# Seconds. Finer at the low end than vLLM's: a step of a small model on a CPU takes milliseconds.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25,
                0.5, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class Metrics:
    """The server's counters, gauges and histograms, every one labelled with the served ``model_name``.

    Speculative decoding (vLLM's ``spec_decode_*``, counted per request and step):
    ``num_drafts`` (row-steps that drafted), ``num_draft_tokens``,
    ``num_accepted_tokens`` and ``num_accepted_tokens_per_pos`` (label
    ``position``: drafts whose first ``position + 1`` tokens were accepted; per
    depth for a token tree). Requests: prompt and generation tokens, ended
    requests by ``finished_reason`` (``stop``, ``length``, ``abort``, ``error``),
    running and waiting gauges, and the time-to-first-token,
    time-per-output-token and end-to-end histograms.

    The engine itself (funcspec's, no vLLM counterpart): ``engine_step_seconds``
    (each ``Engine.step`` call), ``engine_time_per_output_token_seconds`` (a
    request's time per output token counted in ``Engine.step`` time only: the
    TPOT it would see if the server cost nothing; requests that ended by stop
    or length), and the gauges ``engine_compiled_graphs`` and
    ``engine_recompiles`` (the engine's graphs, read at each scrape): a graph
    compiled or a guard recompiled while serving shows as a rise.
    """

    def __init__(self, model_name: str, positions: int):
        # NOTE: no `_created` series (a timestamp per counter, which vLLM turns off too); process-wide in
        # prometheus_client, and this process is the server's.
        disable_created_metrics()
        self.registry = registry = CollectorRegistry()
        name = ["model_name"]

        def counter(key: str, doc: str, labels=()):
            return Counter(f"funcspec:{key}", doc, name + list(labels), registry=registry)

        self.num_drafts = counter("spec_decode_num_drafts", "Speculative drafts made (one per request and step).")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Drafts whose tokens up to this position were all accepted.", ["position"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of accepted requests.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(model_name)
        self.request_success = counter("request_success", "Ended requests, by finish reason.", ["finished_reason"])
        self.running = Gauge("funcspec:num_requests_running", "Requests in a KV slot.", name, registry=registry)
        self.waiting = Gauge("funcspec:num_requests_waiting", "Requests waiting for a KV slot.", name,
                             registry=registry)

        def histogram(key: str, doc: str, buckets):
            return Histogram(f"funcspec:{key}", doc, name, buckets=buckets, registry=registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "From arrival to the first token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "A request's mean time per output token after its first.", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "From arrival to the end of the request.", E2E_BUCKETS)
        self.engine_step = histogram("engine_step_seconds", "Wall time of each Engine.step call.", STEP_BUCKETS)
        self.engine_tpot = histogram("engine_time_per_output_token_seconds",
                                     "A finished request's Engine.step time after its first token, over its output "
                                     "tokens after the first (its TPOT without the server's own cost).",
                                     TPOT_BUCKETS)
        self.compiled_graphs = Gauge("funcspec:engine_compiled_graphs", "Graphs the engine compiled (eager: 0).",
                                     name, registry=registry).labels(model_name)
        self.recompiles = Gauge("funcspec:engine_recompiles", "Recompiles of the engine's graphs (guard failures).",
                                name, registry=registry).labels(model_name)
        self.model_name = model_name
        # NOTE: every series bound once, here: present (at 0) from the start, so a scrape sees each, and a
        # step's counting does no label lookups.
        self._drafts, self._draft_tokens, self._accepted = (
            c.labels(model_name) for c in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens))
        self._per_pos = [self.accepted_per_pos.labels(model_name, str(j)) for j in range(positions)]
        self._ended = {reason: self.request_success.labels(model_name, reason)
                       for reason in ("stop", "length", "abort", "error")}
        self._running, self._waiting = self.running.labels(model_name), self.waiting.labels(model_name)
        self._running.set(0)
        self._waiting.set(0)

    def step(self, spec, running: int, waiting: int, seconds: Optional[float] = None,
             engine_tpot: Sequence[float] = ()) -> None:
        """One engine step: its speculative counts (a :class:`~funcspec.serve.loop.SpecDelta`, or ``None``
        when nothing ran), the queue's state after it, the step's wall time (``None``: no step ran) and the
        Engine.step time per output token of each request it finished."""
        if seconds is not None:
            self.engine_step.observe(seconds)
        for t in engine_tpot:
            self.engine_tpot.observe(t)
        if spec is not None and spec.drafts:
            self._drafts.inc(spec.drafts)
            self._draft_tokens.inc(spec.draft_tokens)
            self._accepted.inc(spec.accepted)
            for counter, n in zip(self._per_pos, spec.per_pos):
                if n:
                    counter.inc(n)
        self._running.set(running)
        self._waiting.set(max(waiting, 0))

    def finished(self, reason: str, e2e: float, tpot: Optional[float]) -> None:
        """A request ended with ``reason`` after ``e2e`` seconds; ``tpot`` when it made two tokens or more."""
        self._ended[reason].inc()
        self.e2e.observe(e2e)
        if tpot is not None:
            self.tpot.observe(tpot)

    def engine(self, compiled_graphs: int, recompiles: int) -> None:
        """The engine's graph counts (:meth:`~funcspec.serve.loop.EngineLoop.graph_counts`)."""
        self.compiled_graphs.set(compiled_graphs)
        self.recompiles.set(recompiles)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def samples(text: str) -> dict[str, float]:
    """A ``/metrics`` text's samples by name and labels, ``model_name`` left out (``name{k="v",...}``), read with
    prometheus_client's own parser: what a client of the server (a test, ``bench serve``) compares."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items() if k != "model_name")
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out
