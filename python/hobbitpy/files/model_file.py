"""What a GGUF model file holds, checked before anything loads it."""

from __future__ import annotations

from dataclasses import dataclass
import os

import numpy as np

from ..binding import hobbit
from ..binding.native import to_str

# architectures llama.cpp runs whose experts the cache cannot serve, and why (offload refuses
# them in one line; stock llama.cpp, --no-offload, runs them)
OFFLOAD_REFUSED = {
    "grovemoe": "each layer runs two expert passes over different expert tensors (GroveMoE's adjugate experts), "
                "and the cache serves one pass per layer",
}


@dataclass(frozen=True)
class ModelInfo:
    path: str
    arch: str
    n_layer: int
    n_layer_moe: int
    """Blocks with routed experts; 0 for a dense model."""
    n_expert: int
    n_expert_used: int
    n_embd: int
    expert_bytes: int
    """One expert of the first MoE block, all its projections: the size of its cache slot."""
    expert_bytes_total: int
    min_budget_bytes: int
    """One token's top-k experts, in each pool (one pool per expert signature)."""
    file_bytes: int
    uniform: bool
    """Every MoE block has the same expert shapes and types (else several pools)."""
    n_split: int = 1
    """Files the model is split into (llama.cpp's gguf-split); the path is the first."""
    # what sizes a context's buffers (memory.context_sizes)
    n_vocab: int = 0
    n_head: int = 1
    n_head_kv: int = 1
    n_embd_head_k: int = 0
    n_embd_head_v: int = 0
    n_ff_expert: int = 0
    """Width of a routed expert's gate/up rows."""
    n_ff_dense: int = 0
    """Width of a dense FFN or shared expert; 0 = none."""
    n_ctx_train: int = 0
    max_slice_bytes: int = 0
    """The largest slice of one expert's projection: what one reader's buffer for this file holds."""

    @property
    def is_moe(self) -> bool:
        return self.n_layer_moe > 0

    @property
    def resident_bytes(self) -> int:
        """Everything but the routed experts: what stays in memory in any case."""
        return self.file_bytes - self.expert_bytes_total


def inspect_model(path: str | os.PathLike) -> ModelInfo:
    """Validate a GGUF file; raises ModelFileError naming the file and the problem."""
    path = os.fspath(path)
    info = hobbit.inspect_model(path)
    return ModelInfo(
        path=path,
        arch=to_str(info.arch),
        n_layer=info.n_layer,
        n_layer_moe=info.n_layer_moe,
        n_expert=info.n_expert,
        n_expert_used=info.n_expert_used,
        n_embd=info.n_embd,
        expert_bytes=info.expert_bytes,
        expert_bytes_total=info.expert_bytes_total,
        min_budget_bytes=info.min_budget_bytes,
        file_bytes=info.file_bytes,
        uniform=bool(info.uniform),
        n_split=info.n_split,
        n_vocab=info.n_vocab,
        n_head=info.n_head,
        n_head_kv=info.n_head_kv,
        n_embd_head_k=info.n_embd_head_k,
        n_embd_head_v=info.n_embd_head_v,
        n_ff_expert=info.n_ff_expert,
        n_ff_dense=info.n_ff_dense,
        n_ctx_train=info.n_ctx_train,
        max_slice_bytes=info.max_slice_bytes,
    )


def model_parts(path: str | os.PathLike) -> list[str]:
    """The files the model is made of: its one file, or every part of a split model (named as
    llama.cpp finds them from the first). Raises ModelFileError as inspect_model does."""
    path = os.fspath(path)
    return hobbit.model_parts(path, inspect_model(path).n_split)


def layer_expert_bytes(path: str | os.PathLike) -> np.ndarray:
    """[moe_layers]: the bytes of one expert of each MoE layer of a GGUF (model or companion),
    all projections, in layer order (a llama.cpp mix gives some layers a wider down type), read
    from its header by the runtime's own index. Raises ModelFileError as inspect_model does."""
    path = os.fspath(path)
    return np.array(hobbit.layer_expert_bytes(path, inspect_model(path).n_layer), np.int64)


def model_fingerprint(path: str | os.PathLike) -> str:
    """The fingerprint of a model's experts (hobbit_model_fingerprint): what a companion
    records of the model it was made of, so that another model of the same shapes is refused."""
    return hobbit.model_fingerprint(os.fspath(path))
