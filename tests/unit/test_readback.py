"""One readback for the step and the prefill: any pytree of tensors to host lists (off the CPU in one copy), and
the logprobs' host view (funcspec/logprobs.py) on top of it."""

import torch

from funcspec import logprobs
from funcspec.outputs import Logprob
from funcspec.runner import host_copy, readback
from funcspec.step import StepOutput


def test_host_copy_makes_one_copy_and_keeps_each_dtype_and_shape(monkeypatch):
    """Off the CPU, readback's tensors cross in one transfer; each comes back bit for bit in its dtype."""
    calls = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    lp = torch.tensor([[-1e-30, -3.4028235e38, -0.1]])  # float32 values a float64 pack keeps exactly
    ids = torch.tensor([[2 ** 53, -1]])  # int64 ids exact below 2^53
    got = host_copy([lp, None, ids, torch.tensor([7], dtype=torch.int32)])
    assert len(calls) == 1  # one device-to-host copy for every tensor
    assert got[1] is None and [x.dtype for x in (got[0], got[2], got[3])] == [torch.float32, torch.int64, torch.int32]
    assert torch.equal(got[0], lp) and torch.equal(got[2], ids) and got[3].tolist() == [7]


def test_readback_reads_a_pytree_and_keeps_each_dtype(monkeypatch):
    calls = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    logits = torch.randn(2, 3, 5)  # [B, E, V]
    tokens = torch.tensor([[1, 4, 0], [2, 2, 3]])  # [B, E]
    lp = logprobs.token_logprobs(logits, tokens, num_top=2)
    out = StepOutput(tokens, torch.tensor([3, 1], dtype=torch.int32), torch.tensor([2, 2]), None, lp)
    host = readback((out, None, [torch.tensor([7]), None]))
    assert calls == []  # host tensors are read as they lie: nothing to copy
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
