"""Recipes: the zoo's BPE tokenizer and its targets, trained from scratch on the stdlib.

``target`` is trained with HF ``LlamaForCausalLM`` and ``moe_target`` with HF
``Qwen3MoeForCausalLM`` (next-token cross-entropy, plus the router's
load-balancing loss for the MoE), so both checkpoints are plain HF format that
transformers and funcspec load. ``moe_target`` reuses ``target``'s tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from funcspec.train import data
from funcspec.train.loop import Schedule, train

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"]
VOCAB_SIZE = 4096
SIZES: dict[str, Any] = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)
SCHEDULE = Schedule(steps=1200, lr=2e-3, warmup=50, weight_decay=0.1)
BATCH, SEQ = 16, 256
MOE_SIZES = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
                 intermediate_size=768, max_position_embeddings=2048)  # intermediate_size: unused (all sparse)
MOE_AUX = 0.01
"""``router_aux_loss_coef``: the weight of each layer's Switch load-balancing loss (:func:`balance_loss`)."""
MOE_SCHEDULE = Schedule(steps=3000, lr=2e-3, warmup=50, weight_decay=0.1)
MOE_SHARD = "8MB"


def train_tokenizer(out: Path, vocab_size: int, files: list[Path]) -> None:
    """A byte-level BPE with BOS/EOS/PAD/MASK, saved with the files ``AutoTokenizer`` loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1],
                                   pad_token=SPECIALS[2], mask_token=SPECIALS[3])
    fast.save_pretrained(str(out))


def run(out: Path, work: Path, seed: int = 0, steps: int | None = None,
        stop_after: int | None = None, device: str = "cpu", time_budget: float | None = None) -> dict:
    """Train tokenizer + target into ``out``; returns the model card's facts."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tokenizer.json").exists():
        train_tokenizer(out, VOCAB_SIZE, data.split_files("train"))
    tok = AutoTokenizer.from_pretrained(str(out))
    stream = data.token_stream(tok, "train", work / "tokens")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=True, **SIZES)
    model = LlamaForCausalLM(cfg).to(device)  # type: ignore[arg-type]  # transformers types .to as unbound
    schedule = Schedule(**{**SCHEDULE.__dict__, "steps": steps or SCHEDULE.steps})

    def loss_fn(step):
        x = data.batch(stream, seed, step, BATCH, SEQ).to(device)
        return model(input_ids=x, labels=x).loss, {}

    summary = train(dict(model.named_parameters()), loss_fn, schedule, work / "target", "target", BATCH * SEQ,
                    stop_after=stop_after, time_budget=time_budget)
    model.save_pretrained(str(out))
    return {**summary, "params": sum(p.numel() for p in model.parameters()), "train_stream_tokens": len(stream),
            "corpus": data.manifest("train"), "heldout": data.manifest("heldout"), "sizes": SIZES,
            "batch": [BATCH, SEQ], "seed": seed, **device_facts(device)}


def run_moe(out: Path, work: Path, tokenizer: Path, seed: int = 0, steps: int | None = None,
            stop_after: int | None = None, device: str = "cpu", sizes: dict | None = None,
            time_budget: float | None = None) -> dict:
    """Train the Qwen3-MoE target into ``out`` with the tokenizer at ``tokenizer`` (copied, never retrained);
    saved in bfloat16, in shards of at most ``MOE_SHARD``. ``sizes`` overrides :data:`MOE_SIZES` (tests)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    sizes = {**MOE_SIZES, **(sizes or {})}
    tok, stream = data.copy_tokenizer(tokenizer, out, work)
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=True, router_aux_loss_coef=MOE_AUX,
                         output_router_logits=True, **sizes)
    model = Qwen3MoeForCausalLM(cfg).to(device)  # type: ignore[arg-type]  # transformers types .to as unbound
    schedule = Schedule(**{**MOE_SCHEDULE.__dict__, "steps": steps or MOE_SCHEDULE.steps})
    k = cfg.num_experts_per_tok

    def loss_fn(step):
        # NOTE: HF's own aux loss (in .loss when labels are given) pools every layer's router logits, so it
        # balances the experts' total load only: a GPU run so trained left experts with no tokens in two layers.
        x = data.batch(stream, seed, step, BATCH, SEQ).to(device)
        o = model(input_ids=x)
        ce = torch.nn.functional.cross_entropy(o.logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
        aux = torch.stack([balance_loss(r, k) for r in o.router_logits])  # [L]
        return ce + MOE_AUX * aux.sum(), {"ce": ce.detach(), "aux": aux.detach().mean(),
                                         "load_min": expert_load(o.router_logits, k).min()}

    summary = train(dict(model.named_parameters()), loss_fn, schedule, work / "moe_target", "moe_target",
                    BATCH * SEQ, stop_after=stop_after, time_budget=time_budget)
    with torch.no_grad():  # the load of each expert on a fixed batch (fraction of the top-k picks; 1/E when even)
        x = data.batch(stream, seed + 7, 0, BATCH, SEQ).to(device)
        load = expert_load(model(input_ids=x).router_logits, k)
    model.config.output_router_logits = False  # NOTE: inference needs no router logits; the coefficient stays
    model.to(torch.bfloat16).save_pretrained(str(out), max_shard_size=MOE_SHARD)
    return {**summary, "params": sum(p.numel() for p in model.parameters()), "train_stream_tokens": len(stream),
            "corpus": data.manifest("train"), "heldout": data.manifest("heldout"), "sizes": sizes,
            "router_aux_loss_coef": MOE_AUX, "expert_load": [[round(float(v), 4) for v in row] for row in load],
            "batch": [BATCH, SEQ], "seed": seed, **device_facts(device)}


def balance_loss(logits: torch.Tensor, k: int) -> torch.Tensor:
    """One layer's Switch load-balancing loss from its router logits [T, E], as transformers computes it
    (E · Σ_e picks_e · mean p_e, over the top-``k`` slots; ``k`` when balanced)."""
    probs = logits.float().softmax(-1)
    picks = torch.nn.functional.one_hot(probs.topk(k, -1).indices, logits.shape[-1]).float().mean(0)  # [k, E]
    return logits.shape[-1] * (picks * probs.mean(0)).sum()


def expert_load(router_logits, k: int) -> torch.Tensor:
    """Per layer, each expert's share of the top-``k`` picks: router logits ([T, E] per layer) -> [L, E]."""
    rows = []
    for logits in router_logits:
        ids = logits.topk(k, -1).indices.flatten()
        rows.append(torch.bincount(ids, minlength=logits.shape[-1]).float() / ids.numel())
    return torch.stack(rows)


def device_facts(device: str) -> dict:
    """Where a recipe ran, for its card: ``device`` (``cpu``, ``cuda``) and the accelerator's name."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    return {"device": dev.type, **({"device_name": name} if name else {})}


def heldout_loss(path: Path, seq: int = SEQ, batch: int = 16) -> float:
    """Mean next-token cross-entropy of the HF causal LM at ``path`` over the held-out split."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = [tok.bos_token_id]
    for p in data.split_files("heldout"):
        ids += [*tok.encode(data.read_text(p), add_special_tokens=False), tok.eos_token_id, tok.bos_token_id]
    windows = torch.tensor(ids[:len(ids) // seq * seq]).view(-1, seq)  # [N, seq]
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = windows[i:i + batch]
            total += model(input_ids=x, labels=x).loss.item() * len(x)
    return total / len(windows)
