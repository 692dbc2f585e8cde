"""``models/README.md``: model cards written from each role's ``train.json`` and a bench spec result.

``funcspec train card [--bench spec-heldout.json [--bench spec-other.json]]`` regenerates it,
so the numbers in the cards are exactly those the recipes and the benchmark wrote.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

from funcspec.train.target import heldout_loss

GOALS = {"eagle3": 2.5, "dflash": 2.5, "dspark": 2.5, "mtp": 1.8, "medusa": 1.8, "draft_model": 2.0}
RIVALS = {"dflash": ("eagle3",), "dspark": ("eagle3", "dflash")}
"""Drafters whose τ on the same prompts a block drafter must also reach (issue #14's goals)."""

ROLE_TEXT = {
    "target": "Llama (HF `LlamaForCausalLM`), trained from scratch on next-token cross-entropy.",
    "draft_model": "1-layer Llama with the target's tokenizer; loads in transformers, so HF `assistant_model` "
                   "can use it. Distilled from the target's distributions.",
    "medusa": "FasterDecoding layout (`medusa_head.{k}.{j}.linear`, `medusa_head.{k}.1`), 4 heads of 1 ResBlock, "
              "each Linear started from the target's LM head; head k trained on the target's distribution at t+k+1, "
              "on the target's own greedy text (below). Saved in bfloat16 (its four V×H matrices would otherwise be "
              "a quarter of the zoo).",
    "mtp": "DeepSeek-V3 layout (`model.layers.4.{enorm,hnorm,eh_proj,shared_head}` + a decoder block), a separate "
           "checkpoint; trained with training-time test over 4 chained steps.",
    "eagle3": "EAGLE-3 layout (`fc` over aux layers [1, 2, 3], `midlayer`, `norm`, `lm_head` over a 2048-token "
              "draft vocabulary with `d2t`/`t2d`); training-time test over 4 steps.",
    "dflash": "z-lab layout (`fc` over target layers [1, 3], `hidden_norm`, 2 non-causal Qwen3 layers, "
              "`dflash_config`); blocks of an anchor and 1-7 masks (cycled, so every K <= 7 is trained) at "
              "32 sampled anchors per sequence, each in its own copy of the context K/V, on the target's own greedy "
              "text; block rows weighted exp(-k/4) as in DFlash. Saved in bfloat16.",
    "dspark": "DeepSpec layout: the DFlash backbone (2 layers) plus a rank-64 Markov head "
              "(`markov_head.markov_w{1,2}`) and a confidence head on [h; W1[x_prev]] (BCE on whether the corrected "
              "argmax is the target's); blocks of 1-7 rows, the Markov head teacher-forced on the previous token, "
              "on the target's own greedy text with DFlash's row weights. Saved in bfloat16.",
    "moe_target": "Qwen3-MoE (HF `Qwen3MoeForCausalLM`), trained from scratch on the target's token stream with its "
                  "tokenizer: next-token cross-entropy plus each layer's Switch load-balancing loss (weight "
                  "`router_aux_loss_coef`), so every expert of every layer keeps a share (its final loss includes "
                  "those terms, about 0.01 × 2 a layer). Saved in bfloat16, in shards of at most 8 MB.",
    "mtp_target": "DeepSeek-V3 (HF `DeepseekV3ForCausalLM`: MLA with q_lora_rank 128, kv_lora_rank 64, rope 16; "
                  "layer 0 dense, then 8 routed experts top-2 with one shared expert and the sigmoid router) trained "
                  "from scratch on the target's token stream with its tokenizer, with one MTP module as DeepSeek-V3 "
                  "trains its own: `eh_proj` over [enorm(embed(x_t+1)); hnorm(h_t)] (the trunk's final normed state, "
                  "the embedding zeroed at position 0 as vLLM does), an MLA + MoE block, then `shared_head.norm` and "
                  "the main model's head, on x_t+2; its final loss is next-token cross-entropy plus `mtp_lambda` "
                  "(0.3) × the module's. Expert balance by DeepSeek-V3's auxiliary-loss-free bias update "
                  "(`e_score_correction_bias`, speed `bias_speed`), no balance loss (the expert load below: the "
                  "trunk's three MoE layers, then the MTP block). Saved in bfloat16 (routers in "
                  "float32), the module as `model.layers.4.*` under DeepSeek-V3's names (`enorm`, `hnorm`, `eh_proj`, "
                  "`shared_head.{norm,head}`, `embed_tokens`, the block), `num_nextn_predict_layers: 1`; "
                  "transformers loads the trunk and leaves those keys unused.",
    "moe_eagle3": "The eagle3 recipe (same layout, draft vocabulary and training-time test) distilled from moe_target: "
                  "its aux layers [1, 2, 3] are MoE layers.",
}
HELDOUT_ROLES = ("target", "draft_model", "moe_target", "mtp_target")
"""HF causal LMs, whose held-out loss the cards compute."""


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _tau_rows(bench: dict | None) -> dict[str, dict]:
    """The funcspec rows of a bench spec result by method (the first K and batch measured)."""
    out: dict[str, dict] = {}
    for r in (bench or {}).get("rows", []):
        if r["engine"] == "funcspec" and r["method"] != "ar" and not r.get("tree"):
            out.setdefault(r["method"], r)
    return out


def corpus_name(corpus: dict) -> str:
    """The training corpus by its Python version and the command that finds it, never the training machine's
    absolute path (``train.json`` records it; older ones hold only the path, whose first version number is
    the interpreter's)."""
    version = corpus.get("python") or re.search(r"\d+\.\d+(?:\.\d+)?", corpus["stdlib"]).group(0)  # type: ignore[union-attr]  # a versioned path
    return (f"The standard library of CPython {version}, the directory that `python -c \"import sysconfig; "
            "print(sysconfig.get_paths()['stdlib'])\"` prints (`funcspec.train.data.stdlib_root()`)")


def render(models: Path, bench_paths: Sequence[Path] = ()) -> str:
    """The model cards as markdown; ``bench_paths``: bench spec results, the first on the held-out
    stdlib (where goals are judged), any others on corpora no model was trained on."""
    benches = [(p, json.loads(p.read_text())) for p in bench_paths]
    lines = ["# The funcspec model zoo", "",
             "Every checkpoint here was trained on this repository's CPU machine (2 cores), unless its card names "
             "another device, from the Python standard library by the recipes in `funcspec/train/` "
             "(`funcspec train all`; resumable, fixed seeds). "
             "`zoo.json` maps roles to directories. This file is generated by `funcspec train card`.", ""]
    facts = {}
    for role_dir in sorted(p for p in models.iterdir() if (p / "train.json").exists()):
        facts[role_dir.name] = json.loads((role_dir / "train.json").read_text())
    if "target" in facts:
        c = facts["target"]["corpus"]
        h = facts["target"]["heldout"]
        lines += ["## Corpus", "",
                  f"- {corpus_name(c)}: `.py` files, sorted, without `test`/`tests`/`idlelib`/`lib2to3`/"
                  "`site-packages` parts.",
                  f"- Training split: {c['files']} files, {c['bytes'] / 1e6:.1f} MB "
                  f"(sha256 of the path list `{c['paths_sha256'][:16]}`).",
                  f"- Held-out split: {h['files']} files, {h['bytes'] / 1e6:.2f} MB: sha256(relative path) % 100 < 5.",
                  f"- Tokenizer: byte-level BPE, vocab 4096 with `<|bos|>` `<|eos|>` `<|pad|>` `<|mask|>`; "
                  f"{facts['target']['train_stream_tokens']:,} training tokens.",
                  "- The drafters that guess several positions at once (medusa, dflash, dspark) train on the target's "
                  "own text: training-split windows of 128 tokens, each continued greedily by the target for 128 "
                  "tokens, with losses on the continuation only; that is what verification accepts. The others "
                  "train on the raw split.", ""]
    lines += ["## Cards", "",
              "Final loss: the training loss over the last 25 steps (soft cross-entropy against the target's "
              "distribution for the drafters, summed over positions/steps with their weights where a head predicts "
              "several). Held-out loss: next-token cross-entropy on the held-out split (HF causal LMs only).", "",
              "| role | params | size | steps | tokens seen | final loss | held-out loss | wall time |",
              "|---|---|---|---|---|---|---|---|"]
    for role, f in facts.items():
        held = f"{heldout_loss(models / role):.3f}" if role in HELDOUT_ROLES else "-"
        lines.append(f"| {role} | {f['params'] / 1e6:.2f} M | {_size(models / role) / 1e6:.1f} MB | {f['steps']} | "
                     f"{f['tokens'] / 1e6:.2f} M | {f['final_loss']:.3f} | {held} | {f['wall_s'] / 60:.1f} min |")
    total = sum(_size(models / r) for r in facts)
    lines += ["", f"Total checkpoint size: {total / 1e6:.1f} MB.", ""]
    for role, f in facts.items():
        extra = f.get("final_metrics") or {}
        agree = ", ".join(f"{k} {v:.2f}" for k, v in extra.items() if k.startswith("agree"))
        lines.append(f"- **{role}**: {ROLE_TEXT.get(role, '')}" + (f" Last logged argmax agreement with the "
                                                                      f"target: {agree}." if agree else "")
                     + _load_text(f) + _mtp_text(f) + _device_text(f)
                     + (f" Run: {f['history']}." if f.get("history") else ""))
    for i, (path, result) in enumerate(benches):
        rows = _tau_rows(result)
        lines += ["", "## Measured acceptance" + ("" if i == 0 else f" on a second corpus: {result.get('corpus')}"), "",
                  f"`funcspec bench spec` ({path.name}): {result['num_prompts']} prompts of "
                  f"{result['prompt_tokens']} tokens from {result.get('corpus', 'held-out stdlib files')}, "
                  f"{result['max_tokens']} new tokens, greedy, K = {result['ks'][0]}, batch {result['batches'][0]}, "
                  f"backend {result['backend']}." + ("" if i == 0 else " No model here was trained on it; the goals "
                                                      "are judged on the first corpus."), "",
                  "| method | τ (mean tokens per step) | goal | per-position acceptance | = AR greedy |",
                  "|---|---|---|---|---|"]
        for m, r in rows.items():
            goal_text, met = _goal(m, r, rows)
            mark = "" if met is None or i else (" ✓" if met else f" ✗ (short by {_threshold(m, rows) - r['tau']:.2f})")
            acc = ", ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
            lines.append(f"| {m} | {r['tau']:.2f} | {goal_text if i == 0 else '-'}{mark} | {acc} | "
                         f"{r['matches_ar_greedy']} |")
        if i == 0:
            lines += misses(facts, rows)
    return "\n".join(lines) + "\n"


def _device_text(facts: dict) -> str:
    """The card's line on where a role trained, when not on the CPU machine (``device`` in train.json)."""
    if facts.get("device", "cpu") == "cpu":
        return ""
    cut = (f" Its {facts['planned_steps']}-step schedule was shortened to {facts['steps']} steps to fit its time "
           "budget (`--time-budget`)." if facts.get("planned_steps") else "")
    return (f" Trained on an {facts.get('device_name') or facts['device']} (`--device {facts['device']}`), "
            "not the 2-core CPU." + cut)


def _load_text(facts: dict) -> str:
    """A MoE's expert load on a fixed batch (train.json's ``expert_load``: per layer, each expert's share)."""
    load = facts.get("expert_load")
    if not load:
        return ""
    flat = [v for row in load for v in row]
    return (f" Expert load on a fixed training batch (share of the top-k picks, {1 / len(load[0]):.3f} when even): "
            f"{min(flat):.3f} to {max(flat):.3f} over {len(load)} layers × {len(load[0])} experts.")


def _mtp_text(facts: dict) -> str:
    """A target's own MTP module on a fixed training batch (train.json's ``fixed_batch``: the trunk's and the
    module's cross-entropy, and how often the module's argmax is the trunk's next one)."""
    fixed = facts.get("fixed_batch")
    if not fixed:
        return ""
    return (f" On a fixed training batch: next-token cross-entropy {fixed['ce']:.3f}, the MTP module's (token after "
            f"next) {fixed['mtp']:.3f}, its argmax equal to the trunk's next argmax {fixed['agree']:.2f} of the time.")


def _goal(method: str, row: dict, rows: dict) -> tuple[str, bool | None]:
    """(goal text, met?) of one drafter's τ: its fixed floor and, for the block drafters, the measured τ
    of the drafters it must match (DFlash and DSpark ≥ EAGLE-3; DSpark ≥ DFlash)."""
    if method not in GOALS:
        return "report", None
    parts = [f"≥ {GOALS[method]}"] + [f"≥ {m} ({rows[m]['tau']:.2f})" for m in RIVALS.get(method, ()) if m in rows]
    return ", ".join(parts), row["tau"] >= _threshold(method, rows)


def _threshold(method: str, rows: dict) -> float:
    """The τ a drafter must reach: the largest of its floor and its rivals' measured τ."""
    return max([GOALS[method]] + [rows[m]["tau"] for m in RIVALS.get(method, ()) if m in rows])


def misses(facts: dict, rows: dict) -> list[str]:
    """Each drafter short of its goal: its training budget (train.json) and where its acceptance falls
    (the bench's per-position acceptance). Every number comes from those files."""
    out = []
    for m, r in rows.items():
        goal_text, met = _goal(m, r, rows)
        if met is not False:
            continue
        f, acc = facts.get(m), r["per_position_acceptance"]
        budget = f"{f['steps']} steps, {f['tokens'] / 1e6:.2f} M tokens, {f['wall_s'] / 60:.0f} min" if f else "?"
        out.append(f"- **{m}**: τ {r['tau']:.2f} against {goal_text}; trained {budget}; acceptance "
                   f"{acc[0]:.2f} at position 1 and {acc[-1]:.2f} at position {len(acc)}.")
    if out:
        out = ["", "**Where goals are missed.**", ""] + out + ["", WHAT_WOULD_CLOSE]
    return out


WHAT_WOULD_CLOSE = """Heads that chain their own tokens (draft_model, MTP, EAGLE-3) keep acceptance after the first
position; heads that guess several positions in parallel from one state (Medusa heads, DFlash/DSpark mask rows) lose
it fastest. The recipes are resumable (`funcspec train <role> --steps N`), and longer training is what closed
EAGLE-3's gap; for the block drafters, z-lab and DeepSpec train on ~10^8 tokens with several layers."""


def write(models: Path, bench_paths: Sequence[Path] = ()) -> Path:
    """Write ``models/README.md``; returns its path."""
    out = models / "README.md"
    out.write_text(render(models, bench_paths))
    return out
