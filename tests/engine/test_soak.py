"""An engine soak: 1000 requests through continuous batching with EAGLE-3 on, captured graphs.

Mixed lengths, greedy and seeded sampling, ``n = 2``, stop strings, aborts
mid-flight and invalid requests arrive while others run, more than the slots
hold. Nothing may be lost or duplicated, every finished request must equal the
same request run alone (a row does not depend on the rows beside it), nothing
may recompile after start-up, and the process's memory must stay flat.
"""

from __future__ import annotations

import random

import pytest

from funcspec import Engine, SamplingParams, zoo

pytestmark = pytest.mark.slow

REQUESTS = 1000
SLOTS = 4
IN_FLIGHT = 10  # more than the slots: requests queue, and admission interleaves with decoding
SNIPPETS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "import os\nimport sys\n\n",
            "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
            "for i in range(10):\n    print(i)\n" * 3, "x = 1\n"]


def _pool(tok) -> list[tuple[list[int], SamplingParams]]:
    """24 distinct requests: mixed prompts and lengths, greedy / seeded temperature / seeded top-p,
    every fourth with a stop string, one in six with two completions."""
    out = []
    for i in range(24):
        kw = dict(max_tokens=(3, 9, 17)[i % 3], ignore_eos=i % 5 != 0)
        if i % 3 == 1:
            kw.update(temperature=0.8, seed=100 + i, top_p=0.9 if i % 2 else 1.0)
        else:
            kw.update(temperature=0.0)
        if i % 4 == 0:
            kw["stop"] = ["\n"]
        if i % 6 == 5:
            kw["n"] = 2
        out.append((tok(SNIPPETS[i % len(SNIPPETS)])["input_ids"], SamplingParams(**kw)))
    return out


def _invalid(tok, vocab: int, max_len: int, i: int):
    """A request ``add_request`` must refuse with a ValueError."""
    return [([], SamplingParams(max_tokens=4)),
            ([vocab + 7], SamplingParams(max_tokens=4)),
            (list(range(3, 3 + max_len + 1)), SamplingParams(max_tokens=4))][i % 3]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def test_engine_soak_loses_nothing_matches_solo_runs_never_recompiles(traced_codegen):
    eng = Engine(zoo.model_path("target"), {"method": "eagle3", "model": zoo.model_path("eagle3"),
                                             "num_speculative_tokens": 3},
                 backend="inductor", max_num_seqs=SLOTS, max_model_len=128)
    tok, vocab = eng.model.tokenizer, eng.model.cfg.vocab_size
    pool, rng = _pool(tok), random.Random(0)
    graphs = set(eng.runner.compiled)  # the compiled graphs (buckets of a symbolic batch share one)

    kinds = rng.choices(["ok", "abort", "invalid"], weights=[85, 8, 7], k=REQUESTS)
    added, aborted, results, refused, abort_at = {}, set(), {}, 0, {}
    rss, step = [], 0
    jobs = iter(enumerate(kinds))
    pending = True
    while pending or eng.has_unfinished_requests():
        while pending and len(added) - len(results) - len(aborted) < IN_FLIGHT:
            job = next(jobs, None)
            if job is None:
                pending = False
                break
            i, kind = job
            if kind == "invalid":
                prompt, params = _invalid(tok, vocab, 128, i)
                waiting = len(eng.scheduler.waiting)
                with pytest.raises(ValueError):
                    eng.add_request(prompt, params)
                assert len(eng.scheduler.waiting) == waiting  # refused whole: nothing queued
                refused += 1
                continue
            which = rng.randrange(len(pool))
            rid = eng.add_request(*pool[which])
            added[rid] = which
            if kind == "abort":
                abort_at[rid] = step + rng.randrange(1, 4)
        for rid in [r for r, s in abort_at.items() if s <= step]:
            eng.abort_request(rid)  # a no-op for a request that has finished already, as in vLLM
            if rid not in results:
                aborted.add(rid)
            del abort_at[rid]
        for out in eng.step():
            assert out.request_id not in results, f"{out.request_id} finished twice"
            assert out.request_id not in aborted, f"aborted {out.request_id} still returned"
            results[out.request_id] = out
        step += 1
        done = len(results) + len(aborted) + refused
        if done >= REQUESTS // 4 and not rss:
            rss.append(_rss_mib())  # after warm-up: the second quarter starts
    rss.append(_rss_mib())

    # nothing lost: every request that was not aborted in flight finished exactly once
    assert set(results) | aborted == set(added) and refused == kinds.count("invalid")
    assert len(results) > 800 and len(aborted) > 30

    # every finished request equals the same request run alone
    solo = {i: _tokens(eng.generate([p], s)[0]) for i, (p, s) in enumerate(pool)}
    differ = [rid for rid, out in results.items() if _tokens(out) != solo[added[rid]]]
    assert differ == []
    assert any(o.outputs[0].finish_reason == "stop" for o in results.values())
    assert any(len(o.outputs) == 2 for o in results.values())

    assert set(eng.runner.compiled) == graphs, "no graph was captured after start-up"
    assert eng.stats()["recompiles"] == 0
    assert rss[-1] < rss[0] * 1.05, f"RSS grew from {rss[0]:.0f} to {rss[-1]:.0f} MiB"
