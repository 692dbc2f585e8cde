"""Autoregressive generation through the public API: HF parity, seeds, batching, stop rules, bad input."""

import collections
import sys

import pytest
import torch

import funcspec
from conftest import make_hf_model
from funcspec import Engine, SamplingParams, kernels

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def _prompts(n, lo=3, hi=20, seed=0, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_greedy_matches_transformers_generate(tmp_path):
    hf = make_hf_model(tmp_path)
    hf.generation_config.eos_token_id = None
    prompts = [[5, 17, 33], list(range(10, 30)), [44, 9, 71, 8, 3, 90, 12, 6, 51, 7, 23]]
    outs = funcspec.generate(str(tmp_path), prompts, GREEDY, max_num_seqs=4, max_model_len=128, enforce_eager=True)
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=48, do_sample=False, min_new_tokens=0)
        assert o.outputs[0].token_ids == ref[0, len(p):].tolist()
        assert o.prompt_token_ids == p and o.outputs[0].finish_reason == "length"


def test_continuous_batching_equals_single_requests(tiny_llama):
    """20 requests through 4 slots give exactly each request's single-request output."""
    prompts = _prompts(20, seed=1)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=20 if i % 3 else 0, seed=i,
                             max_tokens=5 + (i * 7) % 17, ignore_eos=True) for i in range(20)]
    eng = Engine(tiny_llama, max_num_seqs=4, max_model_len=96, enforce_eager=True)
    batched = eng.generate(prompts, params)
    single = Engine(tiny_llama, max_num_seqs=1, max_model_len=96, enforce_eager=True)
    for p, sp, o in zip(prompts, params, batched):
        assert single.generate([p], sp)[0].outputs[0].token_ids == o.outputs[0].token_ids
        assert len(o.outputs[0].token_ids) == sp.max_tokens
    assert set(eng.stats()["buckets_used"]) <= {"B1_K0", "B2_K0", "B4_K0"}
    assert "B4_K0" in eng.stats()["buckets_used"]


def test_seeds_reproduce_and_differ(tiny_llama):
    eng = Engine(tiny_llama, max_num_seqs=2, max_model_len=64, enforce_eager=True)
    p = [[4, 5, 6, 7]]
    a = eng.generate(p, SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True))
    b = eng.generate(p, SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True))
    c = eng.generate(p, SamplingParams(temperature=1.0, seed=8, max_tokens=24, ignore_eos=True))
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert a[0].outputs[0].token_ids != c[0].outputs[0].token_ids


def test_engine_keeps_state_between_calls(tiny_llama):
    eng = Engine(tiny_llama, max_num_seqs=2, max_model_len=64, enforce_eager=True)
    first = eng.generate([[4, 5, 6]], GREEDY.__class__(temperature=0.0, max_tokens=8, ignore_eos=True))
    steps = eng.stats()["steps"]
    second = eng.generate([[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert first[0].outputs[0].token_ids == second[0].outputs[0].token_ids
    assert eng.stats()["steps"] == 2 * steps and len(eng.graphs) == 1


def test_stop_token_ids_and_max_model_len(tiny_llama):
    eng = Engine(tiny_llama, max_num_seqs=2, max_model_len=24, enforce_eager=True)
    free = eng.generate([[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    ids = free.outputs[0].token_ids
    assert len(ids) == 24 - 3 and free.outputs[0].finish_reason == "length"  # max_tokens=None: up to max_model_len
    stop_at = ids[5]
    first = ids.index(stop_at)
    out = eng.generate([[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=None, stop_token_ids=[stop_at],
                                                   ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ids[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_eos_stops_unless_ignored(tiny_llama):
    eng = Engine(tiny_llama, max_num_seqs=1, max_model_len=64, enforce_eager=True)
    ids = eng.generate([[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    ids = ids.outputs[0].token_ids
    # make the 4th generated token the EOS id by loading a model whose eos is that token
    eng.model.cfg = eng.model.cfg.__class__(**{**eng.model.cfg.__dict__, "eos_token_ids": (ids[3],)})
    out = eng.generate([[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0]
    assert out.token_ids == ids[:ids.index(ids[3]) + 1] and out.finish_reason == "stop"


def test_text_prompts_and_stop_strings(default_model):
    eng = Engine(default_model, max_num_seqs=2, max_model_len=128, enforce_eager=True)
    out = eng.generate("def main():", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    text = out.outputs[0].text
    assert out.prompt == "def main():" and len(out.outputs[0].token_ids) == 20
    assert text == eng.model.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    stop = text[3:6]
    cut = eng.generate("def main():", SamplingParams(temperature=0.0, max_tokens=20, stop=[stop],
                                                     ignore_eos=True))[0].outputs[0]
    assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop


def test_prompt_forms(tiny_llama):
    eng = Engine(tiny_llama, max_num_seqs=2, max_model_len=64, enforce_eager=True)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    a = eng.generate([[7, 8, 9]], sp)[0].outputs[0].token_ids
    b = eng.generate([{"prompt_token_ids": [7, 8, 9]}], sp)[0].outputs[0].token_ids
    assert a == b


def test_stats_keys(tiny_llama):
    eng = Engine(tiny_llama, max_num_seqs=2, max_model_len=64, enforce_eager=True)
    eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    st = eng.stats()
    for key in ("steps", "tokens_generated", "recompiles", "graphs", "capture_seconds",
                "mean_acceptance_length", "per_position_acceptance"):
        assert key in st
    assert st["steps"] == 4 and st["tokens_generated"] == 4 and st["mean_acceptance_length"] == 1.0


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_clean(tiny_llama):
    eng = Engine(tiny_llama, max_num_seqs=2, max_model_len=16, enforce_eager=True)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        eng.generate([[1, 2], []], sp)
    with pytest.raises(ValueError, match="max_model_len=16"):
        eng.generate([[1, 2], list(range(3, 40))], sp)
    assert not eng.running and eng.scheduler.free_slots == [0, 1] and not eng.scheduler.waiting  # nothing half-admitted
    assert eng.generate([[1, 2]], sp)[0].outputs[0].token_ids


def test_llm_facade(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the target's num_key_value_heads=2"):
        funcspec.LLM(model=tiny_llama, tensor_parallel_size=3)
    with pytest.warns(UserWarning, match="gpu_memory_utilization"):
        llm = funcspec.LLM(model=tiny_llama, gpu_memory_utilization=0.9, enforce_eager=True, max_num_seqs=3,
                           max_model_len=64)
    assert llm.engine.backend == "eager" and llm.engine.num_slots == 3 and llm.engine.max_model_len == 64
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="unknown engine argument"):
        funcspec.LLM(model=tiny_llama, not_an_arg=1)


@pytest.mark.parametrize("method, logprobs", [("ngram", None), ("suffix", None), ("ngram", 3)])
def test_exactly_one_device_to_host_copy_per_step(tiny_llama, monkeypatch, method, logprobs):
    """Each step reads its results in ``readback`` (off the CPU: its one copy, the # SYNC line), and nothing
    else reads tensor data on the host: no .item(), .tolist(), int(), float() or bool() of a tensor outside it
    (in the graph, the host drafter or the host loop). Logprobs travel with the tokens."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec["prompt_lookup_max"] = 2
    eng = Engine(tiny_llama, speculative_config=spec, max_num_seqs=4, max_model_len=64, enforce_eager=True)
    eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))  # warm up
    calls = collections.Counter()  # (what, calling function) -> count

    def counted(what, real):
        def wrapper(self, *a, **k):
            calls[what, sys._getframe(1).f_code.co_name] += 1
            return real(self, *a, **k)
        return wrapper

    for what in ("cpu", "item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, what, counted(what, getattr(torch.Tensor, what)))
    steps0 = eng.stats()["steps"]
    eng.add_request([5, 6, 5, 6, 5], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                    logprobs=logprobs))
    eng.step()  # admission (prefill) and a first step
    calls.clear()
    for _ in range(4):
        assert eng.step() == []
    assert eng.stats()["steps"] - steps0 == 5
    assert calls["tolist", "readback"] >= 4 * 3  # tokens, num_emitted and num_drafts of each of the 4 steps
    req = eng.running[0]
    assert (req.logprobs and len(req.logprobs)) == (logprobs and len(req.output_ids))
    # NOTE: readback's .tolist() calls read the step's host tensors; anything else is a sync.
    assert {key: n for key, n in calls.items() if key[1] != "readback"} == {}


def test_cli_generate_prints_text_and_speed(default_model, capsys):
    from funcspec.cli import main

    main(["generate", "--model", default_model, "--max-tokens", "5", "--ignore-eos", "--max-model-len", "64",
          "def f():"])  # the default backend (inductor here), one prompt: B = 1, greedy and filtered
    out = capsys.readouterr().out
    assert "tokens/s" in out and "Generated:" in out
    assert "backend=inductor; captured 2 graph(s) at start-up in " in out and "B1_K0_T65_greedy" in out


@pytest.mark.skipif(not (kernels.resolve("cpu").stream and kernels.resolve("cpu").decode_attention),
                    reason="batch invariance needs products and attention whose rows never depend on the row "
                           "count: the streaming and decode-attention kernels (where funcspec's CPU kernels build); "
                           "elsewhere a batched prefill's row count picks the product's path")
def test_a_request_prefilled_beside_others_keeps_the_bits_it_has_alone():
    """Batch invariance at admission: a seeded top-p request admitted with two longer prompts holds, after its
    prefill and first step, bitwise the KV it holds when admitted alone (a batched prefill, padded to the longest
    prompt, once changed its logits' last bits and later a drawn token)."""
    from funcspec import zoo

    def slot0_kv(prompts):
        eng = Engine(str(zoo.model_path("target")), zoo.speculative_config("eagle3", 3), backend="eager",
                     max_num_seqs=4, max_model_len=256)
        for p in prompts:
            eng.add_request(p, SamplingParams(temperature=0.8, top_p=0.95, seed=1005, max_tokens=4, ignore_eos=True))
        eng.step()  # admits every request, then one speculative step
        return eng.state.kv.k[:, 0], eng.state.kv.v[:, 0]

    alone = slot0_kv(["def parse(x):\n    "])
    beside = slot0_kv(["def parse(x):\n    ", "import os\nclass A:\n    def f(self):\n        return 1\n" * 3,
                       "class A:\n"])
    assert all(torch.equal(a, b) for a, b in zip(alone, beside))
