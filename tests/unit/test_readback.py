"""One readback for the step and the prefill: any pytree of tensors to host lists in one copy, and the
logprobs' host view (funcspec/logprobs.py) on top of it."""

import torch

from funcspec import logprobs
from funcspec.outputs import Logprob
from funcspec.runner import readback
from funcspec.step import StepOutput


def test_readback_copies_a_pytree_once_and_keeps_each_dtype(monkeypatch):
    calls = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    logits = torch.randn(2, 3, 5)  # [B, E, V]
    tokens = torch.tensor([[1, 4, 0], [2, 2, 3]])  # [B, E]
    lp = logprobs.token_logprobs(logits, tokens, num_top=2)
    out = StepOutput(tokens, torch.tensor([3, 1], dtype=torch.int32), torch.tensor([2, 2]), None, lp)
    host = readback((out, None, [torch.tensor([7]), None]))
    assert len(calls) == 1  # one device-to-host copy for the whole tree
    step, none, (seven, also_none) = host
    assert step.tokens == tokens.tolist() and step.num_emitted == [3, 1] and step.confidence is None
    assert none is None and seven == [7] and also_none is None
    assert step.logprobs.logprob == lp.logprob.tolist()  # float32 values, bit for bit
    assert step.logprobs.top_ids == lp.top_ids.tolist() and isinstance(step.logprobs.rank[0][0], int)
    rows = logprobs.rows(step.logprobs)  # per row: (logprob [E], rank [E], top [E][M], ids [E][M])
    assert len(rows) == 2 and [len(x) for x in rows[1]] == [3, 3, 3, 3] and len(rows[1][2][0]) == 2


def test_dicts_are_vllms_per_position_dicts():
    row = ([-0.5, -1.0], [2, 1], [[-0.1, -0.5], [-1.0, -2.0]], [[9, 4], [7, 8]])
    got = logprobs.dicts([4, 7], row, 1, logprobs.Decoder(None))
    assert got == [{4: Logprob(-0.5, 2, None), 9: Logprob(-0.1, 1, None)}, {7: Logprob(-1.0, 1, None)}]
