"""funcspec.methods: the one method registry, and the lists that derive from it."""

import dataclasses
import importlib
import subprocess
import sys

import pytest

from funcspec import config, methods, zoo
from funcspec.config import METHOD_ALIASES, DynamicSpecConfig, SpecConfig, rules
from funcspec.config.checks import field_path
from funcspec.token_tree import DynamicTree, TokenTree

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
    assert train.ROLES == ("target",) + zoo.HEAD_METHODS + ("moe_target", "moe_eagle3", "mtp_target")
    assert {train.HEADS[m] for m in zoo.HEAD_METHODS} == {(m, "target") for m in zoo.HEAD_METHODS}
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
    # the capability flags are read from the option group, and select takes them too
    assert methods.select(tree=True) == ("ngram", "suffix", "draft_model", "mtp", "eagle", "eagle3")
    assert methods.select(batch_table=False) == ("suffix", "dspark", "extract_hidden_states")
    assert methods.select(aux_layers=True, draft_window=True) == ("eagle3", "dflash", "dspark")
    with pytest.raises(ValueError, match="select"):
        methods.select(colour="red")
    with pytest.raises(ValueError, match="Method.model"):
        methods.Method("x", model="maybe")


# ----------------------------------------------------------------------------- option groups


def test_option_groups_are_the_rows():
    """Each row declares its option group; the fields beyond the general ones, per method."""
    got = {name: set(methods.options_of(name)) for name in sorted(config.VLLM_METHODS)}
    draft, table, trees = set(methods.DRAFT), set(methods.BATCH_TABLE), set(methods.TREES)
    aux_window = set(methods.AUX_LAYERS + methods.DRAFT_WINDOW)
    assert got == {
        "ngram": {"prompt_lookup_min", "prompt_lookup_max"} | table | trees,
        "suffix": set(methods.SUFFIX) | trees,
        "echo": table,
        "draft_model": draft | table | {"draft_window_size", "draft_tensor_parallel_size"} | trees,
        "medusa": draft | table,
        "mtp": draft | table | trees,
        "eagle": draft | table | {"draft_window_size"} | trees,
        "eagle3": draft | table | aux_window | trees,
        "dflash": draft | table | aux_window | {"dynamic_spec"},
        "dspark": draft | aux_window | {"dynamic_spec"},
        "extract_hidden_states": {"eagle_aux_hidden_state_layer_ids"},
    }
    assert methods.options_of("nope") == methods.Method("nope").options == methods.DRAFT + methods.BATCH_TABLE


def test_every_spec_config_field_is_general_or_owned():
    fields = [f.name for f in dataclasses.fields(SpecConfig)]
    assert not set(methods.GENERAL) & set(methods.GROUPS)
    assert sorted(methods.GENERAL + methods.GROUPS) == sorted(fields)
    assert set(rules.NOT_OWNED) == set(methods.GROUPS)  # every owned field says what the others do with it
    for field in methods.GROUPS:
        assert methods.owner_of(field), field
        assert set(methods.owner_of(field)) < config.VLLM_METHODS, field  # owned: not every method's
    assert methods.owner_of("num_speculative_tokens") == tuple(m for m in methods.METHODS if m in config.VLLM_METHODS)
    assert methods.owner_of("model") == ("draft_model", "medusa", "mtp", "eagle", "eagle3", "dflash", "dspark")
    with pytest.raises(ValueError, match=r"^'max_k' is not a SpecConfig option \(general: "):
        methods.owner_of("max_k")


def test_a_row_owns_whole_groups_and_a_model_with_its_group():
    with pytest.raises(ValueError, match=r"^Method.options of 'x' names \['colour'\], which no option group holds"):
        methods.Method("x", options=methods.DRAFT + ("colour",))
    with pytest.raises(ValueError, match=r"^Method.options of 'x' must hold all of \['prompt_lookup_min', "
                                         r"'prompt_lookup_max'\] or none$"):
        methods.Method("x", options=methods.DRAFT + ("prompt_lookup_min",))
    with pytest.raises(ValueError, match=r"^Method.options of 'x' must hold \['model', 'quantization'\] exactly "
                                         r"when Method.model is not 'none' \(model='none'\)$"):
        methods.Method("x", model=methods.NONE)
    with pytest.raises(ValueError, match=r"exactly when Method.model is not 'none' \(model='optional'\)$"):
        methods.Method("x", model=methods.OPTIONAL, options=methods.BATCH_TABLE)


def _base(name):
    """The least a SpecConfig of method ``name`` needs: K = 1 (one tree node below), a draft where required."""
    return {"method": name, "num_speculative_tokens": 1,
            **({"model": "/draft"} if methods.METHODS[name].model == methods.REQUIRED else {})}


def _direct(field, owner):
    """A valid value of ``field`` as SpecConfig takes it (``owner``: the method it is meant for)."""
    return {"model": "/draft", "quantization": "int8", "prompt_lookup_min": 2, "prompt_lookup_max": 3,
            "suffix_decoding_max_tree_depth": 8, "suffix_decoding_max_cached_requests": 5,
            "suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.5,
            "num_speculative_tokens_per_batch_size": ((1, 4, 1),), "eagle_aux_hidden_state_layer_ids": (0, 1),
            "draft_window_size": 64, "dynamic_spec": DynamicSpecConfig(owner if owner in ("dflash", "dspark") else
                                                                       "dflash"),
            "speculative_token_tree": TokenTree(((0,),)), "dynamic_tree": DynamicTree(1, 1, 2),
            "draft_tensor_parallel_size": 2}[field]


def _vllm(field, owner):
    """The same setting as vLLM's dicts spell it: (speculative_config keys, additional_config)."""
    spec = {field: _direct(field, owner)}
    extra = None
    if field == "num_speculative_tokens_per_batch_size":
        spec = {field: [[1, 4, 1]]}
    elif field == "eagle_aux_hidden_state_layer_ids":
        spec = {"draft_model_config": {"hf_config": {field: [0, 1]}}}
    elif field == "draft_window_size":
        spec, extra = {}, {field: 64}
    elif field == "dynamic_spec":
        spec, extra = {}, {"dynamic_spec_config": {"method": _direct(field, owner).method}}
    elif field == "speculative_token_tree":
        spec = {field: "[(0,)]"}
    elif field == "dynamic_tree":
        spec = {"speculative_eagle_topk": 1, "speculative_num_steps": 1, "speculative_num_draft_tokens": 2}
    return spec, extra


@pytest.mark.parametrize("field", methods.GROUPS)
def test_an_owned_field_is_taken_by_its_owners_and_refused_or_ignored_by_the_rest(field):
    """One table decides: owners take the field; every other supported method refuses it (UNSUPPORTED: from
    vLLM dicts too; UNUSED: vLLM dicts drop and report it) or keeps it unread (IGNORED: vLLM dicts report it)."""
    how = rules.NOT_OWNED[field]
    for name in sorted(config.VLLM_METHODS):
        value = _direct(field, name)
        spec, extra = _vllm(field, name)
        if name in methods.owner_of(field):
            assert getattr(SpecConfig(**{**_base(name), field: value}), field) == value, name
            cfg = SpecConfig.from_vllm({**_base(name), **spec}, extra, check_paths=False)
            assert getattr(cfg, field) == value and field_path(field) not in cfg.ignored_keys, name
            continue
        if how == rules.IGNORED:
            assert getattr(SpecConfig(**{**_base(name), field: value}), field) == value, name
        else:
            verb = "used by" if how == rules.UNUSED else "supported with"
            want = (rf"^{field_path(field)}=2: only method 'draft_model' shards its drafter; the '{name}' drafter"
                    if field == "draft_tensor_parallel_size" else
                    rf"^{field_path(field)} is not {verb} method '{name}' \(only {verb.split()[-1]} method")
            with pytest.raises(ValueError, match=want):
                SpecConfig(**{**_base(name), field: value})
        if how == rules.UNSUPPORTED:
            with pytest.raises(ValueError, match=want):
                SpecConfig.from_vllm({**_base(name), **spec}, extra, check_paths=False)
        else:  # vLLM ignores it for this method: dropped and reported
            cfg = SpecConfig.from_vllm({**_base(name), **spec}, extra, check_paths=False)
            default = SpecConfig.__dataclass_fields__[field].default
            assert getattr(cfg, field) == default and field_path(field) in cfg.ignored_keys, name


def test_a_replicated_drafter_and_bad_sizes_are_not_ownership_questions():
    """draft_tensor_parallel_size 1 is every method's (a replicated drafter); only a sharded one (> 1) is
    draft_model's, so a size that is not one is judged by its own check for every method."""
    assert SpecConfig("ngram", 2, draft_tensor_parallel_size=1).draft_tensor_parallel_size == 1
    with pytest.raises(ValueError, match=r"^speculative_config.draft_tensor_parallel_size must be >= 1, got 0$"):
        SpecConfig("ngram", 2, draft_tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"^speculative_config.draft_tensor_parallel_size must be an integer"):
        SpecConfig("eagle", 2, model="/draft", draft_tensor_parallel_size="2")


def test_registry_imports_nothing_heavy():
    # Importing funcspec.methods runs funcspec/__init__ (which loads torch), so run the file alone.
    code = f"import sys, runpy; runpy.run_path({methods.__file__!r}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
