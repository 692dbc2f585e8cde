"""The speculative decoding guide's 23 examples, run on the zoo as a user of the guide runs them.

Each example is copied here as the guide prints it (the ``LLM(...)`` call as
Python source, the ``vllm serve`` line as shell text; the tests cannot read the
guide) and run with its model names replaced by zoo checkpoints (:data:`ZOO`)
and one change for speed: the eager backend. The guide's numbering is the
issue's: the 11 ``LLM(...)`` calls, the 11 ``vllm serve`` lines and the
``--speculative-config`` schema in order (17 is the schema), plus 24, the newer
guide's adaptive-verification line. A ``vllm serve`` line is parsed by
``funcspec serve``'s own parser into ``LLM``'s arguments, which are checked and
run; examples 2 and 15 are also served and queried.

Where an example cannot run on the zoo as written, the test says why and
proves it: it asserts funcspec's refusal of the value as written, then runs the
example scaled down to the zoo (the other values as the guide has them):

- 4, 5: ``tensor_parallel_size`` 4: the zoo target has 2 KV heads (run at 2);
- 6, 7: DeepSeek-V3.2-Exp-W8A8: a tiny random DeepSeek-V3.2 (:func:`make_deepseek`:
  MLA with its indexer, DeepSeekMoE, 4 heads, a context above the guide's
  36768, the zoo's tokenizer, its MTP layer in its own file) written as
  msmodelslim writes its W8A8 (attention W8A8, MLPs W8A8_DYNAMIC,
  ``kv_b_proj`` float, the MTP layer float), run as written (``mtp`` K = 2,
  ``quantization="ascend"``, expert parallelism) at tensor-parallel 2 (16 would
  cut its 4 heads), on gloo, and equal to one rank
  (:func:`test_example_6_on_two_ranks_equals_one_rank`, example 7 served);
- 8-11, 16: ``max_model_len`` 4096 is above the zoo's 2048 (run at 2048; 9 at
  256, since its 256 slots of 2048 positions would hold 2 GB of KV cache);
- 14, 15: hidden-state layers 18 and 34 of a 36-layer model: the zoo target has
  4 (layers 2, 3, 4 instead);
- 20, 23: the guide's JSON is broken (backslashes before line ends inside a
  single-quoted argument, which the shell keeps): the parser's error names the
  flag; with the backslashes removed, they run.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from funcspec import LLM, SamplingParams, zoo
from funcspec.checkpoints import init_draft_head
from funcspec.checkpoints import quantized_write as qw
from funcspec.config import CompilationConfig
from funcspec.serve.args import build_parser, engine_kwargs, extra_engine_args
from served import Served, post

PROMPTS = ["The future of AI is"]
SAMPLING = SamplingParams(temperature=0.8, top_p=0.95)  # the guide's; max_tokens 16, as vLLM's default
GREEDY = {"temperature": 0, "max_tokens": 16}
EAGLE = "yuhuili/EAGLE-LLaMA3.1-Instruct-8B"  # the zoo has no EAGLE-1 head: a random one stands in (fixture)
ZOO = {  # the guide's model names -> the zoo role standing in for each
    "path/to/target/model": "target", "meta-llama/Meta-Llama-3.1-8B-Instruct": "target",
    "meta-llama/Llama-3.1-8B-Instruct": "target", "Qwen/Qwen3-8B": "target", "<model>": "target",
    "path/to/draft/model": "eagle3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B": "eagle3",
    "z-lab/Qwen3-8B-DFlash-b16": "dflash", "deepseek-ai/dspark_qwen3_8b_block7": "dspark",
}

LLM_EXAMPLES = {
    1: '''LLM(
    model="path/to/target/model",
    speculative_config={
        "method": "eagle3",
        "model": "path/to/draft/model",
        "num_speculative_tokens": 3,
    },
)''',
    3: '''LLM(
      model="meta-llama/Meta-Llama-3.1-8B-Instruct",
      tensor_parallel_size=1,
      speculative_config={
          "method": "ngram",
          "num_speculative_tokens": 5,
          "prompt_lookup_max": 4,
      },
  )''',
    4: '''LLM(
      model="meta-llama/Meta-Llama-3.1-8B-Instruct",
      tensor_parallel_size=4,
      distributed_executor_backend="mp",
      enforce_eager=True,
      speculative_config={
          "method": "eagle",
          "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
          "draft_tensor_parallel_size": 1,
          "num_speculative_tokens": 2,
      },
  )''',
    6: '''LLM(
      model="deepseek-ai/DeepSeek-V3.2-Exp-W8A8",
      tensor_parallel_size=16,
      enable_expert_parallel=True,
      max_model_len=36768,
      max_num_seqs=10,
      quantization="ascend",
      trust_remote_code=True,
      gpu_memory_utilization=0.9,
      compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"},
      speculative_config={
          "method": "mtp",
          "num_speculative_tokens": 2,
          "disable_padded_drafter_batch": False,
      },
  )''',
    8: '''LLM(
      model="Qwen/Qwen3-8B",
      tensor_parallel_size=1,
      distributed_executor_backend="mp",
      max_model_len=4096,
      max_num_seqs=16,
      gpu_memory_utilization=0.8,
      enable_prefix_caching=False,
      speculative_config={
          "method": "dflash",
          "model": "z-lab/Qwen3-8B-DFlash-b16",
          "num_speculative_tokens": 7,
      },
      compilation_config=CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY"),
  )''',
    10: '''LLM(
      model="Qwen/Qwen3-8B",
      tensor_parallel_size=1,
      distributed_executor_backend="mp",
      max_model_len=4096,
      max_num_seqs=8,
      gpu_memory_utilization=0.8,
      enable_prefix_caching=False,
      speculative_config={
          "method": "dspark",
          "model": "deepseek-ai/dspark_qwen3_8b_block7",
          "num_speculative_tokens": 7,
          "enforce_eager": True,
      },
      compilation_config=CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY"),
  )''',
    12: '''LLM(
    model="meta-llama/Meta-Llama-3.1-8B-Instruct",
    tensor_parallel_size=1,
    enforce_eager=True,
    speculative_config={
        "method": "suffix",
        "num_speculative_tokens": 15,
    },
)''',
    14: '''LLM(
              model="Qwen/Qwen3-8B",
              tensor_parallel_size=1,
              speculative_config={
                  "method": "extract_hidden_states",
                  "num_speculative_tokens": 1,
                  "draft_model_config": {
                      "hf_config": {
                          # Layer indices to extract hidden states from
                          "eagle_aux_hidden_state_layer_ids": [2, 18, 34],
                      }
                  },
              },
              kv_transfer_config={
                  "kv_connector": "ExampleHiddenStatesConnector",
                  "kv_role": "kv_producer",
                  "kv_connector_extra_config": {
                      "shared_storage_path": tmpdir,
                  },
              },
          )''',
    16: '''LLM(
    model="Qwen/Qwen3-8B",
    tensor_parallel_size=1,
    distributed_executor_backend="mp",
    max_model_len=4096,
    max_num_seqs=8,
    gpu_memory_utilization=0.8,
    enable_prefix_caching=False,
    speculative_config={
        "method": "dspark",
        "model": "deepseek-ai/dspark_qwen3_8b_block7",
        "num_speculative_tokens": 7,
    },
    additional_config={
        "dynamic_spec_config": {
            "method": "dspark",
            "method_params": {
                "initial_verify_budget_per_req": 5,
                "budget_update_interval": 50,
                "budget_threshold": 0.7,
            },
        },
    },
    compilation_config=CompilationConfig(cudagraph_mode="FULL"),
)''',
    21: '''LLM(
      model,
      additional_config={
          "rejection_sampler_config": {
              "enable_block_verify": True,
              "enable_entropy_verify": True,
              "posterior_threshold": 0.95,
              "posterior_alpha": 0.4,
          }
      },
  )''',
    22: '''LLM(
    model="path/to/target/model",
    speculative_config={
        "method": "eagle3",
        "model": "path/to/draft/model",
        "num_speculative_tokens": 3,
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": [0.9, 0.6, 0.3],
    },
)''',
}

SERVE_EXAMPLES = {
    2: '''vllm serve path/to/target/model \\
  --speculative-config '{"method": "eagle3", "model": "path/to/draft/model", "num_speculative_tokens": 3}\'''',
    5: '''vllm serve meta-llama/Meta-Llama-3.1-8B-Instruct \\
    --tensor-parallel-size 4 \\
    --enforce-eager \\
    --speculative-config '{"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "draft_tensor_parallel_size": 1, "num_speculative_tokens": 2}\'''',  # noqa: E501
    7: '''vllm serve /deepseek-ai/DeepSeek-V3.2-Exp-W8A8 \\
  --port 20004 \\
  --data-parallel-size 1 \\
  --tensor-parallel-size 16 \\
  --enable-expert-parallel \\
  --seed 1024 \\
  --served-model-name dsv3 \\
  --max-model-len 36768 \\
  --max-num-batched-tokens 5000 \\
  --max-num-seqs 10 \\
  --quantization ascend \\
  --trust-remote-code \\
  --gpu-memory-utilization 0.9 \\
  --compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}' \\
  --speculative-config '{"num_speculative_tokens": 2, "method":"mtp", "disable_padded_drafter_batch": false}\'''',
    9: '''vllm serve Qwen/Qwen3-8B \\
    --tensor-parallel-size 1 \\
    --max-model-len 4096 \\
    --max-num-seqs 256 \\
    --gpu-memory-utilization 0.8 \\
    --no-enable-prefix-caching \\
    --compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}' \\
    --speculative-config '{"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 7}\'''',
    11: '''vllm serve Qwen/Qwen3-8B \\
    --tensor-parallel-size 1 \\
    --max-model-len 4096 \\
    --max-num-seqs 8 \\
    --gpu-memory-utilization 0.8 \\
    --no-enable-prefix-caching \\
    --compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}' \\
    --speculative-config '{"method": "dspark", "model": "deepseek-ai/dspark_qwen3_8b_block7", "num_speculative_tokens": 7, "enforce_eager": true}\'''',  # noqa: E501
    13: '''vllm serve meta-llama/Meta-Llama-3.1-8B-Instruct \\
    --tensor-parallel-size 1 \\
    --enforce-eager \\
    --speculative-config '{"method": "suffix", "num_speculative_tokens": 15}\'''',
    15: '''vllm serve Qwen/Qwen3-8B \\
    --tensor-parallel-size 1 \\
    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1, "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 18, 34]}}}' \\
    --kv-transfer-config '{"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": "/dev/shm/hidden_states"}}\'''',  # noqa: E501
    18: '''vllm serve meta-llama/Llama-3.1-8B-Instruct \\
  --speculative-config '{
    "method": "eagle",
    "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
    "num_speculative_tokens": 3,
    "num_speculative_tokens_per_batch_size": [
      [1, 64, 3],
      [65, 128, 1],
      [129, 512, 0]
    ]
  }\'''',
    19: '''vllm serve meta-llama/Llama-3.1-8B-Instruct \\
  --speculative-config '{
    "method": "eagle3",
    "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
    "num_speculative_tokens": 3,
    "num_speculative_tokens_per_batch_size": [
      [1, 16, 5],
      [17, 32, 4],
      [33, 64, 3],
      [65, 128, 1],
      [129, 512, 0]
    ]
  }\'''',
    20: '''vllm serve <model> --additional-config \\
      '{"rejection_sampler_config": {"enable_block_verify": true, \\
      "enable_entropy_verify": true, "posterior_threshold": 0.95, \\
      "posterior_alpha": 0.4}}\'''',
    23: '''vllm serve path/to/target/model \\
  --speculative-config '{"method": "eagle3", "model": "path/to/draft/model", \\
    "num_speculative_tokens": 3, "rejection_sample_method": "synthetic", \\
    "synthetic_acceptance_rates": [0.9, 0.6, 0.3]}\'''',
    24: '''VLLM_USE_V2_MODEL_RUNNER=1 vllm serve Qwen/Qwen3-8B --speculative-config '{"method": "dspark", "model": "deepseek-ai/dspark_qwen3_8b_block7", "num_speculative_tokens": 7, "enable_adaptive_verification": true}\'''',  # noqa: E501
}

SCHEMA_17 = '''--speculative-config '{
    "method": "eagle",
    "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
    "num_speculative_tokens": 3,
    "num_speculative_tokens_per_batch_size": [
      [1, 64, 3],
      [65, 128, 1],
      [129, 512, 0]
    ]
  }\''''


DEEPSEEK = ("deepseek-ai/DeepSeek-V3.2-Exp-W8A8", "/deepseek-ai/DeepSeek-V3.2-Exp-W8A8")
LAYERS = ("speculative_config", "draft_model_config", "hf_config", "eagle_aux_hidden_state_layer_ids")
DROP = object()  # an argument the zoo's run leaves out
_ABOVE = r"^max_model_len={} is above this model's maximum context of 2048 tokens"
_TP = r"^tensor_parallel_size={} must divide the target's num_key_value_heads=2"
_LAYERS = r"eagle_aux_hidden_state_layer_ids: \[18, 34\] outside \[0, 4\] for this target$"
_DEEPSEEK = [
    (("tensor_parallel_size",), 2, r"^tensor_parallel_size=16 must divide the target's num_attention_heads=4 "
                                   r"\(each rank holds whole heads\)"),
]
SCALED = {  # example -> (argument path, the zoo's value, the refusal of the guide's value on the zoo) each
    4: [(("tensor_parallel_size",), 2, _TP.format(4))],
    5: [(("tensor_parallel_size",), 2, _TP.format(4))],
    6: _DEEPSEEK,
    7: _DEEPSEEK,
    8: [(("max_model_len",), 2048, _ABOVE.format(4096))],
    9: [(("max_model_len",), 256, _ABOVE.format(4096))],
    10: [(("max_model_len",), 2048, _ABOVE.format(4096))],
    11: [(("max_model_len",), 2048, _ABOVE.format(4096))],
    14: [(LAYERS, [2, 3, 4], _LAYERS)],
    15: [(LAYERS, [2, 3, 4], _LAYERS)],
    16: [(("max_model_len",), 2048, _ABOVE.format(4096))],
}
WARNED = {  # example -> pieces of the warnings building it gives: what it asks for that funcspec does not do
    4: ["'distributed_executor_backend'"],
    6: ["compilation_config.cudagraph_mode", "'gpu_memory_utilization'", "'trust_remote_code'",
        "speculative_config.disable_padded_drafter_batch"],
    7: ["compilation_config.cudagraph_mode", "'data_parallel_size'", "'gpu_memory_utilization'",
        "'max_num_batched_tokens'", "'trust_remote_code'", "speculative_config.disable_padded_drafter_batch"],
    8: ["compilation_config.cudagraph_mode (funcspec captures each bucket's whole step", "'enable_prefix_caching'"],
    9: ["compilation_config.cudagraph_mode", "'gpu_memory_utilization'"],
    10: ["compilation_config.cudagraph_mode", "speculative_config.enforce_eager"],
    11: ["compilation_config.cudagraph_mode", "speculative_config.enforce_eager"],
    16: ["compilation_config.cudagraph_mode"],
    19: ["entries [[1, 16, 5], [17, 32, 4]] ask for more drafts than speculative_config.num_speculative_tokens=3"],
    20: ["['additional_config.rejection_sampler_config'] have no effect without a speculative_config"],
    21: ["['additional_config.rejection_sampler_config'] have no effect without a speculative_config"],
    24: ["speculative_config.enable_adaptive_verification"],
}
BROKEN = {20: "--additional-config", 23: "--speculative-config"}
"""The examples whose JSON the guide breaks: a backslash before a line end inside single quotes stays in the text."""


def make_deepseek(path: Path) -> None:
    """A tiny random DeepSeek-V3.2 at ``path`` for the guide's DeepSeek examples: 4 heads (MLA) whose indexer picks 8
    positions, 8 routed experts and a shared one, a dense first layer, a context of 40960 (the guide asks 36768),
    the zoo's tokenizer, and its MTP layer ``model.layers.3`` in its own ``model.safetensors``, as DeepSeek ships
    it (a random one: :func:`funcspec.checkpoints.init_draft_head`'s). Every size a W8A8 split at tensor-parallel
    2 keeps whole (blocks of 32 inputs per rank)."""
    tokenizer = zoo.model_path("target")
    special = {k: v for k, v in json.loads((tokenizer / "config.json").read_text()).items() if k.endswith("token_id")}
    config = transformers.DeepseekV32Config(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=40960, tie_word_embeddings=False, moe_intermediate_size=64,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, index_n_heads=8, index_head_dim=32, index_topk=8, **special)
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0) if p.dim() > 1 else None
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):  # the indexer's key norm: random, so that it counts
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.2)
    model.save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, path / name)
    # transformers drops the MTP layer: it goes into the target's own file, as DeepSeek's checkpoints hold it
    mtp = init_draft_head("mtp", str(path), path / "mtp", seed=1)
    save_file({**load_file(str(path / "model.safetensors")), **load_file(str(mtp / "model.safetensors"))},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(mtp)
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}))


@pytest.fixture(scope="module")
def names(tmp_path_factory):
    """The guide's model names -> local paths: the zoo's; a random EAGLE-1 head for the zoo target (the zoo trains
    none); for DeepSeek-V3.2-Exp-W8A8, a tiny DeepSeek-V3.2 with its MTP layer written as msmodelslim writes W8A8
    (:func:`make_deepseek`). Also example 14's ``tmpdir``, where its hidden states go."""
    root = tmp_path_factory.mktemp("guide")
    eagle = init_draft_head("eagle", str(zoo.model_path("target")), root / "eagle")
    make_deepseek(root / "deepseek-float")
    deepseek = qw.write_ascend(root / "deepseek-float", root / "deepseek", **qw.DEEPSEEK_MIX)
    return {**{name: str(zoo.model_path(role)) for name, role in ZOO.items()}, EAGLE: str(eagle),
            **dict.fromkeys(DEEPSEEK, str(deepseek)), "tmpdir": str(root / "hidden_states")}


def localize(text: str, names: dict) -> str:
    """``text`` with each quoted guide model name replaced by its local path."""
    for name in names:
        text = text.replace(json.dumps(name), json.dumps(names[name]))
    return text


def llm_kwargs(number: int, names: dict) -> dict:
    """An ``LLM(...)`` example's arguments as written (local paths): its source run with ``LLM`` collecting them."""
    def collect(*args, **kwargs):
        return dict(zip(["model"], args), **kwargs)

    return eval(localize(LLM_EXAMPLES[number], names), {"LLM": collect, "CompilationConfig": CompilationConfig,
                                                        "model": names["<model>"], "tmpdir": names["tmpdir"]})


def serve_argv(line: str, names: dict) -> list:
    """A ``vllm serve`` line's arguments after ``serve``, split by the shell's rules (a backslash before a line end
    joins lines, except inside single quotes), model names made local."""
    argv = [t for t in shlex.split(line) if t != "\n"]
    return [names.get(t, localize(t, names)) for t in argv[argv.index("serve") + 1:]]


def serve_kwargs(argv: list) -> dict:
    """``LLM``'s arguments as ``funcspec serve`` derives them from ``argv`` (the model included)."""
    args, rest = build_parser().parse_known_args(argv)
    return {"model": args.model, **engine_kwargs(args, extra_engine_args(rest))}


def example_kwargs(number: int, names: dict) -> dict:
    if number in LLM_EXAMPLES:
        return llm_kwargs(number, names)
    # the schema (17) is a flag alone: given here to a target
    line = SERVE_EXAMPLES.get(number, f"vllm serve meta-llama/Llama-3.1-8B-Instruct {SCHEMA_17}")
    if number in BROKEN:  # the guide's intent: the line ends joined as the shell joins them outside quotes
        line = line.replace("\\\n", " ")
    return serve_kwargs(serve_argv(line, names))


def with_value(kwargs: dict, path: tuple, value) -> dict:
    """A deep copy of ``kwargs`` with the argument at ``path`` set to ``value`` (or left out: :data:`DROP`)."""
    out = node = _copy(kwargs)
    for key in path[:-1]:
        node = node[key]
    if value is DROP:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    return out


def _copy(value):
    """A copy of nested dicts and lists (anything else, e.g. a CompilationConfig, shared)."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return [_copy(v) for v in value] if isinstance(value, list) else value


def eager(**kwargs) -> LLM:
    """``LLM(**kwargs)`` on the eager backend, the one change every example gets (no graph compiles)."""
    return LLM(**{"enforce_eager": True, **kwargs})


def scaled(number: int, names: dict) -> dict:
    """The example's arguments on the zoo: each value the zoo cannot take replaced (:data:`SCALED`), after
    asserting that the guide's value alone is refused on the zoo with its reason."""
    kwargs = example_kwargs(number, names)
    zoo_values = {path: (names[value] if value in names else str(zoo.model_path(value))) if path[-1] == "model"
                  else value for path, value, _ in SCALED.get(number, [])}
    runnable = kwargs
    for path, value in zoo_values.items():
        runnable = with_value(runnable, path, value)
    for path, _, refusal in SCALED.get(number, []):
        if refusal is not None:
            node = kwargs
            for key in path:
                node = node[key]
            with pytest.raises(ValueError, match=refusal):
                eager(**with_value(runnable, path, node))
    return runnable


# 2, 6, 7 and 15 run below: 2 and 15 served, 6 and 7 on two ranks against one (each engine spawns ranks)
RUN = [1, 3, 4, 5, 8, 9, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 23, 24]


@pytest.mark.parametrize("number", RUN)
def test_the_guide_examples_run_on_the_zoo(names, number):
    """Each example builds its engine (eager), refusing on the way only what the zoo cannot hold, warns about what
    funcspec does not do, and generates for the guide's prompt."""
    kwargs = scaled(number, names)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        llm = eager(**kwargs)
    text = "\n".join(str(w.message) for w in record)
    for piece in WARNED.get(number, []):
        assert piece in text, (piece, text)
    try:
        out = llm.generate(PROMPTS, SAMPLING)[0].outputs[0]
    finally:
        llm.close()
    assert 1 <= len(out.token_ids) <= 16 and out.finish_reason in ("length", "stop")


@pytest.mark.parametrize("number", sorted(BROKEN))
def test_the_guide_breaks_the_json_of_two_examples(names, number, capsys):
    """As printed, the shell hands the parser JSON with a backslash and a line end in it: the error names the flag."""
    with pytest.raises(SystemExit) as exit_:
        serve_kwargs(serve_argv(SERVE_EXAMPLES[number], names))
    assert exit_.value.code == 2
    flag = BROKEN[number]
    assert re.search(f"argument {flag}(/-sc)?: {flag} must be a JSON object: .*: line 1 column \\d+ \\(char \\d+\\)\n$",
                     capsys.readouterr().err)


def test_example_2_served_answers_as_example_1_generates(names, tmp_path):
    """Example 2 served (eager) and queried with the guide's prompt: greedy, it answers example 1's engine's tokens."""
    pytest.importorskip("fastapi")
    served = Served([*serve_argv(SERVE_EXAMPLES[2], names), "--enforce-eager"], tmp_path / "server.log")
    try:
        status, raw, _ = post(served.connection(), "/v1/completions", dict(GREEDY, prompt=PROMPTS[0], return_token_ids=True))
    finally:
        served.stop()
    want = eager(**example_kwargs(1, names)).generate(PROMPTS, SamplingParams(**GREEDY))[0].outputs[0]
    assert status == 200 and json.loads(raw)["choices"][0]["token_ids"] == want.token_ids


def test_example_15_served_names_each_hidden_state_file(names, tmp_path):
    """Example 15 served (layers 2, 3, 4 of the zoo target, its files in a temporary directory) with example 14's
    prompts: each choice's ``kv_transfer_params`` names its file (the response's: the first's, as vLLM's), which
    holds the prompt's token ids and hidden states ``[tokens, 3 layers, 256]``."""
    pytest.importorskip("fastapi")
    line = SERVE_EXAMPLES[15].replace("[2, 18, 34]", "[2, 3, 4]").replace("/dev/shm/hidden_states", str(tmp_path))
    served = Served([*serve_argv(line, names), "--enforce-eager"], tmp_path / "server.log")
    try:
        status, raw, _ = post(served.connection(), "/v1/completions",
                              {"prompt": ["Hello, how are you?", "What is machine learning?"], "max_tokens": 1,
                               "return_token_ids": True})
    finally:
        served.stop()
    body = json.loads(raw)
    assert status == 200 and body["kv_transfer_params"] == body["choices"][0]["kv_transfer_params"]
    for choice in body["choices"]:
        with safe_open(choice["kv_transfer_params"]["hidden_states_path"], "pt") as f:
            assert f.get_tensor("token_ids").tolist() == choice["prompt_token_ids"]
            assert f.get_tensor("hidden_states").shape == (len(choice["prompt_token_ids"]), 3, 256)


DEEPSEEK_PROMPTS = PROMPTS + ["Speculative decoding drafts tokens that", "Mixture of experts"]


def _texts(llm: LLM, params: list) -> list:
    """For each of ``params`` in turn, on the same engine, the token ids ``llm`` gives each prompt; then closes
    the engine."""
    try:
        return [[o.outputs[0].token_ids for o in llm.generate(DEEPSEEK_PROMPTS, p)] for p in params]
    finally:
        llm.close()


def test_example_6_on_two_ranks_equals_one_rank(names):
    """Example 6 as the guide writes it, but the model (msmodelslim's W8A8 of a tiny DeepSeek-V3.2) and its
    tensor-parallel size: its own MTP layer drafts K = 2, and two gloo ranks with expert parallelism emit one
    rank's tokens, greedy and with the guide's sampling; expert parallelism is not warned about (the target has
    experts)."""
    kwargs = scaled(6, names)
    assert (kwargs["tensor_parallel_size"], kwargs["enable_expert_parallel"], kwargs["quantization"],
            kwargs["max_model_len"], kwargs["speculative_config"]["method"]) == (2, True, "ascend", 36768, "mtp")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        llm = eager(**kwargs)
    text = "\n".join(str(w.message) for w in record)
    assert all(piece in text for piece in WARNED[6]) and "enable_expert_parallel" not in text, text
    assert (llm.engine.spec.method, llm.engine.plan.max_k, llm.engine.model.quantization.method) == \
        ("mtp", 2, "ascend")
    params = [SamplingParams(**GREEDY), SAMPLING]
    two = _texts(llm, params)
    assert two == _texts(eager(**with_value(kwargs, ("tensor_parallel_size",), 1)), params)
    for texts in two:
        assert all(1 <= len(t) <= 16 for t in texts) and len(set(map(tuple, texts))) > 1


def test_example_7_served_on_two_ranks_answers_as_one_rank(names, tmp_path):
    """Example 7 served with the guide's flags (tensor-parallel 2; ``--port`` replaced by a free one), queried by its
    served model name: greedy, it answers one rank's tokens. Building it warns about what funcspec does not do."""
    pytest.importorskip("fastapi")
    line = SERVE_EXAMPLES[7].replace("--tensor-parallel-size 16", "--tensor-parallel-size 2")
    served = Served([*serve_argv(line, names), "--enforce-eager"], tmp_path / "server.log", timeout=300)
    try:
        status, raw, _ = post(served.connection(), "/v1/completions",
                              dict(GREEDY, model="dsv3", prompt=DEEPSEEK_PROMPTS, return_token_ids=True))
    finally:
        served.stop()
    log = served.log.read_text()
    assert all(piece in log for piece in WARNED[7]), log
    want = _texts(eager(**with_value(scaled(7, names), ("tensor_parallel_size",), 1)), [SamplingParams(**GREEDY)])[0]
    assert status == 200, raw
    assert [c["token_ids"] for c in sorted(json.loads(raw)["choices"], key=lambda c: c["index"])] == want
