"""Helm chart tests: deploy/helm/vllm-anisotropic rendered and linted by real Helm.

Scope: `helm lint` (strict) and offline `helm template` of the chart through
helm-python-sdk (import name `helm_python`), which binds Helm v4's own Go SDK via
ctypes, so values coalescing, template functions and values.schema.json validation are
exactly Helm's. No cluster, no network, no helm binary. The rendered manifests are
parsed with PyYAML and checked field by field: the one-argument speculative JSON, the
GPU count (= tensor parallel size), probes, /dev/shm, optional ServiceMonitor / PVC /
hub-token env, and that the schema rejects bad values naming the bad field.

Terms: "render" = `helm template` (Chart.render), "lint" = `helm lint`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (the `test` extra)")
yaml = pytest.importorskip("yaml")

CHART = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "vllm-anisotropic"
RELEASE = "goose"
NAMESPACE = "llm"
FULLNAME = "goose-vllm-anisotropic"

# GOOSE paper defaults, as the chart must render them.
GOOSE_DEFAULTS = {
    "method": "goose",
    "budget": 60,
    "max_depth": 6,
    "top_k": 10,
    "spine_branch_ratio": 0.5,
    "min_branch_score": 0.01,
    "verifier": "greedy",
}


def go_json(obj: dict[str, Any]) -> str:
    """What Helm's `toJson` (Go encoding/json) writes for plain ASCII content:
    compact separators, map keys sorted. Example: {"b": 1, "a": 0.5} -> '{"a":0.5,"b":1}'."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart, values: dict[str, Any] | None = None) -> dict[str, Any]:
    """Render the chart; return {kind: manifest} (each kind appears at most once here)
    plus "NOTES" -> the rendered NOTES.txt text."""
    out = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    docs: dict[str, Any] = {}
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            docs["NOTES"] = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                assert doc["kind"] not in docs, f"two {doc['kind']} manifests"
                docs[doc["kind"]] = doc
    return docs


def container(docs: dict[str, Any]) -> dict[str, Any]:
    containers = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def arg_value(args: list[str], flag: str) -> str | None:
    """Value after `flag` in an args list; None when the flag is absent.
    Example: (["m", "--port", "8000"], "--port") -> "8000"."""
    if flag not in args:
        return None
    assert args.count(flag) == 1, f"{flag} given twice"
    return args[args.index(flag) + 1]


def speculative_arg(docs: dict[str, Any]) -> str | None:
    return arg_value(container(docs)["args"], "--speculative-config")


def gpu_counts(docs: dict[str, Any], resource: str = "nvidia.com/gpu") -> tuple[Any, Any]:
    res = container(docs)["resources"]
    return res.get("requests", {}).get(resource), res.get("limits", {}).get(resource)


# ---------------------------------------------------------------------------- lint


@pytest.mark.parametrize(
    "values",
    [
        None,
        {"tensorParallelSize": 8, "metrics": {"serviceMonitor": {"enabled": True}}},
        {"gpu": {"enabled": False}, "modelCache": {"enabled": True}},
        {"hfToken": {"secretName": "hf-token"}, "speculative": {"method": "suffix"}},
    ],
    ids=["defaults", "tp8-servicemonitor", "nogpu-pvc", "token-suffix"],
)
def test_lint_strict_is_clean(values):
    report = helm.lint(CHART, values, strict=True)
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    # severity 2 = warning, 3 = error; only info (e.g. "icon is recommended") may remain
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# -------------------------------------------------------------------------- defaults


def test_defaults_render_goose_paper_config(chart):
    docs = render(chart)
    assert set(docs) == {"Deployment", "Service", "NOTES"}

    raw = speculative_arg(docs)
    # one argument, the exact compact JSON, and it parses back to the paper defaults
    assert raw == go_json(GOOSE_DEFAULTS)
    assert json.loads(raw) == GOOSE_DEFAULTS

    c = container(docs)
    args = c["args"]
    assert all(isinstance(a, str) for a in args), "Kubernetes args must all be strings"
    assert args[0] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"  # positional model of `vllm serve`
    assert "command" not in c  # the image's ENTRYPOINT (`vllm serve`) stays
    assert arg_value(args, "--tensor-parallel-size") == "1"
    assert arg_value(args, "--gpu-memory-utilization") == "0.9"
    assert arg_value(args, "--port") == "8000"
    assert arg_value(args, "--host") == "0.0.0.0"
    assert arg_value(args, "--max-model-len") is None
    assert c["image"] == "vllm-anisotropic:0.1.0"  # tag defaults to appVersion
    assert gpu_counts(docs) == (1, 1)
    assert "env" not in c  # no token, no cache by default

    # probes: all on /health; startup budget >= 30 min for big models
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 30 * 60

    # /dev/shm: memory-backed emptyDir, mounted
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]

    # the Service selects the pods and targets the named port
    svc = docs["Service"]
    assert svc["metadata"]["name"] == FULLNAME
    assert svc["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]

    assert go_json(GOOSE_DEFAULTS) in docs["NOTES"]


def test_render_is_deterministic(chart):
    values = {"tensorParallelSize": 4, "metrics": {"serviceMonitor": {"enabled": True}}}
    first = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert all(chart.render(values, name=RELEASE, namespace=NAMESPACE) == first for _ in range(3))


# ------------------------------------------------------------------------ edge values


def test_tp8_requests_and_limits_eight_gpus(chart):
    docs = render(chart, {"tensorParallelSize": 8, "maxModelLen": 1048576})
    assert gpu_counts(docs) == (8, 8)
    args = container(docs)["args"]
    assert arg_value(args, "--tensor-parallel-size") == "8"
    # a large integer must not come out in float notation (1.048576e+06)
    assert arg_value(args, "--max-model-len") == "1048576"
    # CPU/memory from .Values.resources are kept next to the GPUs
    res = container(docs)["resources"]
    assert res["requests"]["memory"] == "16Gi" and res["limits"]["memory"] == "64Gi"


def test_other_gpu_resource_name(chart):
    docs = render(chart, {"tensorParallelSize": 2, "gpu": {"resourceName": "amd.com/gpu"}})
    assert gpu_counts(docs, "amd.com/gpu") == (2, 2)
    assert gpu_counts(docs) == (None, None)


def test_no_gpu_mode_renders_no_gpu_resource(chart):
    # `resources: null` drops the chart's CPU/memory defaults (an empty map would merge)
    docs = render(chart, {"gpu": {"enabled": False}, "tensorParallelSize": 2, "resources": None})
    rendered = json.dumps(docs)
    assert "nvidia.com/gpu" not in rendered
    assert container(docs)["resources"] == {}
    # the TP flag is still passed to vLLM
    assert arg_value(container(docs)["args"], "--tensor-parallel-size") == "2"
    assert "no GPU resources requested" in docs["NOTES"]


def test_custom_goose_options_merge_into_one_json(chart):
    values = {
        "speculative": {
            "options": {"goose": {"budget": 120, "min_branch_score": 0.05, "top_k": 16}}
        }
    }
    expected = {**GOOSE_DEFAULTS, "budget": 120, "min_branch_score": 0.05, "top_k": 16}
    raw = speculative_arg(render(chart, values))
    assert raw == go_json(expected)
    assert json.loads(raw) == expected


def test_null_drops_an_option(chart):
    values = {"speculative": {"options": {"goose": {"verifier": None}}}}
    expected = {k: v for k, v in GOOSE_DEFAULTS.items() if k != "verifier"}
    assert json.loads(speculative_arg(render(chart, values))) == expected


@pytest.mark.parametrize(
    ("speculative", "expected"),
    [
        ({"method": "pld"}, {"method": "pld"}),
        (
            {"method": "token_recycling", "options": {"token_recycling": {"budget": 80}}},
            {"method": "token_recycling", "budget": 80},
        ),
        ({"method": "isotropic"}, {"method": "isotropic"}),
        ({"method": "ngram"}, {"method": "ngram", "num_speculative_tokens": 5}),
        ({"method": "suffix"}, {"method": "suffix"}),
    ],
    ids=["pld", "token_recycling", "isotropic", "ngram", "suffix"],
)
def test_other_methods_get_only_their_own_options(chart, speculative, expected):
    raw = speculative_arg(render(chart, {"speculative": speculative}))
    assert raw == go_json(expected)
    assert json.loads(raw) == expected


def test_json_survives_awkward_characters(chart):
    """Quotes, apostrophes, spaces, backslashes, braces, HTML and non-ASCII pass
    through the args list unharmed (no shell; Go may \\u-escape <, >, &)."""
    nasty = "a b'c\"d\\e{f}<g>&h $(rm -rf /) ü"
    # cost_model is a free-form path (the plugin checks the file exists when vLLM starts)
    values = {"speculative": {"options": {"goose": {"cost_model": nasty}}}}
    raw = speculative_arg(render(chart, values))
    assert json.loads(raw) == {**GOOSE_DEFAULTS, "cost_model": nasty}


def test_speculative_disabled_is_a_baseline(chart):
    docs = render(chart, {"speculative": {"enabled": False}})
    assert speculative_arg(docs) is None
    assert "disabled" in docs["NOTES"]


def test_model_flags_and_extra_args(chart):
    values = {
        "model": {
            "name": "/models/llama",
            "servedModelName": "llama",
            "revision": "main",
            "trustRemoteCode": True,
            "dtype": "bfloat16",
        },
        "maxModelLen": 8192,
        "gpuMemoryUtilization": 1,
        "extraArgs": ["--enable-prefix-caching", "--max-num-seqs", 128],
    }
    args = container(render(chart, values))["args"]
    assert args[0] == "/models/llama"
    assert arg_value(args, "--served-model-name") == "llama"
    assert arg_value(args, "--revision") == "main"
    assert arg_value(args, "--dtype") == "bfloat16"
    assert "--trust-remote-code" in args
    assert arg_value(args, "--max-model-len") == "8192"
    assert arg_value(args, "--gpu-memory-utilization") == "1"
    assert args[-3:] == ["--enable-prefix-caching", "--max-num-seqs", "128"]

    args = container(render(chart, {"gpuMemoryUtilization": None}))["args"]
    assert arg_value(args, "--gpu-memory-utilization") is None


def test_shm_can_be_disabled_and_sized(chart):
    docs = render(chart, {"shm": {"enabled": False}})
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    assert "volumes" not in pod
    assert "volumeMounts" not in container(docs)

    docs = render(chart, {"shm": {"sizeLimit": "64Gi"}, "tensorParallelSize": 8})
    volumes = docs["Deployment"]["spec"]["template"]["spec"]["volumes"]
    assert volumes == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}]


# ------------------------------------------------------------- optional resources


def test_service_monitor_only_when_enabled(chart):
    assert "ServiceMonitor" not in render(chart)
    docs = render(
        chart,
        {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}},
    )
    sm = docs["ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= docs["Service"]["metadata"][
        "labels"
    ].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"


def test_pvc_only_when_enabled(chart):
    assert "PersistentVolumeClaim" not in render(chart)

    docs = render(
        chart,
        {"modelCache": {"enabled": True, "size": "500Gi", "storageClassName": "fast"}},
    )
    pvc = docs["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == f"{FULLNAME}-model-cache"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "500Gi"
    assert pvc["spec"]["storageClassName"] == "fast"
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    volumes = {v["name"]: v for v in docs["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {
        "claimName": f"{FULLNAME}-model-cache"
    }
    c = container(docs)
    assert {"name": "model-cache", "mountPath": "/models"} in c["volumeMounts"]
    assert {"name": "HF_HOME", "value": "/models"} in c["env"]

    # no storageClassName key at all when empty: the cluster default class applies
    docs = render(chart, {"modelCache": {"enabled": True}})
    assert "storageClassName" not in docs["PersistentVolumeClaim"]["spec"]


def test_existing_claim_is_mounted_not_created(chart):
    docs = render(
        chart,
        {
            "modelCache": {"enabled": True, "existingClaim": "weights", "mountPath": "/w"},
            "model": {"name": "/w/llama-70b"},
        },
    )
    assert "PersistentVolumeClaim" not in docs
    volumes = {v["name"]: v for v in docs["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "weights"}
    assert container(docs)["args"][0] == "/w/llama-70b"
    assert {"name": "HF_HOME", "value": "/w"} in container(docs)["env"]


def test_hub_token_from_secret(chart):
    values = {
        "hfToken": {"secretName": "hf-token", "secretKey": "hub", "optional": True},
        "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
    }
    env = container(render(chart, values))["env"]
    assert env == [
        {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "hub", "optional": True}},
        },
        {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
    ]


def test_scheduling_values_pass_through(chart):
    values = {
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {}},
        "runtimeClassName": "nvidia",
        "replicas": 3,
    }
    docs = render(chart, values)
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    assert docs["Deployment"]["spec"]["replicas"] == 3
    for key in ("nodeSelector", "tolerations", "affinity", "runtimeClassName"):
        assert pod[key] == values[key]


# ---------------------------------------------------------------- schema rejections


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"speculative": {"method": "medusa"}}, "at '/speculative/method'"),
        ({"tensorParallelSize": 0}, "at '/tensorParallelSize'"),
        ({"gpuMemoryUtilization": -0.1}, "at '/gpuMemoryUtilization'"),
        ({"gpuMemoryUtilization": 1.5}, "at '/gpuMemoryUtilization'"),
        ({"gpuMemoryUtilization": 0}, "at '/gpuMemoryUtilization'"),
        ({"maxModelLen": 0}, "at '/maxModelLen'"),
        (
            {"speculative": {"options": {"goose": {"budget": 0}}}},
            "at '/speculative/options/goose/budget'",
        ),
        (
            {"speculative": {"options": {"goose": {"method": "pld"}}}},
            "at '/speculative/options/goose/method'",
        ),
        ({"tensorParalelSize": 2}, "'tensorParalelSize' not allowed"),
    ],
    ids=[
        "unknown-method",
        "tp0",
        "negative-util",
        "util-above-1",
        "util-0",
        "max-len-0",
        "goose-budget-0",
        "method-in-options",
        "typo-top-level-key",
    ],
)
def test_schema_rejects_bad_values(chart, values, field):
    with pytest.raises(helm.HelmValuesError) as excinfo:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert field in str(excinfo.value)

    report = helm.lint(CHART, values)
    assert report["errors"], "lint must fail on values the schema rejects"
    assert any(field in e for e in report["errors"])


@pytest.mark.parametrize("method", ["goose", "pld", "token_recycling", "isotropic"])
def test_rendered_speculative_config_passes_the_plugins_validator(chart, method):
    """The chart's default GPU deployment starts: its rendered --speculative-config is accepted
    by the plugin's own validator (the code path `vllm serve` runs at start-up), and it renders
    no flag the CUDA path refuses (attention backend, CUDA-graph mode, async scheduling)."""
    from vllm_anisotropic.integration.vllm.frontdoor.config import TreeSpecConfig, split_speculative_dict

    docs = render(chart, {"speculative": {"method": method}})
    spec = json.loads(speculative_arg(docs))
    vllm_fields = {"method", "num_speculative_tokens", "model"}  # the SpeculativeConfig keys we pass
    theirs, ours = split_speculative_dict(dict(spec), vllm_fields)
    assert theirs == {"method": method}
    tree = TreeSpecConfig.build(method, ours)
    assert tree.method == method
    args = container(docs)["args"]
    for refused in ("--attention-backend", "--compilation-config", "-cc", "--async-scheduling"):
        assert refused not in args
    assert gpu_counts(docs) == (1, 1)  # the default is the GPU path


def _plugin_field(method: str, key: str):
    """The pydantic field behind option ``key`` of tree method ``method`` (None: not a key)."""
    from vllm_anisotropic.integration.vllm.frontdoor.config import TREE_METHODS, EngineTreeConfig
    from vllm_anisotropic.proposers import PROPOSERS

    for cls in (PROPOSERS[TREE_METHODS[method]][1], EngineTreeConfig):
        if key in cls.model_fields:
            return cls.model_fields[key]
    return None


@pytest.mark.parametrize("method", ["goose", "pld", "token_recycling", "isotropic"])
def test_schema_options_match_the_plugins_config_classes(method):
    """Issue 14 item 5: every option the chart's schema describes for a tree method is a key the
    plugin accepts, with the same allowed values: a Literal is the schema's enum, and numeric
    bounds are the schema's minimum / maximum. (The schema once accepted ``verifier: specinfer``,
    which the plugin refuses at start-up.)"""
    from typing import Literal, get_args, get_origin

    import annotated_types

    schema = json.loads((CHART / "values.schema.json").read_text())
    options = schema["properties"]["speculative"]["properties"]["options"]["properties"][method]["properties"]
    checked = 0
    for key, prop in options.items():
        if key == "method":
            assert prop is False  # the method is chosen by speculative.method only
            continue
        field = _plugin_field(method, key)
        assert field is not None, f"schema option {method}.{key} is not a plugin key"
        if get_origin(field.annotation) is Literal:
            assert sorted(prop.get("enum", [])) == sorted(get_args(field.annotation)), (method, key, prop)
        bounds = {"minimum": (annotated_types.Ge, "ge"), "exclusiveMinimum": (annotated_types.Gt, "gt"),
                  "maximum": (annotated_types.Le, "le"), "exclusiveMaximum": (annotated_types.Lt, "lt")}
        for name, (kind, attr) in bounds.items():
            plugin = [getattr(m, attr) for m in field.metadata if isinstance(m, kind)]
            assert prop.get(name) == (plugin[0] if plugin else None), (method, key, name, prop, plugin)
        checked += 1
    assert checked or method in ("pld", "token_recycling", "isotropic")
