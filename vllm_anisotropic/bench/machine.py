"""What the benchmarks record about the machine they ran on (``sweep``'s environment, ``demo``'s
header and its ``--dtype auto``)."""

from __future__ import annotations

from typing import Any

__all__ = ["cpu_model"]


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU's model name and the vector extensions vLLM's CPU kernels pick from
    (``amx_tile``: the AMX attention path for bf16; ``avx512f``, ``avx512_bf16``): machines of
    the same kind here differ in them, and CPU figures are only comparable within one model.
    Empty where /proc/cpuinfo cannot be read."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {"cpu_model": name, "cpu_isa": [f for f in ("amx_tile", "avx512f", "avx512_bf16") if f in flags]}
