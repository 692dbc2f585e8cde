"""funcspec.config.CompilationConfig: vLLM's compilation_config, with every key funcspec does not read named."""

import pytest

from funcspec.config import CompilationConfig


def test_vllm_import_becomes_funcspec_import():
    """The guide's ``CompilationConfig(cudagraph_mode=...)`` runs as pasted; funcspec's keys sit beside vLLM's."""
    cc = CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY")
    assert (cc.capture, cc.capture_logprobs, cc.compile_cache, cc.cudagraph_capture_sizes) == ("startup", False,
                                                                                              None, None)
    assert cc.ignored == ("compilation_config.cudagraph_mode (funcspec captures each bucket's whole step as one "
                          "static graph)",)
    assert CompilationConfig.from_vllm(cc) is cc
    assert CompilationConfig(cudagraph_capture_sizes=[5, 10]).cudagraph_capture_sizes == (5, 10)


def test_every_key_with_no_effect_is_named_with_why():
    cc = CompilationConfig.from_vllm({"capture": "lazy", "cudagraph_mode": "full", "level": 3,
                                      "inductor_compile_config": {}, "cudagraph_capture_size": [4],
                                      "made_up": 1})
    assert cc.capture == "lazy" and cc.unknown_keys == ("cudagraph_capture_size", "made_up")
    assert cc.ignored == (
        "compilation_config.level (funcspec compiles with its backend (LLM(backend=...), enforce_eager))",
        "compilation_config.cudagraph_mode (funcspec captures each bucket's whole step as one static graph)",
        "compilation_config.inductor_compile_config (funcspec compiles with its backend (LLM(backend=...), "
        "enforce_eager))",
        "compilation_config.cudagraph_capture_size (not a key of vLLM's or funcspec's; did you mean "
        "'cudagraph_capture_sizes'?)",
        "compilation_config.made_up (not a key of vLLM's or funcspec's)")
    assert CompilationConfig.from_vllm(3).ignored[0].startswith("compilation_config.level ")  # vLLM's integer level
    assert CompilationConfig.from_vllm(None) == CompilationConfig() and not CompilationConfig().ignored


@pytest.mark.parametrize(("value", "match"), [
    ([1], r"^compilation_config must be a dict \(or funcspec.config.CompilationConfig, or vLLM's integer level\), "
          r"got list$"),
    ({"cudagraph_mode": "SOMETIMES"}, r"^compilation_config.cudagraph_mode must be one of \['NONE', 'PIECEWISE', "
                                      r"'FULL', 'FULL_DECODE_ONLY', 'FULL_AND_PIECEWISE'\], got 'SOMETIMES'$"),
    ({"mode": 7}, r"^compilation_config.mode must be one of \['NONE', .*\] or 0-3, got 7$"),
    ({"capture": "never"}, r"^compilation_config.capture must be one of \('startup', 'lazy'\), got 'never'$"),
    ({"capture_logprobs": "yes"}, r"^compilation_config.capture_logprobs must be a bool, got 'yes'$"),
    ({"cudagraph_capture_sizes": [0]}, r"^compilation_config.cudagraph_capture_sizes must be a list of integers"),
    ({"batch_sizes": [1, 0]}, r"^compilation_config.batch_sizes must be a list of batch sizes >= 1"),
    ({"batch_sizes": [2], "cudagraph_capture_sizes": [4]},
     r"^compilation_config.batch_sizes and compilation_config.cudagraph_capture_sizes both name the batch buckets"),
])
def test_bad_values_name_the_key(value, match):
    with pytest.raises(ValueError, match=match):
        CompilationConfig.from_vllm(value)


def test_batch_sizes_name_the_buckets_exactly():
    """Under a K table one capture size can name two batch sizes (8 = 2·(3+1) = 4·(1+1)); ``batch_sizes`` names
    the buckets themselves."""
    from funcspec import EngineArgs

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 4, 1]]}
    by_size = EngineArgs(model="m", speculative_config=spec, max_num_seqs=4,
                         compilation_config={"cudagraph_capture_sizes": [8]})
    exact = EngineArgs(model="m", speculative_config=spec, max_num_seqs=4, compilation_config={"batch_sizes": [4]})
    assert (by_size.batch_buckets, exact.batch_buckets) == ([2, 4], [4])
