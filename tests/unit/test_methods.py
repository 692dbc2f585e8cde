"""funcspec.methods: the one method registry, and the lists that derive from it."""

import importlib
import subprocess
import sys

import pytest

from funcspec import config, methods, zoo
from funcspec.config import METHOD_ALIASES, SpecConfig

OUT_OF_SCOPE = set(methods.select(supported=False))


def test_config_accepts_exactly_the_supported_rows():
    assert OUT_OF_SCOPE == {"mlp_speculator", "custom_class"}
    assert config.VLLM_METHODS == set(methods.METHODS) - OUT_OF_SCOPE
    assert set(config.DYNAMIC_SPEC_METHODS) == {"dflash", "dspark"}


@pytest.mark.parametrize("name", sorted(OUT_OF_SCOPE))
def test_out_of_scope_rows_are_refused_by_name(name):
    with pytest.raises(ValueError, match=f"method '{name}' is a vLLM method that funcspec does not implement"):
        SpecConfig.from_vllm({"method": name, "num_speculative_tokens": 1})


def test_aliases_point_at_supported_rows():
    assert set(METHOD_ALIASES.values()) <= config.VLLM_METHODS
    assert not set(METHOD_ALIASES) & set(methods.METHODS)


def test_proposers_zoo_and_train_derive_from_the_registry():
    from funcspec import train
    from funcspec.proposers import PROPOSERS

    assert PROPOSERS == {m.name: m.proposer for m in methods.METHODS.values() if m.proposer}
    assert set(PROPOSERS) == config.VLLM_METHODS - {"extract_hidden_states"}
    assert zoo.HEAD_METHODS == methods.select(zoo=True)
    assert train.ROLES == ("target",) + zoo.HEAD_METHODS
    assert set(zoo.HEAD_METHODS) <= set(PROPOSERS)


@pytest.mark.parametrize("name", sorted(methods.proposer_modules()))
def test_every_proposer_module_has_the_protocol(name):
    row = methods.METHODS[name]
    module = importlib.import_module(row.proposer)
    for fn in ("build", "init_state", "propose", "commit", "prefill", "hidden_layers"):
        assert callable(getattr(module, fn, None)), f"{row.proposer}.{fn}"
    assert module.runs_on_host is row.host


def test_head_rows_are_the_methods_init_draft_head_writes():
    heads = {m.name: (m.head, dict(m.head_args)) for m in methods.METHODS.values() if m.head is not None}
    assert heads == {"medusa": ("medusa", {}), "eagle": ("eagle", {"version": 1}), "eagle3": ("eagle", {"version": 3}),
                     "mtp": ("mtp", {}), "dflash": ("dflash", {"method": "dflash"}),
                     "dspark": ("dflash", {"method": "dspark"})}
    assert all(m.head is not None or not m.head_args for m in methods.METHODS.values())


def test_model_need_matches_spec_config(tmp_path):
    """A required model is refused when missing, a model-free method refuses one, mtp takes either."""
    for m in methods.METHODS.values():
        if not m.supported:
            continue
        k = 1 if not m.speculates else 2
        if m.model == methods.REQUIRED:
            with pytest.raises(ValueError, match="model is required"):
                SpecConfig(m.name, k)
        elif m.model == methods.NONE:
            with pytest.raises(ValueError, match="model is not used"):
                SpecConfig(m.name, k, model=str(tmp_path))
        else:
            assert SpecConfig(m.name, k).model is None
            assert SpecConfig(m.name, k, model=str(tmp_path)).model == str(tmp_path)


def test_lookup_and_select():
    assert methods.lookup("eagle3").aux_layers and methods.lookup("eagle3").head == "eagle"
    assert methods.lookup("nope") == methods.Method("nope")
    assert methods.select(host=True) == ("suffix",)
    with pytest.raises(ValueError, match="select"):
        methods.select(colour="red")
    with pytest.raises(ValueError, match="Method.model"):
        methods.Method("x", model="maybe")


def test_registry_imports_nothing_heavy():
    # Importing funcspec.methods runs funcspec/__init__ (which loads torch), so run the file alone.
    code = f"import sys, runpy; runpy.run_path({methods.__file__!r}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
