"""Model cards: every number comes from train.json and the bench file."""

import json

from funcspec.train import card


def test_missed_goals_are_written_from_the_files(tmp_path):
    models = tmp_path / "models"
    (models / "medusa").mkdir(parents=True)
    (models / "medusa" / "train.json").write_text(json.dumps(
        {"params": 1e6, "steps": 123, "tokens": 4.56e5, "final_loss": 1.0, "wall_s": 600,
         "history": "resumed once with --steps 123"}))
    bench = tmp_path / "spec.json"
    rows = [{"engine": "funcspec", "method": "medusa", "tau": 1.5, "per_position_acceptance": [0.4, 0.2, 0.1, 0.05],
             "matches_ar_greedy": True},
            {"engine": "funcspec", "method": "mtp", "tau": 2.0, "per_position_acceptance": [0.7, 0.3, 0.0, 0.0],
             "matches_ar_greedy": True}]
    bench.write_text(json.dumps({"rows": rows, "num_prompts": 2, "prompt_tokens": 8, "max_tokens": 8, "ks": [4],
                                 "batches": [1], "backend": "eager"}))
    text = card.render(models, [bench])
    assert "| medusa | 1.50 | ≥ 1.8 ✗ (short by 0.30) |" in text and "| mtp | 2.00 | ≥ 1.8 ✓ |" in text
    assert ("- **medusa**: τ 1.50 against ≥ 1.8; trained 123 steps, 0.46 M tokens, 10 min; acceptance 0.40 at "
            "position 1 and 0.05 at position 4.") in text
    assert "**mtp**" not in text.split("Where goals are missed")[1]
    assert "Run: resumed once with --steps 123." in text


def _bench(path, rows, corpus=None):
    path.write_text(json.dumps({"rows": [{"engine": "funcspec", "matches_ar_greedy": True, **r} for r in rows],
                                "num_prompts": 2, "prompt_tokens": 8, "max_tokens": 8, "ks": [4], "batches": [1],
                                "backend": "eager", **({"corpus": corpus} if corpus else {})}))
    return path


def test_block_drafters_must_also_reach_their_rivals_and_every_corpus_gets_a_table(tmp_path):
    (tmp_path / "models").mkdir()
    acc = [0.8, 0.6, 0.4, 0.2]
    first = _bench(tmp_path / "a.json", [{"method": "eagle3", "tau": 2.9, "per_position_acceptance": acc},
                                         {"method": "dflash", "tau": 2.7, "per_position_acceptance": acc},
                                         {"method": "dspark", "tau": 2.95, "per_position_acceptance": acc}])
    second = _bench(tmp_path / "b.json", [{"method": "dflash", "tau": 1.9, "per_position_acceptance": acc}],
                    corpus="numpy 2.4.6 (installed package, outside the stdlib)")
    text = card.render(tmp_path / "models", [first, second])
    # DFlash clears its floor of 2.5 but not EAGLE-3's 2.9 on the same prompts
    assert "| dflash | 2.70 | ≥ 2.5, ≥ eagle3 (2.90) ✗ (short by 0.20) |" in text
    assert "| dspark | 2.95 | ≥ 2.5, ≥ eagle3 (2.90), ≥ dflash (2.70) ✓ |" in text
    tail = text.split("## Measured acceptance on a second corpus: numpy 2.4.6")[1]
    assert "| dflash | 1.90 | - | 0.80, 0.60, 0.40, 0.20 | True |" in tail and "✗" not in tail


def test_the_corpus_is_named_by_version_never_by_the_training_machine_path():
    root = card.Path(__file__).parents[2] / "models"
    corpus = json.loads((root / "target" / "train.json").read_text())["corpus"]
    name = card.corpus_name(corpus)  # train.json holds the path only: the version comes from it
    assert name.startswith("The standard library of CPython 3.11.7,") and corpus["stdlib"] not in name
    assert any(line.startswith(f"- {name}:") for line in (root / "README.md").read_text().splitlines())
    assert card.corpus_name({"stdlib": "/x/lib/python3.12", "python": "3.12.1"}).startswith(
        "The standard library of CPython 3.12.1,")


def test_a_gpu_role_card_names_its_device_and_expert_load(tmp_path):
    models = tmp_path / "models"
    (models / "moe_eagle3").mkdir(parents=True)
    (models / "moe_eagle3" / "train.json").write_text(json.dumps(
        {"params": 1e6, "steps": 500, "planned_steps": 600, "tokens": 1e6, "final_loss": 1.0, "wall_s": 60,
         "device": "cuda", "device_name": "NVIDIA H200",
         "expert_load": [[0.25, 0.3, 0.2, 0.25], [0.1, 0.4, 0.25, 0.25]]}))
    text = card.render(models)
    assert "Trained on an NVIDIA H200 (`--device cuda`), not the 2-core CPU." in text
    assert "Its 600-step schedule was shortened to 500 steps" in text
    assert "0.250 when even): 0.100 to 0.400 over 2 layers × 4 experts." in text
