"""Validate an LLMDeployment spec and fill in its defaults.

The CRD's schema catches most mistakes at `kubectl apply`, but not all (min > max, a block size
that is not a power of two, a model source that names nothing), and an older CRD may lack a
check. Everything the operator relies on is checked here again, with the field's path in the
message. The defaults equal the CRD's (tests/operator/test_spec.py compares them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from . import names, quantity
from .adapter_spec import AdapterSpec, LoraSpec, lora_modules_in, parse_adapters, parse_lora
from .gateway_spec import EXT_PROC_PORT, GatewaySpec, parse_gateway_spec
from .kv_cache_spec import KVOffloadSpec, parse_kv_cache_spec
from .observability_spec import ObservabilitySpec, parse_observability_spec
from .router_spec import RouterSpec, ScaleToZeroSpec, parse_router_spec, parse_scale_to_zero
from .spec_error import SpecError
from .tls_spec import TLSSpec, parse_tls

__all__ = ["SpecError"]  # re-exported: callers import it from here

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# Who scales: the operator's own autoscaler, or a KEDA ScaledObject it writes (keda_children.py).
AUTOSCALING_PROVIDERS = ("builtin", "keda")
# Flags the operator sets itself: the probes, the Service, the drain and the GPU request depend on them.
MANAGED_FLAGS = ("--host", "--port", "--shutdown-timeout", "--api-key", "--tensor-parallel-size",
                 "--ssl-certfile", "--ssl-keyfile",
                 # a multi-node replica's stage and rendezvous (lws_children.py)
                 "--pipeline-parallel-size", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                 "--headless")
# spec.parallelism.tensor: worker processes per pod, one per GPU; the bound of resources.gpus.
MAX_TENSOR_PARALLEL = 16
# spec.parallelism.pipeline: pods per replica, one pipeline stage each (the CRD's maximum too).
MAX_PIPELINE_PARALLEL = 64

_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclass(frozen=True)
class ModelSpec:
    source: str | None = None
    served_name: str | None = None
    revision: str | None = None
    pvc_claim: str | None = None
    cache_claim: str | None = None


@dataclass(frozen=True)
class ResourcesSpec:
    gpus: int = 0
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class ParallelismSpec:
    tensor: int = 1
    pipeline: int = 1  # pods per replica: more than one makes it a LeaderWorkerSet
    shm_size: str | None = None  # the /dev/shm sizeLimit; None: pod_template's default
    key_secret: tuple[str, str] | None = None  # (secret name, key): the group's step-channel key

    @property
    def multi_node(self) -> bool:
        return self.pipeline > 1


@dataclass(frozen=True)
class RuntimeSpec:
    dtype: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str | None = None
    enable_prefix_caching: bool | None = None
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_queue_len: int | None = None
    shutdown_timeout_seconds: int = 30
    startup_timeout_seconds: int = 1800
    log_requests: bool = False
    api_key_secret: tuple[str, str] | None = None  # (secret name, key)
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int | None = None
    target_queue_depth: float = 4.0
    target_kv_cache_utilization: float = 0.8
    tolerance: float = 0.1
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    max_scale_up_step: int = 4
    poll_interval_seconds: int = 15
    provider: str = "builtin"
    keda_prometheus_address: str | None = None  # where KEDA's Prometheus triggers query

    @property
    def builtin(self) -> bool:
        """Whether the operator's own autoscaler scales (KEDA's object is left to KEDA)."""
        return self.enabled and self.provider == "builtin"


@dataclass(frozen=True)
class LLMSpec:
    model: ModelSpec = field(default_factory=ModelSpec)
    image: str | None = None
    image_pull_policy: str | None = None
    replicas: int = 1
    port: int = 8000
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    env: tuple[dict, ...] = ()
    node_selector: dict = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()
    pod_annotations: dict = field(default_factory=dict)
    pdb_enabled: bool = False
    pdb_max_unavailable: int = 1
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    router: RouterSpec = field(default_factory=RouterSpec)
    scale_to_zero: ScaleToZeroSpec = field(default_factory=ScaleToZeroSpec)
    adapters: tuple[AdapterSpec, ...] = ()
    lora: LoraSpec = field(default_factory=LoraSpec)
    gateway: GatewaySpec = field(default_factory=GatewaySpec)
    tls: TLSSpec = field(default_factory=TLSSpec)
    observability: ObservabilitySpec = field(default_factory=ObservabilitySpec)
    kv_offload: KVOffloadSpec = field(default_factory=KVOffloadSpec)


def check_name(name: str) -> None:
    """The LLMDeployment's own name, which every child takes (names.name_problem says why)."""
    problem = names.name_problem(name)
    if problem:
        raise SpecError("metadata.name", problem)


def parse_spec(raw: Mapping[str, Any] | None) -> LLMSpec:
    """The spec with defaults filled in; raises SpecError naming the first bad field."""
    spec = _Reader(raw or {}, "spec")
    model = spec.section("model")
    resources = spec.section("resources")
    runtime = spec.section("runtime")
    parallelism = _parse_parallelism(spec)
    pdb = spec.section("podDisruptionBudget")
    scaling = spec.section("autoscaling")

    parsed = LLMSpec(
        model=_parse_model(model),
        image=spec.string("image"),
        image_pull_policy=spec.choice("imagePullPolicy", PULL_POLICIES),
        replicas=spec.integer("replicas", 1, minimum=0, maximum=MAX_REPLICAS),
        port=spec.integer("port", 8000, minimum=1, maximum=65535),
        resources=ResourcesSpec(
            gpus=_gpus(resources, parallelism, checked=spec.has("parallelism")),
            cpu=resources.quantity("cpu"),
            memory=resources.quantity("memory"),
        ),
        parallelism=parallelism,
        runtime=_parse_runtime(runtime),
        env=tuple(_as_stored(spec, "env", ENV_KEYS, "name")),
        node_selector=spec.string_map("nodeSelector"),
        tolerations=tuple(_as_stored(spec, "tolerations", TOLERATION_KEYS)),
        pod_annotations=spec.string_map("podAnnotations"),
        pdb_enabled=pdb.boolean("enabled", False),
        pdb_max_unavailable=pdb.integer("maxUnavailable", 1, minimum=0),
        autoscaling=_parse_autoscaling(scaling),
        router=parse_router_spec(raw),
        tls=parse_tls(raw),
        kv_offload=parse_kv_cache_spec(raw),
    )
    if parsed.kv_offload.enabled and parsed.runtime.enable_prefix_caching is False:
        raise SpecError("spec.kvCache.offload", "the KV tiers keep prefix-cache blocks: they need "
                                                "spec.runtime.enablePrefixCaching")
    if parsed.kv_offload.enabled and parsed.parallelism.tensor > 1:
        raise SpecError("spec.kvCache.offload", "KV tiers are not supported with "
                                                "spec.parallelism.tensor > 1 yet")
    if parsed.kv_offload.enabled and parsed.parallelism.multi_node:
        raise SpecError("spec.kvCache.offload", "KV tiers are not supported with "
                                                "spec.parallelism.pipeline > 1 yet")
    gateway = parse_gateway_spec(raw, router_enabled=parsed.router.enabled)
    router = replace(parsed.router, ext_proc_port=EXT_PROC_PORT, objectives=gateway.objectives) \
        if gateway.inference_pool else parsed.router
    observability = parse_observability_spec(raw)
    # A multi-node replica serves from its leader pod only: the router's backends are leaders.
    router = replace(router, observability=observability, leaders_only=parsed.parallelism.multi_node)
    parsed = replace(parsed, scale_to_zero=parse_scale_to_zero(raw, parsed.router), gateway=gateway,
                     router=router, observability=observability)
    return _with_lora(parsed, spec)


def _with_lora(parsed: LLMSpec, spec: _Reader) -> LLMSpec:
    reserved = {name: "--lora-modules in spec.runtime.extraArgs already serves it"
                for name in lora_modules_in(parsed.runtime.extra_args)}
    if parsed.model.served_name:
        reserved[parsed.model.served_name] = "it is the base model's spec.model.servedName"
    adapters = parse_adapters(spec.raw.get("adapters"), reserved=reserved)
    lora = parse_lora(spec.raw.get("lora"), adapters)
    if lora.enabled and parsed.parallelism.tensor > 1:
        raise SpecError("spec.lora" if spec.has("lora") else "spec.adapters",
                        f"LoRA is not supported with spec.parallelism.tensor {parsed.parallelism.tensor} yet "
                        "(the runtime serves adapters on single-worker pods)")
    if lora.enabled and parsed.parallelism.multi_node:
        raise SpecError("spec.lora" if spec.has("lora") else "spec.adapters",
                        f"LoRA is not supported with spec.parallelism.pipeline {parsed.parallelism.pipeline} yet "
                        "(the runtime serves adapters on single-worker pods)")
    router = parsed.router
    if lora.enabled and router.enabled and parsed.runtime.api_key_secret:
        router = replace(router, backend_api_key_secret=parsed.runtime.api_key_secret)
    return replace(parsed, adapters=adapters, lora=lora, router=router)


def _parse_model(model: _Reader) -> ModelSpec:
    pvc = model.section("pvc")
    cache = model.section("cache")
    parsed = ModelSpec(
        source=model.string("source"),
        served_name=model.string("servedName"),
        revision=model.string("revision"),
        pvc_claim=pvc.string("claimName", required=model.has("pvc")),
        cache_claim=cache.string("claimName", required=model.has("cache")),
    )
    _check_source(parsed, model.path + ".source")
    return parsed


def _check_source(model: ModelSpec, path: str) -> None:
    """A source must name something the pod can open; the runtime cannot say so until it starts."""
    source = model.source
    if model.pvc_claim:
        if source is None:
            raise SpecError(path, "is required with model.pvc (the path of the model inside the volume)")
        if source.startswith("/") or ".." in source.split("/"):
            raise SpecError(path, f"{source!r} must be a relative path inside the volume, without '..'")
        return
    if source is None or source.startswith("/"):
        return  # the runtime's default model, or a path inside the image
    if source.endswith(".gguf"):
        raise SpecError(path, f"{source!r} names no file: a GGUF path must be absolute inside the image, "
                              "or relative to model.pvc")
    if not _HF_ID.match(source):
        raise SpecError(path, f"{source!r} names nothing: expected a Hugging Face id (org/name), an absolute "
                              "path inside the image, or a path inside model.pvc")


def _parse_parallelism(spec: _Reader) -> ParallelismSpec:
    parallelism = spec.section("parallelism")
    shm_size = parallelism.quantity("shmSize")
    if shm_size is not None and quantity.value_of(shm_size) <= 0:
        raise SpecError(parallelism.path + ".shmSize", f"{shm_size!r} must be greater than 0")
    return ParallelismSpec(
        tensor=parallelism.integer("tensor", 1, minimum=1, maximum=MAX_TENSOR_PARALLEL),
        pipeline=parallelism.integer("pipeline", 1, minimum=1, maximum=MAX_PIPELINE_PARALLEL),
        shm_size=shm_size,
        key_secret=_key_secret(parallelism),
    )


def _key_secret(parallelism: _Reader) -> tuple[str, str] | None:
    if not parallelism.has("keySecret"):
        return None
    secret = parallelism.section("keySecret")
    return secret.string("name", required=True), secret.string("key") or "distributed-key"


def _gpus(resources: _Reader, parallelism: ParallelismSpec, *, checked: bool) -> int:
    """GPUs per pod: one per tensor-parallel worker.

    Unset: `tensor` GPUs when tensor > 1, else none, as before parallelism existed.
    0 with tensor > 1: CPU workers over gloo, for tests and small models. Any other count must
    equal tensor, but only once the spec has a parallelism section: a spec written before the
    section existed keeps its meaning and its pods (and is not turned Degraded by an upgrade).
    """
    tensor = parallelism.tensor
    gpus = resources.integer("gpus", None, minimum=0, maximum=MAX_TENSOR_PARALLEL)
    if gpus is None:
        return tensor if tensor > 1 else 0
    if checked and gpus not in (0, tensor):
        raise SpecError(resources.path + ".gpus",
                        f"{gpus} does not match spec.parallelism.tensor {tensor} (one worker per GPU): "
                        f"leave gpus out, set it to {tensor}, or to 0 for CPU workers")
    return gpus


def _parse_runtime(runtime: _Reader) -> RuntimeSpec:
    secret = runtime.section("apiKeySecret")
    block_size = runtime.integer("blockSize", None, minimum=1, maximum=256)
    if block_size is not None and block_size & (block_size - 1):
        raise SpecError(runtime.path + ".blockSize", f"{block_size} is not a power of two (1, 2, 4 … 256)")
    extra_args = tuple(runtime.strings("extraArgs"))
    for arg in extra_args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            where = "spec.tls" if flag.startswith("--ssl-") else "the spec field"
            raise SpecError(runtime.path + ".extraArgs", f"{flag} is set by the operator; use {where} instead")
    return RuntimeSpec(
        dtype=runtime.choice("dtype", DTYPES),
        max_model_len=runtime.integer("maxModelLen", None, minimum=1),
        block_size=block_size,
        max_num_seqs=runtime.integer("maxNumSeqs", None, minimum=1),
        max_num_batched_tokens=runtime.integer("maxNumBatchedTokens", None, minimum=1),
        kv_cache_dtype=runtime.choice("kvCacheDtype", KV_CACHE_DTYPES),
        enable_prefix_caching=runtime.boolean("enablePrefixCaching", None),
        kv_cache_memory=runtime.integer("kvCacheMemory", None, minimum=1),
        kv_cache_memory_fraction=runtime.number("kvCacheMemoryFraction", None, above=0.0, maximum=1.0),
        max_queue_len=runtime.integer("maxQueueLen", None, minimum=1),
        shutdown_timeout_seconds=runtime.integer("shutdownTimeoutSeconds", 30, minimum=0, maximum=3600),
        startup_timeout_seconds=runtime.integer("startupTimeoutSeconds", 1800, minimum=10, maximum=86400),
        log_requests=bool(runtime.boolean("logRequests", False)),
        api_key_secret=((secret.string("name", required=True), secret.string("key") or "api-key")
                        if runtime.has("apiKeySecret") else None),
        extra_args=extra_args,
    )


def _parse_autoscaling(scaling: _Reader) -> AutoscalingSpec:
    enabled = bool(scaling.boolean("enabled", False))
    parsed = AutoscalingSpec(
        enabled=enabled,
        # 0 is scale to zero: parse_scale_to_zero says when it is allowed.
        min_replicas=scaling.integer("minReplicas", 1, minimum=0, maximum=MAX_REPLICAS),
        max_replicas=scaling.integer("maxReplicas", None, minimum=1, maximum=MAX_REPLICAS),
        target_queue_depth=scaling.number("targetQueueDepth", 4.0, above=0.0),
        target_kv_cache_utilization=scaling.number("targetKVCacheUtilization", 0.8, above=0.0, maximum=1.0),
        tolerance=scaling.number("tolerance", 0.1, minimum=0.0, maximum=1.0),
        scale_up_stabilization_seconds=scaling.integer("scaleUpStabilizationSeconds", 0, minimum=0, maximum=3600),
        scale_down_stabilization_seconds=scaling.integer("scaleDownStabilizationSeconds", 300, minimum=0, maximum=3600),
        max_scale_up_step=scaling.integer("maxScaleUpStep", 4, minimum=1),
        poll_interval_seconds=scaling.integer("pollIntervalSeconds", 15, minimum=1, maximum=3600),
        provider=scaling.choice("provider", AUTOSCALING_PROVIDERS) or "builtin",
        keda_prometheus_address=_prometheus_address(scaling),
    )
    if enabled and parsed.max_replicas is None:
        raise SpecError(scaling.path + ".maxReplicas", "is required when autoscaling is enabled")
    if parsed.max_replicas is not None and parsed.min_replicas > parsed.max_replicas:
        raise SpecError(scaling.path + ".minReplicas",
                        f"{parsed.min_replicas} is greater than maxReplicas {parsed.max_replicas}")
    return parsed


def _prometheus_address(scaling: _Reader) -> str | None:
    keda = scaling.section("keda")
    address = keda.string("prometheusAddress")
    if address is None and scaling.raw.get("provider") == "keda":
        raise SpecError(keda.path + ".prometheusAddress", "is required when autoscaling.provider is keda "
                                                          "(the Prometheus server KEDA's triggers query)")
    if address is not None and not re.match(r"^https?://[^\s/]+(/\S*)?$", address):
        raise SpecError(keda.path + ".prometheusAddress",
                        f"{address!r} is not an http:// or https:// URL of a Prometheus server")
    return address


class _Reader:
    """Typed reads of one object of the spec, each naming its field on error."""

    def __init__(self, raw: Any, path: str) -> None:
        if not isinstance(raw, Mapping):
            raise SpecError(path, f"must be an object, not {type(raw).__name__}")
        self.raw = raw
        self.path = path

    def _get(self, key: str) -> Any:
        return self.raw.get(key)

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def section(self, key: str) -> _Reader:
        value = self._get(key)
        return _Reader({} if value is None else value, f"{self.path}.{key}")

    def string(self, key: str, *, required: bool = False) -> str | None:
        value = self._get(key)
        if value is None:
            if required:
                raise SpecError(f"{self.path}.{key}", "is required")
            return None
        if not isinstance(value, str) or not value.strip():
            raise SpecError(f"{self.path}.{key}", f"must be a non-empty string, not {value!r}")
        return value

    def choice(self, key: str, allowed: tuple[str, ...]) -> str | None:
        value = self.string(key)
        if value is not None and value not in allowed:
            raise SpecError(f"{self.path}.{key}", f"{value!r} is not one of {', '.join(allowed)}")
        return value

    def integer(self, key: str, default: int | None, *, minimum: int | None = None,
                maximum: int | None = None) -> int | None:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{self.path}.{key}", f"must be an integer, not {value!r}")
        _check_range(f"{self.path}.{key}", value, minimum=minimum, maximum=maximum)
        return value

    def number(self, key: str, default: float | None, *, minimum: float | None = None,
               maximum: float | None = None, above: float | None = None) -> float | None:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{self.path}.{key}", f"must be a number, not {value!r}")
        if above is not None and not value > above:
            raise SpecError(f"{self.path}.{key}", f"{value} must be greater than {above:g}")
        _check_range(f"{self.path}.{key}", value, minimum=minimum, maximum=maximum)
        return float(value)

    def boolean(self, key: str, default: bool | None) -> bool | None:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise SpecError(f"{self.path}.{key}", f"must be true or false, not {value!r}")
        return value

    def quantity(self, key: str) -> str | None:
        value = self._get(key)
        if value is None:
            return None
        if not quantity.is_quantity(value):
            raise SpecError(f"{self.path}.{key}", f"{value!r} is not a Kubernetes quantity: expected a "
                                                  "non-negative number with an optional suffix, such as "
                                                  "4, '500m', '16Gi' or '512M'")
        return str(value)

    def strings(self, key: str) -> list[str]:
        value = self._get(key) or []
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise SpecError(f"{self.path}.{key}", "must be a list of strings")
        return list(value)

    def string_map(self, key: str) -> dict[str, str]:
        value = self._get(key) or {}
        if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
            raise SpecError(f"{self.path}.{key}", "must map strings to strings")
        return dict(value)

    def objects(self, key: str, *, required_key: str | None = None) -> list[dict]:
        value = self._get(key) or []
        if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
            raise SpecError(f"{self.path}.{key}", "must be a list of objects")
        if required_key and not all(item.get(required_key) for item in value):
            raise SpecError(f"{self.path}.{key}", f"every item needs a {required_key!r}")
        return [dict(item) for item in value]


MAX_REPLICAS = 2**31 - 1  # a workload's spec.replicas is an int32

# what the API server keeps of an EnvVar and a Toleration: other keys it drops, and an empty
# string it omits (omitempty), so a desired object holding them would differ from the live one
# on every read (a false drift, patched and reported at each event)
ENV_KEYS = ("name", "value", "valueFrom")
TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")


def _as_stored(spec: _Reader, key: str, keys: tuple[str, ...],
               required_key: str | None = None) -> list[dict]:
    items = spec.objects(key, required_key=required_key)
    for i, item in enumerate(items):
        if required_key is not None and not isinstance(item[required_key], str):
            raise SpecError(f"{spec.path}.{key}[{i}].{required_key}", "must be a string")
    return [{k: item[k] for k in keys if k in item and item[k] != ""} for item in items]


def _check_range(path: str, value: float, *, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and value < minimum:
        raise SpecError(path, f"{value} is below the minimum {minimum}")
    if maximum is not None and value > maximum:
        raise SpecError(path, f"{value} is above the maximum {maximum}")
