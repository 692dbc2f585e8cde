"""``funcspec tune-k --tree``: a token tree's node count N per batch size from hand-made capture and spec
results (worked by hand), and the exported file driving a real engine (greedy == AR)."""

import json

import pytest

from funcspec import LLM, Engine, SamplingParams, tune
from funcspec.cli import main
from heads_cases import PROMPTS, TREE

KEYS = {"speculative_token_tree": str(TREE)}  # 7 nodes, depth 3
# Per-depth acceptance measured at N = 2, 4, 7 (E = 1.5, 2.0, 2.5). N = 4 is not a prefix of N = 7.
ACC = {2: [0.5, 0.0, 0.0], 4: [0.75, 0.25, 0.0], 7: [0.75, 0.5, 0.25]}
# replay_ms per (B, N).
COSTS = {
    1: {0: 10.0, 2: 10.0, 7: 10.0},  # N4 costs 10: tokens/s 100, 150, 200~, 250 -> N = 7
    2: {0: 10.0, 2: 12.0, 7: 22.0},  # N4 costs 16: 200, 250, 250~, 227.3 -> N2 and N4 tie -> N = 2
    4: {0: 10.0, 2: 30.0, 4: 40.0, 7: 60.0},  # 400, 200, 200, 166.7 -> N = 0
    8: {0: 20.0, 4: 25.0},  # N2 costs 22.5: 400, 533.3~, 640 -> N = 4; N = 7 is beyond the measured range
}
WANT_TPS = [(1, 0, 100.0, False), (1, 2, 150.0, False), (1, 4, 200.0, True), (1, 7, 250.0, False),
            (2, 0, 200.0, False), (2, 2, 250.0, False), (2, 4, 250.0, True), (2, 7, 5000 / 22, False),
            (4, 0, 400.0, False), (4, 2, 200.0, False), (4, 4, 200.0, False), (4, 7, 4 * 2.5 / 60 * 1e3, False),
            (8, 0, 400.0, False), (8, 2, 8 * 1.5 / 22.5 * 1e3, True), (8, 4, 640.0, False)]


def _capture(costs=COSTS, tree=KEYS):
    buckets = [{"B": b, "K": n, "tokens": b * (n + 1), "replay_ms": ms, "eager_ms": 2 * ms}
               for b, per_n in costs.items() for n, ms in per_n.items()]
    return {"backend": "inductor", "method": "eagle3", "tree": tree, "buckets": buckets}


def _row(n, acc, tree=KEYS, method="eagle3", batch=4):
    return {"engine": "funcspec", "method": method, "k": n, "batch": batch, "tree": tree,
            "per_position_acceptance": acc, "tau": 1 + sum(acc)}


def _spec():
    """AR, the chain at K = 7, the tree at 7, 2, 4, a later N = 2 row (ignored) and another method's tree."""
    return {"rows": [
        {"engine": "funcspec", "method": "ar", "k": 0, "tree": None, "per_position_acceptance": []},
        {"engine": "funcspec", "method": "eagle3", "k": 3, "tree": None, "per_position_acceptance": [0.9, 0.8, 0.7]},
        _row(7, ACC[7]), _row(2, ACC[2]), _row(4, ACC[4]),
        _row(2, [1.0, 0.0, 0.0], batch=8),
        _row(3, [1.0, 1.0], {"speculative_token_tree": "[(0,), (0, 0), (1,)]"}, method="mtp"),
    ]}


def test_hand_worked_tree_table():
    cfg = tune.tune(_capture(), _spec(), "eagle3", spec_keys={"model": "heads/eagle3"}, tree=True)
    assert cfg["speculative_config"] == {
        "model": "heads/eagle3", "method": "eagle3", **KEYS, "num_speculative_tokens": 7,
        "num_speculative_tokens_per_batch_size": [[1, 1, 7], [2, 2, 2], [3, 4, 0], [5, 8, 4]]}
    # B · (N_B + 1): 1·8, 2·3, 4·1, 8·5
    assert cfg["compilation_config"] == {"cudagraph_capture_sizes": [4, 6, 8, 40]}
    t = cfg["tuning"]
    assert t["best_k"] == {"1": 7, "2": 2, "4": 0, "8": 4} and t["tree"] == KEYS and t["tree_nodes"] == 7
    assert t["spec_rows"] == {"2": 3, "4": 4, "7": 2} and t["per_depth_acceptance"] == {str(n): ACC[n] for n in ACC}
    assert t["expected_tokens"] == {"2": 1.5, "4": 2.0, "7": 2.5}
    got = [(r["B"], r["K"], r["tokens_per_s"], r["interpolated"]) for r in t["tokens_per_s"]]
    assert got == [(b, n, pytest.approx(tps, rel=1e-12), i) for b, n, tps, i in WANT_TPS]
    # the chain rows still tune the chain, as before
    chain = tune.tune(_capture(), _spec(), "eagle3", spec_keys={"model": "heads/eagle3"})
    assert chain["tuning"]["spec_row"] == 1 and "speculative_token_tree" not in chain["speculative_config"]


def test_ties_go_to_the_smaller_n_and_max_k_caps_n():
    # B=1: N0 100, N2 1.5/15 -> 100, N4 2/20 -> 100: all tie, so N = 0
    cfg = tune.tune(_capture({1: {0: 10.0, 2: 15.0, 4: 20.0}}), _spec(), "eagle3", spec_keys={"model": "m"},
                    tree=True)
    assert cfg["tuning"]["best_k"] == {"1": 0}
    assert [r["tokens_per_s"] for r in cfg["tuning"]["tokens_per_s"]] == [100.0, 100.0, 100.0]
    capped = tune.tune(_capture(), _spec(), "eagle3", spec_keys={"model": "m"}, tree=True, max_k=4)
    assert capped["tuning"]["best_k"] == {"1": 4, "2": 2, "4": 0, "8": 4}


def test_a_tree_is_picked_by_its_keys_whatever_their_spelling():
    spelled = {"speculative_token_tree": [list(p) for p in reversed(TREE)]}  # lists, unsorted: the same tree
    cfg = tune.tune(_capture(), _spec(), "eagle3", spec_keys={"model": "m"}, tree=spelled)
    assert cfg["tuning"]["best_k"] == {"1": 7, "2": 2, "4": 0, "8": 4}


@pytest.mark.parametrize("spec, kwargs, match", [
    ({"rows": []}, {}, "spec.rows has 0 token trees of method 'eagle3', not one"),
    ({"rows": [_row(2, ACC[2]), _row(1, [0.5], {"speculative_token_tree": "[(0,)]"})]}, {},
     r"spec.rows has 2 token trees of method 'eagle3', not one: pick one with tree="),
    (_spec(), {"tree": {"speculative_token_tree": "[(0,)]"}},
     r"spec.rows has no funcspec row of method 'eagle3' with tree \{'speculative_token_tree': '\[\(0,\)\]'\}"),
    ({"rows": [_row(8, ACC[7])]}, {}, r"spec.rows\[0\].k=8 is above the 7 nodes of its tree"),
    ({"rows": [_row(0, ACC[7])]}, {}, r"spec.rows\[0\].k must be an integer >= 1"),
    ({"rows": [_row(2, [0.5, 0.75, 0.0])]}, {}, r"spec.rows\[0\].per_position_acceptance must not increase"),
    ({"rows": [_row(2, ACC[2], {"speculative_token_tree": "[(0, 1)]"})]}, {},
     r"spec.rows\[0\].tree: speculative_config.speculative_token_tree node \(0, 1\) needs its parent"),
    (_spec(), {"max_k": 8}, r"max_k=8 is beyond the largest tree size N measured in spec.rows \(7\)"),
    (_spec(), {"tree": "yes"}, "tree must be True, False or a dict of token-tree keys"),
    (_spec(), {"spec_keys": {"speculative_eagle_topk": 2}}, "spec_keys.speculative_eagle_topk is set by the tuner"),
])
def test_bad_tree_input_names_the_field(spec, kwargs, match):
    kwargs = {"tree": True, "spec_keys": {"model": "m"}, **kwargs}
    with pytest.raises(ValueError, match=match):
        tune.tune(_capture(), spec, "eagle3", **kwargs)


def test_tune_dispatches_once_to_the_chain_or_the_tree():
    """tune(tree=False) is tune_chain, tune(tree=True) tune_tree of the method's only tree, tune(tree=keys)
    tune_tree of that tree; tune_chain takes no tree, and an empty dict of keys is no tree (not a chain)."""
    cap, spec, keys = _capture(), _spec(), {"model": "m"}
    assert tune.tune(cap, spec, "eagle3", spec_keys=keys) == tune.tune_chain(cap, spec, "eagle3", spec_keys=keys)
    only = tune.tune_tree(cap, spec, "eagle3", spec_keys=keys)
    assert tune.tune(cap, spec, "eagle3", spec_keys=keys, tree=True) == only
    assert tune.tune(cap, spec, "eagle3", spec_keys=keys, tree=KEYS) == tune.tune_tree(cap, spec, "eagle3",
                                                                                       spec_keys=keys, tree=KEYS)
    assert only["tuning"]["best_k"] == {"1": 7, "2": 2, "4": 0, "8": 4}
    with pytest.raises(TypeError, match="unexpected keyword argument 'tree'"):
        tune.tune_chain(cap, spec, "eagle3", spec_keys=keys, tree=KEYS)
    for bad in (True, {}):
        with pytest.raises(ValueError, match=rf"tree must be a dict of token-tree keys, got {bad}"):
            tune.tune_tree(cap, spec, "eagle3", spec_keys=keys, tree=bad)
    with pytest.raises(ValueError, match=r"tree must be a dict of token-tree keys, got \{\}"):
        tune.tune(cap, spec, "eagle3", spec_keys=keys, tree={})


def test_max_k_beyond_the_captured_n_names_the_capture():
    capture = _capture({1: {0: 10.0, 2: 10.0, 4: 10.0}})  # the spec measured N up to 7, the capture up to 4
    with pytest.raises(ValueError, match=r"^max_k=5 is beyond the largest N measured in capture.buckets \(4\)$"):
        tune.tune_tree(capture, _spec(), "eagle3", spec_keys={"model": "m"}, max_k=5)
    assert tune.tune_tree(capture, _spec(), "eagle3", spec_keys={"model": "m"}, max_k=4)["tuning"]["best_k"] == {
        "1": 4}


def test_a_capture_of_other_buckets_warns():
    with pytest.warns(UserWarning, match="capture result was measured with tree None, tuning tree"):
        tune.tune(_capture(tree=None), _spec(), "eagle3", spec_keys={"model": "m"}, tree=True)


def test_cli_tunes_a_tree(tmp_path, capsys):
    cap, spec, out = tmp_path / "capture.json", tmp_path / "spec.json", tmp_path / "tuned.json"
    cap.write_text(json.dumps(_capture()))
    spec.write_text(json.dumps(_spec()))
    main(["tune-k", "--capture", str(cap), "--spec", str(spec), "--method", "eagle3", "--model", "m",
          "--tree", "--max-batch", "4", "--out", str(out)])
    text = capsys.readouterr().out
    assert "   B best N |        N=0        N=2        N=4        N=7" in text
    assert "   2      2 |     200.0      250.0      250.0~     227.3 " in text
    assert "num_speculative_tokens_per_batch_size = [[1, 1, 7], [2, 2, 2], [3, 4, 0]]" in text
    assert json.loads(out.read_text())["speculative_config"]["speculative_token_tree"] == KEYS["speculative_token_tree"]
    with pytest.raises(SystemExit, match="funcspec tune-k: spec.rows has no funcspec row of method 'eagle3' with"):
        main(["tune-k", "--capture", str(cap), "--spec", str(spec), "--method", "eagle3", "--model", "m",
              "--tree", '{"speculative_token_tree": "[(1,)]"}', "--out", str(out)])


def test_exported_tree_file_drives_the_engine(zoo, tmp_path, monkeypatch):
    """LLM(model, **json.load(file)) with the tuned tree: each step drafts the table's N for its active
    batch, only the tuned (B, N) buckets exist, and the output is autoregressive greedy's."""
    cap, spec, out = tmp_path / "capture.json", tmp_path / "spec.json", tmp_path / "tuned.json"
    cap.write_text(json.dumps(_capture()))
    spec.write_text(json.dumps(_spec()))
    tune.tune_files(cap, spec, "eagle3", out, max_batch=4, spec_keys={"model": zoo.paths["eagle3"]}, tree=True)
    exported = tune.load(out)
    assert exported["compilation_config"]["cudagraph_capture_sizes"] == [4, 6, 8]  # 4·(0+1), 2·(2+1), 1·(7+1)
    llm = LLM(zoo.paths["target"], backend="eager", max_model_len=96, **exported)
    eng = llm.engine
    assert eng.plan.bucket_plan.batch_buckets == (1, 2, 4)
    assert eng.plan.bucket_plan.buckets == [(1, 0), (1, 7), (2, 0), (2, 2), (4, 0)]
    seen = []  # (active rows, N the engine chose) per step
    run = eng.runner.step
    monkeypatch.setattr(eng.runner, "step", lambda live, b, k, *a: seen.append((live, k)) or run(live, b, k, *a))
    # Finishing at different lengths walks the active batch down 4 -> 3 -> 2 -> 1.
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 10, 14, 30)]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    want = [o.outputs[0].token_ids for o in Engine(zoo.target, max_num_seqs=4, max_model_len=96,
                                                   enforce_eager=True).generate(
        PROMPTS, params)]
    assert got == want
    assert {n for n, _ in seen} == {1, 2, 3, 4} and all(k == {1: 7, 2: 2, 3: 0, 4: 0}[n] for n, k in seen)


def test_bench_results_of_a_tree_tune_into_a_working_engine(tiny_llama, tmp_path):
    """bench capture --tree (buckets (B, N)) and bench spec --tree-sizes (rows at each N), tuned, then loaded."""
    from funcspec import load_model
    from funcspec.bench import capture, spec
    from funcspec.checkpoints import init_draft_head

    head = str(init_draft_head("eagle", load_model(tiny_llama), tmp_path / "eagle"))
    tree = {"speculative_token_tree": "[(0,), (1,), (0, 0), (1, 0)]"}  # 4 nodes, depth 2
    cap = capture.run(tiny_llama, batches=(1, 2), ks=(0, 2, 4), backend="eager", method="eagle", head=head,
                      tree=tree, reps=3, prompt_len=8, warm=False, out_dir=tmp_path / "capture")
    assert cap["tree"] == tree
    assert [(r["B"], r["K"], r["tokens"]) for r in cap["buckets"]] == [(1, 0, 1), (1, 2, 3), (1, 4, 5), (2, 0, 2),
                                                                        (2, 2, 6), (2, 4, 10)]
    res = spec.run(tiny_llama, methods=[], ks=(), batches=(2,), prompts="repetitive", num_prompts=2, max_tokens=8,
                   heads={"eagle": head}, hf=False, out_dir=tmp_path / "spec", trees=[("eagle", tree)],
                   tree_sizes=(2, 4))
    assert [(r["method"], r["k"], r["tree"]) for r in res["rows"]] == [
        ("ar", 0, None), ("eagle", 4, None), ("eagle", 4, tree), ("eagle", 2, tree)]
    assert all(r["matches_ar_greedy"] for r in res["rows"]) and res["tree_sizes"] == [2, 4]
    cut = res["rows"][3]["per_position_acceptance"]  # (0,), (1,): one level, so depth 2 is never reached
    assert len(cut) == 2 and cut[1] == 0.0
    with pytest.raises(ValueError, match=r"tree_sizes \[5\] must be node counts in 1..4"):
        spec.run(tiny_llama, methods=[], ks=(), trees=[("eagle", tree)], tree_sizes=(5,), heads={"eagle": head})
    out = tmp_path / "tuned.json"
    cfg = tune.tune_files(next((tmp_path / "capture").glob("*.json")), next((tmp_path / "spec").glob("*.json")),
                          "eagle", out, spec_keys={"model": head}, tree=True)
    assert set(cfg["tuning"]["best_k"]) == {"1", "2"} and set(cfg["tuning"]["best_k"].values()) <= {0, 2, 4}
    prompts = spec.repetitive_prompts(2)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = LLM(tiny_llama, backend="eager", max_model_len=64, **tune.load(out)).generate(prompts, greedy)
    want = Engine(tiny_llama, max_num_seqs=2, max_model_len=64, enforce_eager=True).generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
