"""``funcspec tune-k``: the K table from measured costs and acceptance, worked by hand, and the
exported file driving a real engine (tiny Llama, eager, greedy ngram)."""

import json

import pytest
import torch

from funcspec import LLM, Engine, SamplingParams, tune
from funcspec.cli import main

# Hand-worked example. The acceptance is P(first i+1 drafts all accepted), so
# E[tokens | K] = 1 + sum_{i<K} a_i = 1, 1.75, 2.25, 2.5 for K = 0..3.
ACCEPTANCE = [0.75, 0.5, 0.25]
# replay_ms per (B, K). K = 2 is never measured: its cost is the mean of K = 1 and K = 3.
COSTS = {
    1: {0: 10.0, 1: 10.0, 3: 10.0},  # K2 costs 10: tokens/s 100, 175, 225, 250 -> K = 3
    2: {0: 10.0, 1: 16.0, 3: 22.0},  # K2 costs 19: 200, 218.75, 4500/19 = 236.8, 5000/22 = 227.3 -> K = 2
    4: {0: 10.0, 1: 20.0, 3: 40.0},  # K2 costs 30: 400, 350, 300, 250 -> K = 0
    8: {0: 20.0, 1: 40.0},  # only K <= 1 measured: 400, 350 -> K = 0
}
WANT_TPS = [(1, 0, 100.0, False), (1, 1, 175.0, False), (1, 2, 225.0, True), (1, 3, 250.0, False),
            (2, 0, 200.0, False), (2, 1, 218.75, False), (2, 2, 4500 / 19, True), (2, 3, 5000 / 22, False),
            (4, 0, 400.0, False), (4, 1, 350.0, False), (4, 2, 300.0, True), (4, 3, 250.0, False),
            (8, 0, 400.0, False), (8, 1, 350.0, False)]
NGRAM_WINDOW = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _capture(costs=COSTS, field="replay_ms"):
    """A `bench capture` result with the given costs (eager_ms is twice the replay cost)."""
    buckets = [{"B": b, "K": k, "tokens": b * (k + 1), field: ms, "eager_ms": 2 * ms}
               for b, per_k in costs.items() for k, ms in per_k.items()]
    return {"backend": "inductor", "method": "ngram", "device": "cpu", "buckets": buckets}


def _spec(acceptance=ACCEPTANCE, method="ngram"):
    """A `bench spec` result: an AR row, the method's row, and an HF row without acceptance."""
    return {"rows": [
        {"engine": "funcspec", "method": "ar", "k": 0, "per_position_acceptance": []},
        {"engine": "funcspec", "method": method, "k": len(acceptance), "per_position_acceptance": acceptance,
         "tau": 1 + sum(acceptance)},
        {"engine": "hf", "method": "prompt_lookup", "k": 3},
    ]}


def _files(tmp_path, capture=None, spec=None):
    cap, spec_path = tmp_path / "capture.json", tmp_path / "spec.json"
    cap.write_text(json.dumps(capture or _capture()))
    spec_path.write_text(json.dumps(spec or _spec()))
    return cap, spec_path


def test_expected_tokens_sums_the_unconditional_acceptance():
    assert [tune.expected_tokens(ACCEPTANCE, k) for k in range(4)] == [1.0, 1.75, 2.25, 2.5]


def test_cost_is_interpolated_linearly_in_k_and_never_extrapolated():
    measured = {1: 16.0, 3: 22.0, 7: 30.0}
    assert [tune.interpolate_cost(measured, k) for k in range(1, 8)] == [16.0, 19.0, 22.0, 24.0, 26.0, 28.0, 30.0]
    for k in (0, 8):
        with pytest.raises(ValueError, match=f"k={k} is outside the measured K range 1..7 of capture bucket B=2"):
            tune.interpolate_cost(measured, k, b=2)


def test_hand_worked_table(tmp_path):
    cap, spec = _files(tmp_path)
    cfg = tune.tune_files(cap, spec, "ngram", tmp_path / "out.json", spec_keys=NGRAM_WINDOW)
    assert json.loads((tmp_path / "out.json").read_text()) == tune.llm_kwargs(cfg)
    assert json.loads((tmp_path / "out.tuning.json").read_text()) == cfg["tuning"]
    assert cfg["speculative_config"] == {
        "prompt_lookup_min": 1, "prompt_lookup_max": 3, "method": "ngram", "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 2, 2], [3, 8, 0]]}
    # B · (K_B + 1): 1·4, 2·3, 4·1, 8·1.
    assert cfg["compilation_config"] == {"cudagraph_capture_sizes": [4, 6, 8]}
    t = cfg["tuning"]
    assert (t["capture"], t["spec"], t["cost"]) == (str(cap), str(spec), "replay_ms")
    assert (t["max_batch"], t["spec_row"], t["per_position_acceptance"]) == (8, 1, ACCEPTANCE)
    assert t["best_k"] == {"1": 3, "2": 2, "4": 0, "8": 0} and t["batch_buckets"] == [1, 2, 4, 8]
    got = [(r["B"], r["K"], r["tokens_per_s"], r["interpolated"]) for r in t["tokens_per_s"]]
    assert got == [(b, k, pytest.approx(tps, rel=1e-12), i) for b, k, tps, i in WANT_TPS]


def test_max_batch_keeps_the_bucket_that_pads_it(tmp_path):
    """3 active rows run in bucket 4, so the table stops at 3 but bucket 4's K and capture size stay."""
    cfg = tune.tune(_capture(), _spec(), "ngram", max_batch=3)
    assert cfg["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 2, 2], [3, 3, 0]]
    assert cfg["compilation_config"]["cudagraph_capture_sizes"] == [4, 6]
    assert cfg["tuning"]["batch_buckets"] == [1, 2, 4]


def test_ties_go_to_the_smaller_k_and_eager_cost_is_selectable():
    # B=2 with K3 at 20 ms: K2 (interpolated, 18 ms) and K3 both give exactly 250 tokens/s.
    cfg = tune.tune(_capture({2: {0: 10.0, 1: 16.0, 3: 20.0}}), _spec(), "ngram")
    assert cfg["tuning"]["best_k"] == {"2": 2}
    assert [r["tokens_per_s"] for r in cfg["tuning"]["tokens_per_s"]] == [200.0, 218.75, 250.0, 250.0]
    # eager_ms doubles every cost: half the tokens/s, same K.
    eager = tune.tune(_capture({2: {0: 10.0, 1: 16.0, 3: 20.0}}), _spec(), "ngram", cost="eager_ms")
    assert [r["tokens_per_s"] for r in eager["tuning"]["tokens_per_s"]] == [100.0, 109.375, 125.0, 125.0]


def test_k_is_capped_by_the_acceptance_and_by_max_k():
    """Costs measured up to K=5 but acceptance only to K=3: K stops at 3; max_k=1 caps it further."""
    capture = _capture({1: {0: 10.0, 5: 10.0}})
    assert [r["K"] for r in tune.tune(capture, _spec(), "ngram")["tuning"]["tokens_per_s"]] == [0, 1, 2, 3]
    capped = tune.tune(capture, _spec(), "ngram", max_k=1)
    assert capped["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 1]]
    assert capped["compilation_config"]["cudagraph_capture_sizes"] == [2]


def test_k_zero_everywhere_still_gives_a_valid_config():
    cfg = tune.tune(_capture({1: {0: 1.0, 1: 100.0}}), _spec(), "ngram")
    assert cfg["speculative_config"]["num_speculative_tokens"] == 1
    assert cfg["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 0]]


def test_range_compression():
    assert tune.compress_ranges([3, 2, 0, 0, 0]) == [[1, 1, 3], [2, 2, 2], [3, 5, 0]]
    assert tune.compress_ranges([1, 1, 1]) == [[1, 3, 1]]
    assert tune.compress_ranges([2, 1, 2]) == [[1, 1, 2], [2, 2, 1], [3, 3, 2]]
    assert tune.k_per_batch_size({1: 3, 4: 1, 16: 0}, 10) == [3, 1, 1, 1, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("capture, spec, kwargs, match", [
    (_capture(), _spec(method="suffix"), {}, r"spec.rows has no funcspec row with method 'ngram'; "
                                             r"methods: \['ar', 'suffix'\]"),
    (_capture(), {"rows": [{"engine": "funcspec", "k": 3}]}, {}, r"spec.rows\[0\].method is missing"),
    (_capture(), _spec(), {"max_k": 4},
     r"max_k=4 is beyond the measured spec.rows\[1\].per_position_acceptance \(3 positions\)"),
    (_capture({1: {0: 1.0, 1: 2.0}}), _spec(), {"max_k": 2},
     r"max_k=2 is beyond the largest K measured in capture.buckets \(1\)"),
    (_capture(), _spec(), {"max_batch": 9}, "max_batch=9 is above the largest measured capture bucket B=8"),
    (_capture(), _spec([0.5, 0.75]), {}, r"spec.rows\[1\].per_position_acceptance must not increase"),
    (_capture(), _spec(), {"cost": "eager"}, "cost must be one of"),
    ({"buckets": [{"B": 1, "K": 0, "eager_ms": 1.0}]}, _spec(), {"cost": "replay_ms"},
     r"capture.buckets\[0\].replay_ms is missing"),
    (_capture(), _spec(), {"spec_keys": {"num_speculative_tokens": 2}}, "spec_keys.num_speculative_tokens is set"),
    (_capture(), _spec(), {"spec_keys": {"prompt_lookup_maxx": 3}}, "speculative_config.prompt_lookup_maxx"),
    ({**_capture(), "method": "suffix"}, _spec(method="suffix"), {"method": "suffix"},
     "num_speculative_tokens_per_batch_size is not supported with method 'suffix'"),
])
def test_bad_input_names_the_field(capture, spec, kwargs, match):
    kwargs = dict(kwargs)
    method = kwargs.pop("method", "ngram")
    with pytest.raises(ValueError, match=match):
        tune.tune(capture, spec, method, **kwargs)


def test_expected_tokens_refuses_k_beyond_the_measured_positions():
    with pytest.raises(ValueError, match=r"k=4 is beyond the measured per_position_acceptance \(3 positions\)"):
        tune.expected_tokens(ACCEPTANCE, 4)


def test_cli_prints_the_table_and_writes_the_file(tmp_path, capsys):
    cap, spec = _files(tmp_path)
    out = tmp_path / "tuned" / "tuned-k.json"
    main(["tune-k", "--capture", str(cap), "--spec", str(spec), "--method", "ngram", "--max-batch", "4",
          "--spec-key", "prompt_lookup_min=1", "--spec-key", "prompt_lookup_max=3", "--out", str(out)])
    text = capsys.readouterr().out
    assert "   2      2 |     200.0      218.8      236.8~     227.3 " in text
    assert "num_speculative_tokens_per_batch_size = [[1, 1, 3], [2, 2, 2], [3, 4, 0]]" in text
    assert text.rstrip().endswith(f"wrote {out}")
    assert json.loads(out.read_text())["speculative_config"]["prompt_lookup_max"] == 3
    with pytest.raises(SystemExit, match="funcspec tune-k: max_batch=9 is above"):
        main(["tune-k", "--capture", str(cap), "--spec", str(spec), "--method", "ngram", "--max-batch", "9"])


def _prompts(n: int) -> list[list[int]]:
    """Repetitive prompts, so ngram finds matches."""
    g = torch.Generator().manual_seed(0)
    motifs = [torch.randint(3, 96, (3 + i % 3,), generator=g).tolist() for i in range(n)]
    return [(m * 4)[: 6 + 3 * i] for i, m in enumerate(motifs)]


def test_exported_file_drives_the_engine(tiny_llama, tmp_path, monkeypatch):
    """LLM(model, **json.load(file)): the exported file as it is; every step's K is the table's K for
    its active batch, and the output is autoregressive greedy's, token for token."""
    cap, spec = _files(tmp_path)
    out = tmp_path / "tuned-k.json"
    tune.tune_files(cap, spec, "ngram", out, max_batch=4, spec_keys=NGRAM_WINDOW)
    exported = json.loads(out.read_text())
    assert set(exported) == {"speculative_config", "compilation_config", "max_num_seqs"}
    assert json.loads(out.with_suffix(".tuning.json").read_text())["batch_buckets"] == [1, 2, 4]
    table = exported["speculative_config"]["num_speculative_tokens_per_batch_size"]
    assert table == [[1, 1, 3], [2, 2, 2], [3, 4, 0]]
    assert exported["compilation_config"]["cudagraph_capture_sizes"] == [4, 6]  # 1·(3+1), 2·(2+1), 4·(0+1)
    assert tune.load(out) == exported
    llm = LLM(tiny_llama, enforce_eager=True, max_model_len=96, **exported)
    eng = llm.engine
    assert eng.plan.bucket_plan.batch_buckets == (1, 2, 4) and eng.num_slots == 4
    seen = []  # (active rows, K the engine chose) per step
    run = eng.runner.step
    monkeypatch.setattr(eng.runner, "step", lambda live, b, k, *a: seen.append((live, k)) or run(live, b, k, *a))
    prompts = _prompts(4)
    # Finishing at different lengths walks the active batch down 4 -> 3 -> 2 -> 1.
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 10, 14, 40)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ar = Engine(tiny_llama, max_num_seqs=4, max_model_len=96, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in ar.generate(prompts, params)]
    assert got == want
    table_k = {n: k for start, end, k in table for n in range(start, end + 1)}
    assert all(k == table_k[n] for n, k in seen)
    assert {n for n, _ in seen} == {1, 2, 3, 4} and {k for _, k in seen} == {0, 2, 3}
    bucket = {1: 1, 2: 2, 3: 4, 4: 4}
    assert set(eng.stats()["buckets_used"]) == {f"B{bucket[n]}_K{k}" for n, k in seen}
