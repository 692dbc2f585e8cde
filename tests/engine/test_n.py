"""n > 1 (SamplingParams.n): one prefill, the prompt's KV and drafter state copied into n slots, completions
decoded independently with keys from (seed, index), so completion i is reproducible alone."""

from __future__ import annotations

import math

import pytest

from funcspec import Engine, SamplingParams, kernels, rng, zoo

MAX_LEN = 128
_OPS = kernels.resolve("cpu")
# NOTE: a completion decoded beside its siblings equals it decoded alone where a row's bits never depend on
# the rows beside it (the streaming products and the decode-attention kernel); elsewhere only in law.
ROWS_INDEPENDENT = _OPS.stream and _OPS.decode_attention


def test_n_above_max_num_seqs_raises_naming_n(zoo_target):
    eng = Engine(zoo_target, max_num_seqs=2, max_model_len=MAX_LEN, enforce_eager=True)
    with pytest.raises(ValueError, match="SamplingParams.n=3 must be <= max_num_seqs=2"):
        eng.add_request([5, 6, 7], SamplingParams(n=3))
    with pytest.raises(ValueError, match="SamplingParams.n must be >= 1"):
        SamplingParams(n=0)


# ----------------------------------------------------------------------------- n > 1


@pytest.mark.skipif(not ROWS_INDEPENDENT, reason="this CPU's kernels round a row differently in a larger batch")
@pytest.mark.parametrize("method", [None, "eagle3", "draft_model", "dflash"])
def test_n_completions_prefill_once_and_each_is_reproducible_alone(zoo_target, zoo_prompts, method):
    """Completion i equals the request with seed completion_seed(seed, i) run alone: the copied prompt KV
    and drafter state (a draft model's own KV, EAGLE-3's features) are the prompt's own."""
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=1, n=3)
    for spec in [zoo.speculative_config(method, 3) if method else None]:
        eng = Engine(zoo_target, speculative_config=spec, max_num_seqs=4, max_model_len=MAX_LEN, enforce_eager=True)
        prefills = []
        real = eng.runner.prefill
        eng.runner.prefill = lambda reqs, *a: prefills.append(sum(r.index == 0 for r in reqs)) or real(reqs, *a)
        out = eng.generate(zoo_prompts[:1], sp)[0]
        assert prefills == [1]  # one prompt row for three completions
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in out.outputs}) == 3
        for c in out.outputs:
            alone = eng.generate(zoo_prompts[:1], SamplingParams(temperature=1.0, seed=rng.completion_seed(7, c.index),
                                                             max_tokens=12, ignore_eos=True, logprobs=1))[0]
            assert (alone.outputs[0].token_ids, alone.outputs[0].logprobs) == (c.token_ids, c.logprobs)
            assert c.finish_reason == "length" and len(c.logprobs) == 12
            assert math.isclose(c.cumulative_logprob, sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))


def test_n_with_a_host_drafter_keeps_one_suffix_tree_per_completion(zoo_target, zoo_prompts):
    eng = Engine(zoo_target, speculative_config=zoo.speculative_config("suffix", 3), max_num_seqs=4,
                 max_model_len=MAX_LEN, enforce_eager=True)
    out = eng.generate(zoo_prompts[:1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2))[0]
    ar = Engine(zoo_target, max_num_seqs=4, max_model_len=MAX_LEN, enforce_eager=True).generate(
        zoo_prompts[:1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [ar.outputs[0].token_ids] * 2
    assert not eng.proposer.host.seen  # both completions' trees stopped


def test_n_waits_for_its_slots_and_counts_against_max_num_seqs(zoo_target, zoo_prompts):
    eng = Engine(zoo_target, max_num_seqs=4, max_model_len=MAX_LEN, enforce_eager=True)
    eng.add_request(zoo_prompts[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2))
    rid = eng.add_request(zoo_prompts[1], SamplingParams(temperature=1.0, seed=1, max_tokens=3, ignore_eos=True, n=3))
    eng.step()
    assert len(eng.running) == 2 and len(eng.scheduler.waiting) == 3  # three slots are not free yet
    done = []
    while eng.has_unfinished_requests():
        assert len(eng.running) <= 4
        done += eng.step()
    assert [o.request_id for o in done] == ["0", rid] and [len(o.outputs) for o in done] == [2, 3]
    assert done[0].outputs[0].token_ids == done[0].outputs[1].token_ids  # greedy completions agree
    assert all(c.logprobs is None for o in done for c in o.outputs)


