"""Every in-process patch vllm-anisotropic applies to vLLM, in one module, version-checked.

Scope: the front door -- making ``speculative_config={"method": "goose"}`` (and ``pld``,
``token_recycling``, ``isotropic``) a valid vLLM configuration that selects this plugin's
worker, model runner, attention backend and scheduler -- plus two step-loop hooks (6, 7), one
opt-in kernel switch (8) and, on a CPU, fixes for seeded requests (10) and for vLLM's rejection
sampler (11). Nothing on disk is modified; every
patch wraps a vLLM function in the current process and is idempotent. ``plugin.register()``
calls ``apply()`` in every vLLM process (patches are process-local).

Patches (vLLM 0.32; file:line in shared/notes/vllm-0.32-spec-decode-map.md section 1):

1. ``SpeculativeConfig.method``: our names are added to its ``Literal`` in the three places
   pydantic reads (``__annotations__``, ``__dataclass_fields__[...].type``,
   ``__pydantic_fields__[...].annotation``), then ``rebuild_dataclass(force=True)``.
2. ``SpeculativeConfig.__post_init__``: for our methods, runs vLLM's own ``custom_class``
   branch (no draft model: ``draft_model_config = target_model_config``) and restores the
   method name; ``num_speculative_tokens`` defaults to ``budget - 1``.
3. ``EngineArgs.create_speculative_config`` (front-end process): strips our tunables from the
   dict before vLLM validates it and stores them, validated, in ``additional_config``
   (see ``config.py``).
4. ``VllmConfig.__post_init__``: refuses unsupported combinations with an error naming the
   problem (async scheduling, pipeline parallel, hybrid/Mamba models, fp8 KV cache, the V2
   model runner, a platform other than CPU or CUDA, a user-chosen worker/scheduler class;
   on CUDA also a non-FLASH_ATTN backend, full CUDA graphs, MLA, decode context parallelism,
   dual-batch overlap), forces FLASH_ATTN and PIECEWISE CUDA graphs on CUDA
   (``force_gpu_settings``) and installs our worker class (CPU or GPU; it installs the
   runner, the tree attention backend and the tree sampler) and scheduler class.
5. ``VllmConfig._get_v2_model_runner_unsupported_features``: lists our methods, so the V1
   runner is chosen wherever V2 would be the default.
6. ``EngineCore.post_step`` (engine-core process): vLLM fetches the next step's drafts there
   with a second RPC to the workers (``take_draft_token_ids``) after every step. The tree
   runner sends them with the step's output instead and the tree scheduler applies them in
   ``update_from_output``; for a scheduler that says so (``drafts_arrive_with_output``) the
   RPC is skipped. Measured: the reply alone was 2.6 % of the worker's wall time at four
   requests (docs/measurements/cpu/allocator_measurements.md, "Interleaved and paired").
   Every other scheduler: vLLM's own ``post_step``.
7. ``WorkerProc._execute_worker_rpc`` (worker processes of vLLM's multiprocess executor): after
   an RPC has been answered, a model runner with ``after_reply`` (the tree runner) runs the
   work it deferred past its reply (``drafter.TreeDrafter.run_deferred``: the harvest and
   learning ``TreeDrafter.observe_step`` left for later) while the engine core schedules the
   next step; any other runner: nothing. In-process
   executors have no such loop; the tree runner then runs it at the start of the next step.
8. ``model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` (every process; only with
   ``VLLM_ANISOTROPIC_CPU_GEMM=rows`` on a CPU with AVX512-BF16 and g++; experimental): for a
   bf16 linear layer that vLLM would give its oneDNN matmul, the layer keeps that matmul for
   steps of more than ``ROWS_MAX`` rows (prefill, large batches) and runs up to ``ROWS_MAX``
   rows through ``cpu_rows_gemm`` (one thread only; more threads: vLLM's matmul throughout).
   The op is ``vllm_anisotropic::rows_linear``, opaque to vLLM's compiled graph. It applies to
   plain decoding as much as to trees, so a benchmark gives it to both arms (``+rowsgemm``).
9. ``SamplingParams._validate_spec_decode`` (front end): with a tree method, requests with
   ``min_p`` or ``logit_bias`` are accepted as plain vLLM accepts them (vLLM refuses them with any
   speculative config because its rejection sampler cannot apply them to draft rows; the tree
   runner can, ``runner.ineligible_reason``), and the request's tree options in ``extra_args``
   (``config.REQUEST_KEYS``) are validated, a bad one refused with its name. Other methods:
   vLLM's own check.
10. ``InputBatch.add_request`` and ``GPUModelRunner._sample`` (every process on a CPU
   platform, any method, plain decoding too): a seeded request's CPU generator becomes a
   ``platform_fixes.cpu_generators.StepRewindGenerator``, marked before a sampling step whose
   sample vLLM will drop (``discard_request_mask``), so that vLLM's rewind of that sample (``set_offset(get_offset() - 4)``,
   which raises on a CPU generator and kills the engine core) undoes that step's draws. Not
   installed, with a warning, when either method's parameters differ from vLLM 0.32's.
11. ``utils.cpu_triton_utils._expand_kernel_impl`` (every process on a CPU platform, before the
   platform registers its C++ replacements for Triton kernels, which follows plugin loading in
   ``WorkerWrapperBase.init_worker``): vLLM's replacement for the rejection sampler's
   ``expand_kernel`` writes int64 outputs only and leaves a float32 temperature or top-p of the
   draft rows uninitialised, so vLLM's own ngram / draft_model / EAGLE verify sampled requests
   against a wrong law on a CPU; ``platform_fixes.cpu_expand`` expands every other dtype in
   torch. Not installed, with a warning, when the function's parameters differ from vLLM 0.32's.

The subclasses those classes install override private vLLM methods; ``vllm_surface.py`` lists
every such name (with the parameters passed through) and every step-object field they read,
and patch 4 refuses to start, naming each mismatch, when the installed vLLM differs.

On a vLLM version other than ``vllm_surface.SUPPORTED_VLLM``, only patch 3 is installed, and it
raises a clear error when one of our methods is requested; plain vLLM use is untouched.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import typing
import weakref
from typing import Any

from vllm_anisotropic.integration.vllm.frontdoor import vllm_surface

logger = logging.getLogger(__name__)

WORKER_CLS = "vllm_anisotropic.integration.vllm.engine.worker.TreeCPUWorker"
GPU_WORKER_CLS = "vllm_anisotropic.integration.vllm.engine.worker.TreeGPUWorker"
SCHEDULER_CLS = "vllm_anisotropic.integration.vllm.engine.scheduler.TreeScheduler"
_MARK = "_vllm_anisotropic_patched"
CPU_GEMM_ENV = "VLLM_ANISOTROPIC_CPU_GEMM"
ROWS_MAX = 16  # most rows per step through the rows kernel (above: vLLM's oneDNN matmul)


class UnsupportedConfigError(ValueError):
    """A vLLM option that tree speculative decoding does not support (yet)."""


def _tree_methods() -> dict[str, str]:
    from vllm_anisotropic.integration.vllm.frontdoor.config import TREE_METHODS

    return TREE_METHODS


def is_tree_method(method: Any) -> bool:
    return isinstance(method, str) and method in _tree_methods()


def _already(obj, name: str) -> bool:
    return getattr(getattr(obj, name), _MARK, False)


def _mark(fn):
    setattr(fn, _MARK, True)
    return fn


# ---------------------------------------------------------------- 1 + 2: SpeculativeConfig
def _patch_method_literal(cls) -> None:
    from pydantic.dataclasses import rebuild_dataclass

    current = cls.__dataclass_fields__["method"].type
    args = set()
    for arg in typing.get_args(current):  # Literal[...] | None
        args.update(typing.get_args(arg) or ())
    missing = [m for m in _tree_methods() if m not in args]
    if not missing:
        return
    new = current | typing.Literal[tuple(missing)]  # type: ignore[valid-type]
    cls.__annotations__["method"] = new
    cls.__dataclass_fields__["method"].type = new
    cls.__pydantic_fields__["method"].annotation = new
    rebuild_dataclass(cls, force=True)


def _patch_speculative_post_init(cls) -> None:
    if _already(cls, "__post_init__"):
        return
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        method = self.method
        if not is_tree_method(method):
            return original(self, *args, **kwargs)
        if self.model is not None:
            raise UnsupportedConfigError(
                f"speculative method {method!r} drafts from the context and the target's own "
                f"logits; it takes no draft 'model' (got {self.model!r})"
            )
        if self.num_speculative_tokens is None:
            from vllm_anisotropic.integration.vllm.frontdoor.config import TreeSpecConfig

            self.num_speculative_tokens = TreeSpecConfig.build(method, {}).budget - 1
        # vLLM's custom_class branch: no draft model, draft config = target config.
        self.method = "custom_class"
        self.model = "vllm_anisotropic.integration.vllm.engine.drafter.TreeDrafter"
        try:
            original(self, *args, **kwargs)
        finally:
            self.method = method
            self.model = None

    cls.__post_init__ = _mark(__post_init__)


# ---------------------------------------------------------------- 3: tunables
def _patch_create_speculative_config(engine_args_cls, supported: bool) -> None:
    if _already(engine_args_cls, "create_speculative_config"):
        return
    original = engine_args_cls.create_speculative_config

    @functools.wraps(original)
    def create_speculative_config(self, *args, **kwargs):
        spec = self.speculative_config
        method = spec.get("method", self.spec_method) if isinstance(spec, dict) else self.spec_method
        if not is_tree_method(method):
            return original(self, *args, **kwargs)
        if not supported:
            raise UnsupportedConfigError(
                f"vllm-anisotropic's method {method!r} supports vLLM {vllm_surface.SUPPORTED_VLLM[0]}x; "
                f"installed vLLM is {vllm_surface.vllm_version()}"
            )
        from vllm.config import SpeculativeConfig

        from vllm_anisotropic.integration.vllm.frontdoor.config import (
            ADDITIONAL_CONFIG_KEY,
            DRAFT_MODEL_METHODS,
            TreeSpecConfig,
            split_speculative_dict,
        )

        theirs, ours = split_speculative_dict(dict(spec or {}), set(SpeculativeConfig.__dataclass_fields__))
        if method in DRAFT_MODEL_METHODS and "model" in theirs:
            ours["model"] = theirs.pop("model")  # the draft model is ours to run, not vLLM's
        if method in DRAFT_MODEL_METHODS and isinstance(ours.get("model"), str):
            from vllm_anisotropic.proposers.config import SHAPE_KEYS
            from vllm_anisotropic.selector.shipped import resolve_selector

            # "auto": the selector shipped for this (target, draft) pair, if any (only the front
            # door knows the target); the workers then load the resolved directory or none
            asked = ours.get("selector", "auto")
            quantization = _draft_quantization(ours.get("draft_quantization", "auto")) if asked == "auto" else "none"
            ours["selector"] = resolve_selector(asked, self.model, ours["model"],
                                                shape_given=bool(set(SHAPE_KEYS) & set(ours)), quantization=quantization)
            if asked == "auto":
                logger.info("draft_tree selector 'auto' (q in %s) -> %s", quantization,
                            ours["selector"] if ours["selector"] != "off"
                            else "off (no shipped selector for this target and draft, or a shape was given)")
        additional = dict(self.additional_config or {})
        if ours and ADDITIONAL_CONFIG_KEY in additional:
            raise UnsupportedConfigError(
                f"give the {method!r} tunables either in speculative_config or in "
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}], not both"
            )
        if ours or ADDITIONAL_CONFIG_KEY not in additional:
            tree = TreeSpecConfig.build(method, ours)
        else:
            tree = TreeSpecConfig.from_additional_config(method, additional)
        theirs.setdefault("method", method)
        if tree.budget < 2 and "num_speculative_tokens" not in theirs:
            raise UnsupportedConfigError(
                f"budget {tree.budget} leaves no draft node (the budget counts the root); valid: budget >= 2, "
                f"e.g. 4, or the method's default {TreeSpecConfig.build(method, {}).budget}"
            )
        if method in DRAFT_MODEL_METHODS:
            from vllm_anisotropic.proposers.draft_model import check_same_vocabulary

            check_same_vocabulary(tree.proposer_options["model"], self.tokenizer or self.model)
        theirs.setdefault("num_speculative_tokens", tree.budget - 1)
        additional[ADDITIONAL_CONFIG_KEY] = tree.to_additional_config()
        self.additional_config = additional
        self.speculative_config = theirs
        return original(self, *args, **kwargs)

    engine_args_cls.create_speculative_config = _mark(create_speculative_config)


def _draft_quantization(key) -> str:
    """What the workers will run q's linears in (``cpu_gemm.resolve_quantization``), for choosing
    the shipped selector timed with it; ``"none"`` for a value the engine's checks refuse later."""
    from vllm.platforms import current_platform

    from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import resolve_quantization

    try:
        return resolve_quantization(str(key), current_platform.is_cpu())
    except ValueError:
        return "none"


# ---------------------------------------------------------------- 4 + 5: VllmConfig
def check_and_install(vllm_config) -> None:
    """Refuse unsupported combinations; select our worker and scheduler (process 0)."""
    import vllm.envs as envs
    from vllm.platforms import current_platform

    from vllm_anisotropic.integration.vllm.frontdoor.config import ADDITIONAL_CONFIG_KEY, TreeSpecConfig

    spec = vllm_config.speculative_config
    method = spec.method
    # The tunables normally arrive through create_speculative_config; a SpeculativeConfig
    # built by hand gets the defaults (or whatever additional_config holds), validated here.
    additional = vllm_config.additional_config
    tree = TreeSpecConfig.from_additional_config(method, additional) if isinstance(additional, dict) else None
    problems = []
    on_gpu = current_platform.is_cuda()
    if not (current_platform.is_cpu() or on_gpu):
        problems.append(
            f"platform {current_platform.device_name!r}: tree attention is implemented for "
            f"vLLM's CPU backend and for CUDA's FLASH_ATTN backend only"
        )
    if on_gpu:
        problems += force_gpu_settings(
            vllm_config.compilation_config, vllm_config.attention_config,
            vllm_config.parallel_config, vllm_config.model_config,
        )
    sample_method = getattr(spec, "rejection_sample_method", "standard")
    if sample_method != "standard":
        problems.append(f"rejection_sample_method {sample_method!r} (valid: 'standard'; the tree verifiers replace "
                        "vLLM's rejection sampler and keep the target's law exactly)")
    if vllm_config.scheduler_config.async_scheduling:
        problems.append("async scheduling (drop --async-scheduling / async_scheduling=True)")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism (pipeline_parallel_size > 1)")
    model_config = vllm_config.model_config
    if model_config is not None and getattr(model_config, "is_hybrid", False):
        problems.append("hybrid (Mamba / linear-attention) models: their state cannot roll back a tree")
    if model_config is not None:
        problems += attention_refusals(model_config.hf_text_config, on_gpu)
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        # a connector saves / loads KV by block as vLLM commits it; accepted tree tokens sit
        # at the wrong slots until re-run (scheduler.py), so a connector could ship stale KV
        problems.append("KV connectors (kv_transfer_config; valid: unset)")
    if envs.VLLM_USE_V2_MODEL_RUNNER:
        problems.append("the V2 model runner (unset VLLM_USE_V2_MODEL_RUNNER or set it to 0)")
    if tree is not None and tree.proposer_options.get("draft_quantization") == "int8" and not current_platform.is_cpu():
        problems.append("draft_tree's draft_quantization 'int8' off vLLM's CPU platform (valid here: 'auto', 'none')")
    kv_dtype = str(vllm_config.cache_config.cache_dtype)
    if kv_dtype not in ("auto", "bfloat16", "float16", "float32"):
        problems.append(f"kv_cache_dtype {kv_dtype!r} (valid: 'auto', 'bfloat16', 'float16', 'float32')")
    worker_cls = vllm_config.parallel_config.worker_cls
    if worker_cls not in ("auto", WORKER_CLS, GPU_WORKER_CLS):
        problems.append(f"a custom worker_cls {worker_cls!r} (valid: 'auto'; the plugin installs its tree worker)")
    sched_cls = vllm_config.scheduler_config.scheduler_cls
    if sched_cls not in (None, SCHEDULER_CLS) and not (
        isinstance(sched_cls, str) and sched_cls.endswith("sched.scheduler.Scheduler")
    ):
        problems.append(f"a custom scheduler_cls {sched_cls!r} (leave scheduler_cls unset; the plugin installs "
                        "its tree scheduler)")
    if problems:
        raise UnsupportedConfigError(
            f"speculative method {method!r} (vllm-anisotropic) does not support: " + "; ".join(problems)
        )
    # the private vLLM names the tree worker, runner, scheduler, sampler and attention rely on
    vllm_surface.check_vllm_surface("cuda" if on_gpu else "cpu")
    if tree is not None:
        additional[ADDITIONAL_CONFIG_KEY] = tree.to_additional_config()
    vllm_config.parallel_config.worker_cls = GPU_WORKER_CLS if on_gpu else WORKER_CLS
    vllm_config.scheduler_config.scheduler_cls = SCHEDULER_CLS


# model types whose vLLM implementation uses attention sinks (no config flag says so)
_SINK_MODEL_TYPES = ("gpt_oss",)


def attention_refusals(hf_config, on_gpu: bool) -> list[str]:
    """What the model's attention needs that tree attention cannot do, read from its HF config
    (refused when the engine is configured, not at the first tree step): sliding windows (a
    tree row's window would be counted by row, not by ``root + depth``), ALiBi, attention sinks,
    and on CPU logit soft-capping (vLLM's CUDA path applies it inside FlashAttention). The
    attention implementations refuse the same when they are built (``attention.py``,
    ``gpu_attention.py``): this names it before any weights load."""
    out = []
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:
        window = None  # Qwen2-style configs keep the size with the window off
    if window:
        out.append(f"sliding-window attention (the model's config has sliding_window={window}; valid: a model "
                   "without a sliding window)")
    kind = getattr(hf_config, "model_type", None)
    attn_config = getattr(hf_config, "attn_config", None)
    alibi = (getattr(hf_config, "alibi", False) is True or kind in ("bloom", "jais")
             or (kind == "mpt" and (attn_config.get("alibi") if isinstance(attn_config, dict)
                                    else getattr(attn_config, "alibi", False)))
             or (kind == "baichuan" and getattr(hf_config, "hidden_size", 0) == 5120))  # Baichuan-13B
    if alibi:
        out.append(f"ALiBi position biases (model_type {kind!r}; valid: a model with rotary or learned positions)")
    if kind in _SINK_MODEL_TYPES:
        out.append(f"attention sinks (model_type {kind!r})")
    cap = getattr(hf_config, "attn_logit_softcapping", None)
    if cap and not on_gpu:
        out.append(f"attention logit soft-capping on CPU (attn_logit_softcapping={cap}; valid: unset, or a CUDA GPU)")
    return out


def force_gpu_settings(compilation_config, attention_config, parallel_config, model_config) -> list[str]:
    """CUDA: select FLASH_ATTN and PIECEWISE CUDA graphs; return what cannot be honoured.

    * Attention backend: ``FLASH_ATTN`` (the only one with the tree split; FlashInfer is the
      default on some GPUs). A user-chosen other backend is refused.
    * CUDA graphs: ``PIECEWISE``. A FULL replay runs the attention captured in a dummy run,
      without the step's tree plan, and would emit wrong tokens silently; in PIECEWISE mode
      attention runs eagerly between the captured pieces (shared/notes, "CUDA graphs"). An
      explicitly chosen mode with full graphs is refused; ``NONE`` is kept.
    * Refused: MLA models, decode context parallelism, dual-batch overlap.
    """
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    problems = []
    backend = attention_config.backend
    if backend is None or str(getattr(backend, "name", backend)).upper() in ("AUTO", "FLASH_ATTN"):
        attention_config.backend = AttentionBackendEnum.FLASH_ATTN
    else:
        problems.append(
            f"attention backend {getattr(backend, 'name', backend)!r} (tree attention runs on FLASH_ATTN; "
            f"drop --attention-backend or choose FLASH_ATTN)"
        )
    mode = compilation_config.cudagraph_mode
    if mode is None:
        compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    elif mode.has_full_cudagraphs():
        problems.append(
            f"cudagraph_mode {mode.name} (a full CUDA graph replays attention without the tree mask; "
            f"use PIECEWISE or NONE, or leave it unset)"
        )
    if model_config is not None and getattr(model_config, "use_mla", False):
        problems.append("MLA attention models")
    if getattr(parallel_config, "decode_context_parallel_size", 1) > 1:
        problems.append("decode context parallelism (decode_context_parallel_size > 1)")
    if getattr(parallel_config, "enable_dbo", False):
        problems.append("dual-batch overlap (enable_dbo)")
    return problems


def _patch_vllm_config(cls) -> None:
    if not _already(cls, "__post_init__"):
        original = cls.__post_init__

        @functools.wraps(original)
        def __post_init__(self, *args, **kwargs):
            spec = self.speculative_config
            if spec is not None and is_tree_method(spec.method):
                check_and_install(self)
            return original(self, *args, **kwargs)

        cls.__post_init__ = _mark(__post_init__)

    name = "_get_v2_model_runner_unsupported_features"
    if hasattr(cls, name) and not _already(cls, name):
        original_v2 = getattr(cls, name)

        @functools.wraps(original_v2)
        def unsupported(self, *args, **kwargs):
            out = original_v2(self, *args, **kwargs)
            spec = self.speculative_config
            if spec is not None and is_tree_method(spec.method):
                out.append(f"speculative method '{spec.method}' (vllm-anisotropic)")
            return out

        setattr(cls, name, _mark(unsupported))


# ---------------------------------------------------------------- 6: EngineCore.post_step
def _patch_post_step(cls) -> None:
    if _already(cls, "post_step"):
        return
    original = cls.post_step

    @functools.wraps(original)
    def post_step(self, *args, **kwargs):
        if getattr(self.scheduler, "drafts_arrive_with_output", False):
            return None  # applied from the step's output already (scheduler.TreeScheduler)
        return original(self, *args, **kwargs)

    cls.post_step = _mark(post_step)


# ---------------------------------------------------------------- 7: WorkerProc._execute_worker_rpc
def _patch_worker_rpc(cls) -> None:
    if _already(cls, "_execute_worker_rpc"):
        return
    original = cls._execute_worker_rpc

    @functools.wraps(original)
    def _execute_worker_rpc(self, *args, **kwargs):
        out = original(self, *args, **kwargs)  # the reply is on its way to the engine core
        after = getattr(getattr(self.worker, "model_runner", None), "after_reply", None)
        if after is not None:
            after()
        return out

    cls._execute_worker_rpc = _mark(_execute_worker_rpc)


# ---------------------------------------------------------------- 8: CPU linear layers (opt-in)
class _RowsLayer:
    """One routed layer: its packed weight, vLLM's own ``cpu_linear`` and its shape. The layer
    holds it (``layer._vllm_anisotropic_rows``); the registry only refers to it, so a freed model
    frees its packed weights."""

    __slots__ = ("packed", "fallback", "n", "k", "__weakref__")

    def __init__(self, packed, fallback, n: int, k: int) -> None:
        self.packed, self.fallback, self.n, self.k = packed, fallback, n, k


_ROWS_LAYERS: "weakref.WeakValueDictionary[int, _RowsLayer]" = weakref.WeakValueDictionary()
_ROWS_KEYS = itertools.count()


def _rows_linear_op():
    """``torch.ops.vllm_anisotropic.rows_linear`` (registered once per process)."""
    import torch

    if hasattr(torch.ops, "vllm_anisotropic") and hasattr(torch.ops.vllm_anisotropic, "rows_linear"):
        return torch.ops.vllm_anisotropic.rows_linear
    from vllm_anisotropic.cpu_rows_gemm import RowsGemm

    gemm = RowsGemm()

    # the schema spelled out: this module's annotations are strings (``from __future__``)
    @torch.library.custom_op("vllm_anisotropic::rows_linear", mutates_args=(),
                             schema="(Tensor x, Tensor? bias, int layer) -> Tensor")
    def rows_linear(x, bias, layer):
        entry = _ROWS_LAYERS[layer]
        rows = x.reshape(-1, entry.k)
        if rows.shape[0] > ROWS_MAX or torch.get_num_threads() != 1:
            return entry.fallback(x, None, bias)
        out = gemm(entry.packed, rows)
        if bias is not None:
            out += bias.to(out.dtype)
        return out.view(*x.shape[:-1], entry.n)

    @rows_linear.register_fake
    def _(x, bias, layer):
        return x.new_empty(*x.shape[:-1], _ROWS_LAYERS[layer].n)

    return torch.ops.vllm_anisotropic.rows_linear


def _patch_cpu_gemm() -> None:
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    from vllm_anisotropic.cpu_rows_gemm import pack, unavailable_reason

    for name in ("dispatch_cpu_unquantized_gemm", "check_cpu_sgl_kernel"):
        if not callable(getattr(utils, name, None)):
            raise RuntimeError(f"{CPU_GEMM_ENV}=rows: vllm.model_executor.layers.utils.{name} is missing in vLLM "
                               f"{vllm_surface.vllm_version()}")
    if _already(utils, "dispatch_cpu_unquantized_gemm") or not current_platform.is_cpu():
        return
    reason = unavailable_reason()
    if reason:
        logger.warning("%s=rows ignored: %s", CPU_GEMM_ENV, reason)
        return
    original = utils.dispatch_cpu_unquantized_gemm
    try:
        op = _rows_linear_op()
    except RuntimeError as e:  # the build failed (e.g. a g++ without AVX512-BF16 support)
        logger.warning("%s=rows ignored: %s", CPU_GEMM_ENV, e)
        return

    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        w = layer.weight
        eligible = (not w.is_meta and w.ndim == 2 and w.dtype == torch.bfloat16 and w.shape[0] % 16 == 0
                    and w.shape[1] % 2 == 0 and ops._supports_onednn and not current_platform.is_zen_cpu()
                    and not utils.check_cpu_sgl_kernel(w.shape[0], w.shape[1], w.dtype))
        packed = pack(w.data) if eligible else None
        original(layer, remove_weight)
        if packed is None:
            return
        key = next(_ROWS_KEYS)
        layer._vllm_anisotropic_rows = _ROWS_LAYERS[key] = _RowsLayer(packed, layer.cpu_linear, int(w.shape[0]),
                                                                      int(w.shape[1]))
        layer.cpu_linear = lambda x, weight, bias, _key=key: op(x, bias, _key)

    utils.dispatch_cpu_unquantized_gemm = _mark(dispatch_cpu_unquantized_gemm)
    logger.info("%s=rows: bf16 linear layers take the rows GEMM kernel up to %d rows", CPU_GEMM_ENV, ROWS_MAX)


# ---------------------------------------------------------------- 9: SamplingParams._validate_spec_decode
def _patch_validate_spec_decode(cls) -> None:
    if _already(cls, "_validate_spec_decode"):
        return
    original = cls._validate_spec_decode

    @functools.wraps(original)
    def _validate_spec_decode(self, speculative_config, *args, **kwargs):
        if speculative_config is None or not is_tree_method(getattr(speculative_config, "method", None)):
            return original(self, speculative_config, *args, **kwargs)
        # a tree method: min_p and logit_bias are served (runner._builtin_logits_processors);
        # the request's own tree options are validated here, in the front end (a 400 naming them)
        from vllm_anisotropic.integration.vllm.frontdoor.config import request_tree_options

        try:
            request_tree_options(self.extra_args)
        except ValueError as e:
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(str(e), parameter="extra_args") from None
        return None

    cls._validate_spec_decode = _mark(_validate_spec_decode)


# ---------------------------------------------------------------- 10: seeded requests on the CPU
CPU_GENERATOR_SURFACE = {"vllm.v1.worker.gpu_input_batch:InputBatch.add_request": ("self", "request"),
                         "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample":
                             ("self", "logits", "spec_decode_metadata")}


def _patch_cpu_generators() -> None:
    problems = vllm_surface.method_problems(CPU_GENERATOR_SURFACE)
    if problems:
        logger.warning("vllm-anisotropic: seeded requests' CPU generator fix not installed: %s", "; ".join(problems))
        return
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_anisotropic.integration.vllm.platform_fixes.cpu_generators import StepRewindGenerator, rewindable

    if not vllm_surface._assigned_in_init(GPUModelRunner, "discard_request_mask"):
        logger.warning("vllm-anisotropic: seeded requests' CPU generator fix not installed: "
                       "GPUModelRunner has no discard_request_mask")
        return
    if not _already(InputBatch, "add_request"):
        add_request = InputBatch.add_request

        @functools.wraps(add_request)
        def add_request_with_rewindable_generator(self, request, *args, **kwargs):
            # on the request's cached state too: a request re-added after preemption keeps it
            request.generator = rewindable(request.generator)
            return add_request(self, request, *args, **kwargs)

        InputBatch.add_request = _mark(add_request_with_rewindable_generator)
    if not _already(GPUModelRunner, "_sample"):
        sample = GPUModelRunner._sample

        @functools.wraps(sample)
        def _sample(self, *args, **kwargs):
            # only the requests whose sample vLLM will drop (set in _prepare_inputs): every other
            # generator is left untouched
            generators = self.input_batch.generators
            if generators:
                dropped = self.discard_request_mask.np[: self.input_batch.num_reqs].nonzero()[0]
                for i in dropped.tolist():
                    generator = generators.get(i)
                    if isinstance(generator, StepRewindGenerator):
                        generator.mark()
            return sample(self, *args, **kwargs)

        GPUModelRunner._sample = _mark(_sample)


# ---------------------------------------------------------------- 11: the rejection sampler's expand on the CPU
CPU_EXPAND_SURFACE = {"vllm.utils.cpu_triton_utils:_expand_kernel_impl":
                          ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to")}


def _patch_cpu_expand() -> None:
    problems = vllm_surface.method_problems(CPU_EXPAND_SURFACE)
    if problems:
        logger.warning("vllm-anisotropic: CPU rejection sampler's expand fix not installed: %s", "; ".join(problems))
        return
    from vllm.utils import cpu_triton_utils

    from vllm_anisotropic.integration.vllm.platform_fixes.cpu_expand import expanding_any_dtype

    if not _already(cpu_triton_utils, "_expand_kernel_impl"):
        cpu_triton_utils._expand_kernel_impl = _mark(expanding_any_dtype(cpu_triton_utils._expand_kernel_impl))


def apply() -> bool:
    """Install the patches in this process (idempotent). Returns whether vLLM is supported."""
    from vllm.engine.arg_utils import EngineArgs

    supported = vllm_surface.version_supported()
    _patch_create_speculative_config(EngineArgs, supported)
    if not supported:
        logger.warning(
            "vllm-anisotropic supports vLLM %sx, found %s: tree methods disabled",
            vllm_surface.SUPPORTED_VLLM[0],
            vllm_surface.vllm_version(),
        )
        return False
    from vllm.config import SpeculativeConfig, VllmConfig

    _patch_speculative_post_init(SpeculativeConfig)
    _patch_method_literal(SpeculativeConfig)
    _patch_vllm_config(VllmConfig)
    from vllm.sampling_params import SamplingParams

    _patch_validate_spec_decode(SamplingParams)
    from vllm.v1.engine.core import EngineCore

    _patch_post_step(EngineCore)
    from vllm.v1.executor.multiproc_executor import WorkerProc

    _patch_worker_rpc(WorkerProc)
    if os.environ.get(CPU_GEMM_ENV, "") == "rows":
        _patch_cpu_gemm()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _patch_cpu_generators()
        _patch_cpu_expand()
    return True
