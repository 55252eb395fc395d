#!/usr/bin/env python3
"""Offline checks of the Kubernetes manifests in deploy/.

    python3 deploy/validate.py              # validate; exit 1 with one line per problem
    python3 deploy/validate.py --self-test  # show that each kind of mistake below is caught

Reads deploy/kustomization.yaml and every resource it lists (plus secret.example.yaml, which is
deliberately not listed), and checks:

- core objects (Deployment, Service, ...) against the official Kubernetes JSON schemas bundled by
  the `kubernetes-validate` package, strictly (unknown fields are errors, as with kubectl's
  server-side field validation), for the oldest and the newest Kubernetes versions supported;
- the InferencePool against the vendored CRD (schemas/gie/), the Gateway and the HTTPRoute
  against the vendored Gateway API CRDs (schemas/gateway-api/), unknown fields refused, and
  their metadata against ObjectMeta;
- the endpoint picker's EndpointPickerConfig, embedded in a ConfigMap, against
  schemas/endpointpickerconfig.schema.json;
- cross-references that a schema cannot see, each a real deployment mistake: selectors that
  miss the pods, ports that name nothing, probes on the wrong paths or ports, a grace period
  shorter than the drain, Secret keys that do not exist, endpoint picker flags that its version
  refuses, a metrics scraper pointed at the authenticated port, routes to nothing, ...

Where `kubectl` is installed, the kustomization is also rendered with `kubectl kustomize` and
must give exactly the objects read here. Nothing is fetched from the network.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

try:
    import jsonschema
    import referencing
    import yaml
    from kubernetes_validate import utils as kv_utils
except ImportError as e:  # pragma: no cover - environment problem, not a manifest problem
    sys.exit(
        f"validate.py: missing Python package ({e.name}); install the pinned packages: "
        "pip install kubernetes-validate==1.37.0 jsonschema==4.26.0 pyyaml==6.0.4"
    )

DEPLOY = Path(__file__).resolve().parent
SCHEMAS = DEPLOY / "schemas"
SECRET_EXAMPLE = "secret.example.yaml"

# The oldest Kubernetes version the manifests target (lifecycle.preStop.sleep needs 1.30) and the
# newest one kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", "1.37.0")

CORE_KINDS = {
    ("v1", "Namespace"),
    ("v1", "Secret"),
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("v1", "ServiceAccount"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("rbac.authorization.k8s.io/v1", "ClusterRole"),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"),
}
CLUSTER_SCOPED_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding"}

# Custom resources: (apiVersion, kind) -> (CRD file under schemas/, version).
CRD_KINDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): ("gie/inference.networking.k8s.io_inferencepools.yaml", "v1"),
    ("gateway.networking.k8s.io/v1", "Gateway"): ("gateway-api/gateway.networking.k8s.io_gateways.yaml", "v1"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): ("gateway-api/gateway.networking.k8s.io_httproutes.yaml", "v1"),
}

# The endpoint picker: llm-d/llm-d-router v0.10.0 (the image in epp-deployment.yaml).
# Its flags: pkg/epp/server/options.go (AddFlags) and pkg/common/observability/logging/options.go
# (-v and controller-runtime's zap flags).
EPP_FLAGS = {
    "grpc-port", "ha-enable-leader-election", "drain-timeout", "grpc-max-recv-msg-size",
    "grpc-max-send-msg-size", "pool-group", "pool-namespace", "pool-name", "endpoint-selector",
    "endpoint-target-ports", "disable-endpoint-subset-filter", "emit-endpoint-scores",
    "refresh-metrics-interval", "refresh-prometheus-metrics-interval", "metrics-staleness-threshold",
    "tracing", "health-checking", "metrics-port", "grpc-health-port", "enable-pprof", "cert-path",
    "enable-cert-reload", "enable-grpc-stream-metrics", "secure-serving", "tls-min-version",
    "tls-cipher-suites", "metrics-endpoint-auth", "metrics-client-ca-file", "metrics-cert-dir",
    "config-file", "config-text", "allow-experimental-plugins",
    "v", "zap-devel", "zap-encoder", "zap-log-level", "zap-stacktrace-level", "zap-time-encoding",
}
# Declared but refused at start when given ("flag ... is deprecated and cannot be used; configure
# metrics via engineConfigs in EndpointPickerConfig instead": Options.Validate).
EPP_REFUSED_FLAGS = {
    "total-queued-requests-metric", "total-running-requests-metric",
    "kv-cache-usage-percentage-metric", "lora-info-metric", "cache-info-metric",
}
# Removed in llm-d-router (#1940); the scrape port is the metrics-data-source's `port` parameter.
EPP_REMOVED_FLAGS = {
    "model-server-metrics-port", "model-server-metrics-path", "model-server-metrics-scheme",
    "model-server-metrics-https-insecure-skip-verify",
}
EPP_DEFAULTS = {"grpc-port": "9002", "grpc-health-port": "9003", "metrics-port": "9090",
                "pool-group": "inference.networking.k8s.io"}

# Plugin types of that version that deploy/ may use (each checked to exist there).
KNOWN_PLUGIN_TYPES = {
    "metrics-data-source", "core-metrics-extractor", "queue-scorer", "kv-cache-utilization-scorer",
    "lora-affinity-scorer", "prefix-cache-scorer", "max-score-picker", "random-picker",
    "weighted-random-picker", "single-profile-handler", "openai-parser", "passthrough-parser",
}
SCORER_TYPES = {"queue-scorer", "kv-cache-utilization-scorer", "lora-affinity-scorer", "prefix-cache-scorer"}
PICKER_TYPES = {"max-score-picker", "random-picker", "weighted-random-picker"}
PROFILE_HANDLER_TYPES = {"single-profile-handler"}
# Request parsers and the path suffixes each claims (pkg/epp/framework/plugins/requesthandling/
# parsers/*: Claims); None claims every path (a fallback, after which parsers are ignored:
# pkg/epp/handlers/parsers.go). Without requestHandler.parsers this version uses openai-parser,
# anthropic-parser and vllmhttp-parser, with no fallback.
PARSER_PATHS: dict[str, list[str] | None] = {
    "openai-parser": ["chat/completions", "completions", "embeddings", "responses", "conversations",
                      "chat/completions/render", "completions/render", "images/generations"],
    "passthrough-parser": None,
}

# What loraplex exports on /metrics (README.md) in the vLLM names the picker reads.
LORAPLEX_METRICS = {
    "queuedRequestsSpec": "vllm:num_requests_waiting",
    "runningRequestsSpec": "vllm:num_requests_running",
    "kvUsageSpec": "vllm:kv_cache_usage_perc",
    "loraSpec": "vllm:lora_requests_info",
}

# `loraplex serve` options read from the container: flag -> environment variable.
SERVE_OPTIONS = {
    "host": "LORAPLEX_HOST",
    "port": "LORAPLEX_PORT",
    "metrics-port": "LORAPLEX_METRICS_PORT",
    "data-dir": "LORAPLEX_DATA_DIR",
    "database-url": "LORAPLEX_DATABASE_URL",
    "admin-key": "LORAPLEX_ADMIN_KEY",
    "adapter-store": "LORAPLEX_ADAPTER_STORE",
    "shutdown-timeout": "LORAPLEX_SHUTDOWN_TIMEOUT",
}
SERVE_DEFAULTS = {"host": "127.0.0.1", "port": "8080", "data-dir": "./data", "shutdown-timeout": "30"}
# Variables `loraplex serve` reads (README.md's Configuration, and the cluster options).
LORAPLEX_ENV = {
    "LORAPLEX_MODEL", "LORAPLEX_POOL_MB", "LORAPLEX_BLOCK_SIZE", "LORAPLEX_KV_DTYPE",
    "LORAPLEX_MAX_BATCH_TOKENS", "LORAPLEX_MAX_RUNNING", "LORAPLEX_HOST_CACHE_MB",
    "LORAPLEX_ADAPTER_LOADERS", "LORAPLEX_MAX_LORA_RANK", "LORAPLEX_THREADS", "LORAPLEX_NO_PREFIX_CACHE",
    "LORAPLEX_ATTENTION_COST", "LORAPLEX_SHARED_SLOWDOWN", "LORAPLEX_STEP_OVERHEAD", "LORAPLEX_CPU_ISA",
    "LORAPLEX_SERVED_MODEL_NAME", "LORAPLEX_DEVICE", "LORAPLEX_WORKERS", "LORAPLEX_DATA_DIR",
    "LORAPLEX_DATABASE_URL", "LORAPLEX_HOST", "LORAPLEX_PORT", "LORAPLEX_ADMIN_KEY",
    "LORAPLEX_MAX_UPLOAD_MB", "LORAPLEX_HTTP_WORKERS", "LORAPLEX_SHUTDOWN_TIMEOUT", "LORAPLEX_MAX_PENDING",
    "LORAPLEX_MAX_PENDING_PER_TENANT", "LORAPLEX_BLOCKING_THREADS", "LORAPLEX_BLOCKING_QUEUE",
    "LORAPLEX_BODY_TIMEOUT", "LORAPLEX_MAX_UPLOADS_PER_KEY", "LORAPLEX_MAX_PINNED_PERCENT",
    "LORAPLEX_TENANT_PINNED_PERCENT", "LORAPLEX_MAX_FILE_MB", "LORAPLEX_MAX_TENANT_FILES_MB",
    "LORAPLEX_MAX_ACTIVE_BATCHES", "LORAPLEX_BATCH_CONCURRENCY", "LORAPLEX_KERNEL_CACHE",
    "LORAPLEX_METRICS_PORT", "LORAPLEX_ADAPTER_STORE", "LORAPLEX_CLUSTER_SYNC_MS", "LORAPLEX_MATMUL_DTYPE",
    "LORAPLEX_DEFER_DECODES",
}


# --------------------------------------------------------------------------------------------
# Loading


@dataclass
class Obj:
    doc: dict
    source: str

    @property
    def kind(self) -> str:
        return self.doc.get("kind", "?")

    @property
    def name(self) -> str:
        return (self.doc.get("metadata") or {}).get("name", "?")

    @property
    def namespace(self) -> str | None:
        return (self.doc.get("metadata") or {}).get("namespace")

    @property
    def ref(self) -> str:
        return f"{self.kind}/{self.name} ({self.source})"


@dataclass
class Bundle:
    objects: list[Obj]
    secret_example: Obj | None
    namespace: str | None

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o.kind == kind]

    def find(self, kind: str, name: str) -> Obj | None:
        for o in self.objects:
            if o.kind == kind and o.name == name:
                return o
        return None


class Problems:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.notes: list[str] = []

    def error(self, where: str, message: str) -> None:
        self.errors.append(f"{where}: {message}")

    def note(self, message: str) -> None:
        self.notes.append(message)


def load_yaml_documents(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def load_bundle(deploy: Path, problems: Problems) -> Bundle:
    """Reads the kustomization as kustomize would for the features it uses."""
    kpath = deploy / "kustomization.yaml"
    kust = load_yaml_documents(kpath)[0]
    supported = {"apiVersion", "kind", "namespace", "resources"}
    for key in kust:
        if key not in supported:
            problems.error("kustomization.yaml", f"`{key}` is not understood by validate.py (it reads {sorted(supported)})")
    if kust.get("kind") != "Kustomization":
        problems.error("kustomization.yaml", "kind must be Kustomization")
    namespace = kust.get("namespace")
    objects: list[Obj] = []
    for res in kust.get("resources") or []:
        path = deploy / res
        if not path.is_file():
            problems.error("kustomization.yaml", f"resource {res} is not a file in deploy/")
            continue
        if res == SECRET_EXAMPLE:
            problems.error("kustomization.yaml", f"{SECRET_EXAMPLE} must not be listed: applying it would overwrite the real Secret with placeholders")
        for doc in load_yaml_documents(path):
            objects.append(Obj(apply_namespace(doc, namespace), res))
    secret = None
    spath = deploy / SECRET_EXAMPLE
    if spath.is_file():
        docs = load_yaml_documents(spath)
        if len(docs) != 1:
            problems.error(SECRET_EXAMPLE, "must hold exactly one Secret")
        if docs:
            secret = Obj(apply_namespace(docs[0], namespace), SECRET_EXAMPLE)
    else:
        problems.error("deploy", f"{SECRET_EXAMPLE} is missing")
    return Bundle(objects, secret, namespace)


def apply_namespace(doc: dict, namespace: str | None) -> dict:
    """kustomize's namespace transformer, for the kinds used here."""
    doc = copy.deepcopy(doc)
    if not namespace or not isinstance(doc, dict):
        return doc
    meta = doc.setdefault("metadata", {})
    kind = doc.get("kind")
    if kind == "Namespace":
        meta["name"] = namespace
    elif kind not in CLUSTER_SCOPED_KINDS:
        meta["namespace"] = namespace
    if kind in ("RoleBinding", "ClusterRoleBinding"):
        for subject in doc.get("subjects") or []:
            if subject.get("kind") == "ServiceAccount" and not subject.get("namespace"):
                subject["namespace"] = namespace
    return doc


# --------------------------------------------------------------------------------------------
# Schemas


K8S_DEFINITIONS_URI = "https://kubernetes.io/api/_definitions.json"


def _k8s_schema(version: str, name: str) -> dict:
    return kv_utils.schema_contents(f"kubernetes-json-schema/v{version}-local-strict/{name}", version)


@functools.lru_cache(maxsize=None)
def _k8s_registry(version: str) -> referencing.Registry:
    definitions = referencing.Resource.from_contents(_k8s_schema(version, "_definitions.json"))
    return definitions @ referencing.Registry()  # registered under its $id (K8S_DEFINITIONS_URI)


@functools.lru_cache(maxsize=None)
def core_validator(version: str, api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """A strict validator from kubernetes-validate's bundled schemas (no network)."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = _k8s_schema(version, f"{kind.lower()}-{group_version}.json")
    registry = referencing.Resource.from_contents(schema) @ _k8s_registry(version)
    return jsonschema.Draft202012Validator(schema, registry=registry)


@functools.lru_cache(maxsize=None)
def object_meta_validator(version: str) -> jsonschema.protocols.Validator:
    schema = {"$ref": f"{K8S_DEFINITIONS_URI}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    return jsonschema.Draft202012Validator(schema, registry=_k8s_registry(version))


def strict_openapi(schema: Any) -> Any:
    """A CRD's structural schema as JSON Schema that refuses unknown fields.

    The API server prunes (or, with kubectl's default strict field validation, refuses) fields a
    CRD does not declare; JSON Schema allows them unless additionalProperties is false.
    """
    if isinstance(schema, list):
        return [strict_openapi(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_openapi(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@functools.lru_cache(maxsize=None)
def crd_validator(crd_file: str, version: str) -> jsonschema.protocols.Validator:
    crd = load_yaml_documents(SCHEMAS / crd_file)[0]
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            if not v.get("served"):
                raise ValueError(f"{crd_file}: version {version} is not served")
            schema = strict_openapi(v["schema"]["openAPIV3Schema"])
            # metadata is checked against ObjectMeta separately.
            schema["properties"]["metadata"] = {"type": "object"}
            return jsonschema.Draft202012Validator(schema)
    raise ValueError(f"{crd_file}: no version {version}")


@functools.lru_cache(maxsize=None)
def epp_config_validator() -> jsonschema.protocols.Validator:
    with (SCHEMAS / "endpointpickerconfig.schema.json").open(encoding="utf-8") as f:
        schema = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_errors(validator: jsonschema.protocols.Validator, doc: Any, prefix: str = "") -> list[str]:
    out = []
    for err in sorted(validator.iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path]):
        path = ".".join(([prefix] if prefix else []) + [str(p) for p in err.absolute_path]) or "(top)"
        out.append(f"{path}: {err.message}")
    return out


def check_schemas(bundle: Bundle, problems: Problems) -> None:
    objs = list(bundle.objects) + ([bundle.secret_example] if bundle.secret_example else [])
    for o in objs:
        key = (o.doc.get("apiVersion"), o.kind)
        if key in CORE_KINDS:
            for version in K8S_VERSIONS:
                for msg in schema_errors(core_validator(version, *key), o.doc):
                    problems.error(o.ref, f"Kubernetes {version[:-2]} schema: {msg}")
        elif key in CRD_KINDS:
            crd_file, version = CRD_KINDS[key]
            for msg in schema_errors(crd_validator(crd_file, version), o.doc):
                problems.error(o.ref, f"CRD schema ({crd_file}): {msg}")
            for v in K8S_VERSIONS:
                for msg in schema_errors(object_meta_validator(v), o.doc.get("metadata"), "metadata"):
                    problems.error(o.ref, f"ObjectMeta (Kubernetes {v[:-2]}): {msg}")
        else:
            problems.error(o.ref, f"no schema for {key[0]} {key[1]}: validate.py checks only {sorted(k for _, k in CORE_KINDS | set(CRD_KINDS))}")
        meta = o.doc.get("metadata") or {}
        if o.kind not in CLUSTER_SCOPED_KINDS and bundle.namespace and meta.get("namespace") != bundle.namespace:
            problems.error(o.ref, f"namespace {meta.get('namespace')!r} is not the kustomization's {bundle.namespace!r}")
    seen: dict[tuple, str] = {}
    for o in bundle.objects:
        key = (o.doc.get("apiVersion", "").split("/")[0], o.kind, o.namespace, o.name)
        if key in seen:
            problems.error(o.ref, f"defined twice (also in {seen[key]})")
        seen[key] = o.source


# --------------------------------------------------------------------------------------------
# Helpers for cross-checks


def labels_match(match_labels: dict | None, labels: dict | None) -> bool:
    if not match_labels:
        return False
    labels = labels or {}
    return all(labels.get(k) == v for k, v in match_labels.items())


def pod_labels(deploy: Obj) -> dict:
    return ((deploy.doc.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels") or {}


def pod_spec(deploy: Obj) -> dict:
    return ((deploy.doc.get("spec") or {}).get("template") or {}).get("spec") or {}


def containers(deploy: Obj) -> list[dict]:
    return pod_spec(deploy).get("containers") or []


def resolve_container_port(container: dict, port: Any) -> int | None:
    """A probe's or Service's target port (number or name) as a number declared by the container."""
    for p in container.get("ports") or []:
        if isinstance(port, int) and p.get("containerPort") == port:
            return port
        if isinstance(port, str) and p.get("name") == port:
            return p.get("containerPort")
    return None


def parse_args(args: list[str]) -> dict[str, str | None]:
    """--flag value, --flag=value and boolean --flag into {flag: value}."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        a = str(args[i])
        if a.startswith("--"):
            name, eq, value = a[2:].partition("=")
            if eq:
                out[name] = value
            elif i + 1 < len(args) and not str(args[i + 1]).startswith("--"):
                out[name] = str(args[i + 1])
                i += 1
            else:
                out[name] = None
        elif a.startswith("-") and len(a) > 1:
            name, _, value = a[1:].partition("=")
            out[name] = value or None
        i += 1
    return out


def env_of(container: dict) -> dict[str, dict]:
    return {e.get("name"): e for e in container.get("env") or []}


def serve_option(container: dict, flag: str) -> tuple[str | None, dict | None]:
    """The value of a `loraplex serve` option (flag first, then its variable, then the default),
    and the env entry when it comes from a reference rather than a literal."""
    args = [str(a) for a in (container.get("args") or [])]
    flags = parse_args(args[1:] if args and args[0] == "serve" else args)
    if flag in flags:
        return flags[flag], None
    entry = env_of(container).get(SERVE_OPTIONS[flag])
    if entry is not None:
        if "value" in entry:
            return str(entry["value"]), None
        return None, entry
    return SERVE_DEFAULTS.get(flag), None


def as_int(value: Any) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# Cross-checks


@dataclass
class Parts:
    """The objects the cross-checks are about, found by what they point at."""

    pool: Obj | None = None
    server: Obj | None = None  # the loraplex Deployment
    server_container: dict | None = None
    epp: Obj | None = None  # the endpoint picker Deployment
    epp_container: dict | None = None
    epp_flags: dict = field(default_factory=dict)
    epp_service: Obj | None = None
    serving_port: int | None = None
    metrics_port: int | None = None
    bundle: Bundle | None = None


def find_parts(bundle: Bundle, problems: Problems) -> Parts:
    parts = Parts(bundle=bundle)
    pools = bundle.of_kind("InferencePool")
    if len(pools) != 1:
        problems.error("deploy", f"expected one InferencePool, found {len(pools)}")
        return parts
    parts.pool = pool = pools[0]
    spec = pool.doc.get("spec") or {}
    match = (spec.get("selector") or {}).get("matchLabels") or {}
    deployments = bundle.of_kind("Deployment")
    selected = [d for d in deployments if labels_match(match, pod_labels(d))]
    if not selected:
        problems.error(pool.ref, f"spec.selector.matchLabels {match} selects the pods of no Deployment "
                       f"(pod labels: {', '.join(f'{d.name}: {pod_labels(d)}' for d in deployments)})")
    elif len(selected) > 1:
        problems.error(pool.ref, f"spec.selector.matchLabels {match} selects the pods of several Deployments: {[d.name for d in selected]}")
    else:
        parts.server = selected[0]
        cs = [c for c in containers(parts.server) if (c.get("args") or [None])[0] == "serve"]
        if len(cs) != 1:
            problems.error(parts.server.ref, "expected exactly one container running `loraplex serve` (args starting with `serve`)")
        else:
            parts.server_container = cs[0]
            parts.serving_port = as_int(serve_option(cs[0], "port")[0])
            parts.metrics_port = as_int(serve_option(cs[0], "metrics-port")[0])

    epp_ref = spec.get("endpointPickerRef") or {}
    if (epp_ref.get("kind") or "Service") != "Service" or (epp_ref.get("group") or "") != "":
        problems.error(pool.ref, "spec.endpointPickerRef must name a core Service")
    parts.epp_service = bundle.find("Service", epp_ref.get("name", ""))
    if parts.epp_service is None:
        problems.error(pool.ref, f"spec.endpointPickerRef.name {epp_ref.get('name')!r} names no Service")
    else:
        selector = (parts.epp_service.doc.get("spec") or {}).get("selector") or {}
        epps = [d for d in deployments if labels_match(selector, pod_labels(d))]
        if len(epps) != 1:
            problems.error(parts.epp_service.ref, f"selector {selector} must select the pods of exactly one Deployment (the endpoint picker), selects {[d.name for d in epps]}")
        else:
            parts.epp = epps[0]
            cs = containers(parts.epp)
            if len(cs) != 1:
                problems.error(parts.epp.ref, "expected one container (the endpoint picker)")
            else:
                parts.epp_container = cs[0]
                parts.epp_flags = parse_args([str(a) for a in cs[0].get("args") or []])
    return parts


def check_deployments(bundle: Bundle, problems: Problems) -> None:
    for d in bundle.of_kind("Deployment"):
        sel = ((d.doc.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        if not labels_match(sel, pod_labels(d)):
            problems.error(d.ref, f"spec.selector.matchLabels {sel} does not match the pod template's labels {pod_labels(d)}")


def check_server(bundle: Bundle, parts: Parts, problems: Problems) -> None:
    d, c = parts.server, parts.server_container
    if d is None or c is None:
        return
    where = d.ref
    spec = d.doc.get("spec") or {}

    host, _ = serve_option(c, "host")
    if host not in ("0.0.0.0", "::", "[::]"):
        problems.error(where, f"serve listens on {host!r}: other pods cannot reach it (use --host 0.0.0.0)")
    port, mport = parts.serving_port, parts.metrics_port
    if port is None:
        problems.error(where, "the serving port (--port / LORAPLEX_PORT) is not a literal number")
    if mport is None:
        problems.error(where, "no metrics port (--metrics-port / LORAPLEX_METRICS_PORT): the endpoint picker cannot read the replicas' load without a key")
    elif mport == port:
        problems.error(where, "--metrics-port equals --port: the unauthenticated metrics listener needs a port of its own")
    for p, what in ((port, "serving"), (mport, "metrics")):
        if p is not None and resolve_container_port(c, p) is None:
            problems.error(where, f"the {what} port {p} is not a containerPort of container {c.get('name')!r}")

    # Probes: unauthenticated routes, on the serving port.
    expected = {"readinessProbe": "/ready", "livenessProbe": "/health"}
    for probe, path in expected.items():
        pr = c.get(probe)
        if not pr:
            problems.error(where, f"container {c.get('name')!r} has no {probe} (HTTP GET {path} on the serving port)")
            continue
        get = pr.get("httpGet")
        if not get:
            problems.error(where, f"{probe} must be an httpGet of {path}")
            continue
        if get.get("path") != path:
            problems.error(where, f"{probe} GETs {get.get('path')!r}, expected {path!r}")
        if resolve_container_port(c, get.get("port")) != port:
            problems.error(where, f"{probe} port {get.get('port')!r} is not the serving port {port}")
        if (get.get("scheme") or "HTTP") != "HTTP":
            problems.error(where, f"{probe} scheme must be HTTP")
    sp = c.get("startupProbe")
    if not sp:
        problems.error(where, "no startupProbe: liveness would kill a replica still loading its model")
    else:
        get = sp.get("httpGet") or {}
        if get.get("path") not in ("/health", "/ready") or resolve_container_port(c, get.get("port")) != port:
            problems.error(where, "startupProbe must GET /health (or /ready) on the serving port")
        budget = (sp.get("periodSeconds") or 10) * (sp.get("failureThreshold") or 3)
        if budget < 300:
            problems.error(where, f"startupProbe allows {budget} s for the model to load; give it at least 300 s")

    # Shutdown: endpoints removed (preStop), then drain (LORAPLEX_SHUTDOWN_TIMEOUT), inside the grace period.
    grace = pod_spec(d).get("terminationGracePeriodSeconds", 30)
    timeout = as_int(serve_option(c, "shutdown-timeout")[0])
    if timeout is None:
        problems.error(where, "the shutdown timeout (--shutdown-timeout / LORAPLEX_SHUTDOWN_TIMEOUT) is not a literal number")
        timeout = 0
    pre = ((c.get("lifecycle") or {}).get("preStop") or {})
    if not pre:
        problems.error(where, "no lifecycle.preStop: SIGTERM would arrive before the endpoint is removed from the gateway and the picker")
    pre_sleep = (pre.get("sleep") or {}).get("seconds", 0)
    if not pre.get("sleep") and pre.get("exec"):
        cmd = [str(x) for x in pre["exec"].get("command") or []]
        m = re.search(r"sleep\s+(\d+)", " ".join(cmd))
        pre_sleep = int(m.group(1)) if m else 0
    if pre and pre_sleep <= 0:
        problems.error(where, "lifecycle.preStop must sleep a few seconds")
    if grace <= pre_sleep + timeout:
        problems.error(where, f"terminationGracePeriodSeconds {grace} must exceed preStop sleep {pre_sleep} s + LORAPLEX_SHUTDOWN_TIMEOUT {timeout} s, "
                       "or requests in flight are killed mid-drain")

    # Statelessness: the data dir is an emptyDir; the database is shared PostgreSQL; adapters in S3.
    data_dir, _ = serve_option(c, "data-dir")
    volumes = {v.get("name"): v for v in pod_spec(d).get("volumes") or []}
    mount = next((m for m in c.get("volumeMounts") or [] if m.get("mountPath") == data_dir), None)
    if mount is None:
        problems.error(where, f"the data directory {data_dir!r} is not a volume mount")
    elif "emptyDir" not in volumes.get(mount.get("name"), {}):
        problems.error(where, f"the data directory {data_dir!r} must be an emptyDir (local caches only; nothing durable lives there)")
    store, store_ref = serve_option(c, "adapter-store")
    if store_ref is None and not (store or "").startswith("s3://"):
        problems.error(where, f"the adapter store (--adapter-store / LORAPLEX_ADAPTER_STORE) must be an s3:// URL shared by the replicas, is {store!r}")
    for flag in ("database-url", "admin-key"):
        value, ref = serve_option(c, flag)
        if ref is None or "secretKeyRef" not in (ref.get("valueFrom") or {}):
            problems.error(where, f"{SERVE_OPTIONS[flag]} must come from a Secret (valueFrom.secretKeyRef), not a literal")
    db_value = secret_value(bundle, serve_option(c, "database-url")[1])
    if db_value is not None and not re.match(r"^postgres(ql)?://", db_value):
        problems.error(bundle.secret_example.ref if bundle.secret_example else SECRET_EXAMPLE,
                       "LORAPLEX_DATABASE_URL must be a postgres:// URL: with SQLite every replica would have its own database")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        e = env_of(c).get(var)
        if e is None or "secretKeyRef" not in (e.get("valueFrom") or {}):
            problems.error(where, f"{var} must come from the Secret")

    # Service links: a Service `loraplex` puts LORAPLEX_PORT=tcp://10.0.0.1:8080 (and more) into
    # every pod of the namespace, which the server would read as its own settings.
    if pod_spec(d).get("enableServiceLinks", True):
        for svc in bundle.of_kind("Service"):
            clash = sorted(service_link_variables(svc) & LORAPLEX_ENV)
            if clash:
                problems.error(where, f"{svc.ref} injects {clash} into these pods as service links; set enableServiceLinks: false")

    replicas = spec.get("replicas", 1)
    if replicas < 2:
        problems.error(where, f"replicas {replicas}: run at least 2 so that a drain or a rollout keeps serving")

    # Prometheus annotations point at the metrics port.
    ann = (spec.get("template") or {}).get("metadata", {}).get("annotations") or {}
    if mport is not None and ann.get("prometheus.io/scrape") == "true" and as_int(ann.get("prometheus.io/port")) != mport:
        problems.error(where, f"prometheus.io/port {ann.get('prometheus.io/port')!r} is not the metrics port {mport}")


def service_link_variables(svc: Obj) -> set[str]:
    """The variables Kubernetes puts into pods for a Service when enableServiceLinks is on."""
    prefix = svc.name.upper().replace("-", "_")
    out = {f"{prefix}_SERVICE_HOST", f"{prefix}_SERVICE_PORT", f"{prefix}_PORT"}
    for p in (svc.doc.get("spec") or {}).get("ports") or []:
        proto = (p.get("protocol") or "TCP").upper()
        base = f"{prefix}_PORT_{p.get('port')}_{proto}"
        out |= {base, f"{base}_PROTO", f"{base}_PORT", f"{base}_ADDR"}
        if p.get("name"):
            out.add(f"{prefix}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}")
    return out


def secret_value(bundle: Bundle, env_entry: dict | None) -> str | None:
    if env_entry is None or bundle.secret_example is None:
        return None
    ref = (env_entry.get("valueFrom") or {}).get("secretKeyRef") or {}
    data = bundle.secret_example.doc.get("stringData") or {}
    return data.get(ref.get("key"))


def check_secret_refs(bundle: Bundle, problems: Problems) -> None:
    secret = bundle.secret_example
    if secret is None:
        return
    keys = set((secret.doc.get("stringData") or {}).keys()) | set((secret.doc.get("data") or {}).keys())
    for d in bundle.of_kind("Deployment"):
        for c in containers(d) + (pod_spec(d).get("initContainers") or []):
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if not ref:
                    continue
                if ref.get("name") != secret.name:
                    problems.error(d.ref, f"env {e.get('name')} refers to Secret {ref.get('name')!r}; the example Secret is {secret.name!r}")
                elif ref.get("key") not in keys and not ref.get("optional"):
                    problems.error(d.ref, f"env {e.get('name')} refers to key {ref.get('key')!r}, which {SECRET_EXAMPLE} does not have ({sorted(keys)})")
            for ef in c.get("envFrom") or []:
                ref = ef.get("secretRef")
                if ref and ref.get("name") != secret.name and not ref.get("optional"):
                    problems.error(d.ref, f"envFrom refers to Secret {ref.get('name')!r}; the example Secret is {secret.name!r}")
        for v in pod_spec(d).get("volumes") or []:
            sv = v.get("secret")
            if sv and sv.get("secretName") != secret.name and not sv.get("optional"):
                problems.error(d.ref, f"volume {v.get('name')} mounts Secret {sv.get('secretName')!r}, which is not the example Secret")
            for item in (sv or {}).get("items") or []:
                if item.get("key") not in keys:
                    problems.error(d.ref, f"volume {v.get('name')} mounts key {item.get('key')!r}, which {SECRET_EXAMPLE} does not have")


def check_pool(bundle: Bundle, parts: Parts, problems: Problems) -> None:
    pool = parts.pool
    if pool is None:
        return
    spec = pool.doc.get("spec") or {}
    ports = [p.get("number") for p in spec.get("targetPorts") or []]
    if len(set(ports)) != len(ports):
        problems.error(pool.ref, "spec.targetPorts: port numbers must be unique")
    if parts.server_container is not None:
        for p in ports:
            if resolve_container_port(parts.server_container, p) is None:
                problems.error(pool.ref, f"targetPort {p} is not a containerPort of {parts.server.ref}")
        if parts.serving_port not in ports:
            problems.error(pool.ref, f"spec.targetPorts {ports} must hold the serving port {parts.serving_port}")
        if parts.metrics_port in ports:
            problems.error(pool.ref, f"spec.targetPorts must not hold the metrics port {parts.metrics_port}")
    # No other workload's pods may be selected (the endpoint picker's, say).
    match = (spec.get("selector") or {}).get("matchLabels") or {}
    for d in bundle.of_kind("Deployment"):
        if d is not parts.server and labels_match(match, pod_labels(d)):
            problems.error(pool.ref, f"the selector also selects the pods of {d.ref}")
    # CEL rule of the CRD: port is required when kind is Service.
    epp_ref = spec.get("endpointPickerRef") or {}
    if (epp_ref.get("kind") or "Service") == "Service" and not epp_ref.get("port"):
        problems.error(pool.ref, "spec.endpointPickerRef.port is required when kind is Service")
    if epp_ref.get("failureMode") not in (None, "FailOpen", "FailClose"):
        problems.error(pool.ref, "spec.endpointPickerRef.failureMode must be FailOpen or FailClose")


def check_services(bundle: Bundle, parts: Parts, problems: Problems) -> None:
    deployments = bundle.of_kind("Deployment")
    for svc in bundle.of_kind("Service"):
        spec = svc.doc.get("spec") or {}
        selector = spec.get("selector") or {}
        targets = [d for d in deployments if labels_match(selector, pod_labels(d))]
        if not targets:
            problems.error(svc.ref, f"selector {selector} selects the pods of no Deployment")
            continue
        for p in spec.get("ports") or []:
            tp = p.get("targetPort", p.get("port"))
            for d in targets:
                if not any(resolve_container_port(c, tp) is not None for c in containers(d)):
                    problems.error(svc.ref, f"port {p.get('name')!r} targets {tp!r}, which no container of {d.ref} declares")
    # The replicas' Service: serving and metrics ports.
    if parts.server is not None:
        server_services = [s for s in bundle.of_kind("Service")
                           if labels_match((s.doc.get("spec") or {}).get("selector"), pod_labels(parts.server))]
        if not server_services:
            problems.error(parts.server.ref, "no Service selects these pods")

    # The endpoint picker's Service port is the pool's endpointPickerRef port, and reaches --grpc-port.
    svc, pool = parts.epp_service, parts.pool
    if svc is None or pool is None:
        return
    want = (((pool.doc.get("spec") or {}).get("endpointPickerRef") or {}).get("port") or {}).get("number")
    sports = {p.get("port"): p for p in (svc.doc.get("spec") or {}).get("ports") or []}
    if want not in sports:
        problems.error(svc.ref, f"has no port {want} (the InferencePool's endpointPickerRef.port); ports: {sorted(sports)}")
        return
    sp = sports[want]
    if sp.get("appProtocol") != "kubernetes.io/h2c":
        problems.error(svc.ref, f"port {want} carries gRPC (ext_proc): set appProtocol: kubernetes.io/h2c")
    if parts.epp_container is not None:
        target = resolve_container_port(parts.epp_container, sp.get("targetPort", want))
        grpc = as_int(parts.epp_flags.get("grpc-port", EPP_DEFAULTS["grpc-port"]))
        if target != grpc:
            problems.error(svc.ref, f"port {want} reaches container port {target}, but the endpoint picker serves ext_proc on --grpc-port {grpc}")


def check_pdb(bundle: Bundle, parts: Parts, problems: Problems) -> None:
    pdbs = bundle.of_kind("PodDisruptionBudget")
    if parts.server is None:
        return
    mine = [p for p in pdbs if labels_match(((p.doc.get("spec") or {}).get("selector") or {}).get("matchLabels"), pod_labels(parts.server))]
    if not mine:
        problems.error(parts.server.ref, "no PodDisruptionBudget selects these pods")
    replicas = (parts.server.doc.get("spec") or {}).get("replicas", 1)
    for p in mine:
        spec = p.doc.get("spec") or {}
        if isinstance(spec.get("maxUnavailable"), int) and spec["maxUnavailable"] >= replicas:
            problems.error(p.ref, f"maxUnavailable {spec['maxUnavailable']} allows every one of the {replicas} replicas down")
        if isinstance(spec.get("minAvailable"), int) and spec["minAvailable"] >= replicas:
            problems.error(p.ref, f"minAvailable {spec['minAvailable']} with {replicas} replicas blocks every node drain")
    for p in pdbs:
        if p not in mine:
            sel = ((p.doc.get("spec") or {}).get("selector") or {}).get("matchLabels")
            if not any(labels_match(sel, pod_labels(d)) for d in bundle.of_kind("Deployment")):
                problems.error(p.ref, f"selector {sel} selects no pods")


def netpol_allows(policy: dict, from_labels: dict, from_same_namespace: bool, container: dict, port: int) -> bool:
    for rule in policy.get("ingress") or []:
        ports = rule.get("ports")
        if ports and not any(resolve_container_port(container, p.get("port")) == port or p.get("port") == port for p in ports):
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            if "ipBlock" in peer:
                continue
            if "namespaceSelector" in peer and "podSelector" not in peer:
                continue  # another namespace (cannot tell here)
            if "namespaceSelector" in peer and peer["namespaceSelector"]:
                continue
            if not from_same_namespace:
                continue
            ps = peer.get("podSelector") or {}
            if not ps.get("matchLabels") and not ps.get("matchExpressions"):
                return True
            if labels_match(ps.get("matchLabels"), from_labels) and not ps.get("matchExpressions"):
                return True
    return False


def check_network_policies(bundle: Bundle, parts: Parts, problems: Problems) -> None:
    if parts.server is None or parts.server_container is None:
        return
    policies = [p for p in bundle.of_kind("NetworkPolicy")
                if labels_match(((p.doc.get("spec") or {}).get("podSelector") or {}).get("matchLabels"), pod_labels(parts.server))
                and "Ingress" in ((p.doc.get("spec") or {}).get("policyTypes") or ["Ingress"])]
    if not policies:
        return
    c = parts.server_container
    # Anyone (the gateway's data plane) reaches the serving port.
    if parts.serving_port is not None and not any(
        any(not r.get("from") and any(resolve_container_port(c, p.get("port")) == parts.serving_port or p.get("port") == parts.serving_port
                                      for p in r.get("ports") or [{"port": parts.serving_port}])
            for r in (p.doc.get("spec") or {}).get("ingress") or [])
        for p in policies
    ):
        problems.error(policies[0].ref, f"no ingress rule lets the gateway reach the serving port {parts.serving_port}")
    # The endpoint picker reaches the metrics port.
    if parts.epp is not None and parts.metrics_port is not None:
        same_ns = parts.epp.namespace == parts.server.namespace
        if not any(netpol_allows(p.doc.get("spec") or {}, pod_labels(parts.epp), same_ns, c, parts.metrics_port) for p in policies):
            problems.error(policies[0].ref, f"the endpoint picker's pods ({pod_labels(parts.epp)}) may not reach the metrics port {parts.metrics_port}: it would see no load and no adapters")


def check_epp(bundle: Bundle, parts: Parts, problems: Problems) -> None:
    d, c, flags = parts.epp, parts.epp_container, parts.epp_flags
    if d is None or c is None or parts.pool is None:
        return
    where = d.ref
    image = str(c.get("image", ""))
    tag = image.rsplit(":", 1)[-1] if ":" in image.rsplit("/", 1)[-1] else ""
    if not image.startswith("ghcr.io/llm-d/llm-d-router-endpoint-picker:") or tag in ("", "latest", "main"):
        problems.error(where, f"image {image!r}: validate.py knows the flags and config of ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0; pin a release tag and update EPP_FLAGS when changing it")
    for name in flags:
        if name in EPP_REFUSED_FLAGS:
            problems.error(where, f"--{name} makes this endpoint picker refuse to start (deprecated metric flags cannot be used; set the metric in the engine config of epp-config.yaml)")
        elif name in EPP_REMOVED_FLAGS:
            problems.error(where, f"--{name} no longer exists; the scrape port is the metrics-data-source `port` parameter in epp-config.yaml")
        elif name not in EPP_FLAGS:
            problems.error(where, f"--{name} is not a flag of the endpoint picker")
    pool = parts.pool
    if flags.get("pool-name") != pool.name:
        problems.error(where, f"--pool-name {flags.get('pool-name')!r} is not the InferencePool {pool.name!r}")
    if "endpoint-selector" in flags:
        problems.error(where, "--endpoint-selector and --pool-name exclude each other")
    if flags.get("pool-group", EPP_DEFAULTS["pool-group"]) != "inference.networking.k8s.io":
        problems.error(where, "--pool-group must be inference.networking.k8s.io")
    ns_flag = flags.get("pool-namespace")
    if ns_flag is not None and ns_flag != pool.namespace:
        problems.error(where, f"--pool-namespace {ns_flag!r} is not the pool's namespace {pool.namespace!r}")
    if ns_flag is None:
        ns_env = env_of(c).get("NAMESPACE") or {}
        if ((ns_env.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") != "metadata.namespace" and d.namespace != "default":
            problems.error(where, "without --pool-namespace the picker reads NAMESPACE (else uses `default`): set NAMESPACE from metadata.namespace")
    if d.namespace != pool.namespace:
        problems.error(where, f"is in namespace {d.namespace!r}, the pool in {pool.namespace!r}")
    for name, port_flag in (("grpc", "grpc-port"), ("grpc-health", "grpc-health-port"), ("metrics", "metrics-port")):
        value = as_int(flags.get(port_flag, EPP_DEFAULTS[port_flag]))
        if resolve_container_port(c, value) is None:
            problems.error(where, f"--{port_flag} {value} is not a containerPort")
    health = as_int(flags.get("grpc-health-port", EPP_DEFAULTS["grpc-health-port"]))
    for probe in ("livenessProbe", "readinessProbe"):
        pr = c.get(probe) or {}
        if not pr:
            problems.error(where, f"no {probe}")
        elif as_int((pr.get("grpc") or {}).get("port")) != health:
            problems.error(where, f"{probe} must be a gRPC probe on --grpc-health-port {health}")
    if (d.doc.get("spec") or {}).get("replicas", 1) > 1 and "ha-enable-leader-election" not in flags:
        problems.error(where, "several replicas need --ha-enable-leader-election (and a Role on coordination.k8s.io leases)")
    if parts.server is not None:
        server_grace = pod_spec(parts.server).get("terminationGracePeriodSeconds", 30)
        if pod_spec(d).get("terminationGracePeriodSeconds", 30) < server_grace:
            problems.error(where, f"terminationGracePeriodSeconds is shorter than the replicas' ({server_grace}): requests through the picker would be cut before the replicas drain")

    # Its ServiceAccount may watch pods and InferencePools in the pool's namespace.
    sa = pod_spec(d).get("serviceAccountName") or "default"
    if bundle.find("ServiceAccount", sa) is None:
        problems.error(where, f"serviceAccountName {sa!r} names no ServiceAccount")
    granted: set[tuple[str, str, str]] = set()
    for rb in bundle.of_kind("RoleBinding") + bundle.of_kind("ClusterRoleBinding"):
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == sa and s.get("namespace") == d.namespace
                   for s in rb.doc.get("subjects") or []):
            continue
        role_ref = rb.doc.get("roleRef") or {}
        role = bundle.find(role_ref.get("kind", ""), role_ref.get("name", ""))
        if role is None:
            problems.error(rb.ref, f"roleRef names no {role_ref.get('kind')} {role_ref.get('name')!r}")
            continue
        for rule in role.doc.get("rules") or []:
            for g in rule.get("apiGroups") or []:
                for r in rule.get("resources") or []:
                    for v in rule.get("verbs") or []:
                        granted.add((g, r, v))
    for g, r in (("", "pods"), ("inference.networking.k8s.io", "inferencepools")):
        missing = [v for v in ("get", "list", "watch") if (g, r, v) not in granted and ("*", "*", "*") not in granted]
        if missing:
            problems.error(where, f"ServiceAccount {sa!r} lacks {missing} on {g or 'core'}/{r}")
    if flags.get("metrics-endpoint-auth", "true") != "false":
        for g, r in (("authentication.k8s.io", "tokenreviews"), ("authorization.k8s.io", "subjectaccessreviews")):
            if (g, r, "create") not in granted:
                problems.error(where, f"--metrics-endpoint-auth (the default) needs create on {g}/{r}")


def find_epp_config(bundle: Bundle, parts: Parts, problems: Problems) -> tuple[dict | None, str]:
    """The EndpointPickerConfig that --config-file points at, through the volume and ConfigMap."""
    d, c, flags = parts.epp, parts.epp_container, parts.epp_flags
    if d is None or c is None:
        return None, "?"
    if "config-text" in flags:
        problems.error(d.ref, "use --config-file with the ConfigMap, not --config-text")
        return None, "?"
    path = flags.get("config-file")
    if not path:
        problems.error(d.ref, "no --config-file: the picker would run its default plugins, which scrape the serving port")
        return None, "?"
    mounts = sorted(c.get("volumeMounts") or [], key=lambda m: -len(m.get("mountPath", "")))
    mount = next((m for m in mounts if path.startswith(m.get("mountPath", "").rstrip("/") + "/")), None)
    if mount is None:
        problems.error(d.ref, f"--config-file {path} is under no volume mount")
        return None, "?"
    rel = path[len(mount["mountPath"].rstrip("/")) + 1:]
    volume = next((v for v in pod_spec(d).get("volumes") or [] if v.get("name") == mount.get("name")), None)
    if volume is None or "configMap" not in volume:
        problems.error(d.ref, f"--config-file {path}: volume {mount.get('name')!r} is not a ConfigMap volume")
        return None, "?"
    cm_name = volume["configMap"].get("name")
    key = rel
    for item in volume["configMap"].get("items") or []:
        if item.get("path") == rel:
            key = item.get("key")
    cm = bundle.find("ConfigMap", cm_name)
    if cm is None:
        problems.error(d.ref, f"--config-file {path}: ConfigMap {cm_name!r} is not in the kustomization")
        return None, "?"
    text = (cm.doc.get("data") or {}).get(key)
    if text is None:
        problems.error(cm.ref, f"has no key {key!r} (the picker's --config-file {path})")
        return None, "?"
    try:
        return yaml.safe_load(text), f"{cm.ref} data[{key}]"
    except yaml.YAMLError as e:
        problems.error(cm.ref, f"data[{key}] is not YAML: {e}")
        return None, "?"


def check_epp_config(bundle: Bundle, parts: Parts, problems: Problems) -> None:
    cfg, where = find_epp_config(bundle, parts, problems)
    if cfg is None:
        return
    errors = schema_errors(epp_config_validator(), cfg)
    for msg in errors:
        problems.error(where, f"EndpointPickerConfig schema: {msg}")
    if errors or not isinstance(cfg, dict):
        return
    plugins: dict[str, dict] = {}
    for p in cfg.get("plugins") or []:
        name = p.get("name") or p.get("type")
        if name in plugins:
            problems.error(where, f"duplicate plugin name {name!r}")
        plugins[name] = p
        if p.get("type") not in KNOWN_PLUGIN_TYPES:
            problems.error(where, f"plugin type {p.get('type')!r} is not one validate.py knows in the pinned endpoint picker ({sorted(KNOWN_PLUGIN_TYPES)})")

    def type_of(ref: str) -> str | None:
        return (plugins.get(ref) or {}).get("type")

    for prof in cfg.get("schedulingProfiles") or []:
        refs = [e.get("pluginRef") for e in prof.get("plugins") or []]
        for ref in refs:
            if ref not in plugins:
                problems.error(where, f"scheduling profile {prof.get('name')!r} refers to plugin {ref!r}, which is not defined (plugins: {sorted(plugins)})")
            elif type_of(ref) in PROFILE_HANDLER_TYPES:
                problems.error(where, f"scheduling profile {prof.get('name')!r}: {ref!r} is a profile handler, not a filter, scorer or picker")
        pickers = [r for r in refs if type_of(r) in PICKER_TYPES]
        if len(pickers) > 1:
            problems.error(where, f"scheduling profile {prof.get('name')!r} has several pickers: {pickers}")
        if not any(type_of(r) in SCORER_TYPES for r in refs):
            problems.error(where, f"scheduling profile {prof.get('name')!r} has no scorer")
        for e in prof.get("plugins") or []:
            if "weight" in e and e.get("pluginRef") in plugins and type_of(e.get("pluginRef")) not in SCORER_TYPES:
                problems.error(where, f"scheduling profile {prof.get('name')!r}: weight on {e.get('pluginRef')!r}, which is not a scorer")
    handlers = [n for n, p in plugins.items() if p.get("type") in PROFILE_HANDLER_TYPES]
    if len(cfg.get("schedulingProfiles") or []) > 1 and not handlers:
        problems.error(where, "several scheduling profiles need a profile handler")
    referenced = {e.get("pluginRef") for prof in cfg.get("schedulingProfiles") or [] for e in prof.get("plugins") or []}
    check_parsers(cfg, plugins, parts, problems, where, referenced)

    # Data layer: the metrics source scrapes the metrics port, with the engine loraplex's pods declare.
    dl = cfg.get("dataLayer") or {}
    sources = dl.get("sources") or []
    for s in sources:
        if s.get("pluginRef") not in plugins:
            problems.error(where, f"dataLayer source {s.get('pluginRef')!r} is not a defined plugin")
        referenced.add(s.get("pluginRef"))
        for x in s.get("extractors") or []:
            if x.get("pluginRef") not in plugins:
                problems.error(where, f"dataLayer extractor {x.get('pluginRef')!r} is not a defined plugin")
            referenced.add(x.get("pluginRef"))
    for name, p in plugins.items():
        if name not in referenced and p.get("type") not in PROFILE_HANDLER_TYPES:
            problems.error(where, f"plugin {name!r} is defined but used by no scheduling profile or data source")
    metric_sources = [s for s in sources if type_of(s.get("pluginRef")) == "metrics-data-source"]
    if not metric_sources:
        problems.error(where, "no metrics-data-source in dataLayer.sources: the picker's default source would scrape the serving port, whose /metrics needs a key")
        return
    if dl.get("injectDefaults", True) and not any(s.get("pluginRef") == "metrics-data-source" for s in sources):
        problems.error(where, "the metrics-data-source plugin must be named `metrics-data-source` (or set dataLayer.injectDefaults: false): "
                       "otherwise the picker adds its default source too, scraping the serving port without a key")
    for s in metric_sources:
        params = plugins[s["pluginRef"]].get("parameters") or {}
        if parts.metrics_port is not None and params.get("port") != parts.metrics_port:
            problems.error(where, f"metrics-data-source port {params.get('port')!r} is not the replicas' metrics port {parts.metrics_port} "
                           f"(without it the picker scrapes the pool's target port, whose /metrics needs a key it cannot send)")
        if params.get("path", "/metrics") != "/metrics" or params.get("scheme", "http") != "http":
            problems.error(where, "metrics-data-source must scrape http /metrics")
        extractors = [x.get("pluginRef") for x in s.get("extractors") or []]
        cores = [x for x in extractors if type_of(x) == "core-metrics-extractor"]
        if not cores:
            problems.error(where, f"source {s['pluginRef']!r} has no core-metrics-extractor: no queue, KV-cache or LoRA data")
        for x in cores:
            check_engine(plugins[x].get("parameters") or {}, parts, problems, where, plugins)


def pool_paths(bundle: Bundle, parts: Parts) -> list[str]:
    """The paths the HTTPRoutes send to the InferencePool."""
    out = []
    for route in bundle.of_kind("HTTPRoute"):
        for rule in (route.doc.get("spec") or {}).get("rules") or []:
            if parts.pool is not None and any(r.get("kind") == "InferencePool" and r.get("name") == parts.pool.name
                                              for r in rule.get("backendRefs") or []):
                out += [(m.get("path") or {}).get("value", "/") for m in rule.get("matches") or [{}]]
    return out


def check_parsers(cfg: dict, plugins: dict, parts: Parts, problems: Problems, where: str, referenced: set) -> None:
    handler = cfg.get("requestHandler") or {}
    refs = [p.get("pluginRef") for p in handler.get("parsers") or []]
    referenced.update(refs)
    chain: list[str] = []
    for i, ref in enumerate(refs):
        t = (plugins.get(ref) or {}).get("type")
        if ref not in plugins:
            problems.error(where, f"requestHandler parser {ref!r} is not a defined plugin")
            continue
        if t not in PARSER_PATHS:
            problems.error(where, f"requestHandler parser {ref!r} has type {t!r}, which is not a parser validate.py knows ({sorted(PARSER_PATHS)})")
            continue
        chain.append(t)
        if PARSER_PATHS[t] is None and i != len(refs) - 1:
            problems.error(where, f"requestHandler parser {ref!r} claims every path: the parsers after it ({refs[i + 1:]}) are ignored")
            break
    for name, p in plugins.items():
        if p.get("type") in PARSER_PATHS and name not in refs:
            problems.error(where, f"parser plugin {name!r} is not in requestHandler.parsers")
    if not refs:
        chain = ["openai-parser"]  # and anthropic-parser, vllmhttp-parser: no fallback
    for path in pool_paths(parts.bundle, parts) if parts.bundle else []:
        claimed = any(PARSER_PATHS[t] is None or any(path.rstrip("/").endswith(s) for s in PARSER_PATHS[t]) for t in chain)
        if not claimed:
            problems.error(where, f"the HTTPRoute sends {path} to the InferencePool, but no request parser claims it: "
                           "the endpoint picker would refuse those requests (add passthrough-parser last)")


def check_engine(params: dict, parts: Parts, problems: Problems, where: str, plugins: dict) -> None:
    label_key = params.get("engineLabelKey", "llm-d.ai/engine-type")
    default = params.get("defaultEngine", "vllm")
    engines = {e.get("name"): e for e in params.get("engineConfigs") or []}
    if default not in engines and default not in ("vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm", "triton"):
        problems.error(where, f"core-metrics-extractor defaultEngine {default!r} is not among its engineConfigs")
    engine = default
    if parts.server is not None:
        engine = pod_labels(parts.server).get(label_key, default)
    cfg = engines.get(engine)
    if cfg is None:
        problems.error(where, f"the replicas' engine {engine!r} (pod label {label_key}) has no engineConfig: "
                       "set the metric names explicitly rather than relying on a built-in engine")
        return
    for key, metric in LORAPLEX_METRICS.items():
        if cfg.get(key) != metric:
            problems.error(where, f"engine {engine!r}: {key} is {cfg.get(key)!r}, but loraplex exports {metric!r}")
    uses_lora = any(p.get("type") == "lora-affinity-scorer" for p in plugins.values())
    if uses_lora and not cfg.get("loraSpec"):
        problems.error(where, "lora-affinity-scorer needs the engine's loraSpec")


def check_routes(bundle: Bundle, parts: Parts, problems: Problems) -> None:
    routes = bundle.of_kind("HTTPRoute")
    gateways = bundle.of_kind("Gateway")
    if not routes:
        problems.error("deploy", "no HTTPRoute")
    if not gateways:
        problems.error("deploy", "no Gateway")
    pool = parts.pool
    to_pool = False
    for route in routes:
        spec = route.doc.get("spec") or {}
        for pref in spec.get("parentRefs") or []:
            if (pref.get("group") or "gateway.networking.k8s.io") != "gateway.networking.k8s.io" or (pref.get("kind") or "Gateway") != "Gateway":
                continue
            ns = pref.get("namespace") or route.namespace
            gw = next((g for g in gateways if g.name == pref.get("name") and g.namespace == ns), None)
            if gw is None:
                problems.error(route.ref, f"parentRef {pref.get('name')!r} names no Gateway in namespace {ns!r}")
                continue
            listeners = (gw.doc.get("spec") or {}).get("listeners") or []
            if pref.get("sectionName") and not any(l.get("name") == pref["sectionName"] for l in listeners):
                problems.error(route.ref, f"parentRef sectionName {pref['sectionName']!r} is no listener of {gw.ref}")
            for l in listeners:
                if pref.get("sectionName") and l.get("name") != pref["sectionName"]:
                    continue
                frm = (((l.get("allowedRoutes") or {}).get("namespaces") or {}).get("from") or "Same")
                if frm == "Same" and gw.namespace != route.namespace:
                    problems.error(route.ref, f"listener {l.get('name')!r} of {gw.ref} admits routes from its own namespace only")
        for i, rule in enumerate(spec.get("rules") or []):
            for ref in rule.get("backendRefs") or []:
                group, kind = ref.get("group") or "", ref.get("kind") or "Service"
                ns = ref.get("namespace") or route.namespace
                if ns != route.namespace:
                    problems.error(route.ref, f"rules[{i}] backendRef {ref.get('name')!r} in another namespace needs a ReferenceGrant")
                if (group, kind) == ("inference.networking.k8s.io", "InferencePool"):
                    if pool is None or ref.get("name") != pool.name:
                        problems.error(route.ref, f"rules[{i}] backendRef names InferencePool {ref.get('name')!r}, not {pool.name if pool else None!r}")
                        continue
                    to_pool = True
                    ports = [p.get("number") for p in (pool.doc.get("spec") or {}).get("targetPorts") or []]
                    if "port" in ref and ref["port"] not in ports:
                        problems.error(route.ref, f"rules[{i}] backendRef port {ref['port']} is not a targetPort of the pool {ports}")
                elif (group, kind) == ("", "Service"):
                    svc = bundle.find("Service", ref.get("name", ""))
                    if svc is None:
                        problems.error(route.ref, f"rules[{i}] backendRef names Service {ref.get('name')!r}, which does not exist")
                        continue
                    if "port" not in ref:
                        problems.error(route.ref, f"rules[{i}] backendRef to Service {ref.get('name')!r} needs a port")
                    elif ref["port"] not in [p.get("port") for p in (svc.doc.get("spec") or {}).get("ports") or []]:
                        problems.error(route.ref, f"rules[{i}] backendRef port {ref['port']} is not a port of {svc.ref}")
                    elif parts.server is not None and labels_match((svc.doc.get("spec") or {}).get("selector"), pod_labels(parts.server)):
                        target = next(p for p in svc.doc["spec"]["ports"] if p.get("port") == ref["port"])
                        if resolve_container_port(parts.server_container or {}, target.get("targetPort", target.get("port"))) == parts.metrics_port:
                            problems.error(route.ref, f"rules[{i}] exposes the unauthenticated metrics port through the gateway")
                else:
                    problems.error(route.ref, f"rules[{i}] backendRef {group}/{kind} is neither the InferencePool nor a Service")
    if routes and pool is not None and not to_pool:
        problems.error("HTTPRoute", f"no rule sends requests to the InferencePool {pool.name!r}")
    # The inference endpoints must reach the pool, not only a catch-all Service rule.
    for route in routes:
        for rule in (route.doc.get("spec") or {}).get("rules") or []:
            if any((r.get("kind") == "InferencePool") for r in rule.get("backendRefs") or []):
                paths = {(m.get("path") or {}).get("value") for m in rule.get("matches") or []}
                for needed in ("/v1/completions", "/v1/chat/completions"):
                    if needed not in paths and "/" not in paths and "/v1" not in paths:
                        problems.error(route.ref, f"{needed} does not go to the InferencePool")


def check_placeholders(bundle: Bundle, problems: Problems) -> None:
    """Placeholders are expected in the example; list them so a reader knows what to replace."""
    found = []

    def walk(v: Any, path: str, o: Obj) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}.{k}" if path else k, o)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, f"{path}[{i}]", o)
        elif isinstance(v, str) and re.search(r"replace[-_]?me", v, re.IGNORECASE):
            found.append(f"{o.source}: {path}")

    for o in bundle.objects + ([bundle.secret_example] if bundle.secret_example else []):
        walk(o.doc, "", o)
    if found:
        problems.note("placeholders to replace before use: " + "; ".join(found))


def check_kustomize(deploy: Path, bundle: Bundle, problems: Problems) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        problems.note("kubectl not found: the kustomization was not rendered with kustomize (only read by validate.py)")
        return
    try:
        out = subprocess.run([kubectl, "kustomize", str(deploy)], capture_output=True, text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        problems.error("kustomization.yaml", "kubectl kustomize timed out")
        return
    if out.returncode != 0:
        problems.error("kustomization.yaml", f"kubectl kustomize failed: {out.stderr.strip()}")
        return
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d is not None]

    def key(d: dict) -> tuple:
        m = d.get("metadata") or {}
        return (d.get("apiVersion"), d.get("kind"), m.get("namespace"), m.get("name"))

    ours = {key(o.doc): o.doc for o in bundle.objects}
    theirs = {key(d): d for d in rendered}
    for k in sorted(set(ours) | set(theirs), key=str):
        if k not in theirs:
            problems.error("kustomization.yaml", f"validate.py read {k} but kubectl kustomize does not render it")
        elif k not in ours:
            problems.error("kustomization.yaml", f"kubectl kustomize renders {k}, which validate.py did not read")
        elif ours[k] != theirs[k]:
            problems.error("kustomization.yaml", f"kubectl kustomize renders {k} differently from what validate.py read")
    problems.note(f"kubectl kustomize renders the same {len(rendered)} objects")


# --------------------------------------------------------------------------------------------


def validate(bundle: Bundle) -> Problems:
    problems = Problems()
    check_schemas(bundle, problems)
    parts = find_parts(bundle, problems)
    check_deployments(bundle, problems)
    check_server(bundle, parts, problems)
    check_secret_refs(bundle, problems)
    check_pool(bundle, parts, problems)
    check_services(bundle, parts, problems)
    check_pdb(bundle, parts, problems)
    check_network_policies(bundle, parts, problems)
    check_epp(bundle, parts, problems)
    check_epp_config(bundle, parts, problems)
    check_routes(bundle, parts, problems)
    check_placeholders(bundle, problems)
    return problems


def run(deploy: Path) -> int:
    load_problems = Problems()
    bundle = load_bundle(deploy, load_problems)
    problems = validate(bundle)
    problems.errors[:0] = load_problems.errors
    check_kustomize(deploy, bundle, problems)
    for n in problems.notes:
        print(f"note: {n}")
    kinds = sorted({f"{o.kind}" for o in bundle.objects})
    if problems.errors:
        for e in problems.errors:
            print(f"ERROR {e}")
        print(f"deploy/: {len(problems.errors)} problem(s) in {len(bundle.objects)} objects")
        return 1
    print(f"deploy/: {len(bundle.objects)} objects ({', '.join(kinds)}) and the example Secret are valid "
          f"(Kubernetes {', '.join(v[:-2] for v in K8S_VERSIONS)} schemas, InferencePool/Gateway/HTTPRoute CRDs, "
          f"EndpointPickerConfig, cross-references)")
    return 0


# --------------------------------------------------------------------------------------------
# Self-test: each mutation is a mistake the validator must catch.


def _obj(bundle: Bundle, kind: str, name: str | None = None) -> dict:
    for o in bundle.objects + ([bundle.secret_example] if bundle.secret_example else []):
        if o.kind == kind and (name is None or o.name == name):
            return o.doc
    raise KeyError(f"{kind}/{name}")


def _server(b: Bundle) -> dict:
    return _obj(b, "Deployment", "loraplex")["spec"]["template"]["spec"]["containers"][0]


def _epp(b: Bundle) -> dict:
    return _obj(b, "Deployment", "loraplex-epp")["spec"]["template"]["spec"]["containers"][0]


def _set_arg(container: dict, flag: str, value: str | None) -> None:
    """Sets (value) or removes (None) `--flag=value` / `--flag value` in a container's args."""
    args = container["args"]
    for i, a in enumerate(args):
        if a == flag or a.startswith(flag + "="):
            has_separate_value = a == flag and i + 1 < len(args) and not str(args[i + 1]).startswith("--")
            del args[i : i + (2 if has_separate_value else 1)]
            if value is not None:
                args.insert(i, f"{flag}={value}")
            return
    raise KeyError(flag)


def _set_epp_config(b: Bundle, change: Callable[[dict], None]) -> None:
    cm = _obj(b, "ConfigMap", "loraplex-epp-config")
    cfg = yaml.safe_load(cm["data"]["epp-config.yaml"])
    change(cfg)
    cm["data"]["epp-config.yaml"] = yaml.safe_dump(cfg, sort_keys=False)


def _rename_key(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


def _plugin(cfg: dict, type_: str) -> dict:
    return next(p for p in cfg["plugins"] if p["type"] == type_)


MUTATIONS: list[tuple[str, Callable[[Bundle], None], str]] = [
    ("InferencePool selector misses the pods",
     lambda b: _obj(b, "InferencePool")["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/name": "lora-plex"}),
     "selects the pods of no Deployment"),
    ("readiness probe removed",
     lambda b: _server(b).pop("readinessProbe"),
     "has no readinessProbe"),
    ("liveness probe on the metrics port",
     lambda b: _server(b)["livenessProbe"]["httpGet"].update({"port": "metrics"}),
     "livenessProbe port 'metrics' is not the serving port"),
    ("readiness probe on /health",
     lambda b: _server(b)["readinessProbe"]["httpGet"].update({"path": "/health"}),
     "readinessProbe GETs '/health'"),
    ("grace period shorter than the drain",
     lambda b: _obj(b, "Deployment", "loraplex")["spec"]["template"]["spec"].update({"terminationGracePeriodSeconds": 30}),
     "terminationGracePeriodSeconds 30 must exceed"),
    ("typo in an InferencePool field (targetPort)",
     lambda b: _rename_key(_obj(b, "InferencePool")["spec"], "targetPorts", "targetPort"),
     "'targetPort' was unexpected"),
    ("typo in a Deployment field (readinessProbe.httpGet.paht)",
     lambda b: _rename_key(_server(b)["readinessProbe"]["httpGet"], "path", "paht"),
     "'paht' was unexpected"),
    ("secretKeyRef to a key the Secret does not have",
     lambda b: next(e for e in _server(b)["env"] if e["name"] == "AWS_REGION")["valueFrom"]["secretKeyRef"].update({"key": "AWS_DEFAULT_REGION"}),
     "refers to key 'AWS_DEFAULT_REGION'"),
    ("pool targetPort not a container port",
     lambda b: _obj(b, "InferencePool")["spec"]["targetPorts"][0].update({"number": 8000}),
     "targetPort 8000 is not a containerPort"),
    ("Service selects no pods",
     lambda b: _obj(b, "Service", "loraplex")["spec"]["selector"].update({"app.kubernetes.io/component": "api"}),
     "Service/loraplex (loraplex-service.yaml): selector"),
    ("EPP Service port is not the pool's endpointPickerRef port",
     lambda b: _obj(b, "Service", "loraplex-epp")["spec"]["ports"][0].update({"port": 9003}),
     "has no port 9002"),
    ("HTTPRoute backendRef names another InferencePool",
     lambda b: _obj(b, "HTTPRoute")["spec"]["rules"][0]["backendRefs"][0].update({"name": "vllm"}),
     "backendRef names InferencePool 'vllm'"),
    ("scheduling profile refers to an undefined plugin",
     lambda b: _set_epp_config(b, lambda c: c["schedulingProfiles"][0]["plugins"].append({"pluginRef": "prefix-cache-scorer", "weight": 1})),
     "refers to plugin 'prefix-cache-scorer', which is not defined"),
    ("picker scrapes the authenticated serving port",
     lambda b: _set_epp_config(b, lambda c: _plugin(c, "metrics-data-source")["parameters"].pop("port")),
     "metrics-data-source port None is not the replicas' metrics port"),
    ("typo in a plugin parameter",
     lambda b: _set_epp_config(b, lambda c: _rename_key(_plugin(c, "metrics-data-source")["parameters"], "port", "prot")),
     "'prot' was unexpected"),
    ("wrong LoRA metric name",
     lambda b: _set_epp_config(b, lambda c: _plugin(c, "core-metrics-extractor")["parameters"]["engineConfigs"][0].update({"loraSpec": "vllm:lora_info"})),
     "loraSpec is 'vllm:lora_info'"),
    ("deprecated metric flag the picker refuses",
     lambda b: _epp(b)["args"].append("--lora-info-metric=vllm:lora_requests_info"),
     "--lora-info-metric makes this endpoint picker refuse to start"),
    ("removed model-server-metrics-port flag",
     lambda b: _epp(b)["args"].append("--model-server-metrics-port=9090"),
     "--model-server-metrics-port no longer exists"),
    ("--pool-name names another pool",
     lambda b: _set_arg(_epp(b), "--pool-name", "vllm"),
     "--pool-name 'vllm' is not the InferencePool"),
    ("serve listens on localhost only",
     lambda b: _set_arg(_server(b), "--host", "127.0.0.1"),
     "other pods cannot reach it"),
    ("no metrics port",
     lambda b: _set_arg(_server(b), "--metrics-port", None),
     "no metrics port"),
    ("database URL is SQLite",
     lambda b: _obj(b, "Secret")["stringData"].update({"LORAPLEX_DATABASE_URL": "sqlite:///var/lib/loraplex/db.sqlite"}),
     "must be a postgres:// URL"),
    ("data directory on the root filesystem",
     lambda b: next(e for e in _server(b)["env"] if e["name"] == "LORAPLEX_DATA_DIR").update({"value": "/data"}),
     "the data directory '/data' is not a volume mount"),
    ("NetworkPolicy shuts the picker out of the metrics port",
     lambda b: _obj(b, "NetworkPolicy")["spec"]["ingress"][1]["from"][0]["podSelector"]["matchLabels"].update({"app.kubernetes.io/name": "epp"}),
     "may not reach the metrics port"),
    ("RBAC without InferencePools",
     lambda b: _obj(b, "Role", "loraplex-epp")["rules"].pop(1),
     "lacks ['get', 'list', 'watch'] on inference.networking.k8s.io/inferencepools"),
    ("a route path no request parser claims",
     lambda b: _set_epp_config(b, lambda c: (c["requestHandler"]["parsers"].pop(), c["plugins"].remove(_plugin(c, "passthrough-parser")))),
     "sends /generate to the InferencePool, but no request parser claims it"),
    ("service links left on",
     lambda b: _obj(b, "Deployment", "loraplex")["spec"]["template"]["spec"].pop("enableServiceLinks"),
     "['LORAPLEX_PORT'] into these pods as service links"),
    ("HTTPRoute parent is not the Gateway",
     lambda b: _obj(b, "HTTPRoute")["spec"]["parentRefs"][0].update({"name": "inference-gateway"}),
     "names no Gateway"),
]


def self_test(deploy: Path) -> int:
    load_problems = Problems()
    base = load_bundle(deploy, load_problems)
    passed = failed = 0
    baseline = validate(base)
    baseline.errors[:0] = load_problems.errors
    if baseline.errors:
        print("FAIL the unmodified manifests do not validate:")
        for e in baseline.errors:
            print(f"  {e}")
        failed += 1
    else:
        print("ok   the unmodified manifests validate")
        passed += 1
    for title, mutate, expected in MUTATIONS:
        bundle = copy.deepcopy(base)
        try:
            mutate(bundle)
        except (KeyError, IndexError, StopIteration) as e:
            print(f"FAIL {title}: the mutation no longer applies to the manifests ({e!r})")
            failed += 1
            continue
        errors = validate(bundle).errors
        if any(expected in e for e in errors):
            print(f"ok   {title}")
            passed += 1
        else:
            print(f"FAIL {title}: expected an error containing {expected!r}, got:")
            for e in errors or ["(no error)"]:
                print(f"       {e}")
            failed += 1
    print(f"validate.py self-test: {passed} passed, {failed} failed")
    return 1 if failed else 0


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--self-test", action="store_true", help="check that mutated manifests are caught")
    parser.add_argument("--dir", type=Path, default=DEPLOY, help="the deploy directory (default: this script's)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.self_test:
        return self_test(args.dir)
    return run(args.dir)


if __name__ == "__main__":
    sys.exit(main())
