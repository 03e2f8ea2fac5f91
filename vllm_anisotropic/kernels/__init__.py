"""Compiled (numba) kernels of the per-step path, imported only when first used.

Scope: every numba function of the package lives here, one module per stage: ``match`` (the
context matcher's backward scan), ``table`` (adjacency-table lookup and update), ``goose`` (GOOSE
tree building), ``walk`` (the greedy walk's descent), ``emit`` (after the walk: the emitted
tokens, the accepted path's nodes and K/V moves, the metrics' counts), ``kv`` (the accepted nodes' K/V slot moves
on the CPU), ``plan`` (the tree attention's per-step plans: the CPU first call's rows and path rounds, the CUDA split's
node rows and masks), ``vocab`` (passes over vocabulary rows of logits: the harvest's top-k and
softmax probabilities, the walk's argmax; bf16 rows read as their 16 bits), ``rank`` (the
allocator's probabilities and order of a step's trees), ``allocate`` (the allocator's envelopes
and prefix scans), ``fit`` (the acceptance model's refit), ``label`` (the label queue: its trees queued, and labelled
into the acceptance model's histograms), ``store`` (GOOSE's cross-request store: its arrays' update and a step's lookups). Callers fetch a module with ``load(name)`` at call time, never at import time.

numba's disk cache (``cache=True``) checks a function's own source file only: a kernel that calls
one of another module (``goose`` calls ``table``'s and ``match``'s, ``walk`` calls ``vocab``'s) keeps its cached
machine code when only that other module changes. After editing ``table.py``, ``match.py`` or ``vocab.py``,
delete ``vllm_anisotropic/kernels/__pycache__``
(``scripts/mutate.py`` drops every cache of its copy before each kernel mutant).

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

from vllm_anisotropic.kernels import split as _split  # noqa: F401  (its fork hook, from the package's import on)

__all__ = ["load"]

_NAMES = ("allocate", "emit", "fit", "goose", "kv", "label", "match", "plan", "rank", "store", "table", "vocab",
          "walk")


_LOADED: dict[str, ModuleType] = {}  # what import_module returned (a lookup there costs ~2 us a call)


def load(name: str) -> ModuleType:
    """The kernel module ``name`` (one of allocate, emit, fit, goose, kv, label, match, plan, rank, store, table, vocab, walk), imported on first use."""
    module = _LOADED.get(name)
    if module is None:
        if name not in _NAMES:
            raise ValueError(f"unknown kernel module {name!r}; valid: {', '.join(_NAMES)}")
        module = _LOADED[name] = importlib.import_module(f"{__name__}.{name}")
    return module
