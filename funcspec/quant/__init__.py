"""Weight formats and ``prepare_params``: what a model's weights become, once, at load, for its kernels.

:func:`prepare_params` is the one place where weights are packed, fused and
(later) quantized for an :class:`~funcspec.kernels.Ops`: the engine calls it
on the target's and the drafter's params after loading (and sharding), with
one memo, so a tensor both share is packed once.
"""

from funcspec.quant.prepare import FUSED, INDEXED, prepare_params, quantized

__all__ = ["FUSED", "INDEXED", "prepare_params", "quantized"]
