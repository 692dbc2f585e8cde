"""extract_hidden_states: the guide's example runs and the saved states equal the target's layers."""

import pytest
import torch
from safetensors import safe_open

import funcspec
from conftest import make_hf_model
from funcspec import SamplingParams


def test_guide_example_saves_target_hidden_states(tmp_path):
    hf = make_hf_model(tmp_path / "target", num_hidden_layers=4)
    llm = funcspec.LLM(
        model=str(tmp_path / "target"),
        tensor_parallel_size=1,
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}},
        kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "hs")}},
        compilation_config={"capture": "lazy"},  # not in the guide: this test reads hidden states, not capture
    )
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1))
    for prompt, out in zip(prompts, outputs):
        assert len(out.outputs[0].token_ids) == 1
        path = out.kv_transfer_params.get("hidden_states_path")
        with safe_open(path, "pt") as f:
            token_ids, hidden = f.get_tensor("token_ids"), f.get_tensor("hidden_states")
        assert token_ids.tolist() == prompt
        assert hidden.shape == (len(prompt), 3, 32)  # [num_tokens, num_layers, hidden_size]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        for j, layer in enumerate([1, 2, 4]):
            torch.testing.assert_close(hidden[:, j], ref[layer][0], atol=1e-5, rtol=0)


def test_extract_needs_its_connector(tiny_llama, tmp_path):
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1]}}}
    with pytest.raises(ValueError, match="kv_transfer_config"):
        funcspec.LLM(model=tiny_llama, speculative_config=spec)
    bad = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer"}
    with pytest.raises(ValueError, match="kv_transfer_config.kv_connector"):
        funcspec.LLM(model=tiny_llama, speculative_config=spec, kv_transfer_config=bad)
    far = dict(spec, draft_model_config={"hf_config": {"eagle_aux_hidden_state_layer_ids": [9]}})
    good = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids: \[9\]"):
        funcspec.LLM(model=tiny_llama, speculative_config=far, kv_transfer_config=good)


def test_a_restarted_engine_never_overwrites_earlier_files(tiny_llama, tmp_path):
    """Request ids start over in every process; a part drawn once per engine keeps the file names apart."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1]}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    paths = []
    for _ in range(2):  # a server and its restart
        llm = funcspec.LLM(model=tiny_llama, speculative_config=spec, kv_transfer_config=kv, enforce_eager=True)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1))[0]
        paths.append(out.kv_transfer_params["hidden_states_path"])
        assert paths[-1].startswith(str(tmp_path / f"{out.request_id}-"))
    assert paths[0] != paths[1] and sorted(str(p) for p in tmp_path.iterdir()) == sorted(paths)
