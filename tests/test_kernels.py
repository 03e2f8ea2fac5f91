"""The compiled kernels are imported lazily: loading the plugin into a vLLM process must not
import numba (vLLM's CPU worker start-up scan breaks on llvmlite's library object, see
``vllm_anisotropic/kernels/__init__.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_the_plugin_and_the_core_import_no_numba():
    code = (
        "import sys\n"
        "import vllm_anisotropic.proposers, vllm_anisotropic.verifiers, vllm_anisotropic.allocator\n"
        "from vllm_anisotropic.integration.vllm.frontdoor import plugin\n"
        "plugin.register()\n"
        "import vllm_anisotropic.integration.vllm.engine.runner\n"
        "assert 'numba' not in sys.modules and 'llvmlite' not in sys.modules, "
        "sorted(m for m in sys.modules if m.startswith(('numba', 'llvmlite')))[:5]\n"
        "from vllm_anisotropic import kernels\n"
        "kernels.load('table')\n"
        "assert 'numba' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_load_names_the_valid_modules():
    from vllm_anisotropic import kernels

    with pytest.raises(ValueError, match="allocate, emit, fit, goose, kv, label, match, plan, rank, store, table, vocab, walk"):
        kernels.load("nope")


def test_the_drafters_warm_up_compiles_for_vllms_token_dtype_and_keeps_nothing():
    """``TreeDrafter.warm_up`` (the worker's start): the proposals' kernels (``proposal_inputs``,
    the context match among them, and ``spine_trees``, which reads the spines from the token
    array) get their machine code for vLLM's int32 token array before any request, the
    learning's keys (``learn_keys``) theirs, the cross-request store's update and lookup
    (``kernels.store``) theirs, the acceptance model's refit (``kernels.fit``) its,
    each once (checked in a fresh process: numba's
    signatures are per process), and the drafter's own state (request states, shared adjacency
    table, pending trees) is untouched."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_anisotropic import kernels
    from vllm_anisotropic.integration.vllm.engine.drafter import TreeDrafter
    from vllm_anisotropic.integration.vllm.frontdoor.config import TreeSpecConfig

    spec = TreeSpecConfig.build("goose", {})
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(method="goose", num_speculative_tokens=59),
                          additional_config={"vllm_anisotropic": spec.to_additional_config()},
                          model_config=SimpleNamespace(get_vocab_size=lambda: 64, max_model_len=512))
    d = TreeDrafter(cfg)
    table = d.proposer.table
    before = None if table.unigram_ids is None else table.unigram_ids.copy()
    d.warm_up(np.int32)
    inputs, goose = kernels.load("goose").proposal_inputs, kernels.load("goose").spine_trees
    assert any("int32" in str(sig[0]) for sig in inputs.signatures), inputs.signatures
    assert any("int32" in str(sig[9]) for sig in goose.signatures), goose.signatures  # arg 9: token_ids
    store = kernels.load("store").match_rows
    assert any("int32" in str(sig[6]) for sig in store.signatures), store.signatures  # arg 6: token_ids
    code = """
from types import SimpleNamespace
import numpy as np
from vllm_anisotropic import kernels
from vllm_anisotropic.integration.vllm.engine.drafter import TreeDrafter
from vllm_anisotropic.integration.vllm.frontdoor.config import TreeSpecConfig
spec = TreeSpecConfig.build("goose", {})
cfg = SimpleNamespace(speculative_config=SimpleNamespace(method="goose", num_speculative_tokens=59),
                      additional_config={"vllm_anisotropic": spec.to_additional_config()},
                      model_config=SimpleNamespace(get_vocab_size=lambda: 64, max_model_len=512))
TreeDrafter(cfg).warm_up(np.int32)
goose = kernels.load("goose")
store = kernels.load("store")
print(*(len(f.signatures) for f in (goose.proposal_inputs, goose.spine_trees, goose.learn_keys, store.add_document,
                                    store.match_rows)), len(kernels.load("fit").newton_platt.signatures))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert d.acceptance is not None  # the acceptance model's refit is warmed up too (kernels.fit)
    assert out.stdout.split() == ["1"] * 6
    assert d.states == {} and d.pending == {} and d.proposer.table is table
    assert (before is None and table.unigram_ids is None) or np.array_equal(table.unigram_ids, before)


def test_the_draft_model_drafters_warm_up_loads_the_kernels_around_q():
    """draft_tree's warm-up (q needs none: it is loaded with its proposer) still loads the
    step's kernels around q in a fresh process: the allocator's ranking and offers, the label
    queue and the acceptance model's refit. Without it they compiled in its first tree steps
    (2.7 s and 2.0 s with numba's disk cache empty: the measured gate closed at one request on
    those steps). Nothing of the drafter's own state changes."""
    code = """
from types import SimpleNamespace
import numpy as np, torch
from vllm_anisotropic import kernels
from vllm_anisotropic.models import build_tiny_model
from vllm_anisotropic.integration.vllm.engine.drafter import TreeDrafter
from vllm_anisotropic.integration.vllm.frontdoor.config import TreeSpecConfig
spec = TreeSpecConfig.build("draft_tree", {"model": str(build_tiny_model())})
cfg = SimpleNamespace(speculative_config=SimpleNamespace(method="draft_tree", num_speculative_tokens=8),
                      additional_config={"vllm_anisotropic": spec.to_additional_config()},
                      model_config=SimpleNamespace(get_vocab_size=lambda: None, max_model_len=512, dtype=torch.float32),
                      device_config=SimpleNamespace(device=torch.device("cpu")))
d = TreeDrafter(cfg)
assert d.acceptance is not None
d.warm_up(np.int32)
assert d.states == {} and d.pending == {}
mods = {m: kernels.load(m) for m in ("rank", "allocate", "label", "fit")}
print(*(len(f.signatures) for f in (mods["rank"].rank_trees, mods["allocate"].offer_budgets, mods["label"].queue_trees,
                                     mods["label"].take_labels, mods["fit"].newton_platt)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-5:] == ["1"] * 5, out.stdout
