"""Selectors shipped inside the package, and which (target, draft) pair each was trained for.

``"selector": "auto"`` (the default of ``draft_tree``) takes the shipped selector whose pair
matches the engine's target and draft models, else the fixed shape. A model is recognised by
``model_fingerprint``: its architecture fields (``config.json``) and the first bytes of the
values of its first weight tensor (by name), so a fine-tune of the same architecture is not
taken for the model the selector was trained on, and re-saving the same weights (another
safetensors header, another tensor order) still matches.

A pair may ship one selector per ``draft_quantization`` that q's pass times were measured in
(``selector.json``'s ``draft_quantization``, from its timing record; ``"none"`` when absent):
the shapes that pay depend on what a draft forward costs, and q in int8 costs ~0.6x of bf16 on a
CPU (docs/notebook/draft_tree.md, "q in int8"). The one of q's resolved quantization is taken, else another of the pair.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

__all__ = ["SHIPPED_DIR", "model_fingerprint", "shipped_selector", "resolve_selector"]

SHIPPED_DIR = Path(__file__).parent / "shipped"
_CONFIG_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size")
_WEIGHT_BYTES = 1 << 16


def model_fingerprint(model_dir: str | Path) -> str:
    """16 hex digits naming a checkpoint (module docstring); ValueError if it has no config.json
    or no safetensors file."""
    import torch
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    files = sorted(model_dir.glob("*.safetensors"))
    if not config_path.is_file() or not files:
        raise ValueError(f"{str(model_dir)!r} is not a transformers checkpoint (config.json and *.safetensors)")
    config = json.loads(config_path.read_text())
    h = hashlib.sha256(json.dumps({k: config.get(k) for k in _CONFIG_FIELDS}, sort_keys=True).encode())
    names = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names.update({name: path for name in f.keys()})
    first = min(names)
    with safe_open(str(names[first]), framework="pt") as f:
        tensor = f.get_tensor(first).flatten()
    h.update(first.encode())
    h.update(tensor[: _WEIGHT_BYTES // tensor.element_size()].view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def shipped_selector(target_dir: str | Path, draft_dir: str | Path, shipped: Path | None = None,
                     quantization: str = "none") -> Path | None:
    """The shipped selector directory trained for this (target, draft) pair, or None; of the
    pair's, the one timed with q in ``quantization`` if there is one (module docstring)."""
    candidates = sorted((shipped or SHIPPED_DIR).glob("*/selector.json"))
    if not candidates:
        return None
    try:
        pair = {"target_fingerprint": model_fingerprint(target_dir), "draft_fingerprint": model_fingerprint(draft_dir)}
    except (ValueError, OSError):
        return None  # not a local checkpoint (a hub name): no shipped selector can be matched
    matches = []
    for path in candidates:
        doc = json.loads(path.read_text())
        if all((doc.get("pair") or {}).get(k) == v for k, v in pair.items()):
            matches.append((doc.get("draft_quantization", "none") != quantization, path.parent))
    return min(matches)[1] if matches else None


def resolve_selector(value: str, target_dir: str | Path, draft_dir: str | Path, shape_given: bool,
                     shipped: Path | None = None, quantization: str = "none") -> str:
    """``"auto"`` -> the shipped selector of the pair (for q in ``quantization``: ``shipped_selector``),
    or ``"off"`` (also when the request fixed a shape: ``trunk``, ``branches`` or ``branch_length``
    given); any other value unchanged."""
    if value != "auto":
        return value
    if shape_given:
        return "off"
    found = shipped_selector(target_dir, draft_dir, shipped, quantization)
    return str(found) if found is not None else "off"
