"""Recipes: every drafter of the zoo, distilled from the trained target on the training split.

Each head is trained through the *same* pure functions that draft at inference
(``funcspec.nn.*``), so what is trained is exactly what runs. The label at every
position is the target's next-token distribution there (soft cross-entropy).

Medusa, DFlash and DSpark guess several positions from one state, so they train
on the target's own greedy continuations of training windows
(:func:`funcspec.train.data.greedy_rows`), with losses on the continuation only:
there, the label of every position is what verification will accept. The others
train on raw windows of the split.

- ``draft_model``: a 1-layer HF Llama sharing the tokenizer; logits vs the target's.
- ``medusa``: head k on h_t vs the target's distribution at t+k+1.
- ``mtp`` and ``eagle3``: training-time test. Step 0 runs the head over the whole
  sequence on target features; steps j >= 1 continue from sampled origins a in
  their own KV slot (a copy of step 0's cache) at position a+j, fed their own
  previous output, exactly as drafting does after a catch-up.
- ``dflash`` / ``dspark``: blocks [x_a, MASK...] at sampled anchors a, each in its
  own copy of the context K/V, as ``draft_block`` runs them (2 layers; rows weighted
  exp(-k/4) as in DFlash). DSpark adds its
  Markov bias (teacher-forced on the true previous token) and a confidence head
  trained by BCE on whether the corrected argmax equals the target's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from funcspec.checkpoints import dflash as dflash_ckpt, eagle as eagle_ckpt, medusa as medusa_ckpt, mtp as mtp_ckpt
from funcspec import methods
from funcspec.checkpoints import flatten, init_draft_head, layouts, load_model
from funcspec.nn import dflash, eagle, llama, medusa, mtp
from funcspec.train import data
from funcspec.train.loop import Schedule, train

BATCH, SEQ = 12, 256
TTT_STEPS = 4          # training-time-test depth of mtp / eagle3 (the benchmark drafts K = 4)
ORIGINS = 32           # sampled origins / anchors per sequence for the unrolled steps
EAGLE3_AUX = [1, 2, 3]  # the default [2, L//2, L-3] collides on a 4-layer target
EAGLE3_VOCAB = 2048    # the draft vocabulary: the most frequent target tokens of the training split
DFLASH_LAYERS = [1, 3]
DFLASH_BLOCK = 8       # block rows: anchor + 7 masks (drafts K <= 7)
DSPARK_BLOCK = 7
MARKOV_RANK = 64
BLOCK_LAYERS = 2       # one layer leaves mask rows 3+ nearly blind to the anchor (their query is MASK + RoPE)
BLOCK_DECAY = 4.0      # DFlash's row weights exp(-k / BLOCK_DECAY): a miss at row k voids every row after it
GREEDY_ROWS = 6144     # distillation rows (GREEDY_PROMPT + GREEDY_NEW tokens each) for the roles below
ON_TARGET_TEXT = ("medusa", "dflash", "dspark")
"""Roles trained on the target's own greedy continuations (:func:`data.greedy_rows`) rather than raw text:
the drafters that guess several positions at once, whose labels past the first differ most between the two."""

SCHEDULES = {
    "draft_model": Schedule(steps=300, lr=2e-3, warmup=30),
    "medusa": Schedule(steps=1200, lr=2e-3, warmup=30),
    "mtp": Schedule(steps=200, lr=2e-3, warmup=30),
    "eagle3": Schedule(steps=600, lr=2e-3, warmup=30),
    "dflash": Schedule(steps=3000, lr=2e-3, warmup=30),
    "dspark": Schedule(steps=2000, lr=2e-3, warmup=30),
    "moe_eagle3": Schedule(steps=2400, lr=2e-3, warmup=30),  # on a GPU: 600 steps left agreement at 0.50
}
"""Per role (a role without its own schedule takes its recipe's)."""


# ----------------------------------------------------------------------------- shared pieces


def soft_ce(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -Σ p log softmax(logits); logits, p [.., V]."""
    return soft_ce_rows(logits, p).mean()


def soft_ce_rows(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """-Σ p log softmax(logits) per row: logits, p [.., V] -> [..]."""
    return -(p * torch.log_softmax(logits.float(), -1)).sum(-1)


def decayed(losses: torch.Tensor) -> torch.Tensor:
    """Block rows' losses [N, K] averaged with weights exp(-k / BLOCK_DECAY) over the K rows."""
    w = torch.exp(-torch.arange(losses.shape[1], dtype=losses.dtype, device=losses.device) / BLOCK_DECAY)
    return (losses * w).sum(1).mean() / w.sum()


def agree(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Fraction of rows whose argmax equals the target's (greedy acceptance of that position)."""
    return (logits.argmax(-1) == p.argmax(-1)).float().mean()


def fresh_kv(cfg: llama.ModelConfig, rows: int, max_len: int, device=None) -> llama.KVCache:
    """An empty KV cache for ``rows`` slots of ``max_len`` positions."""
    return llama.init_kv_cache(cfg, rows, max_len, device=device)


def target_pass(target, x: torch.Tensor, layers: tuple[int, ...]):
    """The target over x [B, T]: next-token probs [B, T, V] and hidden states of ``layers`` (no grad)."""
    b, t = x.shape
    slots, starts = torch.arange(b, device=x.device), torch.zeros(b, dtype=torch.int64, device=x.device)
    with torch.no_grad():
        logits, hid, _ = llama.forward(target.cfg, target.params, fresh_kv(target.cfg, b, t, x.device), x, slots,
                                       starts, layers)
    return torch.softmax(logits, -1), hid


def origins(seed: int, step: int, b: int, lo: int, hi: int, n: int) -> torch.Tensor:
    """n sampled positions in [lo, hi) per row: [b, n] int64, a pure function of (seed, step)."""
    g = np.random.default_rng([seed, step, 1])
    return torch.from_numpy(np.stack([g.choice(np.arange(lo, hi), n, replace=False) for _ in range(b)]))


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] at idx [B, N] -> [B·N, ...]."""
    return x[torch.arange(x.shape[0], device=x.device).unsqueeze(1), idx].flatten(0, 1)


def shipped(out: Path, role: str) -> dict[str, str]:
    """The tensors the head at ``out`` ships: funcspec name -> its key in the file (its published layout)."""
    return layouts.read_head(out, methods.METHODS[role].head, role).names  # type: ignore[arg-type]  # a head role


def head_params(params: dict, names) -> dict[str, torch.Tensor]:
    """The trainable leaves of a loaded head: the floating tensors it ships (shared target tensors excluded)."""
    flat = flatten(params)
    return {k: flat[k] for k in names if flat[k].is_floating_point()}


def save_head(out: Path, params: dict, names: dict[str, str], dtype=torch.float32) -> None:
    """Rewrite ``out/model.safetensors`` with the trained tensors under their published names (``names``:
    funcspec name -> published key, from :func:`shipped`)."""
    from safetensors.torch import save_file

    flat = flatten(params)
    tensors = {names[k]: flat[k].detach().to(dtype if flat[k].is_floating_point() else flat[k].dtype).contiguous()
               for k in names}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- per-method losses


def draft_model_setup(target, out: Path, seed: int, stream):
    """A 1-layer HF Llama with the target's tokenizer, embedding and final norm as its start."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf = json.loads((Path(target.path) / "config.json").read_text())
    hf.update(num_hidden_layers=1)
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        hf.pop(key, None)
    model = LlamaForCausalLM(LlamaConfig(**hf)).to(target.params["model"]["embed_tokens"]["weight"].device)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(target.params["model"]["embed_tokens"]["weight"])
        model.model.norm.weight.copy_(target.params["model"]["norm"]["weight"])
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(target.path) / f).exists():
            shutil.copy(Path(target.path) / f, out / f)

    def loss_fn(x, p, _hid, _seed, _step):
        logits = model(input_ids=x).logits
        return soft_ce(logits, p), {"agree": agree(logits, p)}

    return dict(model.named_parameters()), (), loss_fn, lambda: model.save_pretrained(str(out))


def medusa_setup(target, out: Path, seed: int, stream):
    """4 Medusa heads of 1 ResBlock; head k on h_t learns the target's p at t+k+1."""
    init_draft_head("medusa", target, out, seed, num_heads=TTT_STEPS, num_layers=1)
    cfg, params = medusa_ckpt.load_params(out, target)
    names = shipped(out, "medusa")
    with torch.no_grad():  # Medusa starts every head's Linear from the target's LM head
        for k in range(cfg.num_heads):
            params["medusa_head"][k][cfg.num_layers]["weight"].copy_(llama.lm_head(target.cfg, target.params)["weight"])
    layer = target.cfg.num_layers

    def loss_fn(x, p, hid, _seed, _step):
        h, t, metrics = hid[0], x.shape[1], {}
        loss: torch.Tensor | float = 0.0
        s = data.GREEDY_PROMPT - 1  # the last prompt position and on: every later token is the target's
        for k in range(cfg.num_heads):  # head k at t predicts x_{t+k+2}: the target's p at t+k+1
            logits = medusa.head_logits(cfg, params, h[:, s:t - k - 1], k)
            loss = loss + 0.8 ** k * soft_ce(logits, p[:, s + k + 1:])
            metrics[f"agree{k}"] = agree(logits, p[:, s + k + 1:])
        return loss, metrics

    # NOTE: bfloat16 on disk: four V×H matrices would be a quarter of the zoo's size (the loader casts back).
    return head_params(params, names), (layer,), loss_fn, lambda: save_head(out, params, names, torch.bfloat16)


def chain_setup(role: str, target, out: Path, seed: int, stream):
    """mtp / eagle3: step 0 over the sequence, then TTT_STEPS-1 unrolled steps from sampled origins."""
    net: Any  # the head's module: eagle or mtp
    if role == "eagle3":
        init_draft_head("eagle3", target, out, seed, draft_vocab_size=EAGLE3_VOCAB, aux_layers=EAGLE3_AUX)
        cfg, params = eagle_ckpt.load_params(out, target, version=3)
        net, layers = eagle, tuple(llama.capture_index(i, target.cfg.num_layers) for i in cfg.aux_layers)
    else:
        init_draft_head("mtp", target, out, seed)
        cfg, params = mtp_ckpt.load_params(out, target)
        net, layers = mtp, (cfg.hidden_layer,)
        with torch.no_grad():  # the module's head starts as the target's
            params["head"]["weight"].copy_(llama.lm_head(target.cfg, target.params)["weight"])
            params["norm"]["weight"].copy_(target.params["model"]["norm"]["weight"])
    names = shipped(out, role)
    vocab = None
    if role == "eagle3":
        vocab = eagle3_vocab(stream, target.cfg.vocab_size).to(params["d2t"].device)
        with torch.no_grad():
            params["d2t"].copy_(vocab - torch.arange(EAGLE3_VOCAB, device=vocab.device))
            params["t2d"].zero_().index_fill_(0, vocab, True)
            params["lm_head"]["weight"].copy_(llama.lm_head(target.cfg, target.params)["weight"][vocab])
            params["norm"]["weight"].copy_(target.params["model"]["norm"]["weight"])

    def labels(p):  # the target's distribution on the head's vocabulary
        return p if vocab is None else p[..., vocab]

    def loss_fn(x, p, hid, seed, step):
        a = origins(seed, step, x.shape[0], 0, x.shape[1] - TTT_STEPS - 1, ORIGINS).to(x.device)  # [B, N]
        outs = chain_unroll(net, cfg, params, x, torch.cat(hid, -1), a, TTT_STEPS)
        loss: torch.Tensor | float = 0.0
        metrics = {}
        for j, (logits, pos) in enumerate(outs):  # step j at origin t guesses x_{t+j+2}: the target's p at t+j+1
            target_p = labels(p[torch.arange(x.shape[0], device=x.device).unsqueeze(1), pos + 1] if j else p[:, 1:-1])
            loss = loss + 0.8 ** j * soft_ce(logits, target_p)
            metrics[f"agree{j}"] = agree(logits, target_p)
        return loss, metrics

    return head_params(params, names), tuple(layers), loss_fn, lambda: save_head(out, params, names)


def eagle3_vocab(stream: np.ndarray, vocab_size: int) -> torch.Tensor:
    """The EAGLE3_VOCAB most frequent tokens of the training split, ascending ids (EAGLE-3's d2t recipe)."""
    counts = np.bincount(stream, minlength=vocab_size)
    return torch.sort(torch.from_numpy(np.argsort(-counts, kind="stable")[:EAGLE3_VOCAB])).values


def chain_unroll(net, cfg, params, x: torch.Tensor, raw: torch.Tensor, a: torch.Tensor, steps: int):
    """Training-time test of a feature-chain head, as drafting runs it.

    Step 0 runs the head over the whole sequence on target features ``raw``
    [B, T, F] (pairs (f_t, x_{t+1})). Step j >= 1, for each origin a [B, N],
    continues in its own copy of step 0's KV slot at position a+j with token
    x_{a+j+1} and the previous step's output, so it attends to target-feature
    keys up to a and its own keys after, exactly like a draft after catch-up.

    Returns ``[(logits [B, T-2, V_d], None), (logits [B, N, V_d], a + j) for j >= 1]``:
    step 0 at every t < T-2, step j at the origins (its label is the target's p at a+j+1).
    """
    b, t = x.shape
    n, dev = a.shape[1], x.device
    slots, starts = torch.arange(b, device=dev), torch.zeros(b, dtype=torch.int64, device=dev)
    feats = net.target_features(cfg, params, raw)  # [B, T, H]
    g, kv = net.forward(cfg, params, fresh_kv(cfg.model, b, t, dev), x[:, 1:], feats[:, :-1], slots,
                        starts)  # [B, T-1, H]
    outs: list[tuple[torch.Tensor, torch.Tensor | None]] = [(net.draft_logits(cfg, params, g[:, :-1]), None)]
    src = torch.cat([torch.arange(b, device=dev).repeat_interleave(n), torch.tensor([b], device=dev)])  # + scratch
    kv = llama.KVCache(kv.k[:, src], kv.v[:, src], kv.lens[src])
    rows, pos = torch.arange(b * n, device=dev), a.flatten()
    g_prev = gather_rows(g, a)  # [B·N, H]
    xs = x.repeat_interleave(n, 0)  # [B·N, T]
    for j in range(1, steps):
        g_new, kv = net.forward(cfg, params, kv, xs[rows, pos + j + 1].unsqueeze(1), g_prev.unsqueeze(1), rows,
                                pos + j)
        g_prev = g_new[:, 0]
        outs.append((net.draft_logits(cfg, params, g_prev).view(b, n, -1), a + j))
    return outs


def block_setup(role: str, target, out: Path, seed: int, stream):
    """dflash / dspark: blocks at sampled anchors, each in its own copy of the context K/V."""
    rows_per_block = DFLASH_BLOCK if role == "dflash" else DSPARK_BLOCK
    init_draft_head(role, target, out, seed, target_layer_ids=DFLASH_LAYERS, block_size=rows_per_block,
                    mask_token_id=target.tokenizer.mask_token_id, markov_rank=MARKOV_RANK, num_layers=BLOCK_LAYERS)
    cfg, params = dflash_ckpt.load_params(out, target, role)
    names = shipped(out, role)
    layers = cfg.hidden_layers
    shift = 1 if role == "dflash" else 0  # dflash drafts from the mask rows, dspark from every row

    def loss_fn(x, p, hid, seed, step):
        # NOTE: drafting runs blocks of K+1 (dflash) or K (dspark) rows for the bucket's K, and the mask rows
        # see each other; cycling the block length over K = 1..block_size-shift trains every K it allows.
        rows = 1 + shift + step % (rows_per_block - shift)
        # anchors from the last prompt token on: the block's labels are then the target's own continuation
        a = origins(seed, step, x.shape[0], data.GREEDY_PROMPT - 1, x.shape[1] - rows, ORIGINS).to(x.device)
        h = block_rows(cfg, params, x, torch.cat(hid, -1), a, rows).flatten(0, 1)  # [B·N, R, H]
        a = a.flatten()
        r = torch.arange(x.shape[0], device=x.device).repeat_interleave(ORIGINS).unsqueeze(1)  # [B·N, 1] its row
        cols = torch.arange(shift, rows, device=x.device)
        base = dflash.logits(cfg, params, h[:, shift:])  # [N', K, V]: the row at position a+c guesses x_{a+c+1-shift}
        target_p = p[r, a.unsqueeze(1) + cols - shift]  # [N', K, V]
        if role == "dflash":
            return decayed(soft_ce_rows(base, target_p)), {"agree": agree(base, target_p)}
        prev = x[r, a.unsqueeze(1) + cols]  # teacher-forced x_{k-1}: the anchor, then the true tokens
        emb = params["markov_head"]["markov_w1"]["weight"][prev]  # [N', K, r]
        corrected = base + F.linear(emb, params["markov_head"]["markov_w2"]["weight"])
        hit = (corrected.argmax(-1) == target_p.argmax(-1)).float()
        conf = dflash.confidence(cfg, params, h, emb)
        bce = F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), hit)
        return decayed(soft_ce_rows(corrected, target_p)) + 0.1 * bce, {"agree": hit.mean(), "bce": bce}

    # NOTE: bfloat16 on disk keeps the 2-layer blocks inside the zoo's budget (the loader casts back).
    return head_params(params, names), layers, loss_fn, lambda: save_head(out, params, names, torch.bfloat16)


def block_rows(cfg, params, x: torch.Tensor, raw: torch.Tensor, a: torch.Tensor, rows: int) -> torch.Tensor:
    """DFlash/DSpark blocks ``[x_a, MASK × (rows-1)]`` at anchors a [B, N], as ``draft_block`` runs them.

    The context K/V of positions < a come from the target features ``raw``
    [B, T, F]; each block runs in its own copy of its sequence's context slot.
    Returns normed hidden states [B, N, rows, H].
    """
    b, t = x.shape
    n, dev = a.shape[1], x.device
    slots, starts = torch.arange(b, device=dev), torch.zeros(b, dtype=torch.int64, device=dev)
    kv = dflash.write_context(cfg, params, dflash.init_context_kv(cfg, b, t, raw.dtype, raw.device), raw, slots,
                              starts)
    src = torch.cat([torch.arange(b, device=dev).repeat_interleave(n), torch.tensor([b], device=dev)])  # + scratch
    kv = dflash.ContextKV(kv.k[:, src], kv.v[:, src])
    block = torch.full((b * n, rows), cfg.mask_token_id, dtype=torch.int64, device=dev)
    block[:, 0] = gather_rows(x, a)
    h, _ = dflash.block_forward(cfg, params, kv, block, torch.arange(b * n, device=dev), a.flatten())
    return h.view(b, n, rows, -1)


SETUPS: dict[str, Callable[..., Any]] = {"draft_model": draft_model_setup, "medusa": medusa_setup,
          "mtp": functools.partial(chain_setup, "mtp"), "eagle3": functools.partial(chain_setup, "eagle3"),
          "dflash": functools.partial(block_setup, "dflash"), "dspark": functools.partial(block_setup, "dspark")}


def publish(stage: Path, out: Path) -> None:
    """Copy a saved checkpoint's files into ``out``, each written whole (a temporary file, then a rename)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in stage.iterdir():
        shutil.copyfile(f, out / f"{f.name}.tmp")
        (out / f"{f.name}.tmp").replace(out / f.name)


def run(role: str, target: Path, out: Path, work: Path, seed: int = 0, steps: int | None = None,
        stop_after: int | None = None, recipe: str | None = None, device: str = "cpu",
        time_budget: float | None = None) -> dict:
    """Distil ``role`` from the target at ``target`` into ``out`` by ``recipe`` (a key of :data:`SETUPS`;
    default ``role``), on ``device``; returns the model card's facts."""
    from funcspec.train.target import device_facts

    recipe = recipe or role
    tgt = load_model(target, device=device)
    stream = data.token_stream(tgt.tokenizer, "train", work / "tokens")
    # NOTE: a setup writes a freshly initialised head before the trained state is loaded; staging it under
    # ``work`` keeps ``out`` (the committed zoo) whole while a resumed run trains.
    stage = work / role / "checkpoint"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    trainable, layers, loss_of, save = SETUPS[recipe](tgt, stage, seed, stream)
    base = SCHEDULES.get(role, SCHEDULES[recipe])
    schedule = dataclasses.replace(base, steps=steps or base.steps)
    rows = data.greedy_rows(tgt, stream, seed + 1, GREEDY_ROWS, work / "greedy") if recipe in ON_TARGET_TEXT else None

    def loss_fn(step):
        # NOTE: seed + 1: not the target's own batches
        if rows is None:
            x = data.batch(stream, seed + 1, step, BATCH, SEQ)
        else:
            x = data.row_batch(rows, seed + 1, step, BATCH)
        p, hid = target_pass(tgt, x.to(device), layers)
        return loss_of(x.to(device), p, hid, seed, step)

    summary = train(trainable, loss_fn, schedule, work / role, role, BATCH * SEQ, stop_after=stop_after,
                    time_budget=time_budget)
    save()
    publish(stage, out)
    return {**summary, "params": sum(v.numel() for v in trainable.values()),
            "corpus": data.manifest("train"), "batch": [BATCH, SEQ], "seed": seed,
            "distilled_from": Path(target).name, **({"recipe": recipe} if recipe != role else {}),
            **device_facts(device)}
