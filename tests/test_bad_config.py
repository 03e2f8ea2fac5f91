"""Invalid speculative configurations are refused at start-up, naming the bad key or value and
the valid ones (issue 14, item 9).

Scope: one table of invalid ``speculative_config`` dicts, alone or with the engine flags,
environment or ``additional_config`` they conflict with. Each row goes through the path that
``LLM(...)`` and ``vllm serve`` take before any engine process exists:
``EngineArgs(...).create_engine_config()`` with the plugin's patches installed
(``patches.apply()``, what ``plugin.register()`` calls). That runs the plugin's
``create_speculative_config`` wrapper (tunables -> ``TreeSpecConfig.build``), vLLM's own
``SpeculativeConfig`` validation (with the plugin's ``__post_init__``), and
``VllmConfig.__post_init__`` -> ``check_and_install`` (engine-flag conflicts). No engine,
worker or weights: only the tiny model's HF config is read, so this is not an ``engine`` test.

Each row lists substrings the error message must contain: the bad key or value AND at least
one valid alternative (allowed values, range, type or the fix), so a row fails when a message
stops naming what is valid.

Not covered: the CUDA-only refusals of ``patches.force_gpu_settings`` (attention backend other
than FLASH_ATTN, full CUDA graphs, MLA, decode context parallelism, dual-batch overlap), which
``check_and_install`` reaches only on a CUDA platform.
"""

from __future__ import annotations

import copy

import pytest

GOOSE = {"method": "goose"}
KEY = "vllm_anisotropic"  # config.ADDITIONAL_CONFIG_KEY
MISSING_COST_MODEL = "/nonexistent/vllm-anisotropic/cost.json"


def _kv_transfer():
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")


def row(id, spec, *expected, engine=None, env=None, model=None):
    """One table row: ``speculative_config``, substrings of the error, extra ``EngineArgs``/env,
    and the model's attention config (a name of ``MODEL_CONFIGS``; None: the tiny Llama)."""
    return pytest.param(spec, engine or {}, env or {}, expected, model, id=id)


# The attention fields of published model configs (values as in each model's config.json on
# the Hugging Face hub), on the tiny model's small shapes: what tree attention cannot do is
# refused from the config, before any weights load (patches.attention_refusals).
_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              vocab_size=49152, max_position_embeddings=2048)
MODEL_CONFIGS = {
    # mistralai/Mistral-7B-v0.1
    "mistral_7b_v0_1": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096, head_dim=16),
    # google/gemma-2-2b, its sliding window removed (the soft-cap alone), and as published
    "gemma_2_softcap": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", attn_logit_softcapping=50.0,
                            final_logit_softcapping=30.0, sliding_window=None, head_dim=16, query_pre_attn_scalar=16),
    "gemma_2_2b": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, sliding_window=4096, head_dim=16, query_pre_attn_scalar=16),
    # bigscience/bloom-560m
    "bloom_560m": dict(architectures=["BloomForCausalLM"], model_type="bloom", n_layer=2, n_head=4),
    # openai/gpt-oss-20b
    "gpt_oss_20b": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", sliding_window=128,
                        num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    # Qwen/Qwen2.5-0.5B: a window size with use_sliding_window false (valid: the control row)
    "qwen2_5_0_5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=32768,
                         use_sliding_window=False, max_window_layers=21),
}


BAD_CONFIGS = [
    # --- unknown keys / methods
    row("unknown_key", {**GOOSE, "bugdet": 40}, "'bugdet'", "'budget'", "'top_k'"),
    row("unknown_key_additional_config", GOOSE, "'bugdet'", "'budget'",
        engine={"additional_config": {KEY: {"bugdet": 30}}}),
    row("unknown_method", {"method": "goosey"}, "'goosey'", "'goose', 'pld', 'token_recycling', 'isotropic' or 'draft_tree'"),
    row("goose_key_for_token_recycling", {"method": "token_recycling", "spine_branch_ratio": 0.5},
        "'spine_branch_ratio'", "'token_recycling'", "'rank_decay'"),
    row("adjacency_key_for_pld", {"method": "pld", "top_k": 5}, "'top_k'", "'pld'", "'ngram_sizes'"),
    row("token_recycling_key_for_isotropic", {"method": "isotropic", "rank_decay": 1.0},
        "'rank_decay'", "'isotropic'", "'branching'"),
    row("isotropic_key_for_goose", {**GOOSE, "branching": 3}, "'branching'", "'spine_branch_ratio'"),
    # --- wrong types
    row("budget_str", {**GOOSE, "budget": "forty"}, "budget", "'forty'", "valid integer"),
    row("budget_fraction", {**GOOSE, "budget": 40.5}, "budget", "40.5", "valid integer"),
    row("ratio_list", {**GOOSE, "spine_branch_ratio": [0.5]}, "spine_branch_ratio", "[0.5]", "valid number"),
    row("ngram_sizes_str", {**GOOSE, "ngram_sizes": "345"}, "ngram_sizes", "'345'", "valid tuple"),
    row("bigram_int", {**GOOSE, "bigram": 2}, "bigram", "input_value=2", "valid boolean"),
    row("cost_model_online_str", {**GOOSE, "cost_model_online": "maybe"},
        "cost_model_online", "'maybe'", "valid boolean"),
    row("allocator_bool", {**GOOSE, "allocator": True}, "allocator", "input_value=True", "'auto' or 'off'"),
    row("num_speculative_tokens_str", {**GOOSE, "num_speculative_tokens": "five"},
        "num_speculative_tokens", "'five'", "valid integer"),
    # --- out-of-range values
    row("budget_zero", {**GOOSE, "budget": 0}, "budget", "input_value=0", "greater than or equal to 1"),
    row("budget_negative", {"method": "pld", "budget": -5}, "budget", "input_value=-5", "greater than or equal to 1"),
    row("top_k_zero", {"method": "token_recycling", "top_k": 0}, "top_k", "input_value=0", "greater than or equal to 1"),
    row("max_depth_zero", {"method": "isotropic", "max_depth": 0}, "max_depth", "input_value=0",
        "greater than or equal to 1"),
    row("ratio_above_one", {**GOOSE, "spine_branch_ratio": 1.5}, "spine_branch_ratio", "1.5", "less than or equal to 1"),
    row("ema_coef_zero", {**GOOSE, "ema_coef": 0}, "ema_coef", "input_value=0", "greater than 0"),
    row("ngram_sizes_empty", {**GOOSE, "ngram_sizes": []}, "ngram_sizes", "input_value=[]", "at least 1 item"),
    row("ngram_size_zero", {"method": "pld", "ngram_sizes": [0, 3]}, "ngram_sizes.0", "input_value=0",
        "greater than or equal to 1"),
    row("allocator_maybe", {**GOOSE, "allocator": "maybe"}, "allocator", "'maybe'", "'auto' or 'off'"),
    row("probe_every_negative", {**GOOSE, "allocator_probe_every": -1}, "allocator_probe_every",
        "input_value=-1", "greater than or equal to 0"),
    row("offer_factor_negative", {**GOOSE, "allocator_offer_factor": -0.5}, "allocator_offer_factor",
        "input_value=-0.5", "greater than or equal to 0"),
    row("backoff_negative", {**GOOSE, "allocator_backoff": -1}, "allocator_backoff",
        "input_value=-1", "greater than or equal to 0"),
    row("gate_explore_every_one", {**GOOSE, "allocator_gate_explore_every": 1}, "allocator_gate_explore_every",
        "input_value=1", "greater than or equal to 2"),
    row("gate_margin_one", {**GOOSE, "allocator_gate_margin": 1.0}, "allocator_gate_margin",
        "input_value=1.0", "less than 1"),
    row("gate_str", {**GOOSE, "allocator_gate": "sometimes"}, "allocator_gate", "'sometimes'", "valid boolean"),
    row("verifier_unknown", {**GOOSE, "verifier": "specinfer"}, "verifier", "'specinfer'", "'greedy'"),
    row("sampling_verifier_unknown", {**GOOSE, "sampling_verifier": "typical"}, "sampling_verifier", "'typical'",
        "'nss', 'deterministic' or 'none'"),
    row("deterministic_with_gate", {**GOOSE, "deterministic": True, "allocator_gate": True}, "deterministic",
        "allocator_gate", "leave allocator_gate unset or false"),
    row("bypass_signal_unknown", {**GOOSE, "bypass_signal": "length"}, "bypass_signal", "'length'",
        "'draft_length' or 'match_length'"),
    row("cost_model_missing", {**GOOSE, "cost_model": MISSING_COST_MODEL}, "cost_model",
        repr(MISSING_COST_MODEL), "leave cost_model unset"),
    row("num_speculative_tokens_zero", {**GOOSE, "num_speculative_tokens": 0}, "num_speculative_tokens",
        "input_value=0", "greater than 0"),
    row("num_speculative_tokens_negative", {**GOOSE, "num_speculative_tokens": -1}, "num_speculative_tokens",
        "input_value=-1", "greater than 0"),
    row("budget_one_leaves_no_drafts", {**GOOSE, "budget": 1}, "budget 1", "budget >= 2"),
    # --- conflicting settings and engine flags
    row("draft_model_given", {**GOOSE, "model": "some/draft"}, "'some/draft'", "takes no draft 'model'"),
    row("tunables_twice", {**GOOSE, "budget": 40}, "speculative_config", f"additional_config['{KEY}']", "not both",
        engine={"additional_config": {KEY: {"budget": 30}}}),
    row("additional_config_other_method", GOOSE, "'pld'", "speculative_config selects 'goose'",
        engine={"additional_config": {KEY: {"method": "pld", "options": {}}}}),
    row("additional_config_not_a_dict", GOOSE, f"additional_config['{KEY}']", "'goose!'", "{'budget': 40}",
        engine={"additional_config": {KEY: "goose!"}}),
    row("spec_method_flag_and_method", GOOSE, "--spec-method", "--speculative-config['method']",
        "mutually exclusive", engine={"spec_method": "pld"}),
    row("async_scheduling", GOOSE, "async scheduling", "drop --async-scheduling", engine={"async_scheduling": True}),
    row("pipeline_parallel", GOOSE, "pipeline_parallel_size > 1", engine={"pipeline_parallel_size": 2}),
    row("v2_model_runner", GOOSE, "V2 model runner", "set it to 0", env={"VLLM_USE_V2_MODEL_RUNNER": "1"}),
    row("kv_cache_fp8", GOOSE, "kv_cache_dtype 'fp8'", "'auto'", engine={"kv_cache_dtype": "fp8"}),
    row("custom_worker_cls", GOOSE, "'my.Worker'", "'auto'", engine={"worker_cls": "my.Worker"}),
    row("custom_scheduler_cls", GOOSE, "'my.Scheduler'", "leave", engine={"scheduler_cls": "my.Scheduler"}),
    row("kv_connector", GOOSE, "KV connectors", "kv_transfer_config", engine={"kv_transfer_config": _kv_transfer()}),
    # ("synthetic" needs acceptance rates of its own; 0.33 refuses it without them first)
    row("rejection_sample_block", {**GOOSE, "rejection_sample_method": "block"},
        "rejection_sample_method 'block'", "valid: 'standard'"),
    # 0.33's lossy FLy: refused by the plugin on 0.33, by vLLM's own Literal on 0.32
    row("rejection_sample_fly", {**GOOSE, "rejection_sample_method": "fly"}, "'fly'", "'standard'"),
    # --- what the model's attention needs and tree attention cannot do (CPU)
    row("model_sliding_window", GOOSE, "sliding-window attention", "sliding_window=4096", "without a sliding window",
        model="mistral_7b_v0_1"),
    row("model_softcap", GOOSE, "soft-capping", "attn_logit_softcapping=50.0", "a CUDA GPU", model="gemma_2_softcap"),
    row("model_softcap_and_window", GOOSE, "sliding_window=4096", "attn_logit_softcapping=50.0", model="gemma_2_2b"),
    row("model_alibi", GOOSE, "ALiBi", "'bloom'", "rotary or learned positions", model="bloom_560m"),
    row("model_sinks", GOOSE, "attention sinks", "'gpt_oss'", "sliding_window=128", model="gpt_oss_20b"),
]


@pytest.fixture(scope="module")
def engine_args_cls():
    from vllm_anisotropic.integration.vllm.frontdoor import patches, vllm_surface

    if not patches.apply():
        pytest.skip(f"vLLM {vllm_surface.vllm_version()} is not {vllm_surface.SUPPORTED_VLLM[0]}x")
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


def test_table_is_large_enough():
    assert len(BAD_CONFIGS) >= 24


def model_with(tiny_model_dir, name, tmp_path) -> str:
    """The tiny model's directory with MODEL_CONFIGS[name] as its config (None: unchanged)."""
    if name is None:
        return str(tiny_model_dir)
    import json
    import shutil

    path = tmp_path / name
    shutil.copytree(tiny_model_dir, path)
    (path / "config.json").write_text(json.dumps({**_SMALL, **MODEL_CONFIGS[name]}))
    return str(path)


@pytest.mark.parametrize("spec, engine, env, expected, model", BAD_CONFIGS)
def test_bad_config_refused_at_startup(engine_args_cls, tiny_model_dir, monkeypatch, tmp_path, spec, engine, env,
                                       expected, model):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = engine_args_cls(
        model=model_with(tiny_model_dir, model, tmp_path),
        speculative_config=copy.deepcopy(spec),
        enforce_eager=True,
        max_model_len=1024,
        **copy.deepcopy(engine),
    )
    with pytest.raises(ValueError) as info:  # pydantic's ValidationError is a ValueError
        args.create_engine_config()
    message = str(info.value)
    missing = [s for s in expected if s not in message]
    assert not missing, f"message lacks {missing}:\n{message}"


def test_valid_config_still_starts(engine_args_cls, tiny_model_dir, tmp_path):
    """The control row: the same path accepts a valid config (and a cost_model file that exists)."""
    from vllm_anisotropic.allocator import CostModel

    path = tmp_path / "cost.json"
    path.write_text(CostModel.linear(0.01, 1e-4).to_json())
    spec = {**GOOSE, "budget": 40, "ngram_sizes": [4, 3], "cost_model": str(path)}
    config = engine_args_cls(
        model=str(tiny_model_dir), speculative_config=spec, enforce_eager=True, max_model_len=1024
    ).create_engine_config()
    assert config.speculative_config.num_speculative_tokens == 39
    assert config.additional_config[KEY]["options"]["cost_model"] == str(path)


def test_a_window_size_with_the_window_off_is_not_refused(engine_args_cls, tiny_model_dir, tmp_path):
    """Qwen2.5's config keeps ``sliding_window`` with ``use_sliding_window: false``: no window."""
    config = engine_args_cls(model=model_with(tiny_model_dir, "qwen2_5_0_5b", tmp_path), speculative_config=GOOSE,
                             enforce_eager=True, max_model_len=1024).create_engine_config()
    assert config.speculative_config.method == "goose"


def test_an_int8_draft_off_the_cpu_platform_is_refused_when_the_engine_is_built(engine_args_cls, tiny_model_dir,
                                                                                 monkeypatch):
    """``draft_quantization: int8`` runs on vLLM's CPU platform only: on another, the engine's
    config check refuses it by name (before any worker loads q), naming what is valid there."""
    from vllm.platforms import current_platform

    from vllm_anisotropic.integration.vllm.frontdoor import patches

    spec = {"method": "draft_tree", "model": str(tiny_model_dir), "draft_quantization": "int8"}
    config = engine_args_cls(model=str(tiny_model_dir), speculative_config=spec, enforce_eager=True,
                             max_model_len=1024).create_engine_config()  # on the CPU platform: valid
    assert config.additional_config[KEY]["options"]["draft_quantization"] == "int8"
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    with pytest.raises(ValueError) as info:
        patches.check_and_install(config)
    assert "draft_quantization 'int8' off vLLM's CPU platform (valid here: 'auto', 'none')" in str(info.value)
    config.additional_config[KEY]["options"]["draft_quantization"] = "auto"
    with pytest.raises(ValueError) as info:  # still refused (the platform itself), but not for the draft
        patches.check_and_install(config)
    assert "draft_quantization" not in str(info.value)


def test_auto_takes_the_shipped_selector_timed_with_what_q_runs_in(engine_args_cls, tiny_model_dir, tmp_path,
                                                                   monkeypatch):
    """The front door resolves ``"selector": "auto"`` to the pair's shipped selector whose pass
    times were measured with q in the quantization the workers will run (``draft_quantization``,
    ``auto`` resolved as the worker resolves it): the int8-timed one for int8, the other for none."""
    import json
    import shutil

    import torch

    from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import resolve_quantization
    from vllm_anisotropic.selector import shipped
    from vllm_anisotropic.selector.shipped import model_fingerprint

    fp = model_fingerprint(tiny_model_dir)
    fake = tmp_path / "shipped"
    for d in sorted(shipped.SHIPPED_DIR.glob("*/")):  # the package's selectors, re-paired with the tiny model
        shutil.copytree(d, fake / d.name)
        doc = json.loads((fake / d.name / "selector.json").read_text())
        doc["pair"] = {**doc["pair"], "target_fingerprint": fp, "draft_fingerprint": fp}
        (fake / d.name / "selector.json").write_text(json.dumps(doc))
    by_quantization = {json.loads((d / "selector.json").read_text()).get("draft_quantization", "none"): d
                       for d in fake.iterdir()}
    assert set(by_quantization) == {"none", "int8"}
    monkeypatch.setattr(shipped, "SHIPPED_DIR", fake)
    from vllm import _custom_ops as ops

    assert ops._supports_onednn, "vLLM's CPU build has its oneDNN kernels (the int8 q needs them)"
    for vnni, asked, runs in ((True, "none", "none"), (True, "int8", "int8"), (True, "auto", "int8"),
                              (False, "auto", "none"), (False, "int8", "int8")):
        monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda vnni=vnni: vnni)
        assert resolve_quantization(asked, cpu_platform=True) == runs  # what the workers will run
        spec = {"method": "draft_tree", "model": str(tiny_model_dir), "draft_quantization": asked}
        config = engine_args_cls(model=str(tiny_model_dir), speculative_config=spec, enforce_eager=True,
                                 max_model_len=1024).create_engine_config()
        assert config.additional_config[KEY]["options"]["selector"] == str(by_quantization[runs]), (vnni, asked)
