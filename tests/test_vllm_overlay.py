"""scripts/vllm_overlay.py: the overlay's compiled-extension links follow the running environment.

The overlay is cached in the user's home and outlives the venv it was first built from. CI failed
once (stop 84) because the cached overlay's ``*.so`` links pointed into a deleted worktree's venv:
0.33 then started with no ``torch.ops._C`` (``init_cpu_memory_env`` missing).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import vllm

ROOT = Path(__file__).resolve().parents[1]


def _overlay_module():
    spec = importlib.util.spec_from_file_location("vllm_overlay", ROOT / "scripts" / "vllm_overlay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dangling_links_of_a_built_overlay_are_relinked_to_the_installed_extensions(tmp_path):
    overlay = _overlay_module()
    package = tmp_path / "vllm"
    package.mkdir()
    (package / ".overlay-complete").write_text("built earlier\n")
    gone = tmp_path / "deleted-venv" / "_C.abi3.so"
    (package / "_C.abi3.so").symlink_to(gone)  # dangling, as after the worktree was removed
    (package / "_C_OLD.abi3.so").symlink_to(gone.with_name("_C_OLD.abi3.so"))  # a name no longer installed

    assert overlay.build(tmp_path) == tmp_path
    installed = Path(vllm.__file__).resolve().parent
    links = sorted(p.name for p in package.glob("*.so"))
    assert links == sorted(p.name for p in installed.glob("*.so")) and "_C.abi3.so" in links
    for name in links:
        assert (package / name).resolve() == installed / name
    assert not list(package.glob(".*.so.*"))  # no temporary links left


def test_links_go_to_the_files_not_through_a_symlinked_venv(tmp_path):
    overlay = _overlay_module()
    real = tmp_path / "real"
    real.mkdir()
    (real / "_C.abi3.so").write_bytes(b"")
    (tmp_path / "venv-link").symlink_to(real, target_is_directory=True)
    package = tmp_path / "overlay"
    package.mkdir()
    (package / "_C.abi3.so").symlink_to(tmp_path / "elsewhere" / "_C.abi3.so")

    overlay.link_extensions(package, tmp_path / "venv-link")
    assert Path((package / "_C.abi3.so").readlink()) == real / "_C.abi3.so"
    (tmp_path / "venv-link").unlink()  # the symlinked venv goes; the link still resolves
    assert (package / "_C.abi3.so").exists()


def test_the_installed_vllm_is_found_past_an_overlay_on_the_path(tmp_path, monkeypatch):
    """``PYTHONPATH=$(vllm_overlay.py)`` exported, then the script run again: its ``vllm`` is the
    overlay's 0.33, and the links must still go to the installed 0.32's extensions."""
    overlay = _overlay_module()
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "0.33.0"\n')
    (fake / ".overlay-complete").write_text("built earlier\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert overlay.installed_vllm() == Path(vllm.__file__).resolve().parent
    assert overlay.build(tmp_path) == tmp_path and (fake / "_C.abi3.so").resolve().parent == overlay.installed_vllm()


def test_each_installed_vllm_gets_its_own_overlay(tmp_path):
    overlay = _overlay_module()
    a, b = overlay.default_dest(tmp_path / "venv-a"), overlay.default_dest(tmp_path / "venv-b")
    assert a != b and a.parent == b.parent == overlay.CACHE
    (tmp_path / "link").symlink_to(tmp_path / "venv-a")
    assert overlay.default_dest(tmp_path / "link") == a  # a symlinked venv is the venv it points to
