"""Recipe: the zoo's BPE tokenizer and its Llama target, trained from scratch on the stdlib.

The target is trained with HF ``LlamaForCausalLM`` (next-token cross-entropy),
so the committed checkpoint is plain HF format that both transformers and
funcspec load.
"""

from __future__ import annotations

from pathlib import Path

import torch

from funcspec.train import data
from funcspec.train.loop import Schedule, train

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"]
VOCAB_SIZE = 4096
SIZES = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)
SCHEDULE = Schedule(steps=1200, lr=2e-3, warmup=50, weight_decay=0.1)
BATCH, SEQ = 16, 256


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
        stop_after: int | None = None) -> dict:
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
    model = LlamaForCausalLM(cfg)
    schedule = Schedule(**{**SCHEDULE.__dict__, "steps": steps or SCHEDULE.steps})

    def loss_fn(step):
        x = data.batch(stream, seed, step, BATCH, SEQ)
        return model(input_ids=x, labels=x).loss, {}

    summary = train(dict(model.named_parameters()), loss_fn, schedule, work / "target", "target", BATCH * SEQ,
                    stop_after=stop_after)
    model.save_pretrained(str(out))
    return {**summary, "params": sum(p.numel() for p in model.parameters()), "train_stream_tokens": len(stream),
            "corpus": data.manifest("train"), "heldout": data.manifest("heldout"), "sizes": SIZES,
            "batch": [BATCH, SEQ], "seed": seed}


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
