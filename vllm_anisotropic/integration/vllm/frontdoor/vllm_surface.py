"""The private vLLM surface vllm-anisotropic relies on, checked before an engine starts.

Scope: every vLLM name the adapter overrides, calls or reads that is not public API -- the
methods the tree runner, worker, scheduler, sampler and attention subclasses override (with
the leading parameters they pass through), the dataclass fields they read from vLLM's step
objects, and the attributes the tree runner reads from a constructed model runner. The
overrides themselves stay in the subclasses (``engine/runner.py``, ``engine/worker.py``,
``engine/scheduler.py``, ``engine/sampler.py``, ``kernels/attention.py``) and the front-door
patches in ``patches.py``; this module is
the one list of what they assume, so a vLLM release that renames, removes or re-orders any of
it is refused at start-up with every mismatch named, instead of failing mid-step or, worse,
silently skipping an override (a renamed ``_prepare_inputs`` would leave tree positions
unscattered: wrong tokens, no error).

``check_vllm_surface()`` runs in ``patches.check_and_install`` (every engine configuration with
a tree method, in the process that builds it); ``check_runner(runner)`` runs in the tree
runner's ``__init__`` (attributes exist only on a constructed runner). Both raise
``VllmSurfaceError``. Written against vLLM 0.32 (``SUPPORTED_VLLM``); file:line
references in shared/notes/vllm-0.32-spec-decode-map.md.

Example of the error::

    VllmSurfaceError: vLLM 0.33.0 does not have the surface vllm-anisotropic 0.32 relies on:
      vllm.v1.worker.cpu_model_runner:CPUModelRunner._prepare_inputs: expected parameters
      ('self', 'scheduler_output', 'num_scheduled_tokens'), found ('self', 'scheduler_output')
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re

__all__ = ["VllmSurfaceError", "check_runner", "check_vllm_surface", "method_problems", "surface_problems",
           "SUPPORTED_VLLM", "vllm_version", "version_supported", "RUNNER_METHODS", "METHODS", "FIELDS",
           "CLASS_ATTRIBUTES", "RUNNER_ATTRIBUTES"]

# the vLLM releases the names below were checked against; on any other, ``patches.apply``
# installs only the patch that refuses our methods by name
SUPPORTED_VLLM = ("0.32.", "0.33.")

# modules that exist only for (or only import on) one platform
_CPU_ONLY = ("vllm.v1.worker.cpu_", "vllm.v1.attention.backends.cpu_attn")

# runner.TreeRunnerMixin: method -> the leading parameter names our override passes through;
# checked on the platform's runner class (CPUModelRunner derives from GPUModelRunner)
RUNNER_METHODS: dict[str, tuple[str, ...]] = {
    "__init__": ("self", "vllm_config", "device"),
    "_update_states": ("self", "scheduler_output"),
    "_prepare_inputs": ("self", "scheduler_output", "num_scheduled_tokens"),
    "_build_attention_metadata": ("self",),
    "_sample": ("self", "logits", "spec_decode_metadata"),
    "take_draft_token_ids": ("self",),
    "_input_fits_in_drafter": ("self", "common_attn_metadata"),
    "sample_tokens": ("self", "grammar_output"),
    "propose_draft_token_ids": ("self", "scheduler_output", "sampled_token_ids"),
    "_dummy_run": ("self", "num_tokens"),
}
RUNNER_CLASS = {"cpu": "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
                "cuda": "vllm.v1.worker.gpu_model_runner:GPUModelRunner"}

# "module:Class.method" -> the leading parameter names our override or call passes
METHODS: dict[str, tuple[str, ...]] = {
    # worker.TreeCPUWorker / TreeGPUWorker
    "vllm.v1.worker.cpu_worker:CPUWorker.init_device": ("self",),
    "vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model": ("self",),
    "vllm.v1.worker.gpu_worker:Worker._make_model_runner": ("self",),
    "vllm.v1.worker.gpu_worker:Worker.load_model": ("self",),
    # scheduler.TreeScheduler
    "vllm.v1.core.sched.scheduler:Scheduler.__init__": ("self", "vllm_config"),
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": ("self",),
    "vllm.v1.core.sched.scheduler:Scheduler.add_request": ("self", "request"),
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output": ("self", "scheduler_output", "model_runner_output"),
    "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids": ("self", "draft_token_ids"),
    # tree_grammar.py: structured-output trees pruned and masked per node (the root row is vLLM's)
    "vllm.v1.core.sched.scheduler:Scheduler.get_grammar_bitmask": ("self", "scheduler_output"),
    "vllm.v1.structured_output:StructuredOutputManager._get_constraint_bounds": ("self", "request", "spec_tokens"),
    "vllm.v1.structured_output.backend_types:StructuredOutputGrammar.accept_tokens": ("self", "request_id", "tokens"),
    "vllm.v1.structured_output.backend_types:StructuredOutputGrammar.validate_tokens": ("self", "tokens"),
    "vllm.v1.structured_output.backend_types:StructuredOutputGrammar.rollback": ("self", "num_tokens"),
    "vllm.v1.structured_output.backend_types:StructuredOutputGrammar.fill_bitmask": ("self", "bitmask", "batch_index"),
    "vllm.v1.structured_output.backend_types:StructuredOutputGrammar.is_terminated": ("self",),
    "vllm.v1.structured_output.backend_types:StructuredOutputBackend.allocate_token_bitmask": ("self", "max_num_seqs"),
    # Not overridden, relied on: vLLM's update_from_output rolls back the rejected drafts, appends
    # the emitted tokens (_update_request_with_output) and, from 0.33 on, commits the request's
    # full blocks to the prefix cache at once (cache_blocks). Right for trees because the worker
    # moved the accepted nodes' K/V to root + 1 .. root + a before replying (kv_moves.py).
    "vllm.v1.core.sched.scheduler:Scheduler._update_request_with_output": ("self", "request", "new_token_ids"),
    "vllm.v1.core.kv_cache_manager:KVCacheManager.cache_blocks": ("self", "request", "num_computed_tokens"),
    # patches.py patch 6: the tree scheduler takes the drafts from the step's output
    "vllm.v1.engine.core:EngineCore.post_step": ("self", "model_executed"),
    # patches.py patch 7: work the tree runner deferred past its reply
    "vllm.v1.executor.multiproc_executor:WorkerProc._execute_worker_rpc": ("self", "rpc_request"),
    # sampler.TreeRejectionSampler replaces the runner's rejection sampler, same call
    "vllm.v1.sample.rejection_sampler:RejectionSampler.forward": ("self", "metadata", "draft_probs", "logits", "sampling_metadata"),
    # cpu_gemm.use_vllm_cpu_gemm: draft_tree's q takes vLLM's CPU GEMM per linear layer (it then
    # calls the ``cpu_linear(x, weight, bias)`` the dispatch sets on the layer)
    "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm": ("layer", "remove_weight"),
    # cpu_gemm.dispatch_linear with draft_quantization int8: vLLM's oneDNN int8 GEMM (W8A8)
    "vllm._custom_ops:create_onednn_scaled_mm": ("weight", "weight_scales", "output_type", "dynamic_quant", "use_azp",
                                                 "primitive_cache_size"),
    "vllm._custom_ops:onednn_scaled_int8_quant": ("input", "scale", "azp", "symmetric"),
    "vllm._custom_ops:onednn_scaled_mm": ("dnnl_handler", "x", "output", "input_scale", "input_zp", "input_zp_adj", "bias"),
    # cpu_draft.FusedLayers: q's decoder layers on vLLM's CPU ops
    "vllm._custom_ops:rms_norm": ("out", "input", "weight", "epsilon"),
    "vllm._custom_ops:fused_add_rms_norm": ("input", "residual", "weight", "epsilon"),
    "vllm._custom_ops:rotary_embedding": ("positions", "query", "key", "head_size", "cos_sin_cache", "is_neox"),
    # patches.py patch 9: min_p / logit_bias requests and the request's tree options
    "vllm.sampling_params:SamplingParams._validate_spec_decode": ("self", "speculative_config"),
    # runner.TreeRunnerMixin._builtin_logits_processors builds what plain decoding has
    "vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor.__init__": ("self", "vllm_config", "device", "is_pin_memory"),
    "vllm.v1.sample.logits_processor.builtin:LogitBiasLogitsProcessor.__init__": ("self", "_", "device", "is_pin_memory"),
    "vllm.v1.worker.gpu_input_batch:InputBatch._make_sampling_metadata": ("self",),
    # attention.TreeCPUAttentionImpl
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward": (
        "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"),
}

# "module:Class" -> dataclass (or msgspec Struct) fields read from vLLM's step objects and requests
FIELDS: dict[str, tuple[str, ...]] = {
    "vllm.v1.core.sched.output:SchedulerOutput": (
        "scheduled_new_reqs", "num_scheduled_tokens", "total_num_scheduled_tokens", "scheduled_spec_decode_tokens",
        "finished_req_ids", "preempted_req_ids"),
    "vllm.v1.outputs:ModelRunnerOutput": ("req_id_to_index", "sampled_token_ids"),
    "vllm.v1.outputs:DraftTokenIds": ("req_ids", "draft_token_ids"),
    "vllm.v1.core.sched.output:GrammarOutput": ("structured_output_request_ids", "grammar_bitmask",
                                                "num_acceptable_drafts"),
    "vllm.v1.spec_decode.metadata:SpecDecodeMetadata": ("num_draft_tokens", "cu_num_sampled_tokens", "bonus_logits_indices"),
    "vllm.v1.sample.metadata:SamplingMetadata": ("temperature", "top_k", "top_p"),
    "vllm.sampling_params:SamplingParams": ("logit_bias", "allowed_token_ids", "min_p", "extra_args"),
}

# "module:Class" -> attributes read: class-level (methods, properties) or assigned as
# ``self.<name> =`` in the class's ``__init__`` / ``__post_init__``
CLASS_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "vllm.v1.spec_decode.metadata:SpecDecodeMetadata": ("max_spec_len",),
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend": ("get_impl_cls",),
    # patches.py patch 6 reads the engine core's scheduler, patch 7 the worker process's worker
    "vllm.v1.engine.core:EngineCore": ("scheduler",),
    "vllm.v1.executor.multiproc_executor:WorkerProc": ("worker",),
    # scheduler.TreeScheduler.schedule prices a draft model's catch-ups at the batch ahead
    "vllm.v1.core.sched.scheduler:Scheduler": ("running", "waiting", "max_num_running_reqs"),
    # budget.BatchBudget.cut and scheduler.TreeScheduler read the scheduler's running requests
    "vllm.v1.request:Request": ("request_id", "spec_token_ids", "num_tokens", "num_computed_tokens",
                                "num_prompt_tokens", "cache_salt", "sampling_params", "structured_output_request",
                                "is_prefill_chunk", "is_finished"),
    # scheduler.TreeScheduler.get_grammar_bitmask allocates the node rows' buffer from the backend
    "vllm.v1.structured_output:StructuredOutputManager": ("backend",),
    # runner.TreeRunnerMixin.move_kv reads the step's slot mapping of KV cache group 0
    "vllm.v1.worker.block_table:BlockTable": ("slot_mapping",),
}

# attributes the tree runner reads from a constructed model runner (dotted: nested)
RUNNER_ATTRIBUTES: tuple[str, ...] = (
    "drafter", "rejection_sampler", "rejection_sampler.sampler", "input_batch", "input_batch.req_ids",
    "input_batch.num_reqs", "input_batch.num_computed_tokens_cpu", "input_batch.num_tokens_no_spec",
    "input_batch.token_ids_cpu", "input_batch.req_id_to_index", "input_batch.block_table", "query_start_loc",
    "input_batch.logitsprocs", "input_batch.sampling_metadata",
    "positions", "requests", "uses_mrope", "scheduler_config", "model_config",
    # the attention layers whose K/V caches the slot moves edit (kv_moves.KVMover.from_layers)
    "compilation_config.static_forward_context",
    # _prepare_inputs hides it for a step without scheduled drafts (vLLM's plain branch; were a
    # release to stop reading it there, the spec-decode metadata built instead is dropped anyway)
    "speculative_config",
)


class VllmSurfaceError(RuntimeError):
    """The installed vLLM lacks (or changed) a private name vllm-anisotropic relies on."""


def _resolve(path: str):
    """``"pkg.mod:Class.attr"`` -> the object, or raise AttributeError / ImportError."""
    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _leading_parameters(fn, count: int) -> tuple[str, ...]:
    return tuple(list(inspect.signature(fn).parameters)[:count])


def _assigned_in_init(cls, name: str) -> bool:
    """True if ``cls.__init__`` or ``cls.__post_init__`` assigns ``self.<name>``."""
    for init in ("__post_init__", "__init__"):
        fn = cls.__dict__.get(init)
        if fn is None:
            continue
        try:
            # "self.x = ..." or annotated "self.x: T = ..." (not "self.x == ...")
            if re.search(rf"self\.{re.escape(name)}\s*(?::[^=\n]*)?=(?!=)", inspect.getsource(fn)):
                return True
        except (OSError, TypeError):
            continue
    return False


def method_problems(methods: dict[str, tuple[str, ...]]) -> list[str]:
    """Every method of ``methods`` ("module:Class.method" -> leading parameter names) that is
    missing or whose leading parameters differ."""
    problems = []
    for path, expected in methods.items():
        try:
            found = _leading_parameters(_resolve(path), len(expected))
        except (ImportError, AttributeError) as e:
            problems.append(f"{path}: missing ({e})")
            continue
        if found != expected:
            problems.append(f"{path}: expected parameters {expected}, found {found}")
    return problems


def surface_problems(platform: str = "cpu") -> list[str]:
    """Every mismatch between the installed vLLM and RUNNER_METHODS (on the ``platform``'s
    runner, ``"cpu"`` or ``"cuda"``), METHODS, FIELDS and CLASS_ATTRIBUTES (CPU-only modules
    are skipped on ``"cuda"``)."""
    methods = {f"{RUNNER_CLASS[platform]}.{name}": params for name, params in RUNNER_METHODS.items()}
    methods.update(METHODS)
    if platform != "cpu":
        methods = {p: v for p, v in methods.items() if not p.startswith(_CPU_ONLY)}
    problems = method_problems(methods)
    for path, names in FIELDS.items():
        try:
            cls = _resolve(path)
        except (ImportError, AttributeError) as e:
            problems.append(f"{path}: missing ({e})")
            continue
        # a dataclass's fields, or a msgspec Struct's (SamplingParams)
        have = ({f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls)
                else set(getattr(cls, "__struct_fields__", ())))
        missing = [n for n in names if n not in have]
        if missing:
            problems.append(f"{path}: missing dataclass field(s) {missing}")
    for path, names in CLASS_ATTRIBUTES.items():
        if platform != "cpu" and path.startswith(_CPU_ONLY):
            continue
        try:
            cls = _resolve(path)
        except (ImportError, AttributeError) as e:
            problems.append(f"{path}: missing ({e})")
            continue
        missing = [n for n in names if not hasattr(cls, n) and not _assigned_in_init(cls, n)]
        if missing:
            problems.append(f"{path}: missing attribute(s) {missing}")
    return problems


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def version_supported(version: str | None = None) -> bool:
    version = version or vllm_version()
    return any(version.startswith(v) for v in SUPPORTED_VLLM)


def _raise(problems: list[str]) -> None:
    raise VllmSurfaceError(
        f"vLLM {vllm_version()} does not have the surface vllm-anisotropic relies on (written for vLLM "
        f"{', '.join(v + 'x' for v in SUPPORTED_VLLM)}):\n  " + "\n  ".join(problems))


@functools.lru_cache(maxsize=2)
def check_vllm_surface(platform: str = "cpu") -> None:
    """Raise ``VllmSurfaceError`` naming every mismatch (checked once per process and platform)."""
    problems = surface_problems(platform)
    if problems:
        _raise(problems)


def check_runner(runner) -> None:
    """Raise ``VllmSurfaceError`` if a constructed model runner lacks an attribute the tree
    runner reads (RUNNER_ATTRIBUTES)."""
    missing = []
    for dotted in RUNNER_ATTRIBUTES:
        obj = runner
        for part in dotted.split("."):
            if not hasattr(obj, part):
                missing.append(dotted)
                break
            obj = getattr(obj, part)
    if missing:
        _raise([f"{type(runner).__name__}: missing attribute(s) {missing}"])
