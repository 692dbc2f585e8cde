"""Every device- and ISA-specific piece: the CPU kernels, their library, and the one ``Ops`` value per device.

``cpu`` (what this CPU runs; huge-page memory), ``build`` (the C++ library,
compiled on first use and loaded through ``ctypes``), ``stream`` (the
weight-streaming products and their packed layout), ``onednn`` (oneDNN's
pre-packed bf16 products), ``attention`` (the decode attention kernel), ``quant``
(the 8-, 6- and 4-bit products and :class:`QuantFormat`, a quantized linear's static
part), ``moe`` (a MoE layer's routed experts: the CPU kernel that streams the
selected experts once per step, CUDA's grouped GEMMs, torch_npu's MoE ops, the
reference), ``indexer`` (DeepSeek-V3.2's lightning indexer: its scores and
top-k, the reference of Ascend's kernel), ``argmax`` (the greedy argmax over a vocabulary) and
``ops`` (:class:`Ops`: which of them a model takes, :func:`resolve` from the device).
:mod:`funcspec.nn` is math over ``cfg.ops``; nothing here imports it.
"""

from funcspec.kernels.argmax import first_max
from funcspec.kernels.ops import REFERENCE, Ops, resolve
from funcspec.kernels.quant import QuantFormat

__all__ = ["REFERENCE", "Ops", "QuantFormat", "first_max", "resolve"]
