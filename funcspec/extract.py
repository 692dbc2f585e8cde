"""``extract_hidden_states``: save the target's hidden states of chosen layers, one file per request.

This is vLLM's method for collecting EAGLE training data: no speculation, one
output token per request, and the prompt's hidden states written to
``<shared_storage_path>/<request_id>-<run>.safetensors`` (``run``: a random
part drawn once per engine, so a restarted process never overwrites the files
of an earlier one, whose request ids start over) with

    token_ids      [num_tokens] int64
    hidden_states  [num_tokens, num_layers, H]

for ``eagle_aux_hidden_state_layer_ids``. Layer id ``i`` is the input of decoder
layer ``i`` (HF ``hidden_states[i]``), as vLLM's aux hidden states are.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

CONNECTOR = "ExampleHiddenStatesConnector"


@dataclasses.dataclass(frozen=True)
class HiddenStateDump:
    """Where and which layers to save; ``write=False`` (a tensor-parallel rank other than 0) only says where.
    ``run`` is the part of every file name that is unique to this engine.

    NOTE: every tensor-parallel rank holds the same (all-reduced) hidden states, so rank 0 alone
    writes the files, and its outputs name them.
    """

    layers: tuple[int, ...]
    directory: Path
    write: bool = True
    run: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __call__(self, reqs, tokens: torch.Tensor, lens: list[int], hiddens: tuple) -> None:
        """Prefill hook: save each request's prompt hidden states [n, H] per layer, and say where.

        tokens [P, T] (padded prompts), hiddens [P, T, H] per layer of ``self.layers``.
        """
        for i, r in enumerate(reqs):
            path = self.path(r.request_id)
            if self.write:
                self.save(r.request_id, tokens[i, :lens[i]], tuple(h[i, :lens[i]] for h in hiddens))
            r.extra["kv_transfer_params"] = {"hidden_states_path": path}

    def save(self, request_id: str, token_ids: torch.Tensor, hiddens: tuple) -> str:
        """Write one request's file; ``hiddens`` are [n, H] per layer. Returns the path."""
        path = self.path(request_id)
        stacked = torch.stack([h.float() for h in hiddens], dim=1).contiguous().cpu()  # [n, L, H]
        save_file({"token_ids": token_ids.cpu().contiguous(), "hidden_states": stacked}, path)
        return path

    def path(self, request_id: str) -> str:
        """The file of request ``request_id``."""
        return str(self.directory / f"{request_id}-{self.run}.safetensors")


def parse_kv_transfer_config(kv: Optional[dict]) -> Optional[Path]:
    """The ``shared_storage_path`` of vLLM's hidden-states connector, validated field by field."""
    if kv is None:
        return None
    if kv.get("kv_connector") != CONNECTOR:
        raise ValueError(f"kv_transfer_config.kv_connector: only {CONNECTOR!r} is supported, "
                         f"got {kv.get('kv_connector')!r}")
    if kv.get("kv_role") != "kv_producer":
        raise ValueError(f"kv_transfer_config.kv_role must be 'kv_producer', got {kv.get('kv_role')!r}")
    path = (kv.get("kv_connector_extra_config") or {}).get("shared_storage_path")
    if not path:
        raise ValueError("kv_transfer_config.kv_connector_extra_config.shared_storage_path is required")
    return Path(path)


def build(spec, num_layers: int, kv_transfer_config: Optional[dict], write: bool = True) -> HiddenStateDump:
    """The dump for an ``extract_hidden_states`` spec; refuses missing or out-of-range pieces.

    ``write``: whether this process writes the files (tensor-parallel rank 0 only).
    """
    directory = parse_kv_transfer_config(kv_transfer_config)
    if directory is None:
        raise ValueError("method 'extract_hidden_states' needs kv_transfer_config with "
                         f"kv_connector={CONNECTOR!r} and a shared_storage_path")
    layers = spec.eagle_aux_hidden_state_layer_ids
    if not layers:
        raise ValueError("speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids "
                         "is required for method 'extract_hidden_states'")
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids: "
                         f"{bad} outside [0, {num_layers}] for this target")
    directory.mkdir(parents=True, exist_ok=True)
    return HiddenStateDump(tuple(layers), directory, write)
