"""Draft heads as their authors publish them, and their authors' forwards, for the published-layout tests.

Two halves, written from reading the authors' code and vLLM's loaders (each
writer and reference names its source), never from funcspec's:

- **writers** save a tiny random head in exactly the published file names,
  config.json fields and key names;
- **references** are those modules' forwards in plain torch over the whole
  sequence (no KV cache: every draft step recomputes from scratch), reading
  the published tensors by their published names, and a target's features from
  ``transformers``' own model.

``reference_drafts(...)`` is what each head drafts after a context: the tests
check funcspec's incremental drafts against it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

# ----------------------------------------------------------------------------- random tensors


def rand(gen, *shape, scale=None):
    """U(±1/√fan_in) matrices (U(±scale/√fan_in) with ``scale``), N(1, 0.1) norms, U(±0.1) vectors."""
    if len(shape) == 2:
        return (torch.rand(*shape, generator=gen) * 2 - 1) * ((scale or 1.0) / math.sqrt(shape[1]))
    return (torch.rand(*shape, generator=gen) * 2 - 1) * 0.1


def norm_weight(gen, n):
    return 1.0 + 0.1 * torch.randn(n, generator=gen)


def save(path: Path, config: dict, tensors: dict, file: str = "model.safetensors") -> Path:
    """Write ``config.json`` and ``file`` (safetensors, or a PyTorch pickle for .bin / .pt) into ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if file.endswith(".safetensors"):
        save_file(tensors, str(path / file), metadata={"format": "pt"})
    else:
        torch.save(tensors, path / file)
    return path


def read_back(file: Path) -> dict:
    """The tensors of a safetensors file."""
    from safetensors.torch import load_file

    return load_file(str(file))


def save_sharded_bin(path: Path, tensors: dict, shards: int = 2) -> None:
    """``pytorch_model-0000i-of-0000n.bin`` shards and ``pytorch_model.bin.index.json``, as transformers shards."""
    keys, weight_map = sorted(tensors), {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: tensors[k].contiguous() for k in keys[i::shards]}
        torch.save(part, path / name)
        weight_map.update({k: name for k in part})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def block_tensors(gen, prefix, h, heads, kv_heads, inter, in_features=None, qkv_bias=False, o_bias=False,
                  qk_norm=False, input_norm=True):
    """One HF-named decoder block (q/k/v read ``in_features``)."""
    d, i = h // heads, in_features or h
    t = {f"{prefix}self_attn.q_proj.weight": rand(gen, heads * d, i),
         f"{prefix}self_attn.k_proj.weight": rand(gen, kv_heads * d, i),
         f"{prefix}self_attn.v_proj.weight": rand(gen, kv_heads * d, i),
         f"{prefix}self_attn.o_proj.weight": rand(gen, h, heads * d),
         f"{prefix}mlp.gate_proj.weight": rand(gen, inter, h), f"{prefix}mlp.up_proj.weight": rand(gen, inter, h),
         f"{prefix}mlp.down_proj.weight": rand(gen, h, inter),
         f"{prefix}post_attention_layernorm.weight": norm_weight(gen, h)}
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = norm_weight(gen, h)
    if qkv_bias:
        t.update({f"{prefix}self_attn.{n}_proj.bias": rand(gen, o) for n, o in (("q", heads * d), ("k", kv_heads * d),
                                                                              ("v", kv_heads * d))})
    if o_bias:
        t[f"{prefix}self_attn.o_proj.bias"] = rand(gen, h)
    if qk_norm:
        t[f"{prefix}self_attn.q_norm.weight"] = norm_weight(gen, d)
        t[f"{prefix}self_attn.k_norm.weight"] = norm_weight(gen, d)
    return t


def llama_fields(t, **over) -> dict:
    """The decoder fields of a HF LlamaConfig with the target's dims (``t``: a funcspec ModelConfig)."""
    out = dict(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_attention_heads=t.num_heads,
               num_key_value_heads=t.num_kv_heads, num_hidden_layers=1, vocab_size=t.vocab_size,
               rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings,
               hidden_act="silu", rope_theta=t.rope_theta)
    out.update(over)
    return out


# ----------------------------------------------------------------------------- reference math (HF conventions)


def rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def lin(x, p, name):
    y = x @ p[name + ".weight"].T
    return y + p[name + ".bias"] if name + ".bias" in p else y


def rope(x, pos, theta):
    """Rotate-half RoPE of x [T, H, D] at positions pos [T] (HF's default rotary embedding)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    f = pos.float()[:, None] * inv
    emb = torch.cat([f, f], -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def attention(c, p, pre, x, mask):
    """Self-attention of x [T, in] under ``mask`` [T, T] (True: visible), HF Llama/Qwen2/Qwen3 semantics."""
    t = x.shape[0]
    hd = c.head_dim
    q = lin(x, p, pre + "q_proj").view(t, -1, hd)
    k = lin(x, p, pre + "k_proj").view(t, -1, hd)
    v = lin(x, p, pre + "v_proj").view(t, -1, hd)
    if pre + "q_norm.weight" in p:  # Qwen3: per-head norm before RoPE
        q, k = rms(q, p[pre + "q_norm.weight"], c.eps), rms(k, p[pre + "k_norm.weight"], c.eps)
    pos = torch.arange(t)
    q, k = rope(q, pos, c.theta), rope(k, pos, c.theta)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    a = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return lin(torch.einsum("hqk,khd->qhd", a, v).reshape(t, -1), p, pre + "o_proj")


def decoder_layer(c, p, pre, x, mask, attn_in=None):
    """A pre-norm block; ``attn_in`` replaces ``input_layernorm(x)`` (EAGLE's layer 0)."""
    a = rms(x, p[pre + "input_layernorm.weight"], c.eps) if attn_in is None else attn_in
    h = x + attention(c, p, pre + "self_attn.", a, mask)
    m = rms(h, p[pre + "post_attention_layernorm.weight"], c.eps)
    return h + lin(torch.nn.functional.silu(lin(m, p, pre + "mlp.gate_proj")) * lin(m, p, pre + "mlp.up_proj"), p,
                   pre + "mlp.down_proj")


def dims(hidden, heads, eps=1e-6, theta=10000.0):
    return types.SimpleNamespace(head_dim=hidden // heads, eps=eps, theta=theta)


def causal(t):
    return torch.ones(t, t, dtype=torch.bool).tril()


# ----------------------------------------------------------------------------- the target, through transformers


def target_states(hf_model, tokens):
    """transformers' hidden states of tokens [T]: ``(hidden_states tuple of [T, H], pre-norm last [T, H],
    lm_head weight)``; ``hidden_states[i]`` is the input of layer i, ``[L]`` the normed last state."""
    out = {}
    hook = hf_model.model.layers[-1].register_forward_hook(lambda mod, i, o: out.setdefault("last", o))
    with torch.no_grad():
        r = hf_model(torch.tensor([tokens]), output_hidden_states=True)
    hook.remove()
    last = out["last"][0] if isinstance(out["last"], tuple) else out["last"]
    return tuple(h[0] for h in r.hidden_states), last[0], hf_model.lm_head.weight.detach()


def capture(states, prenorm, layer, num_layers):
    """vLLM's auxiliary capture id ``layer``: the input of that layer; L: the last output before the norm."""
    return prenorm if layer == num_layers else states[layer]


# ----------------------------------------------------------------------------- feature-chain heads


def chain_drafts(step, feats, tokens, k):
    """Drafts of a head that reads (feature_t, token_{t+1}) pairs and feeds its output back.

    ``step(u [T, ·] per-position inputs, next tokens [T]) -> (g [T, H], logits of the last [V], draft id)``
    recomputes the whole sequence; ``feats`` [n, F] are the target's, ``tokens`` x_1..x_n.
    """
    us, xs, out = list(feats), list(tokens), []
    for _ in range(k):
        g, d = step(us, xs)
        out.append(d)
        us.append(g[-1])
        xs.append(d)
    return out


def eagle1_step(c, p, lm_head):
    """SafeAILab ``cnets1.Model.forward``: fc(cat(embed, hidden)), layers (layer 0 without input_layernorm),
    no final norm; logits through the target's LM head."""
    layers = sorted({int(k.split(".")[1]) for k in p if k.startswith("layers.")})

    def step(us, xs):
        emb = p["embed_tokens.weight"][torch.tensor(xs)]
        x = lin(torch.cat([emb, torch.stack(list(us))], -1), p, "fc")
        mask = causal(x.shape[0])
        for i in layers:
            x = decoder_layer(c, p, f"layers.{i}.", x, mask, attn_in=x if i == 0 else None)
        return x, int(torch.argmax(x[-1] @ lm_head.T))

    return step


def eagle3_step(c, p, n_target, norm_before_residual=False, norm_output=False, prefix="layers.0.", num_aux=3):
    """EAGLE-3 (SafeAILab ``cnets.py`` ``LlamaDecoderLayeremb``; speculators ``Eagle3DraftModel``; vLLM
    ``llama_eagle3.py``): per position, the target's concatenated aux states go through ``input_norm`` /
    ``fc_norm`` (if shipped) and ``fc``; own features skip them. Layer 0 reads [input_layernorm(embed);
    hidden_norm(u)] with residual u (or hidden_norm(u)); layers 1.. are plain; logits = lm_head(norm(y))."""
    layers = sorted({int(k.split(".")[1]) for k in p if k.startswith("layers.")})
    emb_w = p["embed_tokens.weight"]

    def features(u):
        if u.shape[-1] == n_target:  # the target's [a_1; ...; a_A]
            if "input_norm.weight" in p:
                u = rms(u, p["input_norm.weight"], c.eps)
            if "fc_norm.0.weight" in p:
                u = torch.cat([rms(x, p[f"fc_norm.{i}.weight"], c.eps) for i, x in enumerate(u.chunk(num_aux, -1))], -1)
            return lin(u, p, "fc")
        return u

    def step(us, xs):
        u = torch.stack([features(x) for x in us])
        emb = emb_w[torch.tensor(xs)]
        mask = causal(u.shape[0])
        hn = rms(u, p[prefix + "hidden_norm.weight"], c.eps)
        attn_in = torch.cat([rms(emb, p[prefix + "input_layernorm.weight"], c.eps), hn], -1)
        x = decoder_layer(c, p, prefix, hn if norm_before_residual else u, mask, attn_in=attn_in)
        for i in layers[1:]:
            x = decoder_layer(c, p, f"layers.{i}.", x, mask)
        normed = rms(x, p["norm.weight"], c.eps)
        d = int(torch.argmax(normed[-1] @ p["lm_head.weight"].T))
        d = d + int(p["d2t"][d]) if "d2t" in p else d
        return (normed if norm_output else x), d

    return step


def mimo_mtp_step(c, p, lm_head, pre="model.mtp_layers.0."):
    """vLLM ``mimo_mtp.py`` ``MiMoMultiTokenPredictorLayer.forward``: embed zeroed at position 0,
    input_proj(cat[hidden_layernorm(h), token_layernorm(e)]), a Qwen2 block, final_layernorm; logits
    through the target's LM head, the output fed back."""

    def step(us, xs):
        emb = p["model.embed_tokens.weight"][torch.tensor(xs)].clone()
        emb[0] = 0.0  # position 0
        e = rms(emb, p[pre + "token_layernorm.weight"], c.eps)
        h = rms(torch.stack(list(us)), p[pre + "hidden_layernorm.weight"], c.eps)
        x = lin(torch.cat([h, e], -1), p, pre + "input_proj")
        y = rms(decoder_layer(c, p, pre, x, causal(x.shape[0])), p[pre + "final_layernorm.weight"], c.eps)
        return y, int(torch.argmax(y[-1] @ lm_head.T))

    return step


# ----------------------------------------------------------------------------- Medusa


def medusa_drafts(p, h, heads, layers, bias_names, head_names, token_map=None):
    """FasterDecoding ``ResBlock`` heads (``x + SiLU(linear(x))``, then the head's Linear) on the target's last
    normed state h [H]; vLLM's argmax per head, mapped through ``token_map``. ``bias_names(k, j)`` and
    ``head_names(k)``: the published names of head k's ResBlock j and of its projection."""
    out = []
    for k in range(heads):
        x = h
        for j in range(layers):
            w, b = bias_names(k, j)
            x = x + torch.nn.functional.silu(x @ p[w].T + (p[b] if b in p else 0.0))
        d = int(torch.argmax(x @ p[head_names(k)].T))
        out.append(int(token_map[d]) if token_map is not None else d)
    return out


# ----------------------------------------------------------------------------- DFlash (z-lab / speculators)


def dflash_drafts(c, p, ctx_feats, pending, mask_id, k, theta):
    """z-lab ``dflash/model.py`` (speculators' DFlash is the same module): context = hidden_norm(fc(target
    features)) at positions 0..n-1 gives each layer's K/V (k_norm, RoPE, no input_layernorm); the block
    [pending, MASK × k] at n..n+k attends to the context and to the whole block (non-causal); the drafts are
    lm_head(norm(h)) at the mask rows, mapped through d2t when the draft vocabulary is reduced."""
    n = ctx_feats.shape[0]
    ctx = rms(lin(ctx_feats, p, "fc"), p["hidden_norm.weight"], c.eps)  # [n, H]
    x = p["embed_tokens.weight"][torch.tensor([pending] + [mask_id] * k)]
    layers = sorted({int(name.split(".")[1]) for name in p if name.startswith("layers.")})
    hd = c.head_dim
    pos_c, pos_b = torch.arange(n), torch.arange(n, n + k + 1)
    for i in layers:
        pre = f"layers.{i}.self_attn."
        hx = rms(x, p[f"layers.{i}.input_layernorm.weight"], c.eps)
        q = rms(lin(hx, p, pre + "q_proj").view(k + 1, -1, hd), p[pre + "q_norm.weight"], c.eps)
        ks = [rms(lin(z, p, pre + "k_proj").view(z.shape[0], -1, hd), p[pre + "k_norm.weight"], c.eps)
              for z in (ctx, hx)]
        vs = [lin(z, p, pre + "v_proj").view(z.shape[0], -1, hd) for z in (ctx, hx)]
        q = rope(q, pos_b, theta)
        key = torch.cat([rope(ks[0], pos_c, theta), rope(ks[1], pos_b, theta)])
        val = torch.cat(vs)
        g = q.shape[1] // key.shape[1]
        key, val = key.repeat_interleave(g, 1), val.repeat_interleave(g, 1)
        a = (torch.einsum("qhd,khd->hqk", q, key) / math.sqrt(hd)).softmax(-1)
        x = x + lin(torch.einsum("hqk,khd->qhd", a, val).reshape(k + 1, -1), p, pre + "o_proj")
        m = rms(x, p[f"layers.{i}.post_attention_layernorm.weight"], c.eps)
        mlp = f"layers.{i}.mlp."
        x = x + lin(torch.nn.functional.silu(lin(m, p, mlp + "gate_proj")) * lin(m, p, mlp + "up_proj"), p,
                    mlp + "down_proj")
    d = torch.argmax(rms(x, p["norm.weight"], c.eps)[1:] @ p["lm_head.weight"].T, -1)
    return [int(i) + (int(p["d2t"][i]) if "d2t" in p else 0) for i in d]


# ----------------------------------------------------------------------------- recording funcspec's drafts


def record_drafts(eng, rows: int):
    """Wrap the engine's proposer so that every propose call appends ``(context, drafts)`` to the returned list
    for each of its first ``rows`` slots that holds a request: the row's tokens (committed and pending, from
    the token history) and its drafts."""
    rec, mod = [], eng.proposer.module
    wrapped = types.ModuleType(mod.__name__ + "_recorded")
    wrapped.__dict__.update(vars(mod))

    def propose(cfg, params, state, ctx, k):
        proposal, new = mod.propose(cfg, params, state, ctx, k)
        for i, (slot, n) in enumerate(zip(ctx.slots.tolist(), ctx.lens.tolist())):
            if slot < rows:
                rec.append((ctx.history[slot, :n + 1].tolist(), proposal.tokens[i].tolist()))
        return proposal, new

    wrapped.propose = propose
    eng.proposer = eng.runner.proposer = dataclasses.replace(eng.proposer, module=wrapped)
    return rec
