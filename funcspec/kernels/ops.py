"""``Ops``: which kernel every product and attention of a step takes, decided once per device.

The math (:mod:`funcspec.nn`) calls ``cfg.ops.linear(x, p)`` and
``cfg.ops.attend(...)``; an :class:`Ops` is a frozen value resolved from the
device when the engine is built (:func:`resolve`) and carried in every
``ModelConfig``, so it is part of each bucket's static key and the choice is
visible, not an import-time global. Tests choose a path by passing an ``Ops``.

The packed copies the kernels stream are made once, at load, by
``funcspec.quant.prepare_params`` (a linear's params gain ``packed``; q/k/v and
gate/up gain a fused ``qkv_proj`` / ``gate_up_proj``); a linear without them
takes the plain torch paths.

NOTE on the choice of product per CPU. Wherever funcspec's kernels are built
(:mod:`funcspec.kernels.build`: one build per ISA, avx512bf16, avx512, avxvnni,
avx2 or portable, so every CPU with a C++ compiler), every packed bf16 and fp32 product
takes the weight-streaming kernel (:mod:`funcspec.kernels.stream`) at any row
count: a row's result does not depend on the rows beside it, so AR and
verification agree bit for bit, and no choice compares the row count (symbolic
in a graph with a symbolic batch: a comparison would be a guard on it).
Without them (``cpu_kernels=False``, ``FUNCSPEC_CPU_KERNELS=0``, no compiler):
bf16 takes oneDNN on pre-packed weights where the CPU multiplies bf16
(``onednn_bf16``, :mod:`funcspec.kernels.onednn`), fp32 on AMX CPUs ``F.linear``
(``blas_skinny``), and otherwise the plain paths (:func:`_plain`: row-wise
reductions fused by inductor up to :data:`STACKED_ROWS` rows, ``(W @ x.T).T``
up to :data:`SKINNY_ROWS` fp32 rows, else ``F.linear``; half-precision products
of more rows in fp32 on CPUs without bf16 instructions). Those pick by row
count, and their sums depend on it. The measurements behind each choice:
graphs/results/notes/kernels.md.

The row count is static, so every choice is made at trace time.

A MoE layer's routed experts (``Ops.routed_experts``) take, wherever funcspec's
CPU kernels are built, the kernel of :mod:`funcspec.kernels.moe`: it streams the
experts a step selects, once, with the streaming products' tiles, or the
quantized products' tiles for quantized experts; on CUDA, ``torch._grouped_mm``
in bf16; on an Ascend NPU, torch_npu's MoE ops; else the reference, every
expert on every token.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F

from funcspec.kernels import attention, build, cpu, indexer, moe, onednn, quant, stream

SKINNY_ROWS = 64
"""fp32 CPU products of at most this many rows take ``(W @ x.T).T`` on the plain paths."""

STACKED_ROWS = 9
"""Compiled CPU products of at most this many rows (B·(K+1): batch 8 AR, K = 8 at batch 1)
are row-wise reductions on the plain paths (beyond, inductor stops fusing them into one pass)."""

HALF = (torch.bfloat16, torch.float16)

ROUTED = {"reference": None, "cpu_kernel": "cpu", "grouped_mm": "cuda", "npu": "npu"}
"""The paths of :meth:`Ops.experts` -> the device each serves: :func:`moe.reference` (any), the CPU kernel
(:func:`moe.experts_op`), CUDA's grouped GEMMs (:func:`moe.grouped`), torch_npu's MoE ops (:func:`moe.npu_experts`)."""


@dataclasses.dataclass(frozen=True)
class Ops:
    """The kernels a model's products and attention take (static: part of every bucket's key).

    Attributes:
        stream: the weight-streaming products (:mod:`funcspec.kernels.stream`) for packed bf16 and fp32 weights.
        onednn_bf16: oneDNN's pre-packed bf16 products (:mod:`funcspec.kernels.onednn`).
        half_gemm: the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX).
        blas_skinny: MKL streams skinny fp32 products fastest (AMX Xeons).
        decode_attention: the CPU decode attention kernel (:mod:`funcspec.kernels.attention`).
        quantized: the CPU kernel of 8-, 6- and 4-bit weights (:mod:`funcspec.kernels.quant`); without it they
            take the same math in torch.
        routed_experts: the path of a MoE layer's routed experts, one of :data:`ROUTED` (:meth:`experts`).
    """

    stream: bool = False
    onednn_bf16: bool = False
    half_gemm: bool = False
    blas_skinny: bool = False
    decode_attention: bool = False
    quantized: bool = False
    routed_experts: str = "reference"

    def __post_init__(self):
        if self.routed_experts not in ROUTED:
            raise ValueError(f"Ops.routed_experts must be one of {tuple(ROUTED)}, got {self.routed_experts!r}")

    def layout(self, weight: torch.Tensor) -> Optional[str]:
        """The packed layout ``prepare_params`` makes of a linear's weight for these kernels, or ``None``."""
        if weight.device.type != "cpu":
            return None
        if self.stream and weight.dtype in stream.DTYPES:
            return "stream"
        if self.onednn_bf16 and weight.dtype == torch.bfloat16:
            return "onednn"
        return None

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weight`` in :meth:`layout`."""
        return stream.pack_weight(weight) if self.layout(weight) == "stream" else onednn.pack(weight)

    def linear(self, x: torch.Tensor, p: dict, bias: bool = True) -> torch.Tensor:
        """``x @ W.T (+ b)`` for x [..., in] and a linear's params ``p`` (``weight`` [out, in], optional
        ``bias``, and the ``packed`` copy ``prepare_params`` made; or a quantized linear's ``qweight``, ``scales``,
        ``offsets``? and ``format``); ``bias=False`` leaves the bias out."""
        if "qweight" in p:
            return self._quantized(x, p if bias else {k: v for k, v in p.items() if k != "bias"})
        weight, b = p["weight"], p.get("bias") if bias else None
        rows = math.prod(x.shape[:-1])  # not numel // in: a linear of 0 inputs has rows too
        if x.device.type != "cpu":
            return F.linear(x, weight, b)
        autograd = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        packed = None if autograd else p.get("packed")
        if packed is not None and self._streams(x, weight):
            return stream.stream_op(x, packed, b, weight.shape[0])
        if packed is not None and self.onednn_bf16 and weight.dtype == torch.bfloat16:
            return onednn.packed_op(x, packed, b, weight.shape[0])
        return _plain(self, x, weight, b, rows)

    def linears(self, x: torch.Tensor, ps: list, fused: Optional[dict] = None) -> list[torch.Tensor]:
        """:meth:`linear` of layers that read the same x (q/k/v; gate/up).

        NOTE: with the streaming kernel they are one product over the group
        ``fused`` that ``prepare_params`` packed side by side: a Llama decode step
        makes 65 calls instead of 113, each a longer stream. Every output has the
        bits of its own :meth:`linear`.
        """
        if fused is not None and "qweight" in fused:
            out = self._quantized(x, fused)
            return quant.split(out, [p["format"].out_features for p in ps])
        if fused is None or any("weight" not in p for p in ps):
            return [self.linear(x, p) for p in ps]
        autograd = torch.is_grad_enabled() and (x.requires_grad or any(p["weight"].requires_grad for p in ps))
        if fused is not None and not autograd and all(self._streams(x, p["weight"]) for p in ps):
            sizes = [p["weight"].shape[0] for p in ps]
            out = stream.stream_op(x, fused["packed"], fused.get("bias"), sum(stream.widths(sizes)))
            return stream.split(out, sizes)
        return [self.linear(x, p) for p in ps]

    def _quantized(self, x: torch.Tensor, p: dict) -> torch.Tensor:
        """A quantized linear: the kernel where it runs, else its math in torch (:func:`quant.reference`).
        A linear stored in another input order (GPTQ's act-order: ``perm``) reads x in that order; a
        tensor-parallel shard's ``perm`` may also read zeros past x's end (``funcspec.quant.shard``)."""
        if "perm" in p:
            perm = p["perm"]  # [K'] indices into x, and K' for a zero input
            if perm.shape[0] > x.shape[-1]:  # static: only a shard's padded act-order blocks read past x
                x = F.pad(x, (0, perm.shape[0] + 1 - x.shape[-1]))
            x = x.index_select(-1, perm)
        if self.quantized and x.device.type == "cpu" and x.dtype in quant.DTYPES:
            return quant.qlinear(x, p)
        return quant.reference(x, p)

    def _streams(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether a product takes the streaming kernel (static). NOTE: never by row count: AR and
        verification must take the same kernel, and a symbolic batch's row count would become a guard."""
        return self.stream and x.dtype == weight.dtype and weight.dtype in stream.DTYPES

    def rows_free(self, dtype: torch.dtype) -> bool:
        """Whether every CPU product of ``dtype`` weights takes a path that never compares the row count
        (static): the streaming kernel, or ``F.linear`` itself. Only then may a graph leave its batch
        symbolic; the plain paths (:func:`_plain`) and oneDNN pick by row count, which would specialise a
        symbolic batch (a guard, or a constraint violation under ``mark_dynamic``)."""
        if self.stream and dtype in stream.DTYPES:
            return True
        if dtype == torch.bfloat16:
            return self.half_gemm and not self.onednn_bf16
        return dtype == torch.float32 and self.blas_skinny

    def attends(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> bool:
        """Whether the decode attention kernel takes these operands (static)."""
        return self.decode_attention and attention.supports(q, keys, vals)

    def reads_live_only(self, dtype: torch.dtype, head_dim: int, device) -> bool:
        """Whether decode and verify attention of a model with this dtype and head size takes the decode
        kernel, which reads only each row's live positions: then a step's cost does not depend on how
        much of the cache it is handed, and one context bucket serves every length."""
        if not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim must be a positive int (a model's head size), got {head_dim!r}")
        return (self.decode_attention and torch.device(device).type == "cpu" and dtype in attention.DTYPES
                and head_dim <= attention.MAX_HEAD_DIM)

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, p: dict) -> torch.Tensor:
        """A MoE layer's routed experts (:mod:`funcspec.kernels.moe`): x [T, H] routed to ``ids`` [T, k] int64
        with ``weights`` [T, k]; ``p`` holds the stacked ``gate_up_proj`` [E, 2I, H] and ``down_proj``
        [E, H, I] (each ``{"weight": ...}``, and the ``packed`` copy ``prepare_params`` made for the CPU
        kernel), or the same experts quantized (:func:`moe.stack_quantized`). Returns [T, H]; x [..., H] with
        ids and weights [..., k] gives [..., H]. The path is :meth:`routed_path`'s."""
        gate_up, down = p["gate_up_proj"], p["down_proj"]
        path = self.routed_path(x, gate_up, down)
        if torch.is_grad_enabled() and weights.requires_grad:  # the kernels pass no gradient to the router
            path = "reference"
        shape = x.shape
        ids = ids.reshape(-1, ids.shape[-1])  # [T, k]
        x, weights = x.reshape(-1, shape[-1]), weights.reshape(ids.shape)  # [T, H], [T, k]
        if "qweight" in gate_up:  # quantized experts: the CPU kernel, else their math in torch
            quantized = path == "cpu_kernel"
            out = (moe.qexperts_op if quantized else moe.quantized_reference)(x, ids, weights, gate_up, down)
        elif path == "cpu_kernel":
            out = moe.experts_op(x, ids, weights, gate_up["packed"], down["packed"])
        elif path == "grouped_mm":
            out = moe.grouped(x, ids, weights, gate_up["weight"], down["weight"])
        elif path == "npu":  # its ops need every id in [0, E): another rank's slot (-1, weight 0) reads expert 0
            out = moe.npu_experts(x, ids.clamp(min=0), weights, gate_up["weight"], down["weight"])
        else:
            out = moe.reference(x, ids, weights, gate_up["weight"], down["weight"])
        return out.view(shape)  # [..., H]

    def routed_path(self, x: torch.Tensor, gate_up: dict, down: dict) -> str:
        """The path :meth:`experts` takes (static: device, dtypes, autograd, packed copies): :attr:`routed_experts`
        where it serves these operands, else ``"reference"``."""
        if "qweight" in gate_up:  # quantized (stacked by moe.stack_quantized): the quantized products' kernel
            fits = self.quantized and x.device.type == "cpu" and x.dtype in quant.DTYPES
            return "cpu_kernel" if fits and not (torch.is_grad_enabled() and x.requires_grad) else "reference"
        w = gate_up["weight"]
        grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or down["weight"].requires_grad)
        if grad or x.dtype != w.dtype or x.device.type != ROUTED[self.routed_experts]:
            return "reference"
        if self.routed_experts == "cpu_kernel":
            return "cpu_kernel" if "packed" in gate_up and "packed" in down else "reference"
        if self.routed_experts == "grouped_mm":
            return "grouped_mm" if moe.grouped_fits(x, w, down["weight"]) else "reference"
        return self.routed_experts

    def packs_experts(self, weight: torch.Tensor) -> bool:
        """Whether ``prepare_params`` packs a MoE layer's stacked expert weight [E, N, K] for the CPU kernel."""
        return self.routed_experts == "cpu_kernel" and weight.device.type == "cpu" and weight.dtype in moe.DTYPES

    def attend(self, q, keys, vals, visible) -> torch.Tensor:
        """The decode attention kernel (:func:`funcspec.kernels.attention.decode_attention`); needs :meth:`attends`."""
        return attention.decode_attention(q, keys, vals, visible)

    def lightning_indexer(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor,
                          topk: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3.2's lightning indexer (:mod:`funcspec.kernels.indexer`): the ``min(topk, T_read)`` best
        positions (``idx``, ``valid`` [B, T, k]) of index queries q [B, T, Hi, Di] over index keys [B, T_read, Di]
        with head weights [B, T, Hi], among those visible [B, T, T_read].

        The hook of Ascend's ``npu_lightning_indexer`` (torch_npu, which
        vLLM-Ascend calls for this): not wired, for want of an NPU to check it
        on, so every device takes :func:`indexer.reference`.
        """
        return indexer.reference(q, keys, weights, visible, topk, scale)

    def sparse_attention(self, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, r: int,
                         scale: float) -> torch.Tensor:
        """DeepSeek-V3.2's attention over each query's selected latents (:func:`indexer.sparse_attention`): q [B, T,
        H, D] over keys [B, T, k, D] where valid [B, T, k]; -> [B, T, H, r].

        The hook of Ascend's ``npu_sparse_flash_attention`` (torch_npu, which vLLM-Ascend calls for this): not
        wired, for want of an NPU to check it on, so every device takes the torch reference.
        """
        return indexer.sparse_attention(q, keys, valid, r, scale)

    def mla_prolog(self, reference, *args):
        """Multi-head latent attention's prolog: the queries absorbed into latent space and the token's latent,
        ``reference(*args)`` (the torch math of :func:`funcspec.nn.deepseek.mla_query_latent`).

        The hook of Ascend's ``npu_mla_prolog_v3`` (one kernel for the down and up projections, both RMSNorms,
        RoPE and the cache write, at DeepSeek-V3's dims): not wired, for want of an NPU to check it on, so every
        device takes the reference.
        """
        return reference(*args)


REFERENCE = Ops()
"""Plain torch products and attention: what a model runs before :func:`resolve`, and training (autograd)."""


def resolve(device=None, cpu_kernels: bool = True) -> Ops:
    """The kernels for ``device``: on a CPU, funcspec's own (streaming products, decode attention, quantized
    products, routed experts) in the best build its ISA runs, or the one ``FUNCSPEC_CPU_KERNELS`` names
    (:mod:`funcspec.kernels.build`; see the module's note); elsewhere torch's, with the device's grouped expert
    products (``torch._grouped_mm`` on CUDA where torch has it, torch_npu's MoE ops on an Ascend NPU).

    ``cpu_kernels=False`` (or ``FUNCSPEC_CPU_KERNELS=0`` in the environment) leaves out funcspec's own CPU
    kernels and never builds them:
    what is picked is what a CPU where they cannot be built gets (oneDNN, MKL, SDPA, the quantized math and the
    routed experts in torch). ``REFERENCE`` is plain torch everywhere.
    """
    kind = torch.device(device or "cpu").type
    if kind == "cuda":
        return Ops(routed_experts="grouped_mm") if moe.has_grouped_mm() else REFERENCE
    if kind == "npu":
        return Ops(routed_experts="npu")
    if kind != "cpu":
        return REFERENCE
    kernels = cpu_kernels and build.available()
    return Ops(stream=kernels, onednn_bf16=cpu.onednn_bf16() and not kernels,
               half_gemm=cpu.avx512_bf16() or cpu.amx(), blas_skinny=cpu.amx(),
               decode_attention=kernels, quantized=kernels, routed_experts="cpu_kernel" if kernels else "reference")


def _plain(ops: Ops, x: torch.Tensor, weight: torch.Tensor, bias, rows: int) -> torch.Tensor:
    """A CPU product without a packed copy: the BLAS and row-reduction paths of the module's note."""
    if weight.dtype == torch.bfloat16 and ops.half_gemm:
        return F.linear(x, weight, bias)
    if weight.dtype == torch.float32 and ops.blas_skinny:
        return F.linear(x, weight, bias)
    if rows > STACKED_ROWS and weight.dtype in HALF:
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)
    if rows > SKINNY_ROWS:
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])  # [rows, in]
    if rows <= STACKED_ROWS and torch.compiler.is_compiling():
        w = weight.float()
        y = torch.stack([(w * x2[r].float()).sum(-1) for r in range(rows)]).to(x.dtype)  # [rows, out]
    elif x.dtype == torch.float32 and rows > 1:
        y = torch.mm(weight, x2.t()).t()  # [rows, out]
    else:
        return F.linear(x, weight, bias)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
