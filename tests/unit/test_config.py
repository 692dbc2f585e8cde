"""funcspec.config: vLLM speculative_config parsing, validation, K tables and sampling params.

The guide's ``LLM(...)`` examples appear here as dicts, with hub names replaced
by local directories.
"""

import copy
import dataclasses
import json

import pytest

from funcspec.config import DynamicSpecConfig, RejectionSamplerConfig, SamplingParams, SpecConfig, rules


@pytest.fixture
def draft(tmp_path):
    """A local directory standing in for a hub draft model."""
    path = tmp_path / "draft"
    path.mkdir()
    return str(path)


# ----------------------------------------------------------------------------- guide examples


def test_guide_ngram():
    cfg = SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    assert (cfg.method, cfg.num_speculative_tokens) == ("ngram", 5)
    # vLLM copies the given bound into the missing one.
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    assert cfg.model is None and cfg.verifier_method == "standard" and cfg.ignored_keys == ()


def test_guide_eagle(draft):
    cfg = SpecConfig.from_vllm(
        {"method": "eagle", "model": draft, "draft_tensor_parallel_size": 1, "num_speculative_tokens": 2}
    )
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("eagle", draft, 2)
    assert cfg.prompt_lookup_min is None and cfg.prompt_lookup_max is None
    assert cfg.ignored_keys == () and cfg.draft_tensor_parallel_size == 1  # 1: replicated, as everywhere


def test_guide_eagle3_common_example(draft):
    cfg = SpecConfig.from_vllm({"method": "eagle3", "model": draft, "num_speculative_tokens": 3})
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("eagle3", draft, 3)


def test_guide_mtp():
    cfg = SpecConfig.from_vllm({"method": "mtp", "num_speculative_tokens": 2, "disable_padded_drafter_batch": False})
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("mtp", None, 2)
    assert cfg.ignored_keys == ("speculative_config.disable_padded_drafter_batch",)


def test_guide_dflash(draft):
    cfg = SpecConfig.from_vllm({"method": "dflash", "model": draft, "num_speculative_tokens": 7})
    assert (cfg.method, cfg.num_speculative_tokens) == ("dflash", 7)


def test_guide_dspark(draft):
    cfg = SpecConfig.from_vllm(
        {"method": "dspark", "model": draft, "num_speculative_tokens": 7, "enforce_eager": True}
    )
    assert (cfg.method, cfg.num_speculative_tokens) == ("dspark", 7)
    # The draft runs inside the target's step graph: LLM(enforce_eager=...) picks its backend.
    assert cfg.ignored_keys == ("speculative_config.enforce_eager",)


def test_guide_suffix():
    cfg = SpecConfig.from_vllm({"method": "suffix", "num_speculative_tokens": 15})
    assert (cfg.method, cfg.num_speculative_tokens) == ("suffix", 15)
    assert (cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests) == (24, 10000)
    assert (cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob) == (1.0, 0.1)


def test_suffix_k_defaults_to_tree_depth():
    assert SpecConfig.from_vllm({"method": "suffix"}).num_speculative_tokens == 24
    cfg = SpecConfig.from_vllm({"method": "suffix", "suffix_decoding_max_tree_depth": 12})
    assert (cfg.num_speculative_tokens, cfg.suffix_decoding_max_tree_depth) == (12, 12)


def test_guide_extract_hidden_states():
    cfg = SpecConfig.from_vllm(
        {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 18, 34]}},
        }
    )
    assert (cfg.method, cfg.num_speculative_tokens, cfg.model) == ("extract_hidden_states", 1, None)
    assert cfg.eagle_aux_hidden_state_layer_ids == (2, 18, 34)
    assert cfg.ignored_keys == ()


def test_guide_dynamic_dspark(draft):
    cfg = SpecConfig.from_vllm(
        {"method": "dspark", "model": draft, "num_speculative_tokens": 7},
        additional_config={
            "dynamic_spec_config": {
                "method": "dspark",
                "method_params": {
                    "initial_verify_budget_per_req": 5,
                    "budget_update_interval": 50,
                    "budget_threshold": 0.7,
                },
            }
        },
    )
    assert cfg.dynamic_spec == DynamicSpecConfig(
        method="dspark", initial_verify_budget_per_req=5, budget_update_interval=50,
        budget_threshold=0.7, min_verify_tokens=1,
    )


def test_dynamic_spec_defaults_match_vllm_ascend():
    assert DynamicSpecConfig.from_dict({"method": "dflash"}) == DynamicSpecConfig(
        method="dflash", initial_verify_budget_per_req=5, budget_update_interval=16,
        budget_threshold=0.3, min_verify_tokens=1,
    )
    # vLLM-Ascend: no method means the feature is off.
    assert DynamicSpecConfig.from_dict({}) is None and DynamicSpecConfig.from_dict(None) is None


GUIDE_EAGLE_TABLE = [[1, 64, 3], [65, 128, 1], [129, 512, 0]]
GUIDE_EAGLE3_TABLE = [[1, 16, 5], [17, 32, 4], [33, 64, 3], [65, 128, 1], [129, 512, 0]]


def test_guide_dynamic_sd_eagle(draft):
    cfg = SpecConfig.from_vllm(
        {"method": "eagle", "model": draft, "num_speculative_tokens": 3,
         "num_speculative_tokens_per_batch_size": GUIDE_EAGLE_TABLE}
    )
    assert cfg.num_speculative_tokens_per_batch_size == ((1, 64, 3), (65, 128, 1), (129, 512, 0))
    lookups = {1: 3, 64: 3, 65: 1, 128: 1, 129: 0, 512: 0, 600: 0}
    assert {bs: cfg.k_for_batch_size(bs) for bs in lookups} == lookups


def test_guide_dynamic_sd_eagle3_clamps_to_num_speculative_tokens(draft):
    capped = r"entries \[\[1, 16, 5\], \[17, 32, 4\]\] ask for more drafts than " \
             r"speculative_config.num_speculative_tokens=3: they run with K=3"
    with pytest.warns(UserWarning, match=capped):  # vLLM caps them without a word
        cfg = SpecConfig.from_vllm(
            {"method": "eagle3", "model": draft, "num_speculative_tokens": 3,
             "num_speculative_tokens_per_batch_size": GUIDE_EAGLE3_TABLE}
        )
    # The table asks for 5 and 4 at low concurrency; K never exceeds num_speculative_tokens.
    lookups = {1: 3, 16: 3, 17: 3, 32: 3, 33: 3, 64: 3, 65: 1, 128: 1, 129: 0, 512: 0}
    assert {bs: cfg.k_for_batch_size(bs) for bs in lookups} == lookups


def test_guide_block_and_entropy_verify():
    cfg = SpecConfig.from_vllm(
        {"method": "ngram", "num_speculative_tokens": 5},
        additional_config={
            "rejection_sampler_config": {
                "enable_block_verify": True, "enable_entropy_verify": True,
                "posterior_threshold": 0.95, "posterior_alpha": 0.4,
            }
        },
    )
    assert cfg.rejection_sampler == RejectionSamplerConfig(True, True, 0.95, 0.4)
    assert (cfg.verifier_method, cfg.verify_entropy) == ("magicmtp", True)


def test_guide_synthetic(draft):
    cfg = SpecConfig.from_vllm(
        {"method": "eagle3", "model": draft, "num_speculative_tokens": 3,
         "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.9, 0.6, 0.3]}
    )
    assert cfg.synthetic_acceptance_rates == (0.9, 0.6, 0.3)
    assert cfg.verifier_method == "synthetic"


def test_newer_guide_adaptive_verification_and_draft_window(draft):
    cfg = SpecConfig.from_vllm(
        {"method": "dspark", "model": draft, "num_speculative_tokens": 7, "enable_adaptive_verification": True},
        additional_config={"draft_window_size": 1024},
    )
    assert cfg.draft_window_size == 1024
    assert cfg.ignored_keys == ("speculative_config.enable_adaptive_verification",)


def test_draft_window_forced_off_for_mtp():
    cfg = SpecConfig.from_vllm({"method": "mtp", "num_speculative_tokens": 1}, {"draft_window_size": 512})
    assert cfg.draft_window_size is None
    assert cfg.ignored_keys == ("additional_config.draft_window_size",)


def test_cli_json_strings_are_accepted():
    cfg = SpecConfig.from_vllm(
        json.dumps({"method": "ngram", "num_speculative_tokens": 3}),
        '{"rejection_sampler_config": {"enable_entropy_verify": true}}',
    )
    assert (cfg.num_speculative_tokens, cfg.verifier_method) == (3, "entropy")


# ----------------------------------------------------------------------------- vLLM semantics


def test_ngram_defaults_when_no_bounds_given():
    cfg = SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    cfg = SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize("alias", ["[ngram]", "ngram_gpu"])
def test_ngram_aliases(alias):
    assert SpecConfig.from_vllm({"method": alias, "num_speculative_tokens": 3}).method == "ngram"


def test_deprecated_mtp_model_type_alias():
    assert SpecConfig.from_vllm({"method": "deepseek_mtp", "num_speculative_tokens": 1}).method == "mtp"


def test_method_inferred_from_model_like_vllm(tmp_path):
    assert SpecConfig.from_vllm({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    eagle3 = tmp_path / "EAGLE3-LLaMA3.1-Instruct-8B"
    eagle3.mkdir()
    assert SpecConfig.from_vllm({"model": str(eagle3), "num_speculative_tokens": 2}).method == "eagle3"
    plain = tmp_path / "small-llm"
    plain.mkdir()
    assert SpecConfig.from_vllm({"model": str(plain), "num_speculative_tokens": 2}).method == "draft_model"


def test_k_from_draft_n_predict(draft):
    with open(f"{draft}/config.json", "w") as f:
        json.dump({"n_predict": 4}, f)
    assert SpecConfig.from_vllm({"method": "medusa", "model": draft}).num_speculative_tokens == 4


def test_mtp_k_from_num_nextn_predict_layers(draft, tmp_path):
    """vLLM's MTP K, when num_speculative_tokens is absent: the MTP checkpoint's num_nextn_predict_layers (its
    n_predict), read from the draft directory, else from the target's own checkpoint."""
    from funcspec import zoo

    assert SpecConfig.from_vllm({"method": "mtp", "model": str(zoo.model_path("mtp"))}).num_speculative_tokens == 1
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_nextn_predict_layers": 2}))
    assert SpecConfig.from_vllm({"method": "mtp"}, target=str(target)).num_speculative_tokens == 2
    assert SpecConfig.from_vllm({"method": "mtp", "num_speculative_tokens": 3},
                                target=str(target)).num_speculative_tokens == 3  # a given K wins
    with open(f"{draft}/config.json", "w") as f:
        json.dump({"n_predict": 4}, f)  # not an MTP checkpoint's key
    with pytest.raises(ValueError, match=r"^speculative_config.num_speculative_tokens is required for method 'mtp' "
                                         r"\(its checkpoint's config.json gives no num_nextn_predict_layers\)$"):
        SpecConfig.from_vllm({"method": "mtp", "model": draft})
    with pytest.raises(ValueError, match="^speculative_config.num_speculative_tokens is required for method 'mtp'$"):
        SpecConfig.from_vllm({"method": "mtp"})  # no target to read


def test_corrupt_draft_config_json_is_named(draft):
    """A draft config.json that vLLM's fallbacks read (the method from its layout, K from n_predict) and that does
    not parse is an error naming the file, not a guess ("draft_model") or "num_speculative_tokens is required"."""
    with open(f"{draft}/config.json", "w") as f:
        f.write('{"n_predict": 4,')
    for spec in ({"model": draft, "num_speculative_tokens": 2}, {"method": "medusa", "model": draft}):
        with pytest.raises(ValueError, match=rf"^{draft}/config\.json: not valid JSON \("):
            SpecConfig.from_vllm(spec)
    # a given method and K read nothing: the loader names the file when it builds the drafter
    assert SpecConfig.from_vllm({"method": "medusa", "model": draft, "num_speculative_tokens": 2}).model == draft


def test_hub_name_allowed_without_path_check():
    cfg = SpecConfig.from_vllm(
        {"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 2},
        check_paths=False,
    )
    assert cfg.model == "yuhuili/EAGLE-LLaMA3.1-Instruct-8B"


def test_draft_model_is_built(draft):
    cfg = SpecConfig.from_vllm({"method": "draft_model", "model": draft, "num_speculative_tokens": 4})
    assert (cfg.method, cfg.model) == ("draft_model", draft)


def test_no_speculative_config_gives_none():
    assert SpecConfig.from_vllm(None) is None
    with pytest.warns(UserWarning, match=r"\['additional_config.rejection_sampler_config'\] have no effect without "
                                         r"a speculative_config"):
        assert SpecConfig.from_vllm(None, {"rejection_sampler_config": {}}) is None
    # additional_config is still validated.
    with pytest.raises(ValueError, match="posterior_alpha"):
        SpecConfig.from_vllm(None, {"rejection_sampler_config": {"posterior_alpha": -1}})


def test_ignored_keys_are_collected(draft):
    cfg = SpecConfig.from_vllm(
        {"method": "eagle3", "model": draft, "num_speculative_tokens": 3, "quantization": "ascend",
         "max_model_len": 4096, "prompt_lookup_max": 4, "suffix_decoding_max_tree_depth": 8,
         "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2], "foo": 1}}},
        additional_config={"ascend_scheduler_config": {}, "torchair_graph_config": {"enabled": True}},
    )
    assert cfg.eagle_aux_hidden_state_layer_ids == (1, 2)
    assert cfg.prompt_lookup_max is None and cfg.suffix_decoding_max_tree_depth == 24
    assert set(cfg.ignored_keys) == {
        "speculative_config.quantization", "speculative_config.max_model_len",
        "speculative_config.prompt_lookup_max", "speculative_config.suffix_decoding_max_tree_depth",
        "speculative_config.draft_model_config.hf_config.foo",
        "additional_config.ascend_scheduler_config", "additional_config.torchair_graph_config",
    }


@pytest.mark.parametrize(
    ("rejection_sample_method", "rs", "method", "entropy"),
    [
        ("standard", {}, "standard", False),
        ("block", {}, "block", False),
        ("standard", {"enable_block_verify": True}, "magicmtp", False),
        ("standard", {"enable_entropy_verify": True}, "entropy", True),
        ("standard", {"enable_block_verify": True, "enable_entropy_verify": True}, "magicmtp", True),
    ],
)
def test_verifier_method(rejection_sample_method, rs, method, entropy):
    cfg = SpecConfig.from_vllm(
        {"method": "ngram", "num_speculative_tokens": 4, "rejection_sample_method": rejection_sample_method},
        {"rejection_sampler_config": rs},
    )
    assert (cfg.verifier_method, cfg.verify_entropy) == (method, entropy)


def test_synthetic_ignores_entropy_verify():
    cfg = SpecConfig.from_vllm(
        {"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
         "synthetic_acceptance_length": 2.0},
        {"rejection_sampler_config": {"enable_entropy_verify": True}},
    )
    assert (cfg.verifier_method, cfg.verify_entropy) == ("synthetic", False)
    assert cfg.ignored_keys == ("additional_config.rejection_sampler_config.enable_entropy_verify",)


@pytest.mark.parametrize(
    ("length", "k", "rates"),
    [(3.4, 5, (1.0, 1.0, 0.4, 0.0, 0.0)), (1.0, 3, (0.0, 0.0, 0.0)), (4.0, 3, (1.0, 1.0, 1.0)),
     (2.5, 3, (1.0, 0.5, 0.0))],
)
def test_synthetic_length_resolves_to_rates(length, k, rates):
    cfg = SpecConfig.from_vllm(
        {"method": "ngram", "num_speculative_tokens": k, "rejection_sample_method": "synthetic",
         "synthetic_acceptance_length": length}
    )
    assert cfg.synthetic_acceptance_rates == pytest.approx(rates)


# ----------------------------------------------------------------------------- K table


ASCEND_TABLE = [(1, 16, 3), (32, 128, 2), (256, 256, 0)]  # vLLM-Ascend tests/ut/spec_decode/test_dynamic_sd.py


@pytest.mark.parametrize(
    ("bs", "k"),
    [(0, 0), (1, 3), (16, 3), (17, 3), (31, 3), (32, 2), (128, 2), (129, 2), (255, 2), (256, 0), (1000, 0)],
)
def test_vllm_ascend_table_boundaries_and_gaps(bs, k):
    cfg = SpecConfig.from_vllm(
        {"method": "ngram", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": ASCEND_TABLE}
    )
    assert cfg.k_for_batch_size(bs) == k


def test_table_k_is_clamped_and_unsorted_table_is_sorted():
    with pytest.warns(UserWarning, match=r"entries \[\[1, 16, 4\]\] ask for more drafts"):
        cfg = SpecConfig.from_vllm(
            {"method": "ngram", "num_speculative_tokens": 3,
             "num_speculative_tokens_per_batch_size": [[17, 32, 1], [1, 16, 4]]}
        )
    assert cfg.num_speculative_tokens_per_batch_size == ((1, 16, 4), (17, 32, 1))
    assert [cfg.k_for_batch_size(bs) for bs in (1, 16, 17, 99)] == [3, 3, 1, 1]


def test_no_table_gives_num_speculative_tokens():
    cfg = SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 4})
    assert [cfg.k_for_batch_size(bs) for bs in (1, 7, 4096)] == [4, 4, 4]
    with pytest.raises(ValueError, match="bs must be >= 0"):
        cfg.k_for_batch_size(-1)


# ----------------------------------------------------------------------------- bad configs


NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
TABLE = "speculative_config.num_speculative_tokens_per_batch_size"
SYNTH = {"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"}
RS = "additional_config.rejection_sampler_config."
DYN = "additional_config.dynamic_spec_config."

BAD_CONFIGS = [
    # (speculative_config, additional_config, match); "DRAFT" is replaced by a local directory.
    ({"method": "ngram", "num_speculative_tokens": 0}, None,
     r"speculative_config.num_speculative_tokens must be >= 1 for method 'ngram', got 0"),
    ({"method": "ngram"}, None, "speculative_config.num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": True}, None, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, None, "speculative_config.num_speculative_tokens"),
    ({**NGRAM, "num_speculative_token": 3}, None, "speculative_config.num_speculative_token is not a known key"),
    ({"method": "foo", "num_speculative_tokens": 1}, None, "speculative_config.method must be one of"),
    ({"method": "mlp_speculator", "model": "DRAFT", "num_speculative_tokens": 1}, None, "speculative_config.method"),
    ({"method": "eagle-3", "model": "DRAFT", "num_speculative_tokens": 1}, None, "speculative_config.method"),
    ({"num_speculative_tokens": 1}, None, "speculative_config.method is required"),
    ({**NGRAM, "tensor_parallel_size": 1}, None, "speculative_config.tensor_parallel_size"),
    ({**NGRAM, "draft_tensor_parallel_size": 2}, None,
     "speculative_config.draft_tensor_parallel_size=2: only method 'draft_model' shards its drafter"),
    ({**NGRAM, "draft_tensor_parallel_size": 0}, None, "speculative_config.draft_tensor_parallel_size must be >= 1"),
    ({**NGRAM, "use_heterogeneous_vocab": True}, None, "speculative_config.use_heterogeneous_vocab"),
    ({**NGRAM, "draft_sample_method": "beam"}, None, "speculative_config.draft_sample_method"),
    ({**NGRAM, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, None, "speculative_config.prompt_lookup_min"),
    ({**NGRAM, "prompt_lookup_max": 0}, None, "speculative_config.prompt_lookup_max must be >= 1"),
    ({"method": "extract_hidden_states", "num_speculative_tokens": 2}, None,
     "speculative_config.num_speculative_tokens must be exactly 1"),
    ({"method": "eagle", "num_speculative_tokens": 2}, None, "speculative_config.model is required"),
    ({"method": "dspark", "num_speculative_tokens": 7}, None, "speculative_config.model is required"),
    ({"method": "eagle3", "model": "/no/such/draft", "num_speculative_tokens": 2}, None,
     "speculative_config.model '/no/such/draft' does not exist"),
    ({"method": "eagle3", "model": "DRAFT", "num_speculative_tokens": 2, "enable_adaptive_verification": True},
     None, "speculative_config.enable_adaptive_verification"),
    ({"method": "eagle3", "model": "DRAFT", "num_speculative_tokens": 2, "index_share_for_mtp_iteration": True},
     None, "speculative_config.index_share_for_mtp_iteration"),
    # num_speculative_tokens_per_batch_size
    ({**NGRAM, "num_speculative_tokens_per_batch_size": [[2, 16, 3]]}, None, TABLE + " the first .* start at 1"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 16, 3], [16, 32, 2]]}, None, TABLE + ".*non-overlapping"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 16, -1]]}, None, TABLE + " must be >= 0"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": [[8, 4, 1]]}, None, TABLE + ".*start_bs <= end_bs"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 16]]}, None, TABLE + " entries must be"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 16, 1, 4096, 3]]}, None, TABLE + " entries must be"),
    ({**NGRAM, "num_speculative_tokens_per_batch_size": []}, None, TABLE + " must be a non-empty list"),
    ({"method": "suffix", "num_speculative_tokens_per_batch_size": [[1, 8, 2]]}, None, TABLE + " is not supported"),
    # synthetic
    ({**SYNTH, "synthetic_acceptance_rates": [0.9, 0.6, 0.3], "synthetic_acceptance_length": 2.0}, None,
     "synthetic_acceptance_rates or synthetic_acceptance_length"),
    (SYNTH, None, "synthetic_acceptance_rates or synthetic_acceptance_length"),
    ({**SYNTH, "synthetic_acceptance_rates": [0.9, 0.6]}, None, "speculative_config.synthetic_acceptance_rates"),
    ({**SYNTH, "synthetic_acceptance_rates": [0.5, 0.6, 0.3]}, None, "synthetic_acceptance_rates must be non-incr"),
    ({**SYNTH, "synthetic_acceptance_rates": [1.2, 0.6, 0.3]}, None, "synthetic_acceptance_rates"),
    ({**SYNTH, "synthetic_acceptance_rates": [None, 0.6, 0.3]}, None, "synthetic_acceptance_rates"),
    ({**SYNTH, "synthetic_acceptance_length": 5.0}, None, "synthetic_acceptance_length"),
    ({**SYNTH, "synthetic_acceptance_length": "2"}, None, "synthetic_acceptance_length"),
    ({**NGRAM, "synthetic_acceptance_rates": [0.9, 0.6, 0.3, 0.1]}, None, "synthetic_acceptance_rates"),
    ({**SYNTH, "synthetic_acceptance_length": 2.0}, {"rejection_sampler_config": {"enable_block_verify": True}},
     RS + "enable_block_verify cannot be combined"),
    ({**NGRAM, "rejection_sample_method": "block"}, {"rejection_sampler_config": {"enable_block_verify": True}},
     RS + "enable_block_verify cannot be combined"),
    ({**NGRAM, "rejection_sample_method": "block"}, {"rejection_sampler_config": {"enable_entropy_verify": True}},
     RS + "enable_entropy_verify cannot be combined"),
    ({**NGRAM, "rejection_sample_method": "typical"}, None, "speculative_config.rejection_sample_method"),
    # suffix
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, None, "speculative_config.suffix_decoding_max_tree"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, None, "suffix_decoding_max_cached_requests"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": -0.5}, None, "suffix_decoding_max_spec_factor"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, None, "suffix_decoding_min_token_prob"),
    # draft_model_config
    ({"method": "extract_hidden_states", "num_speculative_tokens": 1,
      "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 2]}}}, None,
     "draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids"),
    ({"method": "extract_hidden_states", "num_speculative_tokens": 1,
      "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [-1]}}}, None,
     "eagle_aux_hidden_state_layer_ids must be >= 0"),
    ({"method": "extract_hidden_states", "num_speculative_tokens": 1,
      "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": []}}}, None,
     "eagle_aux_hidden_state_layer_ids must be a non-empty list"),
    # additional_config
    (NGRAM, {"rejection_sampler_config": {"posterior_threshold": 0}}, RS + r"posterior_threshold must be in \(0, 1\]"),
    (NGRAM, {"rejection_sampler_config": {"posterior_threshold": 1.5}}, RS + "posterior_threshold"),
    (NGRAM, {"rejection_sampler_config": {"posterior_alpha": -0.1}}, RS + "posterior_alpha must be >= 0"),
    (NGRAM, {"rejection_sampler_config": {"enable_block_verify": "yes"}}, RS + "enable_block_verify must be a bool"),
    (NGRAM, {"rejection_sampler_config": {"posterior_thresold": 0.9}}, RS + "posterior_thresold is not a known key"),
    ({"method": "dspark", "model": "DRAFT", "num_speculative_tokens": 7}, {"dynamic_spec_config": {"method": "dflash"}},
     DYN + "method must equal speculative_config.method"),
    (NGRAM, {"dynamic_spec_config": {"method": "ngram"}}, DYN + "method must be one of"),
    ({"method": "dflash", "model": "DRAFT", "num_speculative_tokens": 7},
     {"dynamic_spec_config": {"method": "dflash", "method_params": {"budget_threshold": 0}}},
     DYN + "method_params.budget_threshold"),
    ({"method": "dflash", "model": "DRAFT", "num_speculative_tokens": 7},
     {"dynamic_spec_config": {"method": "dflash", "method_params": {"budget_update_interval": 0}}},
     DYN + "method_params.budget_update_interval must be >= 1"),
    ({"method": "dflash", "model": "DRAFT", "num_speculative_tokens": 7},
     {"dynamic_spec_config": {"method": "dflash", "method_params": {"initial_verify_budget_per_req": 0}}},
     DYN + "method_params.initial_verify_budget_per_req"),
    ({"method": "dflash", "model": "DRAFT", "num_speculative_tokens": 7},
     {"dynamic_spec_config": {"method": "dflash", "method_params": {"min_verify_tokens": 0}}},
     DYN + "method_params.min_verify_tokens must be >= 1"),
    ({"method": "dflash", "model": "DRAFT", "num_speculative_tokens": 3},
     {"dynamic_spec_config": {"method": "dflash", "method_params": {"min_verify_tokens": 4}}},
     DYN + "method_params.min_verify_tokens must be <= speculative_config.num_speculative_tokens"),
    ({"method": "dflash", "model": "DRAFT", "num_speculative_tokens": 7},
     {"dynamic_spec_config": {"method": "dflash", "method_params": {"budget_treshold": 0.5}}},
     DYN + "method_params.budget_treshold is not a known key"),
    ({"method": "dflash", "model": "DRAFT", "num_speculative_tokens": 7},
     {"dynamic_spec_config": {"method": "dflash", "params": {}}}, DYN + "params is not a known key"),
    ({"method": "eagle3", "model": "DRAFT", "num_speculative_tokens": 3}, {"draft_window_size": 0},
     "additional_config.draft_window_size must be >= 1"),
    ({"method": "eagle3", "model": "DRAFT", "num_speculative_tokens": 3}, {"draft_window_size": "512"},
     "additional_config.draft_window_size must be an integer"),
    ([("method", "ngram")], None, "speculative_config must be a dict"),
    ("{method: ngram}", None, "speculative_config is not valid JSON"),
    (NGRAM, [1], "additional_config must be a dict"),
]


@pytest.mark.parametrize(("spec", "additional", "match"), BAD_CONFIGS)
def test_bad_config_names_the_field(draft, spec, additional, match):
    if isinstance(spec, dict) and spec.get("model") == "DRAFT":
        spec = {**spec, "model": draft}
    with pytest.raises(ValueError, match=match):
        SpecConfig.from_vllm(spec, additional)


def test_k_is_bounded_by_the_verify_block(draft):
    """num_speculative_tokens <= 63 for every method: a step verifies K + 1 <= 64 tokens per row, the bound a
    token tree's N + 1 already had (config.tree.MAX_TREE_NODES)."""
    from funcspec.config.tree import MAX_TREE_NODES

    assert MAX_TREE_NODES == 63 and SpecConfig("ngram", 63).num_speculative_tokens == 63
    why = r"a step verifies at most 64 tokens per row \(K \+ 1, as a token tree's N \+ 1\)"
    with pytest.raises(ValueError, match=rf"^speculative_config\.num_speculative_tokens must be <= 63 for method "
                                         rf"'eagle3': {why}, got 500$"):
        SpecConfig.from_vllm({"method": "eagle3", "model": draft, "num_speculative_tokens": 500})
    with pytest.raises(ValueError, match=r"must be <= 63 for method 'ngram'.*, got 64$"):
        SpecConfig("ngram", 64)
    # a K nobody gave says where it came from
    with pytest.raises(ValueError, match=r"must be <= 63 for method 'suffix' \(its default: "
                                         r"suffix_decoding_max_tree_depth\): .*, got 100$"):
        SpecConfig.from_vllm({"method": "suffix", "suffix_decoding_max_tree_depth": 100})
    with open(f"{draft}/config.json", "w") as f:
        json.dump({"n_predict": 80}, f)
    with pytest.raises(ValueError, match=rf"must be <= 63 for method 'medusa' \(from {draft}/config\.json\)"):
        SpecConfig.from_vllm({"method": "medusa", "model": draft})


def test_spec_config_is_resolved_then_built_once():
    """rules.resolve is pure and returns every final field value; SpecConfig sets each field once from it (no
    __post_init__ rewriting a frozen object), positionally or by name, and dataclasses.replace re-resolves."""
    defaults = {f.name: f.default for f in dataclasses.fields(SpecConfig) if f.default is not dataclasses.MISSING}
    given = {**defaults, "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
             "num_speculative_tokens_per_batch_size": [[5, 8, 1], [1, 4, 3]], "ignored_keys": ("a", "b", "a"),
             "suffix_decoding_min_token_prob": 1}
    before = copy.deepcopy(given)
    final = rules.resolve(given)
    assert given == before  # nothing given is changed
    assert (final["prompt_lookup_min"], final["prompt_lookup_max"]) == (4, 4)
    assert final["num_speculative_tokens_per_batch_size"] == ((1, 4, 3), (5, 8, 1))
    assert final["ignored_keys"] == ("a", "b") and type(final["suffix_decoding_min_token_prob"]) is float
    assert rules.resolve(final) == final  # a resolved config resolves to itself
    cfg = SpecConfig(**given)
    assert {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)} == final
    assert not hasattr(SpecConfig, "__post_init__")
    assert SpecConfig("ngram", 3, None, 2) == SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2)
    assert dataclasses.replace(cfg, num_speculative_tokens=2) == SpecConfig(**{**given, "num_speculative_tokens": 2})
    with pytest.raises(TypeError, match=r"^SpecConfig\(\): got an unexpected keyword argument 'k'$"):
        SpecConfig("ngram", 3, k=1)
    with pytest.raises(TypeError, match=r"^SpecConfig\(\): missing a required argument: 'num_speculative_tokens'$"):
        SpecConfig("ngram")


def test_direct_construction_is_validated():
    assert SpecConfig(method="ngram", num_speculative_tokens=3).prompt_lookup_max == 5
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        SpecConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_config.model is not used by method 'ngram'"):
        SpecConfig(method="ngram", num_speculative_tokens=3, model="/tmp")
    with pytest.raises(ValueError, match="additional_config.draft_window_size is not used"):
        SpecConfig(method="ngram", num_speculative_tokens=3, draft_window_size=64)


def test_a_field_of_another_methods_group_is_refused_before_its_value_is_judged(draft):
    """rules.check_owners reads the registry's option groups: one message names the field, the method and the
    methods that take it, and comes before the field's own value checks (a bad value of an unused option is
    still an unused option)."""
    with pytest.raises(ValueError, match=r"^speculative_config\.prompt_lookup_min is not used by method 'eagle' "
                                         r"\(only by method 'ngram'\)$"):
        SpecConfig("eagle", 2, model=draft, prompt_lookup_min=0)
    with pytest.raises(ValueError, match=r"^additional_config\.draft_window_size is not used by method 'mtp' \(only "
                                         r"by methods \['draft_model', 'eagle', 'eagle3', 'dflash', 'dspark'\]\)$"):
        SpecConfig("mtp", 2, draft_window_size=0)
    with pytest.raises(ValueError, match=r"^speculative_config\.draft_model_config\.hf_config\."
                                         r"eagle_aux_hidden_state_layer_ids is not used by method 'eagle'"):
        SpecConfig("eagle", 2, model=draft, eagle_aux_hidden_state_layer_ids=(2, 2))
    # a dynamic_spec_config for a method without confidence drafts: refused as such, not as a method mismatch
    with pytest.raises(ValueError, match=r"^additional_config\.dynamic_spec_config is not supported with method "
                                         r"'eagle3' \(only with methods \['dflash', 'dspark'\]\)$"):
        SpecConfig.from_vllm({"method": "eagle3", "model": draft, "num_speculative_tokens": 3},
                             {"dynamic_spec_config": {"method": "dflash"}})
    with pytest.raises(ValueError, match=r"^speculative_config\.model is not used by method 'suffix' \(only by "
                                         r"methods \['draft_model', 'medusa', 'mtp', 'eagle', 'eagle3', 'dflash', "
                                         r"'dspark'\]\)$"):
        SpecConfig("suffix", 2, model=draft)


def test_configs_are_frozen_and_hashable():
    a = SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 3,
                              "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 8, 1]]})
    b = SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 3,
                              "num_speculative_tokens_per_batch_size": [(5, 8, 1), (1, 4, 3)]})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_speculative_tokens = 5
    assert hash(SamplingParams(stop=["a"])) == hash(SamplingParams(stop=("a",)))


# ----------------------------------------------------------------------------- backend


def test_aclgraph_limits_query_tokens():
    SpecConfig.from_vllm({"method": "suffix", "num_speculative_tokens": 15}).validate_for_backend("aclgraph")
    cfg = SpecConfig.from_vllm({"method": "suffix"})  # K = 24 from the tree depth
    cfg.validate_for_backend("cudagraph")
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens.*npu_fused_infer_attention"):
        cfg.validate_for_backend("aclgraph")
    with pytest.raises(ValueError, match="backend must be one of"):
        cfg.validate_for_backend("tpu")


# ----------------------------------------------------------------------------- SamplingParams


def test_sampling_params_defaults_match_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (1.0, 1.0, 0, 16, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.min_tokens, p.n) == ((), (), False, 0, 1)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_p) == (1.0, 0.0, 0.0, 0.0)
    assert not p.greedy


def test_sampling_params_normalisation():
    p = SamplingParams(temperature=0, top_k=-1, stop="###", stop_token_ids=[2, 7], max_tokens=None, seed=-3)
    assert (p.temperature, p.top_k, p.stop, p.stop_token_ids, p.max_tokens) == (0.0, 0, ("###",), (2, 7), None)
    assert p.greedy
    assert SamplingParams(stop=["a", "b"], top_k=50).stop == ("a", "b")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.1}, r"SamplingParams.temperature must be in \[0, 3.40282e\+38\], got -0.1"),
        ({"temperature": float("nan")}, "SamplingParams.temperature must be a finite number"),
        ({"top_p": 0.0}, r"SamplingParams.top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, "SamplingParams.top_p"),
        ({"top_k": -2}, "SamplingParams.top_k must be >= -1"),
        ({"top_k": 1.5}, "SamplingParams.top_k must be an integer"),
        ({"max_tokens": 0}, "SamplingParams.max_tokens must be >= 1"),
        ({"min_tokens": -1}, "SamplingParams.min_tokens must be >= 0"),
        ({"min_tokens": 20, "max_tokens": 10}, "SamplingParams.min_tokens must be <= max_tokens"),
        ({"seed": 1.5}, "SamplingParams.seed"),
        ({"stop": [1]}, "SamplingParams.stop"),
        ({"stop": ""}, "SamplingParams.stop"),
        ({"stop_token_ids": [-1]}, "SamplingParams.stop_token_ids"),
        ({"stop_token_ids": "7"}, "SamplingParams.stop_token_ids"),
        ({"ignore_eos": "yes"}, "SamplingParams.ignore_eos must be a bool"),
        ({"n": 0}, "SamplingParams.n must be >= 1"),
        ({"n": 1.5}, "SamplingParams.n must be an integer"),
        ({"logprobs": 21}, "SamplingParams.logprobs must be <= 20"),
        ({"prompt_logprobs": -1}, "SamplingParams.prompt_logprobs must be >= 0"),
        ({"repetition_penalty": 1.1}, "SamplingParams.repetition_penalty=1.1 is not supported"),
        ({"presence_penalty": 0.5}, "SamplingParams.presence_penalty=0.5 is not supported"),
        ({"frequency_penalty": 0.5}, "SamplingParams.frequency_penalty=0.5 is not supported"),
        ({"min_p": 0.1}, "SamplingParams.min_p=0.1 is not supported"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
