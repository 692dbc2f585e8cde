"""funcspec.dynamic: the confidence-based verify length (vLLM-Ascend DynamicSpecScheduler), by hand-worked examples."""

import pytest
import torch

from funcspec import dynamic
from funcspec.config import DynamicSpecConfig
from funcspec.step import mask_beyond
from funcspec.types import PLACEHOLDER
from funcspec.verifiers import rejection_sample

# Token confidences t [B=3, D=4]; survival s = cumprod(t):
#   row 0: 0.9   0.8  0.5  0.9   -> 0.9   0.72    0.36     0.324
#   row 1: 0.6   0.4  0.9  0.9   -> 0.6   0.24    0.216    0.1944
#   row 2: 0.95  0.95 0.9  0.2   -> 0.95  0.9025  0.81225  0.16245
T = torch.tensor([[0.9, 0.8, 0.5, 0.9], [0.6, 0.4, 0.9, 0.9], [0.95, 0.95, 0.9, 0.2]])
S = torch.tensor([[0.9, 0.72, 0.36, 0.324], [0.6, 0.24, 0.216, 0.1944], [0.95, 0.9025, 0.81225, 0.16245]])


def cfg(**kw):
    return DynamicSpecConfig(method="dspark", **kw)


def test_survival_is_cumprod():
    torch.testing.assert_close(dynamic.survival(T), S)


def test_budget_worked_examples():
    # #(s >= 0.3) = 4 + 1 + 3 = 8 over 3 rows -> ceil(2.67) = 3 (odd) -> 3.
    assert dynamic.next_budget(S, 0.3, 1, 4) == 3
    # threshold 0.5: 2 + 1 + 3 = 6 -> ceil(2) = 2, even and < D -> 3.
    assert dynamic.next_budget(S, 0.5, 1, 4) == 3
    # threshold 0.9: 1 + 0 + 2 = 3 -> 1 (odd) -> 1; min_k 2 lifts it to 2.
    assert dynamic.next_budget(S, 0.9, 1, 4) == 1 and dynamic.next_budget(S, 0.9, 2, 4) == 2
    # everything survives: k = 4 = D, even but not < D -> stays 4.
    assert dynamic.next_budget(torch.ones(2, 4), 0.3, 1, 4) == 4
    assert dynamic.next_budget(torch.zeros(0, 4), 0.3, 1, 4) is None


def test_initial_budget():
    assert dynamic.initial_budget(cfg(), 4) == 4  # max(1, min(5, 4))
    assert dynamic.initial_budget(cfg(initial_verify_budget_per_req=2), 7) == 2
    assert dynamic.initial_budget(cfg(initial_verify_budget_per_req=1, min_verify_tokens=3), 7) == 3


def test_allocation_worked_example():
    # budget 3, min 1: every row gets 1, and 3·(3-1) = 6 winners among s[:, 1:]:
    #   0.9025 (r2) 0.81225 (r2) 0.72 (r0) 0.36 (r0) 0.324 (r0) 0.24 (r1) | 0.216 0.1944 0.16245
    # -> r0 +3, r1 +1, r2 +2 -> [4, 2, 3]
    assert dynamic.allocate(S, 3, 1).tolist() == [4, 2, 3]
    assert dynamic.allocate(S, torch.tensor(3), 1).tolist() == [4, 2, 3]
    # budget 2: 3 winners: 0.9025, 0.81225 (r2), 0.72 (r0) -> [2, 1, 3]
    assert dynamic.allocate(S, 2, 1).tolist() == [2, 1, 3]
    # budget = min_k: nobody gains; budget D: everyone gets D.
    assert dynamic.allocate(S, 1, 1).tolist() == [1, 1, 1]
    assert dynamic.allocate(S, 4, 1).tolist() == [4, 4, 4]
    assert dynamic.allocate(S, 3, 4).tolist() == [4, 4, 4]


def test_padding_rows_never_win():
    s = torch.cat([S, torch.ones(2, 4)])  # two padding rows with perfect survival
    valid = torch.tensor([True, True, True, False, False])
    assert dynamic.allocate(s, 3, 1, valid).tolist() == [4, 2, 3, 0, 0]
    # a padding row in the middle
    s = torch.stack([S[0], torch.ones(4), S[1], S[2]])
    assert dynamic.allocate(s, 3, 1, torch.tensor([True, False, True, True])).tolist() == [4, 0, 2, 3]


def test_allocation_is_a_bounded_prefix_and_spends_the_budget():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        b, d = 1 + trial % 6, 1 + trial % 7
        s = dynamic.survival(torch.rand(b, d, generator=g))
        for budget in range(1, d + 1):
            for min_k in range(1, d + 1):
                n = dynamic.allocate(s, budget, min_k)
                assert ((n >= min(min_k, d)) & (n <= d)).all()
                if budget >= min_k:
                    assert int(n.sum()) == b * max(budget, min(min_k, d))
                # Every verified position outranks every unverified one past min_k (a global top-k).
                cols = torch.arange(d).view(1, -1)
                kept, dropped = s[cols < n.view(-1, 1)], s[(cols >= n.view(-1, 1))]
                if kept.numel() and dropped.numel() and budget > min_k:
                    assert dropped.max() <= s[(cols < n.view(-1, 1)) & (cols >= min_k)].min()


def test_scheduler_updates_every_interval():
    sched = dynamic.ConfidenceScheduler(cfg(budget_update_interval=2, budget_threshold=0.3), 4)
    assert sched.budget_k == 4
    assert sched.observe(0, T) == 4  # not yet an update step
    assert sched.observe(1, T) == 3  # the 2nd call: survival above gives 3
    assert sched.observe(2, torch.ones(3, 4)) == 3
    assert sched.observe(3, torch.ones(3, 4).tolist()) == 4
    assert sched.observe(5, torch.zeros(0, 4)) == 4  # no rows: keep the budget
    assert sched.budget_tensor().dtype == torch.int64


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_verify_only_their_prefix(temperature):
    """Drafts equal to the target argmax with a confident target: each row emits its verify_len + 1 tokens."""
    b, k, v = 3, 4, 11
    drafts = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 1]])
    logits = torch.full((b, k + 1, v), -30.0)
    targets = torch.cat([drafts, torch.tensor([[0], [1], [2]])], 1)
    logits.scatter_(2, targets.unsqueeze(-1), 30.0)  # p(draft) ~ 1 at every position
    verify_len = dynamic.allocate(S, 3, 1)  # [4, 2, 3]
    tokens, n = rejection_sample(torch.arange(b), logits, mask_beyond(drafts, verify_len), temperature=temperature)
    assert n.tolist() == (verify_len + 1).tolist()
    for row in range(b):
        m = int(verify_len[row])
        # the prefix, then the target's own token at the first unverified position
        assert tokens[row, : m + 1].tolist() == targets[row, : m + 1].tolist()
        assert (tokens[row, m + 1:] == PLACEHOLDER).all()


def test_allocate_captures_without_host_sync():
    fn = torch.compile(lambda s, budget, valid: dynamic.allocate(s, budget, 1, valid), fullgraph=True,
                       dynamic=False, backend="eager")
    valid = torch.tensor([True, True, True, False])
    s = torch.cat([S, torch.ones(1, 4)])
    assert fn(s, torch.tensor(3), valid).tolist() == [4, 2, 3, 0]
    assert fn(s, torch.tensor(2), valid).tolist() == [2, 1, 3, 0]
