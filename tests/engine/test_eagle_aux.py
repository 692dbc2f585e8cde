"""EAGLE-3 auxiliary layers: new heads work on any target depth; loaded ones follow vLLM's default."""

import json

import pytest

from funcspec import Engine, SamplingParams
from funcspec.checkpoints import init_draft_head, load_model
from funcspec.checkpoints import eagle
from conftest import make_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_default_is_vllms_clamped():
    assert eagle.default_aux_layers(32) == (2, 16, 29)
    assert eagle.default_aux_layers(4) == (2, 2, 1)
    assert eagle.default_aux_layers(2) == (1, 1, 0)


@pytest.mark.parametrize("layers, want", [(1, (0,)), (2, (0, 1)), (3, (0, 1, 2)), (4, (0, 2, 3)), (6, (0, 2, 5)),
                                          (7, (2, 3, 4)), (32, (2, 16, 29))])
def test_new_heads_spread_distinct_layers(layers, want):
    assert eagle.spread_aux_layers(layers) == want


@pytest.mark.parametrize("layers", [1, 4])
def test_init_draft_head_gives_a_usable_eagle3_head_on_any_depth(tmp_path, layers):
    """A fresh head on a shallow target writes its aux ids and drafts losslessly."""
    target = tmp_path / "target"
    make_hf_model(target, num_hidden_layers=layers)
    head = init_draft_head("eagle3", str(target), tmp_path / "head")
    ids = json.loads((head / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    assert tuple(ids) == eagle.spread_aux_layers(layers)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    ar = [o.outputs[0].token_ids for o in Engine(str(target), max_num_seqs=2,
                                                 enforce_eager=True).generate(prompts, GREEDY)]
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    eng = Engine(str(target), speculative_config=spec, max_num_seqs=2, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in eng.generate(prompts, GREEDY)] == ar


def test_loaded_head_without_ids_on_a_small_target_says_how_to_set_them(tmp_path):
    target = tmp_path / "target"
    make_hf_model(target, num_hidden_layers=4)
    hf, _ = eagle.init_params(load_model(str(target)).cfg, version=3)
    del hf["eagle_aux_hidden_state_layer_ids"]
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids .*got \[1, 2, 2\].*e\.g\. \[0, 2, 3\]"):
        eagle.aux_layers(hf, 4)
