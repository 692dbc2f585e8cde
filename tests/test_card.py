"""Model cards: every number comes from train.json and the bench file."""

import json

from funcspec.train import card


def test_missed_goals_are_written_from_the_files(tmp_path):
    models = tmp_path / "models"
    (models / "medusa").mkdir(parents=True)
    (models / "medusa" / "train.json").write_text(json.dumps(
        {"params": 1e6, "steps": 123, "tokens": 4.56e5, "final_loss": 1.0, "wall_s": 600}))
    bench = tmp_path / "spec.json"
    rows = [{"engine": "funcspec", "method": "medusa", "tau": 1.5, "per_position_acceptance": [0.4, 0.2, 0.1, 0.05],
             "matches_ar_greedy": True},
            {"engine": "funcspec", "method": "mtp", "tau": 2.0, "per_position_acceptance": [0.7, 0.3, 0.0, 0.0],
             "matches_ar_greedy": True}]
    bench.write_text(json.dumps({"rows": rows, "num_prompts": 2, "prompt_tokens": 8, "max_tokens": 8, "ks": [4],
                                 "batches": [1], "backend": "eager"}))
    text = card.render(models, bench)
    assert "| medusa | 1.50 | ≥ 1.8 ✗ (short by 0.30) |" in text and "| mtp | 2.00 | ≥ 1.8 ✓ |" in text
    assert ("- **medusa**: τ 1.50 against ≥ 1.8; trained 123 steps, 0.46 M tokens, 10 min; acceptance 0.40 at "
            "position 1 and 0.05 at position 4.") in text
    assert "**mtp**" not in text.split("Where goals are missed")[1]
