"""Compiled (numba) kernels of the per-step path, imported only when first used.

Scope: every numba function of the package lives here, one module per stage: ``match`` (the
context matcher's backward scan), ``table`` (adjacency-table lookup and update), ``goose`` (GOOSE
tree building), ``walk`` (the greedy walk's descent), ``harvest`` (top-k and softmax
probabilities of logits rows), ``rank`` (the allocator's probabilities and order of a step's trees), ``allocate`` (the
allocator's envelopes and prefix scans). Callers fetch a module with ``load(name)``
at call time, never at import time.

Why lazily: vLLM's CPU worker, when it starts, scans every imported module's attributes for
Triton kernels to override (``vllm/triton_utils/dispatcher.py``, ``_rebind_kernels``) and calls
``vars(value).get`` on each; once numba is imported, llvmlite's ``ffi.lib`` answers ``__dict__``
with a function wrapper and the worker dies with ``AttributeError``. The plugin is loaded into
every vLLM process before that scan (``vllm.general_plugins``), so importing it must not import
numba (``tests/test_kernels.py`` checks it). Compiled functions are cached on disk
(``cache=True``): a new process loads them instead of compiling again.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["load"]

_NAMES = ("allocate", "goose", "harvest", "match", "rank", "table", "walk")


def load(name: str) -> ModuleType:
    """The kernel module ``name`` (one of allocate, goose, harvest, match, rank, table, walk), imported on first use."""
    if name not in _NAMES:
        raise ValueError(f"unknown kernel module {name!r}; valid: {', '.join(_NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")
