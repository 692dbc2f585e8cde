"""Bad input through ``funcspec.LLM(...)`` and ``LLM.generate``: a corpus of (input, exception, message) rows.

Every row raises exactly its exception type (a ``ValueError``, or ``FileNotFoundError`` for a missing file,
never a bare ``TypeError``, ``AttributeError`` or ``JSONDecodeError``) with a message naming the argument or
the file, and leaves no half-built state:

- ``LLM(...)``: an argument that can be judged on its own is refused before the checkpoint is read (the row's
  ``reads`` is False: ``load_model`` is replaced by a tripwire), and no process is left behind.
- ``generate``: nothing is queued or running afterwards, the refused call took no request id (an unseeded
  request's seed is its id), and the engine still generates what it generated before.

Everything runs on the zoo target (``models/target``) with ``enforce_eager=True``: no graph is compiled.
"""

from __future__ import annotations

import multiprocessing
import re
from pathlib import Path

import pytest
import torch

import funcspec
from funcspec import SamplingParams, zoo

TARGET = Path(zoo.model_path("target"))
EAGLE3 = Path(zoo.model_path("eagle3"))
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
DTYPES = re.escape("['auto', 'bfloat16', 'double', 'float', 'float16', 'float32', 'float64', 'half']")
PROMPT_KINDS = re.escape("a string, a list of token ids or a dict with 'prompt' or 'prompt_token_ids'")
K_LIMIT = r"a step verifies at most 64 tokens per row \(K \+ 1, as a token tree's N \+ 1\)"


def _copy_with(src: Path, name: str, text: str):
    """A builder of a copy of checkpoint ``src`` (its files symlinked) whose file ``name`` holds ``text``."""
    def build(tmp_path: Path) -> str:
        out = tmp_path / src.name
        out.mkdir()
        for f in src.iterdir():
            if f.name != name:
                (out / f.name).symlink_to(f)
        (out / name).write_text(text)
        return str(out)
    return build


CORRUPT_CONFIG = _copy_with(TARGET, "config.json", '{"hidden_size": 256,')
CORRUPT_GENERATION_CONFIG = _copy_with(TARGET, "generation_config.json", "{oops")
CORRUPT_TOKENIZER_CONFIG = _copy_with(TARGET, "tokenizer_config.json", "{oops")
CORRUPT_DRAFT_CONFIG = _copy_with(EAGLE3, "config.json", "")


def _eagle3(k=None, **extra):
    spec = {"method": "eagle3", "model": str(EAGLE3), **extra}
    return spec if k is None else {**spec, "num_speculative_tokens": k}


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}

# (LLM keyword arguments, exception, message regex, reads the checkpoint before refusing).
# A callable value is a builder: it is called with the test's tmp_path and replaced by what it returns.
CONSTRUCTION = [
    pytest.param(dict(dtype="float7"), ValueError, rf"^dtype must be one of {DTYPES} or a floating torch dtype, "
                 r"got 'float7'$", False, id="dtype-unknown-name"),
    pytest.param(dict(dtype="int32"), ValueError, r"^dtype must be one of .*, got 'int32'$", False,
                 id="dtype-integer-name"),
    pytest.param(dict(dtype=torch.int8), ValueError, r"^dtype must be one of .*, got torch\.int8$", False,
                 id="dtype-integer-torch"),
    pytest.param(dict(dtype=3), ValueError, r"^dtype must be one of .*, got 3$", False, id="dtype-not-a-name"),
    pytest.param(dict(speculative_config=_eagle3(500)), ValueError,
                 rf"^speculative_config\.num_speculative_tokens must be <= 63 for method 'eagle3': {K_LIMIT}, "
                 r"got 500$", False, id="eagle3-chain-k-500"),
    pytest.param(dict(speculative_config={"method": "ngram", "num_speculative_tokens": 64}), ValueError,
                 r"^speculative_config\.num_speculative_tokens must be <= 63 for method 'ngram'.* got 64$", False,
                 id="ngram-k-64"),
    pytest.param(dict(speculative_config={"method": "suffix", "suffix_decoding_max_tree_depth": 100}), ValueError,
                 r"^speculative_config\.num_speculative_tokens must be <= 63 for method 'suffix' \(its default: "
                 r"suffix_decoding_max_tree_depth\): .* got 100$", False, id="suffix-k-from-depth-100"),
    pytest.param(dict(speculative_config={"method": "eagle-3", "num_speculative_tokens": 2}), ValueError,
                 r"^speculative_config\.method must be one of \[.*\].*got 'eagle-3'$", False, id="unknown-method"),
    pytest.param(dict(speculative_config={**NGRAM, "num_speculative_token": 3}), ValueError,
                 r"^speculative_config\.num_speculative_token is not a known key; did you mean "
                 r"'num_speculative_tokens'\?$", False, id="spec-unknown-key-suggested"),
    pytest.param(dict(speculative_config={"method": "ngram", "num_speculative_tokens": "3"}), ValueError,
                 r"^speculative_config\.num_speculative_tokens must be an integer for method 'ngram', got '3'$",
                 False, id="spec-k-string"),
    pytest.param(dict(speculative_config={**NGRAM, "prompt_lookup_min": 0}), ValueError,
                 r"^speculative_config\.prompt_lookup_min must be >= 1, got 0$", False, id="spec-ngram-window"),
    pytest.param(dict(speculative_config={**NGRAM, "num_speculative_tokens_per_batch_size": "1-8:3"}), ValueError,
                 r"^speculative_config\.num_speculative_tokens_per_batch_size must be a non-empty list", False,
                 id="spec-table-string"),
    pytest.param(dict(speculative_config={**_eagle3(3), "draft_model_config": [1]}), ValueError,
                 r"^speculative_config\.draft_model_config must be a dict, got list$", False,
                 id="spec-draft-model-config-list"),
    pytest.param(dict(speculative_config=[("method", "ngram")]), ValueError,
                 r"^speculative_config must be a dict, got list$", False, id="spec-list"),
    pytest.param(dict(speculative_config=5), ValueError, r"^speculative_config must be a dict, got int$", False,
                 id="spec-int"),
    pytest.param(dict(speculative_config="{method"), ValueError, r"^speculative_config is not valid JSON: ", False,
                 id="spec-bad-json-string"),
    pytest.param(dict(additional_config=[1]), ValueError, r"^additional_config must be a dict, got list$", False,
                 id="additional-list-without-spec"),
    pytest.param(dict(speculative_config=NGRAM,
                      additional_config={"rejection_sampler_config": {"posterior_thresold": 0.9}}), ValueError,
                 r"^additional_config\.rejection_sampler_config\.posterior_thresold is not a known key; did you mean "
                 r"'posterior_threshold'\?$", False, id="additional-unknown-key-suggested"),
    pytest.param(dict(speculative_config=_eagle3(3, model="/no/such/draft")), ValueError,
                 r"^speculative_config\.model '/no/such/draft' does not exist", False, id="draft-missing"),
    pytest.param(dict(speculative_config={"method": "eagle3", "model": CORRUPT_DRAFT_CONFIG}), ValueError,
                 r"^/.*/eagle3/config\.json: not valid JSON \(", False, id="draft-corrupt-config-k-from-it"),
    pytest.param(dict(speculative_config={"model": CORRUPT_DRAFT_CONFIG, "num_speculative_tokens": 2}), ValueError,
                 r"^/.*/eagle3/config\.json: not valid JSON \(", False, id="draft-corrupt-config-method-from-it"),
    pytest.param(dict(max_num_seqs=-1), ValueError, r"^max_num_seqs must be >= 1, got -1$", False,
                 id="max-num-seqs-negative"),
    pytest.param(dict(max_num_seqs=2.5), ValueError, r"^max_num_seqs must be an integer, got 2\.5$", False,
                 id="max-num-seqs-float"),
    pytest.param(dict(max_model_len="64"), ValueError, r"^max_model_len must be an integer, got '64'$", False,
                 id="max-model-len-string"),
    pytest.param(dict(max_model_len=1), ValueError, r"^max_model_len must be >= 2, got 1$", False,
                 id="max-model-len-1"),
    pytest.param(dict(max_num_seq=4), ValueError, r"^LLM: unknown engine argument\(s\) \['max_num_seq'\] "
                 r"\('max_num_seq': did you mean 'max_num_seqs'\?\)$", False, id="unknown-argument-suggested"),
    pytest.param(dict(enforce_eager="yes"), ValueError, r"^enforce_eager must be a bool, got 'yes'$", False,
                 id="enforce-eager-string"),
    pytest.param(dict(seed="x"), ValueError, r"^seed must be an integer, got 'x'$", False, id="seed-string"),
    pytest.param(dict(backend="tpu"), ValueError, r"^backend must be one of \(.*\), got 'tpu'$", False,
                 id="backend-unknown"),
    pytest.param(dict(device="gpu0"), ValueError, r"^device must be a torch device name .* got 'gpu0'", False,
                 id="device-unknown"),
    pytest.param(dict(quantization="int3"), ValueError, r"^quantization must be one of ", False,
                 id="quantization-unknown"),
    pytest.param(dict(tensor_parallel_size=0), ValueError, r"^tensor_parallel_size must be >= 1, got 0$",
                 False, id="tensor-parallel-0"),
    pytest.param(dict(compilation_config=[1]), ValueError, r"^compilation_config must be a dict .* got list$",
                 False, id="compilation-config-list"),
    pytest.param(dict(compilation_config={"capture": "never"}), ValueError,
                 r"^compilation_config\.capture must be one of \('startup', 'lazy'\), got 'never'$", False,
                 id="compilation-capture-unknown"),
    pytest.param(dict(compilation_config={"cudagraph_capture_sizes": "abc"}), ValueError,
                 r"^compilation_config\.cudagraph_capture_sizes must be a list of integers >= 1, got 'abc'$", False,
                 id="compilation-sizes-string"),
    pytest.param(dict(tokenizer=3), ValueError, r"^tokenizer must be a directory path, got 3$", False,
                 id="tokenizer-not-a-path"),
    pytest.param(dict(model=None), ValueError, r"^model must be a checkpoint directory or a \.gguf file path, "
                 r"got None$", False, id="model-none"),
    # what only the files can tell
    pytest.param(dict(model="/no/such/model"), FileNotFoundError,
                 r"^model path '/no/such/model' does not exist or is not a directory$", True, id="model-missing"),
    pytest.param(dict(model=CORRUPT_CONFIG), ValueError, r"^/.*/target/config\.json: not valid JSON \(", True,
                 id="corrupt-config-json"),
    pytest.param(dict(model=CORRUPT_GENERATION_CONFIG), ValueError,
                 r"^/.*/target/generation_config\.json: not valid JSON \(", True, id="corrupt-generation-config"),
    pytest.param(dict(model=CORRUPT_TOKENIZER_CONFIG), ValueError,
                 r"^/.*/target/tokenizer_config\.json: not valid JSON \(", True, id="corrupt-tokenizer-config"),
    pytest.param(dict(tokenizer="/no/such/tokenizer"), FileNotFoundError,
                 r"^tokenizer '/no/such/tokenizer': not a directory with a tokenizer", False,
                 id="tokenizer-missing"),
]


def _materialise(value, tmp_path):
    """``value`` with every builder (a callable) replaced by what it builds under ``tmp_path``."""
    if isinstance(value, dict):
        return {k: _materialise(v, tmp_path) for k, v in value.items()}
    return value(tmp_path) if callable(value) and not isinstance(value, (type, torch.dtype)) else value


@pytest.mark.parametrize(("kwargs", "exc", "match", "reads"), CONSTRUCTION)
def test_bad_llm_arguments(kwargs, exc, match, reads, tmp_path, monkeypatch):
    kwargs = _materialise(kwargs, tmp_path)
    if not reads:  # judged on the arguments alone: refused before the checkpoint is read
        def tripwire(*args, **kw):
            raise AssertionError("LLM(...) read the checkpoint before refusing its arguments")
        monkeypatch.setattr("funcspec.build.load_model", tripwire)
        monkeypatch.setattr("funcspec.build.load_config", tripwire)
    args = {"model": str(TARGET), "enforce_eager": True, "max_num_seqs": 2, "max_model_len": 64, **kwargs}
    with pytest.raises(exc) as err:
        funcspec.LLM(**args)
    assert type(err.value) is exc, f"{type(err.value).__name__}: {err.value}"
    assert re.search(match, str(err.value)), str(err.value)
    assert multiprocessing.active_children() == []


# ----------------------------------------------------------------------------- generate


@pytest.fixture(scope="module")
def llm():
    """One engine for every generate row; its reference output and next request id are checked after each."""
    llm = funcspec.LLM(str(TARGET), enforce_eager=True, max_num_seqs=2, max_model_len=64)
    llm.reference = llm.generate([5, 6, 7], GREEDY)[0].outputs[0].token_ids
    return llm


# (prompts, sampling_params, exception, message regex)
GENERATE = [
    pytest.param(None, None, ValueError, rf"^prompts must be {PROMPT_KINDS}, or a list of them, got None$",
                 id="prompts-none"),
    pytest.param([None], None, ValueError, rf"^prompts\[0\] must be {PROMPT_KINDS}, got None$", id="list-of-none"),
    pytest.param(["def f(x):", None], None, ValueError, r"^prompts\[1\] must be .*, got None$",
                 id="list-with-none"),
    pytest.param(["def f(x):", 3], None, ValueError, r"^prompts\[1\] must be .*, got int$", id="list-with-int"),
    pytest.param(["def f(x):", 1.5], None, ValueError, r"^prompts\[1\] must be .*, got float$",
                 id="list-with-float"),
    pytest.param([1.5, 2.5], None, ValueError, r"^prompts\[0\] must be a token id \(an integer\), got 1\.5$",
                 id="float-token-ids"),
    pytest.param([[7, 2.0]], None, ValueError, r"^prompts\[0\]\[1\] must be a token id \(an integer\), got 2\.0$",
                 id="float-token-id-in-a-list"),
    pytest.param([[3, True]], None, ValueError, r"^prompts\[0\]\[1\] must be a token id \(an integer\), got True$",
                 id="bool-token-id"),
    pytest.param([5, "a"], None, ValueError, r"^prompts\[1\] must be a token id \(an integer\), got 'a'$",
                 id="string-among-token-ids"),
    pytest.param(3, None, ValueError, r"^prompts must be .*, or a list of them, got int$", id="prompts-int"),
    pytest.param(b"def f", None, ValueError, r"^prompts must be .*, or a list of them, got bytes$",
                 id="prompts-bytes"),
    pytest.param({"promt": "def f"}, None, ValueError,
                 r"^prompts: key promt is not a known key; did you mean 'prompt'\?$", id="dict-unknown-key"),
    pytest.param({}, None, ValueError, r"^prompts: a prompt dict needs 'prompt_token_ids' or 'prompt'$",
                 id="dict-empty"),
    pytest.param([{"prompt": 3}], None, ValueError, r"^prompts\[0\]\['prompt'\] must be a string, got int$",
                 id="dict-prompt-int"),
    pytest.param({"prompt_token_ids": None}, None, ValueError,
                 r"^prompts\['prompt_token_ids'\] must be a list of token ids, got None$", id="dict-ids-none"),
    pytest.param({"prompt_token_ids": [1, 2.5]}, None, ValueError,
                 r"^prompts\['prompt_token_ids'\]\[1\] must be a token id \(an integer\), got 2\.5$",
                 id="dict-float-id"),
    pytest.param("", None, ValueError, r"^prompt must not be empty$", id="empty-text"),
    pytest.param([[]], None, ValueError, r"^prompt must not be empty$", id="empty-token-ids"),
    pytest.param([[5, 4096]], None, ValueError, r"^prompt_token_ids must be in \[0, 4096\), got 4096 at position 1$",
                 id="id-past-vocab"),
    pytest.param([[-1]], None, ValueError, r"^prompt_token_ids must be in \[0, 4096\), got -1 at position 0$",
                 id="negative-id"),
    pytest.param(["def f(x):", [5, 4096]], None, ValueError,
                 r"^prompt_token_ids must be in \[0, 4096\), got 4096 at position 1$", id="second-prompt-past-vocab"),
    pytest.param([[1] * 64], None, ValueError, r"^prompt of 64 tokens does not fit max_model_len=64",
                 id="prompt-too-long"),
    pytest.param("def f(x):", {"temperature": 0}, ValueError,
                 r"^sampling_params must be a SamplingParams or a list of them, got dict$", id="params-dict"),
    pytest.param(["def f(x):"], [None], ValueError, r"^sampling_params\[0\] must be a SamplingParams, got None$",
                 id="params-list-of-none"),
    pytest.param(["def f(x):"], [GREEDY, GREEDY], ValueError, r"^sampling_params: got 2 for 1 prompts$",
                 id="params-count"),
    pytest.param("def f(x):", SamplingParams(n=3), ValueError,
                 r"^SamplingParams\.n=3 must be <= max_num_seqs=2", id="n-above-slots"),
]


@pytest.mark.parametrize(("prompts", "params", "exc", "match"), GENERATE)
def test_bad_generate_input(llm, prompts, params, exc, match):
    sched = llm.engine.scheduler
    counter = sched.counter
    with pytest.raises(exc) as err:
        llm.generate(prompts, params)
    assert type(err.value) is exc, f"{type(err.value).__name__}: {err.value}"
    assert re.search(match, str(err.value)), str(err.value)
    # nothing half-built: no request queued or running, no request id taken, every slot free
    assert not llm.engine.has_unfinished_requests() and sched.counter == counter
    assert sorted(sched.free_slots) == [0, 1]
    out = llm.generate([5, 6, 7], GREEDY)[0]
    assert out.outputs[0].token_ids == llm.reference and out.request_id == str(counter)


@pytest.mark.parametrize(("prompt", "params", "match"), [
    pytest.param(None, None, r"^prompt must be .*, got None$", id="none"),
    pytest.param([[1, 2]], None, r"^prompt\[0\] must be a token id \(an integer\), got \[1, 2\]$",
                 id="a-list-of-prompts"),
    pytest.param([1, 2], {"temperature": 0}, r"^sampling_params must be a SamplingParams, got dict$",
                 id="params-dict"),
])
def test_bad_add_request_input(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request(prompt, params)
    assert not llm.engine.has_unfinished_requests()


def test_accepted_prompt_forms_still_run(llm):
    """The forms vLLM takes (and arrays of ids) all still run: one token-id list, a tuple, a dict, a tensor."""
    want = llm.reference
    for prompt in ([5, 6, 7], (5, 6, 7), {"prompt_token_ids": [5, 6, 7]}, torch.tensor([5, 6, 7]),
                   [torch.tensor([5, 6, 7])], {"prompt": None, "prompt_token_ids": (5, 6, 7)}):
        assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == want, prompt
    assert llm.generate([], GREEDY) == []
