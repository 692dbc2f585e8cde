"""The method registry: every speculative method funcspec knows, one row each.

A row says everything the rest of the package asks about a method: which
proposer module drafts for it, whether it takes a draft checkpoint, its option
group (the ``SpecConfig`` fields, named as vLLM's keys, that belong to it and
not to every method), whether the zoo trains a checkpoint for it and which
draft head family writes its random init. ``config`` (validation), ``proposers``
(``PROPOSERS``), ``zoo`` and ``train`` derive their lists from ``METHODS``, so
adding a method is adding a row here plus its proposer module.

Names are vLLM's canonical method names; vLLM's aliases (``ngram_gpu``,
``<model>_mtp``, ...) are a parsing matter and live in ``config.vllm``.

This module sits at the bottom of the layers, beside ``types``: it imports
nothing from funcspec and nothing heavy (modules are named as strings), so
every layer, and tools that must start fast, can read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

REQUIRED, OPTIONAL, NONE = "required", "optional", "none"
"""The values of :attr:`Method.model`."""

# The option groups a row's ``options`` is built from: SpecConfig fields that only some methods take.
# (The names are vLLM's keys; config.checks.field_path gives the dotted path each message names.)
DRAFT = ("model", "quantization")
"""A draft checkpoint of its own, and vLLM's on-load quantization of it (which "only takes effect when
using the draft model-based speculative method")."""
NGRAM_WINDOW = ("prompt_lookup_min", "prompt_lookup_max")
SUFFIX = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
          "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
BATCH_TABLE = ("num_speculative_tokens_per_batch_size",)
AUX_LAYERS = ("eagle_aux_hidden_state_layer_ids",)
"""``draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids``: the target layers whose hidden states it reads."""
DRAFT_WINDOW = ("draft_window_size",)
"""vLLM-Ascend's draft KV window: methods with draft attention of their own (not mtp, which reuses the target's)."""
DYNAMIC_SPEC = ("dynamic_spec",)
"""vLLM-Ascend's ``dynamic_spec_config``: drafts that carry the confidence it budgets with."""
TREES = ("speculative_token_tree", "dynamic_tree")
"""vLLM's static token tree and SGLang's EAGLE-2 dynamic tree (``speculative_eagle_topk``, ...)."""
DRAFT_TP = ("draft_tensor_parallel_size",)
"""Sharding the drafter (a size > 1); a size of 1 (replicated) is every method's."""
_GROUP_LIST = (DRAFT, NGRAM_WINDOW, SUFFIX, BATCH_TABLE, AUX_LAYERS, DRAFT_WINDOW, DYNAMIC_SPEC, TREES, DRAFT_TP)
GROUPS = sum(_GROUP_LIST, ())
"""Every field that some methods own: the union of the groups, in the order ``config.rules`` checks them."""

GENERAL = ("method", "num_speculative_tokens", "rejection_sample_method", "synthetic_acceptance_rates",
           "rejection_sampler", "ignored_keys")
"""The SpecConfig fields every method takes (the verify rule and its settings belong to the verifier, not the
drafter). With :data:`GROUPS` they are every field; ``tests/unit/test_methods.py`` holds them to it."""

# Capability flags read from the option group: the flag is true where the row owns the field.
_FLAGS = {"aux_layers": AUX_LAYERS[0], "draft_window": DRAFT_WINDOW[0], "batch_table": BATCH_TABLE[0],
          "dynamic_spec": DYNAMIC_SPEC[0], "tree": TREES[0]}


@dataclasses.dataclass(frozen=True)
class Method:
    """One speculative method and what it needs.

    Attributes:
        name: the canonical method name, as in ``speculative_config["method"]``.
        proposer: the module path of its proposer, or ``None`` when it has none
            (extract_hidden_states does not draft; out-of-scope methods are not built).
        model: whether ``speculative_config["model"]``, a local draft checkpoint,
            is ``REQUIRED``, ``OPTIONAL`` (mtp defaults to the target's own MTP
            layers) or ``NONE`` (refused: the method has no draft weights).
        supported: ``False`` for vLLM methods outside funcspec's feature set:
            they are recognised and refused, rather than called unknown.
        speculates: ``False`` when the method drafts nothing, so its
            ``num_speculative_tokens`` must be exactly 1 (extract_hidden_states).
        options: its option group: the SpecConfig fields beyond :data:`GENERAL`
            that it takes, built from the groups above (:data:`DRAFT` exactly
            when ``model`` is not ``NONE``). ``config.rules`` refuses or ignores
            the others for it (``rules.NOT_OWNED``).
        host: drafts on the host (the proposer module's ``runs_on_host``).
        zoo: the zoo trains a checkpoint for it (``funcspec train <name>``
            writes ``models/<name>``).
        head: the draft-head family whose random init ``init_draft_head``
            writes (``funcspec.checkpoints.<head>``), or ``None``.
        head_args: keyword arguments to that family's ``init_params`` that pick
            this method's layout, as ``(key, value)`` pairs (a dict is not hashable).

    Read from ``options`` (properties, and :func:`select` keys):
        aux_layers: reads target hidden states of chosen layers (:data:`AUX_LAYERS`).
        draft_window: has its own draft attention, so vLLM-Ascend's
            ``draft_window_size`` applies (:data:`DRAFT_WINDOW`).
        batch_table: ``num_speculative_tokens_per_batch_size`` applies.
        dynamic_spec: vLLM-Ascend's ``dynamic_spec_config`` can name it.
        tree: it drafts token trees (``speculative_token_tree`` or an EAGLE-2
            dynamic tree): draft networks with ``proposers.tree_draft``,
            ngram and suffix from the continuations their history offers.

    The defaults are those of a draft-model method, and also what
    :func:`lookup` gives an unknown name.
    """

    name: str
    proposer: Optional[str] = None
    model: str = REQUIRED
    supported: bool = True
    speculates: bool = True
    options: tuple[str, ...] = DRAFT + BATCH_TABLE
    host: bool = False
    zoo: bool = False
    head: Optional[str] = None
    head_args: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.model not in (REQUIRED, OPTIONAL, NONE):
            raise ValueError(f"Method.model must be one of {(REQUIRED, OPTIONAL, NONE)}, got {self.model!r}")
        unknown = [f for f in self.options if f not in GROUPS]
        if unknown:
            raise ValueError(f"Method.options of {self.name!r} names {unknown}, which no option group holds "
                             f"(general fields, {list(GENERAL)}, are every method's)")
        # A group is one setting of vLLM's (a window's two bounds, a tree in either form): owned whole or not at all.
        for group in _GROUP_LIST:
            if 0 < sum(f in self.options for f in group) < len(group):
                raise ValueError(f"Method.options of {self.name!r} must hold all of {list(group)} or none")
        # The model column says whether a checkpoint is taken; the group must agree, or config would
        # accept a model it then refuses to load (or refuse one the method needs).
        if (DRAFT[0] in self.options) != (self.model != NONE):
            raise ValueError(f"Method.options of {self.name!r} must hold {list(DRAFT)} exactly when Method.model is "
                             f"not {NONE!r} (model={self.model!r})")

    aux_layers = property(lambda self: _FLAGS["aux_layers"] in self.options)
    draft_window = property(lambda self: _FLAGS["draft_window"] in self.options)
    batch_table = property(lambda self: _FLAGS["batch_table"] in self.options)
    dynamic_spec = property(lambda self: _FLAGS["dynamic_spec"] in self.options)
    tree = property(lambda self: _FLAGS["tree"] in self.options)


def _proposer(name: str) -> str:
    """The module path of the proposer file named after the method."""
    return f"funcspec.proposers.{name}"


# Row order is the order in which ``funcspec train all`` trains the zoo's heads
# (after the target, which every head is distilled from).
_ROWS = (
    Method("ngram", _proposer("ngram"), model=NONE, options=NGRAM_WINDOW + BATCH_TABLE + TREES),
    # The guide: suffix is already per-request dynamic, so it takes no batch table.
    Method("suffix", _proposer("suffix"), model=NONE, host=True, options=SUFFIX + TREES),
    # funcspec's own benchmark proposer (not vLLM): always drafts, at no cost.
    Method("echo", _proposer("echo"), model=NONE, options=BATCH_TABLE),
    Method("draft_model", _proposer("draft_model"), zoo=True,
           options=DRAFT + BATCH_TABLE + DRAFT_WINDOW + TREES + DRAFT_TP),
    Method("medusa", _proposer("medusa"), zoo=True, head="medusa", options=DRAFT + BATCH_TABLE),
    # mtp's window is forced off by vLLM-Ascend: MTP reuses the target's own layers.
    Method("mtp", _proposer("mtp"), model=OPTIONAL, zoo=True, head="mtp", options=DRAFT + BATCH_TABLE + TREES),
    Method("eagle", _proposer("eagle"), head="eagle", head_args=(("version", 1),),
           options=DRAFT + BATCH_TABLE + DRAFT_WINDOW + TREES),
    Method("eagle3", _proposer("eagle3"), zoo=True, head="eagle", head_args=(("version", 3),),
           options=DRAFT + BATCH_TABLE + AUX_LAYERS + DRAFT_WINDOW + TREES),
    Method("dflash", _proposer("dflash"), zoo=True, head="dflash", head_args=(("method", "dflash"),),
           options=DRAFT + BATCH_TABLE + AUX_LAYERS + DRAFT_WINDOW + DYNAMIC_SPEC),
    # The guide: DSpark is not supported on the batch-size path.
    Method("dspark", _proposer("dspark"), zoo=True, head="dflash", head_args=(("method", "dspark"),),
           options=DRAFT + AUX_LAYERS + DRAFT_WINDOW + DYNAMIC_SPEC),
    # Saves hidden states and emits one token per request (engine + extract.py): no proposer.
    Method("extract_hidden_states", model=NONE, speculates=False, options=AUX_LAYERS),
    # Valid vLLM methods that funcspec does not implement.
    Method("mlp_speculator", supported=False),
    Method("custom_class", supported=False),
)

METHODS: dict[str, Method] = {m.name: m for m in _ROWS}
"""Canonical method name -> :class:`Method`, in training order."""


def lookup(name: Any) -> Method:
    """The row for ``name``; an unknown name gets the defaults.

    Parsing asks about a method before it has refused an unknown one, so that
    errors come in vLLM's order; the default row keeps those questions harmless.
    """
    row = METHODS.get(name) if isinstance(name, str) else None
    return row if row is not None else Method(name=str(name))


def select(**fields: Any) -> tuple[str, ...]:
    """The names, in registry order, of the methods whose ``fields`` have the given values.

    ``select(zoo=True)``, ``select(model=NONE)``, ``select(supported=False)``, and the flags read from
    the option group: ``select(tree=True)``.
    """
    known = {f.name for f in dataclasses.fields(Method)} | set(_FLAGS)
    if not fields.keys() <= known:
        raise ValueError(f"select() takes Method fields {sorted(known)}, got {sorted(fields)}")
    return tuple(m.name for m in _ROWS if all(getattr(m, k) == v for k, v in fields.items()))


def supported() -> frozenset[str]:
    """The method names ``SpecConfig`` accepts."""
    return frozenset(select(supported=True))


def proposer_modules() -> dict[str, str]:
    """Method name -> proposer module path, for the methods that have a proposer."""
    return {m.name: m.proposer for m in _ROWS if m.proposer is not None}


def options_of(name: Any) -> tuple[str, ...]:
    """The option group of method ``name``: the SpecConfig fields beyond :data:`GENERAL` that it takes (an
    unknown name gets the default row's)."""
    return lookup(name).options


def owner_of(field: str) -> tuple[str, ...]:
    """The supported methods, in registry order, that take SpecConfig field ``field``: every one for a
    :data:`GENERAL` field, the rows whose option group holds it otherwise."""
    if field in GENERAL:
        return select(supported=True)
    if field not in GROUPS:
        raise ValueError(f"{field!r} is not a SpecConfig option (general: {list(GENERAL)}; "
                         f"in option groups: {list(GROUPS)})")
    return tuple(m.name for m in _ROWS if m.supported and field in m.options)
