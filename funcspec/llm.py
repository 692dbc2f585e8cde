"""``funcspec.LLM``: a vLLM facade, so the guide's ``LLM(...)`` examples run unchanged."""

from __future__ import annotations

from funcspec.args import (  # noqa: F401 (re-exported: their home was here)
    DTYPES,
    NO_EFFECT_ARGS,
    EngineArgs,
    batch_buckets_from_compilation,
    check_device,
    torch_dtype,
)
from funcspec.engine import Engine


class LLM:
    """vLLM-compatible entry point: ``LLM(model=PATH, **engine_args).generate(prompts, params)``.

    The arguments are :class:`~funcspec.args.EngineArgs`' fields, under vLLM's names and with its defaults
    (``max_model_len``, ``max_num_seqs``, ``enforce_eager``, ``speculative_config``, ``compilation_config``,
    ``additional_config``, ``kv_transfer_config``, ``seed``, ``dtype``, ``quantization``, ``tokenizer``,
    ``tensor_parallel_size``, ``enable_expert_parallel``), and funcspec's own (``backend``, ``device``,
    ``cpu_kernels``, ...); or one ``EngineArgs``. vLLM arguments with no effect here are accepted with one
    warning; any other is refused, every one before the checkpoint is read. ``tensor_parallel_size=N`` shards
    the target across N ranks: from a plain process this ``LLM`` is rank 0 and spawns the others
    (:mod:`funcspec.distributed`); under ``torchrun`` every rank builds its own. :meth:`close` stops them (so
    does interpreter exit).
    """

    def __init__(self, model, **kwargs):
        # NOTE: every argument is checked before the checkpoint is read or anything is built, so a refused
        # LLM(...) costs nothing and leaves nothing behind (no ranks, no caches).
        args = model if isinstance(model, EngineArgs) and not kwargs else \
            EngineArgs.from_kwargs({"model": model, **kwargs}, "LLM")
        self.engine = Engine(args)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False):
        """Same as :meth:`funcspec.Engine.generate`."""
        return self.engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def close(self) -> None:
        """Stop the spawned tensor-parallel ranks, if any (:meth:`funcspec.Engine.close`)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        """``with LLM(...) as llm:`` closes the engine (its tensor-parallel ranks) on leaving the block."""
        self.close()

    def get_tokenizer(self):
        """The target checkpoint's tokenizer (``None`` if it ships none), as vLLM's ``LLM.get_tokenizer``."""
        return self.engine.model.tokenizer
