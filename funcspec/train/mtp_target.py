"""Recipe: ``mtp_target``, a tiny DeepSeek-V3 trained from scratch with its own MTP module.

The trunk is HF ``DeepseekV3ForCausalLM`` (MLA with ``q_lora_rank``; DeepSeekMoE
with a dense first layer, a shared expert and the sigmoid router with
``e_score_correction_bias``), trained on the zoo's token stream with its
tokenizer. One MTP module (depth 1) trains beside it as DeepSeek-V3 trains
its own (arXiv 2412.19437, section 2.2)::

    x_t   = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])    embed zeroed at position 0, as vLLM's deepseek_mtp
    g_t   = block(x_t)                                     a DeepseekV3DecoderLayer (MLA + MoE), index L
    p_t+2 = softmax(head(shared_head.norm(g_t)))           the main model's embedding and head, shared

with ``h_t`` the trunk's final normed hidden state (what vLLM's DeepSeek model
hands its MTP drafter). The loss is next-token cross-entropy plus
:data:`MTP_LAMBDA` times the module's cross-entropy on ``x_{t+2}``; the
module's gradient reaches the trunk through ``h_t``, as in the paper.

Load balance is DeepSeek-V3's auxiliary-loss-free rule, nothing else: after
each step every router's ``e_score_correction_bias`` moves by
:data:`BIAS_SPEED` against its expert's load on that batch (the paper's small
sequence-wise loss is left out). The bias only picks experts; the gate
weights come from the unbiased scores, as in HF and vLLM.

The checkpoint is plain HF: ``save_pretrained`` of the trunk with the module
as ``model.layers.{L}.*`` under DeepSeek-V3's published names
(:func:`mtp_keys`): the block's keys as the trunk's MoE layers store theirs,
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, and copies of the
shared ``embed_tokens`` and head (``shared_head.head``), as DeepSeek-V3 ships
them; ``config.json`` has ``num_nextn_predict_layers: 1``. transformers loads
the trunk and leaves the module's keys unused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from funcspec.train import data
from funcspec.train.loop import Schedule, train
from funcspec.train.target import BATCH, SEQ, device_facts

MTP_SIZES = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                 intermediate_size=768, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
                 n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
                 routed_scaling_factor=2.5, max_position_embeddings=2048)
"""The trunk: moe_target's width, depth and experts (hidden 256, 4 layers, 8 experts top-2 of 256), with MLA
(latent 64 + rope 16 per token, query rank 128) and DeepSeek-V3's MoE (layer 0 dense, one shared expert,
V3's routed scaling 2.5; one expert group, so no group-limited routing)."""
MTP_LAMBDA = 0.3
"""The MTP loss weight λ: DeepSeek-V3's for its first 10T tokens (0.1 after)."""
BIAS_SPEED = 0.001
"""γ, the bias update speed of DeepSeek-V3's auxiliary-loss-free balancing (its value for the first 14.3T tokens)."""
MTP_SCHEDULE = Schedule(steps=3000, lr=2e-3, warmup=50, weight_decay=0.1)
MTP_SHARD = "8MB"
MTP_NAMES = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
             "embed_tokens.weight")
"""The module's keys outside its decoder block, under ``model.layers.{L}.``."""


def build(sizes: dict, vocab: int, bos: int, eos: int, pad: int):
    """A random ``DeepseekV3ForCausalLM`` of ``sizes`` whose ``model.layers`` holds one more layer than
    ``num_hidden_layers``: the MTP module's block (index L, an MoE layer) with its ``enorm``, ``hnorm``,
    ``eh_proj`` and ``shared_head.norm`` attached.

    Why one model: HF initialises the block as it does the trunk's layers, its parameters train with them,
    and ``save_pretrained`` writes it as ``model.layers.{L}.*`` with the trunk's own key conversions (its
    experts stored as the trunk's are). The trunk's forward runs only the first L layers.
    """
    from torch import nn
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    layers = sizes["num_hidden_layers"]
    cfg = DeepseekV3Config(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                           tie_word_embeddings=False, num_nextn_predict_layers=1,  # type: ignore[call-arg]  # kept as an attribute
                           **{**sizes, "num_hidden_layers": layers + 1})
    model = DeepseekV3ForCausalLM(cfg)
    model.config.num_hidden_layers = layers
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    mtp = mtp_layer(model)
    mtp.enorm, mtp.hnorm = DeepseekV3RMSNorm(h, eps), DeepseekV3RMSNorm(h, eps)
    mtp.eh_proj = nn.Linear(2 * h, h, bias=False)
    nn.init.normal_(mtp.eh_proj.weight, std=cfg.initializer_range)
    mtp.shared_head = nn.Module()
    mtp.shared_head.norm = DeepseekV3RMSNorm(h, eps)
    return model


def mtp_layer(model):
    """The MTP module: ``model.model.layers[L]``, past the trunk's layers."""
    return model.model.layers[model.config.num_hidden_layers]


def routers(model) -> list:
    """Every ``DeepseekV3TopkRouter`` of the trunk's MoE layers, then the MTP block's."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def mtp_hidden(model, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The module's outputs g [B, T, H] for next tokens [B, T] (x_{t+1}) and trunk states h [B, T, H] (h_t) at
    positions 0..T-1; the embedding at position 0 is zeroed, as vLLM's ``deepseek_mtp`` does. The embedding is
    the module's own copy where it has one (a loaded checkpoint), else the main model's (training)."""
    from transformers.masking_utils import create_causal_mask

    mtp = mtp_layer(model)
    embed = getattr(mtp, "embed_tokens", model.model.embed_tokens)
    pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)  # [1, T]
    emb = embed(tokens).masked_fill((pos == 0).unsqueeze(-1), 0.0)
    x = mtp.eh_proj(torch.cat([mtp.enorm(emb), mtp.hnorm(h.to(emb.dtype))], -1))
    mask = create_causal_mask(model.config, x, None, None, pos)  # positional: the cache's name moved in 5.x
    return mtp(x, attention_mask=mask, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos))


def mtp_logits(model, g: torch.Tensor) -> torch.Tensor:
    """Logits [.., V] of module outputs g through ``shared_head.norm`` and ``shared_head.head`` where the module
    has its own copy (a loaded checkpoint), else the main model's head (training)."""
    head = mtp_layer(model).shared_head
    return getattr(head, "head", model.lm_head)(head.norm(g))


def losses(model, x: torch.Tensor) -> dict:
    """The trunk's next-token cross-entropy ``ce``, the module's cross-entropy on the token after next ``mtp``
    and ``agree``: how often the module's argmax at t equals the trunk's at t + 1 (the first draft a greedy
    verifier accepts, on teacher-forced text). x: [B, T] token ids."""
    ce_fn = torch.nn.functional.cross_entropy
    h = model.model(input_ids=x).last_hidden_state  # [B, T, H], after the final norm
    logits = model.lm_head(h)
    ce = ce_fn(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
    ml = mtp_logits(model, mtp_hidden(model, x[:, 1:], h[:, :-1]))  # [B, T-1, V]: position t predicts x_{t+2}
    mtp = ce_fn(ml[:, :-1].flatten(0, 1).float(), x[:, 2:].flatten())
    agree = (ml[:, :-1].argmax(-1) == logits[:, 1:-1].argmax(-1)).float().mean()
    return {"ce": ce, "mtp": mtp, "agree": agree.detach()}


def record_picks(model) -> list:
    """Forward hooks on every router (:func:`routers`) that append its top-k expert ids to the returned list,
    one [N, k] tensor per router and forward, in :func:`routers`' order."""
    picks: list = []
    for gate in routers(model):
        gate.register_forward_hook(lambda _m, _i, out: picks.append(out[2].detach()))
    return picks


def loads(picks: list, experts: int) -> torch.Tensor:
    """Each router's expert loads [R, E] (share of its top-k picks; 1/E when even) from its picks [N, k]."""
    return torch.stack([torch.bincount(p.flatten(), minlength=experts).float() / p.numel() for p in picks])


@torch.no_grad()
def update_bias(gates: list, load: torch.Tensor, speed: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free step: each router's ``e_score_correction_bias`` rises by ``speed`` for
    experts under their even share and falls for those over it. load: [R, E] (:func:`loads`)."""
    for gate, row in zip(gates, load):
        gate.e_score_correction_bias.add_(speed * torch.sign(1.0 / row.numel() - row))


def mtp_keys(hf: dict, trunk_keys: list[str]) -> dict[str, tuple[int, ...] | None]:
    """The module's published names under ``model.layers.{L}.`` and their shapes, for a ``config.json``
    ``hf``: its own (:data:`MTP_NAMES`) and its block's, named as the trunk's last layer (an MoE layer, as
    the block is) is saved in ``trunk_keys``, shape ``None`` (that layer's)."""
    h, v = hf["hidden_size"], hf["vocab_size"]
    last = f"model.layers.{hf['num_hidden_layers'] - 1}."
    own = dict(zip(MTP_NAMES, ((h,), (h,), (h, 2 * h), (h,), (v, h), (v, h))))
    return {**{k[len(last):]: None for k in trunk_keys if k.startswith(last)}, **own}


def save(model, out: Path) -> None:
    """The trunk and its MTP module into ``out`` in bfloat16 (routers in float32, as DeepSeek-V3 and HF's
    ``_keep_in_fp32_modules_strict`` keep them), in shards of at most :data:`MTP_SHARD`: the module's
    ``shared_head.head`` and ``embed_tokens`` are copies of the main model's, as DeepSeek-V3 ships them."""
    from torch import nn

    mtp = mtp_layer(model)
    mtp.shared_head.head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    mtp.shared_head.head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    mtp.embed_tokens = nn.Embedding(model.config.vocab_size, model.config.hidden_size)
    mtp.embed_tokens.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    try:
        model.to(torch.bfloat16)
        for gate in routers(model):
            gate.float()
        model.save_pretrained(str(out), max_shard_size=MTP_SHARD)
    finally:
        del mtp.shared_head.head, mtp.embed_tokens


def check(out: Path) -> dict:
    """What a reader of ``out`` finds: the module's keys all there under DeepSeek-V3's names with the right
    shapes, and the trunk loading in transformers (``DeepseekV3ForCausalLM``) with nothing missing and only
    the module's keys unused. Returns key counts for ``train.json``; raises ``ValueError`` naming what is wrong."""
    import json

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from funcspec.checkpoints import read_weights

    hf = json.loads((out / "config.json").read_text())
    if hf.get("num_nextn_predict_layers") != 1 or hf.get("architectures") != ["DeepseekV3ForCausalLM"]:
        raise ValueError(f"{out}/config.json: want DeepseekV3ForCausalLM with num_nextn_predict_layers 1")
    tensors = read_weights(out)
    prefix, last = f"model.layers.{hf['num_hidden_layers']}.", f"model.layers.{hf['num_hidden_layers'] - 1}."
    trunk = [k for k in tensors if not k.startswith(prefix)]
    got = {k[len(prefix):]: tuple(t.shape) for k, t in tensors.items() if k.startswith(prefix)}
    want = {k: shape or tuple(tensors[last + k].shape) for k, shape in mtp_keys(hf, trunk).items()}
    if got != want:
        wrong = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        raise ValueError(f"{out}: MTP keys {[(prefix + k, got.get(k), want.get(k)) for k in wrong]} "
                         "(name, shape found, shape wanted)")
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # NOTE: the load report lists every module key as unexpected, as it should
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
        model, info = loaded  # (model, loading info): output_loading_info=True
    finally:
        logging.set_verbosity(verbosity)
    unused = sorted(info["unexpected_keys"])
    if info["missing_keys"] or any(not k.startswith(prefix) for k in unused):
        raise ValueError(f"{out}: transformers loads it with missing {sorted(info['missing_keys'])} and unused "
                         f"{unused}; want none missing and only {prefix}* unused")
    return {"keys": len(tensors), "trunk_keys": len(trunk), "mtp_keys": len(got), "hf_class": type(model).__name__}


def load(path: Path, dtype: torch.dtype = torch.float32):
    """The checkpoint at ``path`` as :func:`build` lays it out: the trunk and the MTP block loaded by
    transformers, the module's own tensors (norms, ``eh_proj``, its ``embed_tokens`` and ``shared_head``
    copies) set from the files, so :func:`mtp_hidden` and :func:`mtp_logits` run the module as shipped.
    Why: a reference for readers of the checkpoint (funcspec's DeepSeek MTP)."""
    from torch import nn
    from transformers import AutoConfig, DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    from transformers.utils import logging

    from funcspec.checkpoints import read_weights

    layers = AutoConfig.from_pretrained(str(path)).num_hidden_layers
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # NOTE: the module's own tensors are unexpected here; they are set below
    try:
        model = DeepseekV3ForCausalLM.from_pretrained(str(path), dtype=dtype, num_hidden_layers=layers + 1).eval()
    finally:
        logging.set_verbosity(verbosity)
    model.config.num_hidden_layers = layers
    t = {k[len(f"model.layers.{layers}."):]: v for k, v in read_weights(path).items()
         if k.startswith(f"model.layers.{layers}.")}
    mtp = mtp_layer(model)
    mtp.enorm, mtp.hnorm = (DeepseekV3RMSNorm(t["enorm.weight"].shape[0], model.config.rms_norm_eps)
                            for _ in range(2))
    mtp.shared_head = nn.Module()
    mtp.shared_head.norm = DeepseekV3RMSNorm(t["enorm.weight"].shape[0], model.config.rms_norm_eps)
    (eh_out, eh_in), (head_out, head_in) = t["eh_proj.weight"].shape, t["shared_head.head.weight"].shape
    mtp.eh_proj = nn.Linear(eh_in, eh_out, bias=False)
    mtp.shared_head.head = nn.Linear(head_in, head_out, bias=False)
    mtp.embed_tokens = nn.Embedding(*t["embed_tokens.weight"].shape)
    with torch.no_grad():
        for name in MTP_NAMES:
            p = mtp.get_parameter(name)
            p.data = t[name].to(dtype)
    return model


def run(out: Path, work: Path, tokenizer: Path, seed: int = 0, steps: int | None = None,
        stop_after: int | None = None, device: str = "cpu", sizes: dict | None = None,
        time_budget: float | None = None) -> dict:
    """Train the DeepSeek-V3 target and its MTP module into ``out`` with the tokenizer at ``tokenizer`` (copied,
    never retrained); ``sizes`` overrides :data:`MTP_SIZES` (tests). Returns the model card's facts."""
    sizes = {**MTP_SIZES, **(sizes or {})}
    tok, stream = data.copy_tokenizer(tokenizer, out, work)
    torch.manual_seed(seed)
    model = build(sizes, len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id).to(device)
    gates, picks = routers(model), record_picks(model)
    experts = model.config.n_routed_experts
    schedule = Schedule(**{**MTP_SCHEDULE.__dict__, "steps": steps or MTP_SCHEDULE.steps})

    def loss_fn(step):
        x = data.batch(stream, seed, step, BATCH, SEQ).to(device)
        picks.clear()
        parts = losses(model, x)
        load = loads(picks, experts)
        update_bias(gates, load, BIAS_SPEED)
        return (parts["ce"] + MTP_LAMBDA * parts["mtp"],
                {**{k: v.detach() for k, v in parts.items()}, "load_min": load.min()})

    summary = train(dict(model.named_parameters()), loss_fn, schedule, work / "mtp_target", "mtp_target",
                    BATCH * SEQ, stop_after=stop_after, time_budget=time_budget,
                    buffers={f"bias{i}": g.e_score_correction_bias for i, g in enumerate(gates)})
    with torch.no_grad():  # on a fixed batch: the module's loss and agreement, and each router's expert load
        x = data.batch(stream, seed + 7, 0, BATCH, SEQ).to(device)
        picks.clear()
        held = {k: round(float(v), 4) for k, v in losses(model, x).items()}
        load = loads(picks, experts)
    bias = torch.stack([g.e_score_correction_bias for g in gates])
    save(model, out)
    facts = check(out)
    return {**summary, "params": sum(p.numel() for p in model.parameters()),
            "mtp_params": sum(p.numel() for p in mtp_layer(model).parameters()), "train_stream_tokens": len(stream),
            "corpus": data.manifest("train"), "heldout": data.manifest("heldout"), "sizes": sizes,
            "mtp_lambda": MTP_LAMBDA, "bias_speed": BIAS_SPEED, "fixed_batch": held,
            "expert_load": [[round(float(v), 4) for v in row] for row in load],
            "bias_range": [round(float(bias.min()), 4), round(float(bias.max()), 4)], "checkpoint": facts,
            "batch": [BATCH, SEQ], "seed": seed, **device_facts(device)}
