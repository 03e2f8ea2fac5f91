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

    with pytest.raises(ValueError, match="allocate, goose, harvest, match, rank, table, walk"):
        kernels.load("nope")
