"""``vllm.general_plugins`` entry point.

vLLM calls ``register()`` once per process, in every process it starts: the user's process
(``EngineArgs.__post_init__``), the EngineCore process and every worker
(``WorkerBase.init_worker``), before the model is loaded. It must be cheap (no heavy imports)
and idempotent: it may be called again by hand, and registrations are process-local.

What it does today:
- asks for AMX tile permission (see ``amx.py``): the fix for vLLM CPU workers dying at random
  with SIGILL;
- installs the front-door patches (``patches.py``) that make
  ``speculative_config={"method": "goose"}`` (and ``pld``, ``token_recycling``,
  ``isotropic``) select this plugin's tree worker, runner, attention and scheduler;
- exports the tree metrics (``metrics.py``): names the stats file the workers write (a
  temporary file unless ``VLLM_ANISOTROPIC_TREE_STATS`` is set; child processes inherit it)
  and registers the ``vllm_anisotropic:*`` Prometheus collector that reads it;
- when ``VLLM_ANISOTROPIC_TRACE_REGISTER`` names a file, appends ``<pid>`` to it once per
  process, so tests and users can check which processes loaded the plugin;
- declares our ``VLLM_ANISOTROPIC_*`` environment variables to ``vllm.envs`` (vLLM warns about,
  or with ``fail_on_environ_validation`` refuses, unknown ``VLLM_*`` variables).
"""

from __future__ import annotations

import logging
import os

from vllm_anisotropic.integration.vllm.platform_fixes.amx import request_amx_permission
from vllm_anisotropic.integration.vllm.engine.metrics import STATS_ENV, install_collector
from vllm_anisotropic.integration.vllm.engine.metrics import TRACE_ENV as TREE_TRACE_ENV

logger = logging.getLogger(__name__)

TRACE_ENV = "VLLM_ANISOTROPIC_TRACE_REGISTER"
# Every environment variable this package reads (README / docs name them).
OUR_ENV_VARS = (
    TRACE_ENV,
    STATS_ENV,
    TREE_TRACE_ENV,
    "VLLM_ANISOTROPIC_CACHE",
    "VLLM_ANISOTROPIC_QWEN",
    "VLLM_ANISOTROPIC_CPU_GEMM",
    "VLLM_ANISOTROPIC_HOST_THREADS",
)

# Process-local registration flag: the only module state, and it is per process by design.
_registered_pid: int | None = None


def register() -> None:
    """Install vllm-anisotropic into the current vLLM process (idempotent, cheap)."""
    global _registered_pid
    pid = os.getpid()
    if _registered_pid == pid:
        return
    amx = request_amx_permission()
    from vllm_anisotropic.integration.vllm.frontdoor.patches import apply

    apply()
    _declare_env_vars()
    install_collector()
    _registered_pid = pid
    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(trace, "a", encoding="ascii") as f:
            f.write(f"{pid}\n")
    logger.debug("vllm-anisotropic registered in pid %d (amx permission: %s)", pid, amx)


def _declare_env_vars() -> None:
    import vllm.envs as envs

    for name in OUR_ENV_VARS:
        envs.environment_variables.setdefault(name, lambda name=name: os.environ.get(name))
