"""N-gram proposer: the tensor version against a plain-Python mirror of vLLM's KMP search."""

from __future__ import annotations

import random

import pytest
import torch

from funcspec.proposers.ngram import ngram_propose
from funcspec.types import PLACEHOLDER


def ngram_reference(tokens: list[int], k: int, n_min: int, n_max: int, max_model_len: int | None = None) -> list[int]:
    """Mirror of vLLM's ``_find_longest_matched_ngram_and_propose_tokens``: KMP on the reversed tokens.

    In the reversed list ``rev`` the suffix n-gram becomes a prefix, so the KMP state at
    ``i`` is the longest prefix of ``rev`` (capped at n_max) ending at ``i``. A later ``i``
    in ``rev`` is an earlier start in ``tokens``, and ``>=`` makes the earliest one win ties.
    """
    n = len(tokens)
    if n < n_min:
        return []
    if max_model_len is not None:
        k = min(k, max_model_len - n)
    if k <= 0:
        return []
    rev = tokens[::-1]
    border = [0] * n_max  # border[j]: longest proper border of rev[: j + 1], j < n_max
    best_len, best_end = 0, 0
    state, i = 0, 1
    while i < n:
        if rev[i] == rev[state]:
            state += 1
            if state >= best_len:
                best_len, best_end = state, i
            if i < n_max:
                border[i] = state
            if state == n_max:  # never match beyond n_max: fall back as after a full match
                state = border[n_max - 1]
            i += 1
        elif state:
            state = border[state - 1]
        else:
            i += 1
    if best_len < n_min:
        return []
    start = n - 1 - best_end + best_len  # first token after the match, in `tokens`
    return tokens[start : start + min(k, n - start)]


def brute_force(tokens: list[int], k: int, n_min: int, n_max: int, max_model_len: int | None = None) -> list[int]:
    """The stated semantics, written the obvious way, to cross-check the KMP mirror."""
    size = len(tokens)
    cap = k if max_model_len is None else min(k, max_model_len - size)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        for s in range(size - n):  # starts before the suffix itself
            if tokens[s : s + n] == tokens[size - n :]:
                return tokens[s + n : s + n + max(cap, 0)]
    return []


def run_rows(rows: list[list[int]], k, n_min, n_max, max_model_len=None, T=None, fn=ngram_propose, garbage=99):
    """Pack rows into [B, T] with garbage after each row's end, run ``fn``, return python lists."""
    T = T or max(1, max(map(len, rows)))
    history = torch.full((len(rows), T), garbage, dtype=torch.int64)  # [B, T]
    for b, row in enumerate(rows):
        history[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int64)  # [B]
    drafts, num_valid = fn(history, lens, k, n_min, n_max, max_model_len)
    assert drafts.shape == (len(rows), k) and drafts.dtype == torch.int64
    assert num_valid.shape == (len(rows),) and num_valid.dtype == torch.int64
    out = []
    for b in range(len(rows)):
        nv = int(num_valid[b])
        assert drafts[b, nv:].eq(PLACEHOLDER).all(), "padding after the valid drafts must be PLACEHOLDER"
        out.append(drafts[b, :nv].tolist())
    return out


def random_rows(rng: random.Random, B: int, T: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(0, T))] for _ in range(B)]


# --- the references agree with each other and with vLLM's documented example ---------------


def test_reference_docstring_example():
    # vLLM's docstring: [1,2,3,4,2,3], min 2, max 3, k 4 -> [4,2,3] (only 3 tokens follow).
    assert ngram_reference([1, 2, 3, 4, 2, 3], 4, 2, 3) == [4, 2, 3]


def test_kmp_reference_equals_brute_force():
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.randint(2, 5)) for _ in range(rng.randint(0, 30))]
        n_min = rng.randint(1, 4)
        n_max = rng.randint(n_min, 6)
        k = rng.choice([1, 3, 5])
        mml = rng.choice([None, len(tokens) + rng.randint(-2, 4)])
        assert ngram_reference(tokens, k, n_min, n_max, mml) == brute_force(tokens, k, n_min, n_max, mml)


# --- tensor version == reference ------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("n_min,n_max", [(1, 1), (1, 3), (2, 2), (2, 5), (3, 4), (4, 4)])
def test_matches_reference_random(k, n_min, n_max):
    rng = random.Random(1000 * k + 10 * n_min + n_max)
    for _ in range(40):
        T = rng.randint(1, 40)
        rows = random_rows(rng, rng.randint(1, 6), T, rng.randint(3, 6))
        lens = [len(r) for r in rows]
        mml = rng.choice([None, None, rng.randint(min(lens), T + 3)])
        got = run_rows(rows, k, n_min, n_max, mml, T=T, garbage=rng.randrange(3))
        want = [ngram_reference(r, k, n_min, n_max, mml) for r in rows]
        assert got == want, (rows, k, n_min, n_max, mml)


def test_matches_reference_long_rows():
    rng = random.Random(7)
    T = 3000
    rows = [[rng.randrange(5) for _ in range(rng.randint(T - 300, T))] for _ in range(16)]
    rows[3] = rows[3][:2]  # one short row among long ones
    assert run_rows(rows, 5, 2, 6, T=T) == [ngram_reference(r, 5, 2, 6) for r in rows]


# --- hand-made cases -------------------------------------------------------------------------


def test_longest_beats_shorter():
    # "2" alone first occurs at 0 (-> 8), but "1 2" occurs at 2 and is longer (-> 9 1 2).
    assert run_rows([[2, 8, 1, 2, 9, 1, 2]], 3, 1, 3) == [[9, 1, 2]]


def test_earliest_occurrence_wins_ties():
    # "1 2" occurs at 0 and at 3; the earliest (followed by 5) wins.
    assert run_rows([[1, 2, 5, 1, 2, 6, 1, 2]], 2, 2, 2) == [[5, 1]]


def test_no_match_is_all_placeholder():
    tokens = [[1, 2, 3, 4], [1], []]
    history = torch.tensor([[1, 2, 3, 4], [1, 0, 0, 0], [0, 0, 0, 0]])  # [B, T]
    drafts, num_valid = ngram_propose(history, torch.tensor([4, 1, 0]), 3, 1, 3)
    assert drafts.eq(PLACEHOLDER).all() and num_valid.tolist() == [0, 0, 0]
    assert run_rows(tokens, 3, 1, 3) == [[], [], []]


def test_short_continuation_padded_and_runs_into_suffix():
    # "1 2" matches at 0; the continuation 3 1 2 reads into the suffix and ends at lens.
    history = torch.tensor([[1, 2, 3, 1, 2, 8, 8, 8]])  # [1, T]; 8s are garbage
    drafts, num_valid = ngram_propose(history, torch.tensor([5]), 5, 2, 2)
    assert drafts.tolist() == [[3, 1, 2, PLACEHOLDER, PLACEHOLDER]] and num_valid.tolist() == [3]


def test_overlapping_occurrence_counts_but_suffix_itself_does_not():
    assert run_rows([[7, 7, 7, 7]], 3, 1, 3) == [[7]]  # "7 7 7" at start 0, overlapping the suffix
    assert run_rows([[7, 7, 7, 7]], 3, 4, 4) == [[]]  # the whole row is the suffix itself


def test_n_max_caps_the_match_length():
    # With n_max=2 only "1 2" is compared, whose earliest occurrence is at 0 (-> 5), even
    # though the 3-gram "9 1 2" occurs later (-> 6).
    row = [1, 2, 5, 9, 1, 2, 6, 9, 1, 2]
    assert run_rows([row], 1, 1, 2) == [[5]]
    assert run_rows([row], 1, 1, 3) == [[6]]


def test_max_model_len_caps_drafts():
    row = [1, 2, 3, 1, 2]
    assert run_rows([row], 5, 2, 2, max_model_len=7) == [[3, 1]]
    assert run_rows([row], 5, 2, 2, max_model_len=6) == [[3]]
    assert run_rows([row], 5, 2, 2, max_model_len=5) == [[]]


def test_garbage_after_lens_is_ignored():
    rows = [[3, 1, 3, 1, 3], [2, 2]]
    assert run_rows(rows, 3, 1, 3, T=12, garbage=3) == run_rows(rows, 3, 1, 3, T=12, garbage=1)


def test_rejects_bad_ngram_bounds():
    history, lens = torch.zeros(1, 4, dtype=torch.int64), torch.tensor([4])
    with pytest.raises(ValueError, match="n_min"):
        ngram_propose(history, lens, 3, 0, 2)
    with pytest.raises(ValueError, match="n_max"):
        ngram_propose(history, lens, 3, 3, 2)


# --- captured == eager -----------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_equals_eager():
    k, n_min, n_max, mml, B, T = 3, 1, 4, 60, 4, 64

    def step(history, lens):
        return ngram_propose(history, lens, k, n_min, n_max, mml)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    gen = torch.Generator().manual_seed(0)
    for trial in range(12):
        history = torch.randint(0, 3 + trial % 4, (B, T), generator=gen)  # [B, T]
        lens = torch.randint(0, T + 1, (B,), generator=gen)  # [B]
        want = step(history, lens)
        if trial == 0:
            got = compiled(history, lens)  # the one compile
        else:
            with torch.compiler.set_stance("fail_on_recompile"):
                got = compiled(history, lens)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
