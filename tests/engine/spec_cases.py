"""Shared cases of the speculative-decoding tests (test_spec, test_history_trees): repetitive prompts,
greedy params and per-method speculative configs."""

import torch

from funcspec import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Repetitive prompts (code-editing-like), so ngram and suffix find matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        motif = torch.randint(3, 96, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        out.append((motif * 4)[: 4 + (i * 5) % 14])
    return out


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _spec(method, k, draft=None, **extra):
    cfg = {"method": method, "num_speculative_tokens": k, **extra}
    if method == "ngram":
        cfg.update(prompt_lookup_min=1, prompt_lookup_max=3)
    if method == "draft_model":
        cfg["model"] = draft
    return cfg


def assert_captured_lossless(target, spec, prompts, want, warm: int, **engine) -> "Engine":
    """A lazily captured inductor engine on bucket (4, K) of ``target`` (with ``engine``'s further arguments): its
    greedy tokens equal ``want``, the prompts after the first ``warm`` under ``fail_on_recompile``, and nothing
    recompiled; returns the engine."""
    from funcspec import Engine

    eng = Engine(target, speculative_config=spec, backend="inductor", max_batch_size=4, batch_buckets=[4],
                 max_model_len=96, capture="lazy", **engine)
    assert _ids(eng.generate(prompts[:warm], GREEDY)) == want[:warm]
    with torch.compiler.set_stance("fail_on_recompile"):
        assert _ids(eng.generate(prompts[warm:], GREEDY)) == want[warm:]
    assert eng.stats["recompiles"] == 0
    return eng
