"""``EngineArgs``: one set of engine arguments behind ``LLM``, ``Engine``, ``generate`` and ``funcspec serve``;
the engine's named build steps; the aclgraph limit under every way of choosing the backend."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import funcspec
from funcspec import LLM, Engine, EngineArgs, SamplingParams, build
from funcspec.capture import backends
from funcspec.checkpoints import load_model
from funcspec.config import CompilationConfig, SpecConfig
from funcspec.kernels import REFERENCE, Ops
from funcspec.parallel import SINGLE
from funcspec.plan import EnginePlan
from funcspec.serve.args import ENGINE_FLAGS, build_parser, engine_kwargs, extra_engine_args

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


class Stop(Exception):
    """Raised by a stubbed build step: the engine's arguments were built, nothing else."""


@pytest.fixture
def built_args(monkeypatch):
    """The :class:`EngineArgs` each engine built, stopping it before its first build step."""
    seen = []

    def stop(args, followed=None):
        seen.append(args)
        raise Stop

    monkeypatch.setattr(build, "plan", stop)
    return seen


def test_llm_engine_and_generate_build_the_same_arguments_with_vllms_defaults(tiny_llama, built_args):
    for make in (lambda: LLM(tiny_llama), lambda: Engine(tiny_llama), lambda: funcspec.generate(tiny_llama, [[1]]),
                 lambda: Engine(EngineArgs(model=tiny_llama))):
        with pytest.raises(Stop):
            make()
    assert built_args == [EngineArgs(model=tiny_llama)] * 4
    args = built_args[0]
    assert (args.max_num_seqs, args.enforce_eager, args.backend_name, args.resolved_backend, args.torch_dtype) == \
        (8, False, "auto", "inductor", torch.float32)
    assert args.compilation_config == CompilationConfig() and args.speculative_config is None
    for kw in (dict(enforce_eager=True), dict(backend="eager"), dict(enforce_eager=True, backend="eager")):
        assert EngineArgs(model=tiny_llama, **kw).resolved_backend == "eager"
    assert EngineArgs(model=tiny_llama, enforce_eager=True, backend="inductor").resolved_backend == "inductor"


def test_keywords_build_what_the_fields_build(tiny_llama, built_args):
    kw = dict(speculative_config=NGRAM, max_num_seqs=2, max_model_len=64, enforce_eager=True, seed=3,
              compilation_config={"capture": "lazy"})
    for make in (lambda: LLM(tiny_llama, **kw), lambda: Engine(tiny_llama, **kw),
                 lambda: funcspec.generate(tiny_llama, [[1]], **kw)):
        with pytest.raises(Stop):
            make()
    want = EngineArgs(model=tiny_llama, **kw)
    assert built_args == [want] * 3
    assert want.speculative_config == SpecConfig.from_vllm(NGRAM) and want.compilation_config.capture == "lazy"


def test_generate_takes_llms_enforce_eager(tiny_llama):
    prompts = [[5, 6, 7, 8], [9, 8, 7]]
    got = [o.outputs[0].token_ids for o in funcspec.generate(tiny_llama, prompts, GREEDY, enforce_eager=True,
                                                             max_num_seqs=2, max_model_len=64)]
    eng = Engine(tiny_llama, backend="eager", max_num_seqs=2, max_model_len=64)
    assert eng.backend == "eager" and eng.runner.compiled == {}
    assert got == [o.outputs[0].token_ids for o in eng.generate(prompts, GREEDY)]
    assert all(len(ids) == 5 for ids in got)


def test_an_engine_args_is_taken_alone():
    args = EngineArgs(model="m", enforce_eager=True)
    with pytest.raises(ValueError, match=r"^Engine takes an EngineArgs alone, or a model and keywords: not both$"):
        Engine(args, max_num_seqs=2)


# ----------------------------------------------------------------------------- old spellings, unknown arguments
OLD = [
    pytest.param(dict(max_batch_size=3), "max_batch_size= is deprecated; use max_num_seqs",
                 lambda a: a.max_num_seqs == 3, id="max_batch_size"),
    pytest.param(dict(capture="lazy"), "capture= is deprecated; use compilation_config['capture']",
                 lambda a: a.compilation_config.capture == "lazy", id="capture"),
    pytest.param(dict(compile_cache="cc.zip"), "compile_cache= is deprecated; use compilation_config['compile_cache']",
                 lambda a: a.compilation_config.compile_cache == "cc.zip", id="compile_cache"),
    pytest.param(dict(capture_logprobs=True),
                 "capture_logprobs= is deprecated; use compilation_config['capture_logprobs']",
                 lambda a: a.compilation_config.capture_logprobs is True, id="capture_logprobs"),
    pytest.param(dict(batch_buckets=[1, 4], speculative_config=NGRAM),
                 "batch_buckets= is deprecated; use compilation_config['batch_sizes'] (or vLLM's "
                 "cudagraph_capture_sizes)",
                 lambda a: a.compilation_config.batch_sizes == (1, 4) and a.batch_buckets == [1, 4],
                 id="batch_buckets"),
]


@pytest.mark.parametrize(("kwargs", "warning", "mapped"), OLD)
def test_each_old_spelling_warns_and_maps_to_the_new_one(kwargs, warning, mapped):
    with pytest.warns(DeprecationWarning, match=f"^Engine: {re.escape(warning)}$"):
        args = EngineArgs.from_kwargs({"model": "m", **kwargs}, "Engine")
    assert mapped(args)


def test_an_old_and_a_new_spelling_of_one_argument_are_refused():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="^max_batch_size is the old name of "
                                                                           "max_num_seqs: give max_num_seqs alone$"):
        EngineArgs.from_kwargs({"model": "m", "max_batch_size": 2, "max_num_seqs": 4})
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"^capture is given twice: as capture= "
                                                                           r"and as compilation_config\['capture'\]$"):
        EngineArgs.from_kwargs({"model": "m", "capture": "lazy", "compilation_config": {"capture": "startup"}})


def test_unknown_arguments_are_refused_with_a_suggestion_and_vllms_idle_ones_warn_once(tiny_llama, built_args):
    with pytest.raises(ValueError, match=r"^Engine: unknown engine argument\(s\) \['max_num_seq'\] "
                                         r"\('max_num_seq': did you mean 'max_num_seqs'\?\)$"):
        Engine(tiny_llama, max_num_seq=2)
    with pytest.raises(ValueError, match=r"^funcspec.generate: unknown engine argument\(s\) \['enforce_eagre'\] "
                                         r"\('enforce_eagre': did you mean 'enforce_eager'\?\)$"):
        funcspec.generate(tiny_llama, [[1]], enforce_eagre=True)
    with pytest.warns(UserWarning) as seen, pytest.raises(Stop):
        Engine(tiny_llama, gpu_memory_utilization=0.9, compilation_config={"level": 3})
    assert [str(w.message) for w in seen] == [
        "Engine: arguments with no effect in funcspec were ignored: ['gpu_memory_utilization', "
        f"'compilation_config.level ({CompilationConfig.from_vllm({'level': 3}).ignored[0].split('(', 1)[1]}']"]
    with pytest.warns(UserWarning, match="compilation_config.level"):
        assert built_args == [EngineArgs(model=tiny_llama, compilation_config={"level": 3})]  # kept, unread


# ----------------------------------------------------------------------------- serve's flags
def test_every_field_is_a_serve_flag_and_parses_to_itself():
    fields = [f.name for f in dataclasses.fields(EngineArgs)]
    assert list(ENGINE_FLAGS) == fields[1:]  # every field but the positional model
    argv = ["m", "--tokenizer", "tok", "-sc", json.dumps(NGRAM), "-tp", "2", "--enable-expert-parallel",
            "--max-model-len", "64", "--max-num-seqs", "4", "--enforce-eager", "--compilation-config",
            '{"capture": "lazy"}', "--additional-config", "{}", "--kv-transfer-config", "{}", "--seed", "7",
            "--dtype", "bfloat16", "-q", "int8", "--backend", "eager", "--device", "cpu", "--no-cpu-kernels",
            "--context-buckets", "16", "65", "--ops", '{"stream": true}']
    args, rest = build_parser().parse_known_args(argv)
    assert rest == []
    assert engine_kwargs(args, extra_engine_args(rest)) == {
        "tokenizer": "tok", "speculative_config": NGRAM, "tensor_parallel_size": 2, "enable_expert_parallel": True,
        "max_model_len": 64, "max_num_seqs": 4, "enforce_eager": True, "compilation_config": {"capture": "lazy"},
        "additional_config": {}, "kv_transfer_config": {}, "seed": 7, "dtype": "bfloat16", "quantization": "int8",
        "backend": "eager", "device": "cpu", "cpu_kernels": False, "context_buckets": [16, 65],
        "ops": {"stream": True}}
    assert set(engine_kwargs(args, {})) == set(fields[1:])
    none, _ = build_parser().parse_known_args(["m"])
    assert engine_kwargs(none, {}) == {}  # an absent flag keeps EngineArgs' default


# ----------------------------------------------------------------------------- what followers receive
def test_engine_args_travel_as_plain_data_and_back(tiny_llama):
    args = EngineArgs(model=tiny_llama, speculative_config={**NGRAM, "speculative_token_tree": "[(0,), (0, 0)]",
                                                            "num_speculative_tokens": 2},
                      additional_config={"rejection_sampler_config": {"posterior_threshold": 0.5}},
                      compilation_config={"cudagraph_capture_sizes": [3, 6], "capture": "lazy"}, max_num_seqs=2,
                      dtype=torch.bfloat16, context_buckets=[16, 65], ops=Ops(stream=True), seed=5,
                      tensor_parallel_size=2, enforce_eager=True)
    plain = json.loads(json.dumps(args.to_dict()))
    assert plain["dtype"] == "bfloat16" and plain["ops"]["stream"] is True and plain["context_buckets"] == [16, 65]
    back = EngineArgs.from_dict(plain)
    assert back == args and back.batch_buckets == [1, 2] and back.torch_dtype == torch.bfloat16
    assert back.speculative_config.tree == args.speculative_config.tree
    with pytest.raises(ValueError, match=r"^EngineArgs has no field 'max_batch_size'"):
        EngineArgs.from_dict({**plain, "max_batch_size": 2})
    with pytest.raises(ValueError, match=r"^model: a spawned tensor-parallel engine needs a checkpoint path"):
        EngineArgs(model=load_model(tiny_llama), enforce_eager=True).to_dict()


# ----------------------------------------------------------------------------- the named build steps
def test_each_build_step_can_be_stopped_after(tiny_llama, monkeypatch):
    args = EngineArgs(model=tiny_llama, speculative_config=NGRAM, enforce_eager=True, max_num_seqs=2,
                      max_model_len=64, ops=REFERENCE)

    def tripwire(*a, **kw):
        raise AssertionError("plan read the checkpoint's weights")

    with monkeypatch.context() as m:
        m.setattr(build, "load_model", tripwire)
        planned = build.plan(args)  # the config alone
    assert isinstance(planned.plan, EnginePlan) and planned.cfg.ops == REFERENCE
    assert (planned.plan.max_k, planned.plan.max_model_len, planned.plan.num_slots, planned.plan.backend) == \
        (3, 64, 2, "eager")
    assert build.plan(args, planned.plan.to_dict()) == planned  # a follower's: rank 0's plan, as sent

    loaded = build.load(args, planned)
    assert loaded.model.cfg == planned.cfg and loaded.quantization is None
    prepared = build.prepare(args, planned, loaded)
    assert prepared.proposer.module.__name__ == "funcspec.proposers.ngram"
    assert prepared.dyn is None and prepared.hooks == () and not prepared.shard_draft
    dist = build.distribute(args, planned, prepared, Engine)
    assert dist.tp == SINGLE and dist.followers is None
    captured = build.capture(args, planned, prepared, dist)
    assert captured.startup_seconds == 0.0 and captured.runner.compiled == {} and captured.compile_cache is None

    eng = Engine(args)
    prompts = [[5, 6, 7, 5, 6, 7, 5]]
    assert eng.plan == planned.plan and eng.args is args
    assert eng.generate(prompts, GREEDY)[0].outputs[0].token_ids == \
        Engine(tiny_llama, enforce_eager=True, max_num_seqs=2, max_model_len=64).generate(prompts, GREEDY)[0] \
        .outputs[0].token_ids


# ----------------------------------------------------------------------------- aclgraph's K + 1 <= 16
ACL_LIMIT = r"^speculative_config\.num_speculative_tokens must be <= 15 on backend 'aclgraph'"


def test_aclgraphs_query_limit_holds_when_auto_picks_it(tiny_llama, monkeypatch):
    """On an NPU (here a CPU that ``auto`` resolves as one), ``auto`` is aclgraph: K + 1 <= 16 is checked there
    too, before the checkpoint is read or torch_npu imported."""
    monkeypatch.setitem(backends.AUTO_BACKENDS, "cpu", "aclgraph")

    def tripwire(*a, **kw):
        raise AssertionError("the checkpoint was read before the arguments were refused")

    monkeypatch.setattr(build, "load_config", tripwire)
    k16 = {"method": "ngram", "num_speculative_tokens": 16}
    for make in (lambda: Engine(tiny_llama, k16), lambda: LLM(tiny_llama, speculative_config=k16),
                 lambda: Engine(tiny_llama, k16, backend="aclgraph")):
        with pytest.raises(ValueError, match=ACL_LIMIT):
            make()
    assert EngineArgs(model=tiny_llama, speculative_config=k16, enforce_eager=True).resolved_backend == "eager"
    assert EngineArgs(model=tiny_llama, speculative_config={**k16, "num_speculative_tokens": 15}).resolved_backend \
        == "aclgraph"
