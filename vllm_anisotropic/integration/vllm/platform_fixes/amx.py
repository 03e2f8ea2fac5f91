"""Request the Linux AMX tile-data permission in the current process.

Why: on x86 CPUs with AMX (Sapphire Rapids and later), Linux requires every process to ask for
the XTILEDATA state component with ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``
before it executes AMX tile instructions; otherwise the kernel raises SIGILL. The permission is
per process and does not survive ``exec``. vLLM's CPU engine *spawns* its EngineCore and worker
processes, and its CPU attention kernel picks the AMX code path for bf16; whether anything in a
spawned worker asks for the permission before the first attention call varies from run to run,
so workers died at random with ``exit code -4`` (see shared/notes/vllm-0.32-spec-decode-map.md
section 6). Asking once, early, in every process (the plugin's ``register()`` runs in each one)
removes the race.

No vLLM import here: this is plain ``ctypes`` over the raw syscall.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

logger = logging.getLogger(__name__)

SYS_ARCH_PRCTL = 158  # x86_64 syscall number of arch_prctl
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def cpu_has_amx() -> bool:
    """True when /proc/cpuinfo lists the ``amx_tile`` flag."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def _arch_prctl(code: int, arg: int | ctypes.c_void_p) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return int(libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), arg))


def amx_permitted() -> bool:
    """True when this process may already execute AMX tile instructions."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    mask = ctypes.c_uint64(0)
    if _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.cast(ctypes.byref(mask), ctypes.c_void_p)) != 0:
        return False
    return bool(mask.value & (1 << XFEATURE_XTILEDATA))


def request_amx_permission() -> bool:
    """Ask the kernel for AMX tile-data permission; return whether AMX is now usable.

    A no-op returning False on non-Linux, non-x86_64 or CPUs without AMX. Idempotent: the kernel
    grants the permission once per process and repeated requests succeed.
    """
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if not cpu_has_amx():
        return False
    if _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        logger.warning("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: errno %d", err)
        return False
    return amx_permitted()
