"""What ``swap_swiglu_mlps`` does for every causal-LM family of the installed transformers: each family's
model is built from a tiny config on the meta device (no memory, no download) and swapped; every MLP
and routed-experts class found is then materialised alone with random weights and swapped with the
forward check, so that "fused" means the fused module computes what the family's module computes.

``python -m fused_swiglu.families`` prints the table (Markdown; ``--gated``: only the families with a
gated MLP or expert module; ``--summary``: those families grouped by outcome);
``tests/test_families.py`` holds the table of the tested transformers release to the same results.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from .experts.swap import experts_mismatch, has_expert_weights
from .integrations import _is_candidate, _mismatch, swap_swiglu_mlps

#: Small sizes, set where a family's config has the attribute.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "vocab_size": 128,
    "pad_token_id": 0,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,  # DeepSeek: the second layer routed
    "max_position_embeddings": 64,
}


class _Holder(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp


def _readable(config, name: str) -> bool:
    """Whether ``config`` has ``name`` as one global value (per-layer configs refuse to read some)."""
    try:
        return hasattr(config, name)
    except Exception:  # noqa: BLE001 - e.g. transformers' AmbiguousGlobalPerLayerAttributeError
        return False


def _tiny(config):
    """``config`` with :data:`TINY` set on it and on every sub-config (encoder, decoder, text, ...), so
    that each MLP class is checked at a small size."""
    from transformers import PretrainedConfig

    for name, value in TINY.items():
        if _readable(config, name):
            setattr(config, name, value)
    for value in vars(config).values():
        if isinstance(value, PretrainedConfig):
            _tiny(value)
    return config


def _tiny_model(model_type: str) -> nn.Module:
    """The family's model from a tiny config, on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_tiny(AutoConfig.for_model(model_type)))


#: An MLP class is checked only this small (parameters): a config that did not shrink is reported.
CHECKED_PARAMETERS = 1 << 20


def _checked(mlp: nn.Module) -> str:
    """``mlp`` materialised with random weights and swapped with the forward check: "fused" or why not."""
    size = sum(p.numel() for p in mlp.parameters())
    if size > CHECKED_PARAMETERS:
        return f"not checked: {size} parameters at the config's sizes"
    mlp = mlp.to_empty(device="cpu").float()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5)
    report = swap_swiglu_mlps(_Holder(mlp), on_mismatch="skip")
    return "fused" if report else f"left alone: {report.skipped['mlp']}"


def _structural_mismatch(module: nn.Module) -> str | None:
    return experts_mismatch(module) if has_expert_weights(module) else _mismatch(module)


def family_row(model_type: str) -> dict:
    """One family: how many modules the swap fuses in its tiny model, and per MLP class the outcome."""
    try:
        model = _tiny_model(model_type)
    except Exception as error:  # noqa: BLE001 - a config that does not build small is reported, not raised
        return {"family": model_type, "built": False, "why": f"{type(error).__name__}"}
    classes = {type(m).__name__: m for m in model.modules() if _is_candidate(m)}
    # What a swap of weights not yet materialised (nothing to compare) takes by structure alone.
    unchecked = sorted(name for name, m in classes.items() if _structural_mismatch(m) is None)
    outcomes = {name: _checked(m) for name, m in classes.items()}
    swapped = swap_swiglu_mlps(model, check=False)
    return {
        "family": model_type,
        "built": True,
        "swapped": len(swapped),
        "mlps": outcomes,
        "unchecked": unchecked,
    }


def family_rows() -> list[dict]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    logging.getLogger("fused_swiglu").setLevel(logging.ERROR)  # the table says what the warnings would
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [family_row(t) for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)]


def markdown(rows: list[dict], gated_only: bool = False) -> str:
    """The table; ``gated_only``: only the families that built and have a gated MLP class."""
    lines = ["| family | MLP modules fused (tiny model) | MLP classes: outcome |", "|---|---|---|"]
    for r in rows:
        if gated_only and not (r["built"] and r["mlps"]):
            continue
        if not r["built"]:
            lines.append(f"| {r['family']} | - | no tiny config built ({r['why']}) |")
            continue
        mlps = "; ".join(f"{name}: {what}" for name, what in r["mlps"].items()) or "no gated MLP module"
        lines.append(f"| {r['family']} | {r['swapped']} | {mlps} |")
    return "\n".join(lines)


def _short(why: str) -> str:
    """The reason a class was left alone, in a few words."""
    why = why.removeprefix("left alone: ")
    for cut in (" (", ", not", "; "):
        why = why.split(cut)[0]
    return why


def summary(rows: list[dict]) -> str:
    """The families with a gated MLP or expert module, grouped by what the swap does (Markdown)."""
    groups: dict[str, list[str]] = {"routed experts fused": [], "MLPs fused": [], "partly fused": []}
    groups["left alone"] = []
    for r in rows:
        if not (r["built"] and r["mlps"]):
            continue
        outcomes = r["mlps"]
        fused = [name for name, what in outcomes.items() if what == "fused"]
        others = {name: _short(what) for name, what in outcomes.items() if what != "fused"}
        if fused and others:
            groups["partly fused"].append(
                f"{r['family']} ({'; '.join(f'{n}: {w}' for n, w in others.items())})"
            )
        elif fused and any(name.endswith("Experts") for name in fused):
            groups["routed experts fused"].append(r["family"])
        elif fused:
            groups["MLPs fused"].append(r["family"])
        else:
            groups["left alone"].append(f"{r['family']} ({'; '.join(sorted(set(others.values())))})")
    lines = ["| what the swap does | families |", "|---|---|"]
    lines += [f"| {what} ({len(names)}) | {', '.join(names)} |" for what, names in groups.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    import transformers

    print(f"transformers {transformers.__version__}\n")
    rows = family_rows()
    print(
        summary(rows) if "--summary" in sys.argv[1:] else markdown(rows, gated_only="--gated" in sys.argv[1:])
    )
