"""The supported-models table (docs/MODELS.md): each architecture, models that use it, the
routing its metadata asks for, what the tests check; each expert type; the architectures
offload refuses and why. Rendered from the tuples the tests are parametrized with (synthetic_moe's
ARCH_LAYOUTS, FEATURE_ARCHES and EXPERT_TYPES), so that it cannot drift from them:
`python -m hobbitpy.files.supported_models > docs/MODELS.md` (a test compares)."""

from __future__ import annotations

from .model_file import OFFLOAD_REFUSED
from .synthetic_moe import ARCH_LAYOUTS, EXPERT_TYPES, FEATURE_ARCHES, ArchLayout

EXAMPLES = {
    "llama": "Mixtral-8x7B, Mixtral-8x22B",
    "qwen2moe": "Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B",
    "gpt-oss": "gpt-oss-20b, gpt-oss-120b",
    "qwen3moe": "Qwen3-30B-A3B, Qwen3-235B-A22B",
    "olmoe": "OLMoE-1B-7B",
    "granitemoe": "Granite 3.x MoE (1B-A400M, 3B-A800M)",
    "phimoe": "Phi-3.5-MoE",
    "deepseek2": "DeepSeek-V2, V2-Lite, V3, R1; Kimi-K2",
    "glm4moe": "GLM-4.5, GLM-4.5-Air, GLM-4.6",
    "llama4": "Llama-4-Scout, Llama-4-Maverick",
    "ernie4_5-moe": "ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B",
    "hunyuan-moe": "Hunyuan-A13B",
    "dots1": "dots.llm1",
    "bailingmoe": "Ling-lite, Ling-plus",
    "bailingmoe2": "Ling-mini-2.0, Ling-flash-2.0",
    "minimax-m2": "MiniMax-M2",
    "qwen3next": "Qwen3-Next-80B-A3B",
}

# models of the architectures offload refuses (model_file.OFFLOAD_REFUSED)
REFUSED_EXAMPLES = {"grovemoe": "GroveMoE-Inst"}


MODELS_PAGE_HEAD = """# Supported models

Which MoE files hobbitpy offloads, and what the tests check for each. Every architecture
below is written by `hobbitpy.files.synthetic_moe` as llama.cpp's loader reads it, with the
routing real models of it use, and run offloaded against stock llama.cpp: the logits must
be equal bit for bit (`tests/runtime/test_architectures.py`, `tests/runtime/test_exactness.py`).
A split model (`NAME-00001-of-0000N.gguf`) runs from its first part
(`tests/runtime/test_split.py`).

Not done yet: the predictor (prefetch) ranks the next layer's experts by its router's
logits, which is the selection when the routing has no selection bias and no expert groups.
With them (DeepSeek-V3, GLM-4.5, dots.llm1, Ling-2, MiniMax-M2) prefetch may guess wrong
more often; what is served stays exact either way.

This page is written by `python -m hobbitpy.files.supported_models > docs/MODELS.md`.

"""


# the gating the graph fixes whatever the metadata says
FIXED_GATING = {"llama4": "sigmoid of the logits", "gpt-oss": "softmax over the selected"}


def _routing(arch: str, layout: ArchLayout) -> str:
    parts = [FIXED_GATING.get(arch, "sigmoid" if layout.gating == 2 else "softmax")]
    if layout.probs_bias:
        parts.append("selection bias")
    if layout.groups:
        parts.append(f"{layout.groups[1]} of {layout.groups[0]} expert groups")
    if layout.weights_scale not in (None, 1.0):
        parts.append(f"weights x{layout.weights_scale:g}")
    return ", ".join(parts)


def _structure(arch: str, layout: ArchLayout) -> str:
    parts = []
    if layout.mla:
        parts.append("latent attention (MLA)")
    if layout.dense_lead:
        parts.append(f"{layout.dense_lead} leading dense layer")
    if layout.moe_every > 1:
        parts.append(f"experts every {layout.moe_every} layers")
    if layout.shared:
        parts.append("shared expert" + (" (gated)" if layout.shared == "sigmoid" else ""))
    if arch == "gpt-oss":
        parts.append("expert biases, attention sinks")
    if layout.delta_net:
        parts.append("linear attention (Gated DeltaNet) in 3 of 4 layers")
    if arch == "llama4":
        parts.append("router weights scale each expert's input")
    return ", ".join(parts) or "routed experts only"


def models_table() -> str:
    """docs/MODELS.md's tables (Markdown)."""
    lines = ["| architecture | models | routing | layers | tested |", "|---|---|---|---|---|"]
    for arch, layout in ARCH_LAYOUTS.items():
        tested = ("every feature's tests (exact at four budgets, mixed precision, cooperative, prefetch, placement, "
                  "neurons, beam search, ...)" if arch in FEATURE_ARCHES else "exact at a tight budget and at 60 %")
        lines.append(f"| `{arch}` | {EXAMPLES[arch]} | {_routing(arch, layout)} | {_structure(arch, layout)} | {tested} |")
    for arch, why in OFFLOAD_REFUSED.items():
        lines.append(f"| `{arch}` | {REFUSED_EXAMPLES[arch]} | | | **refused** in one line (stock runs it, "
                     f"`--no-offload`): {why} |")
    lines += ["", "| expert type | tested |", "|---|---|"]
    for name in EXPERT_TYPES:
        lines.append(f"| `{name}` | exact at a tight budget (one precision) |")
    lines.append("| a mix by layer (`Q4_K`, `IQ3_S`, `Q6_K`, `IQ4_XS`, down projections `Q5_K`) | exact at the "
                 "minimum and at half the experts, with one level and with two |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(MODELS_PAGE_HEAD + models_table(), end="")
