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

    eng = Engine(target, speculative_config=spec, backend="inductor", max_num_seqs=4,
                 compilation_config={"batch_sizes": [4], "capture": "lazy"},
                 max_model_len=96, **engine)
    assert _ids(eng.generate(prompts[:warm], GREEDY)) == want[:warm]
    with torch.compiler.set_stance("fail_on_recompile"):
        assert _ids(eng.generate(prompts[warm:], GREEDY)) == want[warm:]
    assert eng.stats()["recompiles"] == 0
    return eng


def ar_reference(target: str, n: int = 12):
    """``n`` repetitive prompts and their greedy AR outputs on ``target`` (batch 4, 96 positions)."""
    from funcspec import Engine

    prompts = _prompts(n)
    return prompts, _ids(Engine(target, max_num_seqs=4, max_model_len=96,
                                enforce_eager=True).generate(prompts, GREEDY))


def assert_generate_equals_hf(path, hf, new: int, seed: int = 2) -> None:
    """funcspec's greedy tokens for a 9-token prompt on checkpoint ``path`` equal HF ``generate`` on ``hf``."""
    from funcspec import LLM

    prompt = torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        hf.generation_config.eos_token_id = None  # as ignore_eos (min_new_tokens would forbid EOS, not ignore it)
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    out = LLM(str(path), enforce_eager=True, max_model_len=64).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == want[0, len(prompt):].tolist()


def assert_decode_equals_hf(model, hf, tokens, prefill: int, slots, atol: float = 5e-5) -> None:
    """Logits of a prefill of tokens [B, :prefill], then one decode step a token through the model's own cache,
    equal HF's over the whole of tokens [B, T]."""
    from funcspec.nn import forward, init_kv_cache

    b, t = tokens.shape
    kv = init_kv_cache(model.cfg, b, max(32, t))
    got, _, kv = forward(model.cfg, model.params, kv, tokens[:, :prefill], slots, torch.zeros(b, dtype=torch.long))
    steps = [got]
    for i in range(prefill, t):
        step, _, kv = forward(model.cfg, model.params, kv, tokens[:, i:i + 1], slots, torch.full((b,), i))
        steps.append(step)
    with torch.no_grad():
        want = hf(tokens).logits
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=atol, rtol=1e-5)


def random_moe(model_cls, config, seed: int = 0, positive_bias: bool = False):
    """A tiny random HF model in eval mode with wide greedy margins (its matrices scaled by 3), its routers'
    correction bias random (non-negative with ``positive_bias``) so that it changes which experts are chosen, and
    any LayerNorm (DeepSeek-V3.2's indexer) random so that it counts."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0) if p.dim() > 1 else None
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                bias = torch.randn(m.e_score_correction_bias.shape)
                m.e_score_correction_bias.copy_((bias.abs() if positive_bias else bias) * 0.5)
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.2)
    return model
