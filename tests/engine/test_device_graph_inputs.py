"""No captured step copies host data to the device.

A CUDA (or Ascend) graph refuses a pageable host-to-device copy while it
captures: ``torch.tensor(list, device=...)``, ``torch.as_tensor(int, ...)``
or indexing by a Python list inside the step failed ``backend="cudagraph"``
on a real GPU. Here, on the CPU, every captured step runs once as a device
graph's warm-up does, then again under a dispatch mode that fails on
``aten.lift_fresh`` (what each of those makes of host data), for every method,
tree kind, verifier and sampling feature.
"""

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from funcspec import Engine, SamplingParams, runner
from funcspec.checkpoints import init_draft_head

from spec_cases import _prompts, _spec

TREE = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"
DYNAMIC = {"speculative_eagle_topk": 2, "speculative_num_steps": 2, "speculative_num_draft_tokens": 5}
SAMPLED = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=4, ignore_eos=True, seed=3, logprobs=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)


class NoHostData(TorchDispatchMode):
    """Fails on host data becoming a tensor, naming the funcspec line that did it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default:
            lines = [f for f in traceback.extract_stack() if "/funcspec/" in f.filename]
            where = f"{lines[-1].filename.split('funcspec/')[-1]}:{lines[-1].lineno}" if lines else "?"
            raise AssertionError(f"a captured step made a tensor of host data at {where}: a device graph "
                                 f"refuses that copy while it captures")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def guarded_steps(monkeypatch):
    """Every captured step's first call runs as a device graph's warm-up; later calls under NoHostData."""
    real = runner.capture

    def capture(fn, example_args, backend, *args, **kwargs):
        calls = []

        def step(*a):
            calls.append(1)
            if len(calls) == 1:
                return fn(*a)
            with NoHostData():
                return fn(*a)

        return real(step, example_args, backend, *args, **kwargs)

    monkeypatch.setattr(runner, "capture", capture)


@pytest.fixture(scope="module")
def heads(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("graph_input_heads")
    return {m: str(init_draft_head(m, tiny_llama, root / m)) for m in ("eagle", "eagle3", "medusa", "mtp", "dflash",
                                                                      "dspark")}


CASES = {
    "ar": lambda h, d: None,
    "ngram": lambda h, d: _spec("ngram", 3),
    "ngram-tree": lambda h, d: {**_spec("ngram", 5), "speculative_token_tree": TREE},
    "suffix": lambda h, d: _spec("suffix", 3),
    "draft_model": lambda h, d: _spec("draft_model", 3, d),
    "draft_model-tree": lambda h, d: {**_spec("draft_model", 5, d), "speculative_token_tree": TREE},
    **{m: (lambda h, d, m=m: {"method": m, "model": h[m], "num_speculative_tokens": 3})
       for m in ("eagle", "eagle3", "medusa", "mtp", "dflash", "dspark")},
    "eagle3-tree": lambda h, d: {"method": "eagle3", "model": h["eagle3"], "speculative_token_tree": TREE},
    "eagle3-dynamic": lambda h, d: {"method": "eagle3", "model": h["eagle3"], **DYNAMIC},
    "block": lambda h, d: {**_spec("ngram", 3), "rejection_sample_method": "block"},
    "synthetic": lambda h, d: {**_spec("ngram", 3), "rejection_sample_method": "synthetic",
                               "synthetic_acceptance_rates": [0.8, 0.6, 0.4]},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_captured_step_copies_host_data(case, tiny_llama, tiny_draft, heads, guarded_steps):
    eng = Engine(tiny_llama, speculative_config=CASES[case](heads, tiny_draft), max_num_seqs=2, max_model_len=64,
                 enforce_eager=True)
    for params in (GREEDY, SAMPLED):
        outs = eng.generate(_prompts(2), params)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_the_guard_catches_a_python_list_index_and_a_host_scalar():
    x = torch.arange(6).view(2, 3)
    with NoHostData(), pytest.raises(AssertionError, match="host data"):
        x[:, [0, 2]]
    with NoHostData(), pytest.raises(AssertionError, match="host data"):
        torch.as_tensor(-1, dtype=torch.int64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine (CI has none)")
@pytest.mark.parametrize("case", sorted(set(CASES) - {"ar", "synthetic"}))  # synthetic accepts by rate: not lossless
def test_cudagraph_greedy_speculation_equals_eager_ar_on_cuda(case, tiny_llama, tiny_draft, heads):
    """Every lossless case above captured as CUDA graphs on a real GPU: greedy tokens equal eager greedy AR's."""
    kw = dict(max_num_seqs=2, max_model_len=64, device="cuda")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in Engine(tiny_llama, **kw, enforce_eager=True).generate(_prompts(4), params)]
    eng = Engine(tiny_llama, speculative_config=CASES[case](heads, tiny_draft), backend="cudagraph", **kw)
    assert [o.outputs[0].token_ids for o in eng.generate(_prompts(4), params)] == want
    assert eng.generate(_prompts(2), SAMPLED)[0].outputs[0].token_ids  # sampled steps capture and run too
