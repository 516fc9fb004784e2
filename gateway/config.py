"""The gateway's configuration: one YAML file, validated once at start-up.

Unknown keys and impossible values are errors that name the key (`ConfigError`). Field
names are a contract with users: extend, never rename. Every key, its type and its default
are documented in docs/configuration.md (tests/gateway/test_configuration_doc.py checks it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.core.latency import StepCosts
from gateway.core.reservation import AdaptivePolicy, PredictionPolicy
from gateway.core.routing import DEFAULT_CACHED_BLOCK_WEIGHT, DEFAULT_SCORERS, SCORERS
from gateway.core.types import ServiceClass

TOKENIZER_KINDS = ("tiktoken:", "hf:", "engine", "estimate", "estimate:")

PositiveInt = Annotated[int, Field(gt=0)]


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Milliseconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class StepCostsConfig(_Strict):
    """An engine's step costs in the step model of docs/latency.md, in milliseconds: what
    predictions start from until the engine's own figures calibrate them."""

    base_ms: Milliseconds = 10.0  # per engine step
    per_seq_ms: Milliseconds = 0.5  # per sequence scheduled in a step
    per_prefill_token_ms: Milliseconds = 0.05  # per prompt token computed
    # vLLM's max_num_batched_tokens: the tokens one step computes at most (its online
    # server's default on most GPUs; 8192 on large ones).
    chunk_tokens: PositiveInt = 2048
    overhead_ms: Milliseconds = 5.0  # per request, outside the steps (API server, network)

    def costs(self) -> StepCosts:
        """These costs as the core's `StepCosts` (seconds)."""
        return StepCosts(
            base_s=self.base_ms / 1000,
            per_seq_s=self.per_seq_ms / 1000,
            per_prefill_token_s=self.per_prefill_token_ms / 1000,
            chunk_tokens=self.chunk_tokens,
            overhead_s=self.overhead_ms / 1000,
        )


class EngineStepCostsConfig(_Strict):
    """One engine's step costs where they differ from `slo.step_costs` (null: its value)."""

    base_ms: Milliseconds | None = None
    per_seq_ms: Milliseconds | None = None
    per_prefill_token_ms: Milliseconds | None = None
    chunk_tokens: PositiveInt | None = None
    overhead_ms: Milliseconds | None = None

    def over(self, base: StepCostsConfig) -> StepCostsConfig:
        """`base` with the costs set here in its place."""
        mine = {k: v for k, v in self.model_dump().items() if v is not None}
        return base.model_copy(update=mine)


class EngineConfig(_Strict):
    """One vLLM engine. Numbers left out are discovered from the engine at start-up."""

    url: str
    name: str | None = None
    models: list[str] | None = None
    num_gpu_blocks: PositiveInt | None = None
    block_size: PositiveInt | None = None
    max_num_seqs: PositiveInt | None = None
    max_model_len: PositiveInt | None = None
    # For vLLM's default max_num_seqs when it is not configured: gpu (256), gpu-large
    # (≥ 70 GiB, not A100: 1024), cpu or cpu:<world size> (128 × world size).
    platform: str = "gpu"
    # The engine's own flags that change what a chat prompt holds, which the gateway cannot
    # read from it: `--exclude-tools-when-tool-choice-none` (tools are not rendered for
    # tool_choice "none") and `--trust-request-chat-template` (a request's own chat_template
    # is taken; else the engine refuses it, and so does the gateway, before reserving).
    exclude_tools_when_tool_choice_none: bool = False
    trust_request_chat_template: bool = False
    # The engine's KV-cache event publisher (vLLM's `--kv-events-config` with the zmq
    # publisher), e.g. tcp://10.0.0.5:5557: its events feed the prefix index (exact mode).
    kv_events: str | None = None
    # Whether the engine shares cached prompt blocks between requests (vLLM's
    # --enable-prefix-caching, on by default; --no-enable-prefix-caching turns it off). Null:
    # read from the engine's /metrics (`vllm:cache_config_info`), and counted as off while
    # unknown. A request is credited with prompt blocks other requests hold on an engine,
    # and routed by what the engine caches, only where this is true.
    prefix_caching: bool | None = None
    # Its step costs where they differ from slo.step_costs (another GPU, another model).
    step_costs: EngineStepCostsConfig | None = None

    @field_validator("platform")
    @classmethod
    def _platform(cls, platform: str) -> str:
        kind, _, size = platform.partition(":")
        if platform in ("gpu", "gpu-large", "cpu") or (kind == "cpu" and size.isdigit()):
            return platform
        raise ValueError("must be gpu, gpu-large, cpu or cpu:<world size>")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"must be an http(s) URL like http://127.0.0.1:8001, got {url!r}")
        return url.rstrip("/")

    @field_validator("kv_events")
    @classmethod
    def _zmq_endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        scheme, _, rest = endpoint.partition("://")
        host, _, port = rest.rpartition(":")
        if scheme == "ipc" and rest:
            return endpoint
        if scheme == "tcp" and host and host != "*" and port.isdigit():
            return endpoint
        raise ValueError(
            f"must be the engine's publisher to connect to, like tcp://10.0.0.5:5557, "
            f"got {endpoint!r}"
        )

    @property
    def display_name(self) -> str:
        return self.name or urlsplit(self.url).netloc


class FetchConfig(_Strict):
    """Fetching remote images to read their size (off by default: a gateway that fetches
    client URLs is a client of whatever they name). Without it, a remote image counts at its
    worst case."""

    enabled: bool = False
    max_bytes: PositiveInt = 20 * 1024 * 1024
    timeout_s: float = Field(default=5.0, gt=0)


class WorstCaseConfig(_Strict):
    """Tokens one media item of each kind is counted at when the gateway cannot read its
    size. null: refused (400) — never counted as 0. `image` defaults to the family's largest
    image."""

    image: PositiveInt | None = None
    video: PositiveInt | None = None
    audio: PositiveInt | None = None


class MediaConfig(_Strict):
    """How a vision (or audio) model's media parts are counted (docs/tokens.md, "Media")."""

    # The processor rule: qwen2_vl, qwen2_5_vl, qwen3_vl (resized within min/max pixels,
    # 2x2-merged patches), llava (576 per image), fixed (image_tokens per image). null: no
    # rule; images count at worst_case.image.
    family: Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "fixed"] | None = None
    # The model's preprocessor_config.json values when they differ from the family's.
    min_pixels: PositiveInt | None = None
    max_pixels: PositiveInt | None = None
    image_tokens: PositiveInt | None = None  # `fixed` (and `llava`): tokens per image
    worst_case: WorstCaseConfig = WorstCaseConfig()
    max_image_bytes: PositiveInt = 20 * 1024 * 1024
    max_image_pixels: PositiveInt = 178_956_970  # vLLM's VLLM_MAX_IMAGE_PIXELS
    fetch: FetchConfig = FetchConfig()
    # The `engine` counter: the engine's /tokenize counts media (vLLM 0.32 does). false: the
    # gateway adds its own media count to the engine's.
    engine_counts_media: bool = True

    @model_validator(mode="after")
    def _fixed_needs_tokens(self) -> MediaConfig:
        if self.family == "fixed" and self.image_tokens is None:
            raise ValueError("family 'fixed' needs image_tokens")
        return self


class ModelConfig(_Strict):
    """A model the gateway serves and how to count its tokens."""

    name: str
    tokenizer: str = "engine"
    # The engines' `--default-chat-template-kwargs` for this model (e.g. enable_thinking:
    # false): the `hf:` counter renders with them under each request's own kwargs.
    default_chat_template_kwargs: dict[str, Any] | None = None
    # Whether the model keeps a KV cache for its prompts (decoder models, embeddings from
    # them included). false (encoder-only poolers): embeddings/score/rerank requests take
    # sequence slots but no KV blocks.
    uses_kv_cache: bool = True
    media: MediaConfig | None = None

    @field_validator("tokenizer")
    @classmethod
    def _known_kind(cls, spec: str) -> str:
        if not any(spec == k or (k.endswith(":") and spec.startswith(k)) for k in TOKENIZER_KINDS):
            raise ValueError(
                f"unknown tokenizer {spec!r}; use tiktoken:<encoding>, hf:<dir>, engine or estimate"
            )
        return spec


class QueueConfig(_Strict):
    max_length: int = Field(default=256, ge=0)
    max_wait_s: float = Field(default=30.0, gt=0)
    # Fair queuing's burst credit, in KV blocks: a tenant that has used less than its share
    # may start up to this many blocks (÷ weight) ahead of the line; 0 = plain fair queuing.
    fair_burst_blocks: float = Field(default=256.0, ge=0)


class PredictionConfig(_Strict):
    """The `predicted` reservation's estimate: a quantile of recent output lengths."""

    # Output tokens per sequence reserved: this quantile of the model's recent outputs.
    quantile: float = Field(default=0.9, gt=0, le=1)
    # How many completed requests (per model) the quantile is taken over.
    window: int = Field(default=1000, ge=1)
    # Worst-case reservations until this many requests of the model have completed.
    min_samples: int = Field(default=50, ge=1)

    @model_validator(mode="after")
    def _valid_policy(self) -> PredictionConfig:
        self.policy()  # the core's own checks (min_samples <= window)
        return self

    def policy(self) -> PredictionPolicy:
        return PredictionPolicy(self.quantile, self.window, self.min_samples)


class AdaptiveConfig(_Strict):
    """The `adaptive` reservation: `prediction.quantile` of recent outputs plus a margin for
    the tail, steered to keep the engines' preemptions per 1,000 completed requests at most
    at the target (gateway/core/reservation.py, `AdaptiveReservation`)."""

    target_preemptions_per_1000: float = Field(default=1.0, gt=0)
    # The margin: how many times the outputs' mean excess over the quantile is added to it.
    start_margin: float = Field(default=6.0, ge=0)
    max_margin: float = Field(default=10.0, ge=0)
    # How far one preemption moves the margin up (a completed request: step × target / 1000
    # down); beyond the margin's range the quantile moves, 0.1 per unit.
    step: float = Field(default=0.1, gt=0)
    # The lowest quantile it may reserve for (below a margin of 0).
    min_quantile: float = Field(default=0.5, gt=0, le=1)
    # Completed requests per model before it steers (a cold start's preemptions not owed).
    warmup_requests: int = Field(default=1000, ge=0)

    @model_validator(mode="after")
    def _valid_policy(self) -> AdaptiveConfig:
        self.policy()  # the core's own checks (start_margin <= max_margin)
        return self

    def policy(self) -> AdaptivePolicy:
        return AdaptivePolicy(
            target_per_1000=self.target_preemptions_per_1000,
            start_margin=self.start_margin,
            max_margin=self.max_margin,
            step=self.step,
            min_quantile=self.min_quantile,
            warmup_requests=self.warmup_requests,
        )


class AdmissionConfig(_Strict):
    kv_ceiling: float = Field(default=0.95, gt=0, le=1)
    # worst_case: prompt + the whole output budget (the engine never preempts);
    # predicted: prompt + min(budget, a quantile of recent outputs) (more concurrency, some
    # preemption risk). See gateway/core/reservation.py.
    # adaptive: predicted plus a margin for the tail, steered by the engines' preemptions.
    reservation: Literal["worst_case", "predicted", "adaptive"] = "worst_case"
    prediction: PredictionConfig = PredictionConfig()
    adaptive: AdaptiveConfig = AdaptiveConfig()
    # A max_tokens longer than the context leaves after the prompt: `clamp` reserves (and
    # vLLM 0.32 generates) what fits; `refuse` answers 400 as most vLLM versions and OpenAI.
    # A max_tokens larger than the whole context is refused either way.
    over_length: Literal["refuse", "clamp"] = "clamp"
    # Sequences per engine admitted beyond max_num_seqs to wait inside the engine (blocks
    # reserved as for any other): a finishing sequence's slot is taken at the engine's next
    # step, as when clients go direct, not after a round trip through the gateway.
    staged_seqs: int = Field(default=2, ge=0)
    # Retry-After when no release has been observed yet to estimate a drain rate from.
    retry_fallback_s: float = Field(default=2.0, gt=0)
    # Window over which the release rate (blocks per second) is measured.
    rate_window_s: float = Field(default=30.0, gt=0)
    # With several tenants active, a tenant above its weighted share of an engine may take
    # more only while this fraction of the engine stays free, so a tenant under its share
    # finds room at once; 0 turns the rule off. A lone tenant is never limited.
    share_headroom: float = Field(default=0.2, ge=0, lt=1)
    # A tenant counts as active while it holds or queues, and this long after (its unused
    # share is kept from tenants above theirs meanwhile: longer protects tenants that send a
    # request every few seconds, shorter hands an idle tenant's share to the others sooner).
    active_window_s: float = Field(default=30.0, gt=0)


class PrefixCacheConfig(_Strict):
    """vLLM's automatic prefix caching in the footprint and the routing (gateway/prefixes.py)."""

    # Credit a footprint with the prompt blocks live leases already hold on the engine.
    credit: bool = True
    # Block hashes this replica remembers having sent to engines (about 150 bytes each,
    # measured in docs/benchmarks.md), for routing to where a prompt is cached; 0: no index.
    index_entries: int = Field(default=1_000_000, ge=0)


class RoutingConfig(_Strict):
    scorers: list[str] = Field(default_factory=lambda: list(DEFAULT_SCORERS))
    # What one block expected in an engine's prefix cache is worth to `most_free_after`, in
    # free blocks (it saves that block's prefill): higher keeps shared prefixes together.
    cached_block_weight: float = Field(default=DEFAULT_CACHED_BLOCK_WEIGHT, ge=0)
    seed: int | None = None

    @field_validator("scorers")
    @classmethod
    def _known_scorers(cls, names: list[str]) -> list[str]:
        unknown = [n for n in names if n not in SCORERS]
        if unknown or not names:
            raise ValueError(f"unknown scorer(s) {unknown}; known: {sorted(SCORERS)}")
        return names


class UpstreamConfig(_Strict):
    connect_timeout_s: float = Field(default=5.0, gt=0)
    # Until the engine answers with headers (non-streaming requests wait for the whole answer).
    first_byte_timeout_s: float = Field(default=600.0, gt=0)
    # Longest silence between two chunks of a streaming answer.
    idle_timeout_s: float = Field(default=120.0, gt=0)
    # Until an engine answers a /tokenize call (the `engine` token counter); then the next
    # engine serving the model is asked.
    tokenize_timeout_s: float = Field(default=30.0, gt=0)
    max_connections: int = Field(default=1000, gt=0)
    # Largest request body accepted, in bytes.
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)


class ClientsConfig(_Strict):
    """What the gateway accepts from its clients (the upstream section's `max_body_bytes`
    bounds a body's size)."""

    # Deepest nesting of a JSON body (`[]` and `{}` count one level each); deeper is a 400.
    max_json_depth: int = Field(default=64, ge=4, le=512)
    # A request's headers must be complete within this of the connection opening (or of the
    # previous answer's end on a kept-alive connection): else 408, or a quiet close when
    # nothing was sent.
    header_timeout_s: float = Field(default=10.0, gt=0)
    # A request's body must be complete within this of its headers: else 408.
    body_timeout_s: float = Field(default=60.0, gt=0)
    # Client connections open at once; one more is answered 503 too_many_connections.
    max_connections: int = Field(default=1000, gt=0)
    # The same from one client address; null = no such cap (behind a load balancer every
    # client has the balancer's address).
    max_connections_per_address: PositiveInt | None = None
    # A request's head (request line and headers, as sent) is read only up to this many
    # bytes: a longer one is answered 431 before more of it is buffered. It bounds what a
    # connection that has not yet shown an API key can make the gateway hold.
    max_head_bytes: int = Field(default=64 * 1024, ge=1024)
    # One header, name and value: longer is a 431.
    max_header_bytes: int = Field(default=16 * 1024, ge=256)
    # Headers in one request: more is a 431.
    max_headers: int = Field(default=100, ge=8)
    # The request target (path and query string): longer is a 414.
    max_url_bytes: int = Field(default=8 * 1024, ge=256)

    @model_validator(mode="after")
    def _parts_fit_the_head(self) -> ClientsConfig:
        for name in ("max_header_bytes", "max_url_bytes"):
            if getattr(self, name) > self.max_head_bytes:
                raise ValueError(f"clients.{name} cannot exceed clients.max_head_bytes")
        return self


DIGEST_PREFIX = "sha256:"


class TenantConfig(_Strict):
    """An API client: its keys (sha256 digests, never plaintext) and its limits."""

    name: str
    api_keys: list[str] = Field(min_length=1)
    max_concurrency: PositiveInt | None = None
    rpm: PositiveInt | None = None
    tpm: PositiveInt | None = None
    kv_share: float | None = Field(default=None, gt=0, le=1)
    priority: int = 0
    weight: float = Field(default=1.0, gt=0)
    max_queued: int | None = Field(default=None, ge=0)
    # Its requests' service class when they name none (null: slo.default_class), and the
    # classes they may name in slo.header (its own always).
    service_class: str | None = None
    service_classes: list[str] = Field(default_factory=list)

    @field_validator("api_keys")
    @classmethod
    def _digests(cls, keys: list[str]) -> list[str]:
        return _digests(keys)


def _digests(keys: list[str]) -> list[str]:
    out = []
    for key in keys:
        digest = key.removeprefix(DIGEST_PREFIX).lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(
                "api_keys are sha256 digests (64 hex digits, optionally 'sha256:'-prefixed); "
                "make one with `kv-gateway hash-key`"
            )
        out.append(digest)
    return out


class AdminConfig(_Strict):
    """Who may read the admin surface: `/admin/*` and `/metrics`.

    With keys, a request there needs `Authorization: Bearer <one of them>`. Without keys the
    surface is open when no tenants are configured (anyone may call the API anyway: the demo,
    a trusted network), and closed (403) when tenants are: their keys say the API is not
    public, and the admin surface names engines, addresses and every tenant's load.
    """

    api_keys: list[str] = Field(default_factory=list)  # sha256 digests, as tenants'

    @field_validator("api_keys")
    @classmethod
    def _digests(cls, keys: list[str]) -> list[str]:
        return _digests(keys)


class RedisConfig(_Strict):
    """Shared state for several gateway replicas. Absent → in-process state."""

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "kvgw"
    lease_ttl_s: float = Field(default=15.0, gt=0)
    # What to do when Redis cannot be reached: refuse with 503 (`fail_closed`, the default:
    # never over-commit an engine) or admit on a conservative local share of each engine
    # (`fail_open_local`: stay up, at the risk of replicas together exceeding the ceiling).
    on_failure: Literal["fail_closed", "fail_open_local"] = "fail_closed"
    local_share: float = Field(default=0.5, gt=0, le=1)
    # A Redis call (connect, or a script's answer) slower than this counts as Redis lost.
    timeout_s: float = Field(default=1.0, gt=0)
    # Bounds the Redis calls of a gateway process: one connection for the change notices,
    # one for the lease renewals, and one pipelined connection for admissions and releases
    # carrying at most `max_connections - 2` calls in flight (more wait their turn, never
    # counted as Redis lost). Waiting requests hold none. Size: calls per second × round
    # trip (2,000 req/s × 2 calls × ~1 ms ≈ 4 in flight), plus room for bursts.
    max_connections: int = Field(default=32, ge=3)


class HealthConfig(_Strict):
    """How engines are watched: `/health` and `/metrics` every `scrape_interval_s`."""

    scrape_interval_s: float = Field(default=1.0, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)
    # Probes in a row that time out before a routed engine is ejected (refused connections
    # and failed /health answers eject at once).
    timeouts_to_eject: int = Field(default=2, ge=1)
    # An ejected engine is probed again after 1, 2, 4 … scrape intervals, at most this long.
    backoff_max_s: float = Field(default=30.0, gt=0)
    # Probe timeouts do not count while the engine's answers keep arriving, for at most this
    # long since it last answered a probe or started a new answer: an engine that only
    # trickles old streams and takes no new work is then treated as any slow engine.
    busy_grace_s: float = Field(default=30.0, ge=0)


Target = Annotated[float, Field(gt=0, allow_inf_nan=False)]
CLASS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
HEADER_NAME = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+")
READ_HEADERS = frozenset(
    {"authorization", "content-length", "content-type", "host", "transfer-encoding", "x-request-id"}
)
"""Headers that already mean something to the gateway or to HTTP: not a class header."""


class ServiceClassConfig(_Strict):
    """A service class's targets, in seconds; none set: best effort."""

    ttft_s: Target | None = None  # arrival at the gateway → first token
    tpot_s: Target | None = None  # (end − first token) / (output tokens − 1)


class SloConfig(_Strict):
    """Service classes (latency targets per tenant, docs/admission.md) and the step costs
    the latency model starts from (docs/latency.md)."""

    classes: dict[str, ServiceClassConfig] = Field(default_factory=dict)
    # The class of tenants that name none (and of everyone when no tenants are configured).
    default_class: str | None = None
    # The request header that names a class (one of the tenant's).
    header: str = "x-kv-gateway-service-class"
    step_costs: StepCostsConfig = StepCostsConfig()
    calibrate: bool = True  # learn each engine's step costs from what it serves

    @field_validator("classes")
    @classmethod
    def _class_names(cls, classes: dict[str, ServiceClassConfig]) -> dict[str, ServiceClassConfig]:
        bad = [name for name in classes if not CLASS_NAME.fullmatch(name)]
        if bad:
            raise ValueError(
                f"a class name is a letter or digit, then up to 63 letters, digits, '_', '.' "
                f"or '-': not {bad}"
            )
        return classes

    @field_validator("header")
    @classmethod
    def _header_name(cls, header: str) -> str:
        name = header.strip().lower()
        if not HEADER_NAME.fullmatch(name):
            raise ValueError(f"must be an HTTP header name, got {header!r}")
        if name in READ_HEADERS:
            raise ValueError(f"{name!r} already means something else; name another header")
        return name

    @model_validator(mode="after")
    def _default_exists(self) -> SloConfig:
        if self.default_class is not None and self.default_class not in self.classes:
            raise ValueError(
                f"slo.default_class {self.default_class!r} is not in slo.classes "
                f"{sorted(self.classes)}"
            )
        return self

    def service_class(self, name: str) -> ServiceClass:
        """The configured class `name` (KeyError if there is none)."""
        targets = self.classes[name]
        return ServiceClass(name, ttft_s=targets.ttft_s, tpot_s=targets.tpot_s)


class GatewayConfig(_Strict):
    engines: list[EngineConfig] = Field(min_length=1)
    models: list[ModelConfig] = Field(default_factory=list)
    queue: QueueConfig = QueueConfig()
    admission: AdmissionConfig = AdmissionConfig()
    routing: RoutingConfig = RoutingConfig()
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    health: HealthConfig = HealthConfig()
    clients: ClientsConfig = ClientsConfig()
    tenants: list[TenantConfig] = Field(default_factory=list)
    admin: AdminConfig = AdminConfig()
    redis: RedisConfig | None = None
    slo: SloConfig = SloConfig()

    @model_validator(mode="after")
    def _unique_names(self) -> GatewayConfig:
        names = [e.display_name for e in self.engines]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"engine names must be unique; repeated: {dupes}")
        models = [m.name for m in self.models]
        dupes = sorted({n for n in models if models.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; repeated: {dupes}")
        tenants = [t.name for t in self.tenants]
        dupes = sorted({n for n in tenants if tenants.count(n) > 1})
        if dupes:
            raise ValueError(f"tenant names must be unique; repeated: {dupes}")
        keys = [k for t in self.tenants for k in t.api_keys]
        if len(keys) != len(set(keys)):
            raise ValueError("an API key digest is listed for more than one tenant")
        if set(keys) & set(self.admin.api_keys):
            raise ValueError("an admin key digest is also a tenant's: give admins their own keys")
        if self.prefix_cache.index_entries == 0 and any(e.kv_events for e in self.engines):
            raise ValueError(
                "engines[].kv_events feeds the prefix index: it needs "
                "prefix_cache.index_entries > 0"
            )
        return self

    @model_validator(mode="after")
    def _known_classes(self) -> GatewayConfig:
        known = self.slo.classes
        for i, t in enumerate(self.tenants):
            named = [("service_class", t.service_class)] if t.service_class is not None else []
            named += [(f"service_classes.{j}", c) for j, c in enumerate(t.service_classes)]
            for key, name in named:
                if name not in known:
                    raise ValueError(
                        f"tenants.{i}.{key}: {name!r} is not in slo.classes {sorted(known)}"
                    )
        return self

    def step_costs_for(self, engine_name: str) -> StepCosts:
        """The step costs `engine_name` starts from: its own `step_costs` over
        `slo.step_costs`, or those alone (an engine not in the file, e.g. from a source)."""
        for e in self.engines:
            if e.display_name == engine_name and e.step_costs is not None:
                return e.step_costs.over(self.slo.step_costs).costs()
        return self.slo.step_costs.costs()

    def tokenizer_for(self, model: str) -> str:
        return self.model_settings(model).tokenizer

    def model_settings(self, model: str) -> ModelConfig:
        """The configured entry of `model`, or the defaults (the `engine` counter)."""
        for m in self.models:
            if m.name == model:
                return m
        return ModelConfig(name=model)


def _describe(error: ValidationError) -> str:
    lines = []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)


def parse_config(data: Any) -> GatewayConfig:
    if not isinstance(data, dict):
        raise ConfigError("the configuration must be a YAML mapping (engines:, models:, ...)")
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid configuration: {_describe(e)}") from None


ENV_REDIS_URL = "KV_GATEWAY_REDIS_URL"


def load_config(path: str | Path) -> GatewayConfig:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path} is not valid YAML: {e}") from None
    cfg = parse_config(data)
    # Secrets may stay out of the file: the Redis URL (with its password) from the environment.
    url = os.environ.get(ENV_REDIS_URL)
    if url:
        redis = cfg.redis or RedisConfig()
        cfg = cfg.model_copy(update={"redis": redis.model_copy(update={"url": url})})
    return cfg
