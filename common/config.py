"""The engine-config schema: the JSON the operator renders into a ConfigMap and
the worker and gateway read (DESIGN.md, Command line).

One place, small self-checking dataclasses, no globals. ``ServingConfig.to_dict``
and ``ServingConfig.from_dict`` round-trip exactly; unknown keys are refused so
a typo in a ConfigMap is an error, not a silently ignored setting.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvserving.argtypes import read_json_file

KV_DTYPES = ("bf16", "fp8_e4m3", "nvfp4", "triaxial")
ROLES = ("prefill", "decode", "both")
LOAD_FORMATS = ("auto", "dummy")
# "auto": what the checkpoint stores (config.json's quantization_config; unquantized without one);
# "bf16": the model dtype; "fp8": E4M3 with a scale per tensor; "fp8_block": per 128x128 tile.
WEIGHT_FORMATS = ("auto", "bf16", "fp8", "fp8_block")
GLOBAL_SCALE_MODES = ("static", "calibrated")
# Default page size per KV dtype (DESIGN.md, Worker): triaxial pages are 32
# tokens because INT2 keys are quantized per channel over a page.
DEFAULT_PAGE_SIZE = {"bf16": 16, "fp8_e4m3": 16, "nvfp4": 16, "triaxial": 32}
TRIAXIAL_PAGE_SIZE = 32
# A worker's generate stream carries an event or an SSE comment (": keep-alive") at least this
# often once its response has started (docs/worker-api.md): a longer silence means the worker
# is frozen, not busy (``gateway.event_timeout_s``).
STREAM_KEEPALIVE_S = 1.0
# A worker's HTTP server closes a connection idle this long; every client of the workers (the gateway, a worker
# pulling from another) drops its own idle connections sooner: a request sent on a connection the server is
# closing at that moment fails (aiohttp: ServerDisconnectedError), which a pull counts as an unreachable peer.
WORKER_KEEP_ALIVE_S = 5
WORKER_CLIENT_IDLE_S = WORKER_KEEP_ALIVE_S - 1


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Which model a worker serves. ``path`` is a local directory (nothing downloads)."""

    path: str = ""
    served_name: str = "kvserving-tiny"
    max_model_len: int | None = None
    # "auto": the directory's safetensors weights; "dummy": seeded random weights
    # built on the device from config.json alone (real-shape benchmarks; nothing read).
    load_format: str = "auto"
    seed: int = 0  # of the dummy weights: every process of a deployment draws the same
    # Weights as stored by default; an FP8 format here quantizes a bf16 checkpoint or the dummy
    # weights at load, and must match an FP8 checkpoint's own.
    weight_format: str = "auto"

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"model.weight_format must be one of {list(WEIGHT_FORMATS)}, got {self.weight_format!r}")
        if not self.served_name:
            raise ValueError("model.served_name must not be empty")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"model.load_format must be one of {list(LOAD_FORMATS)}, got {self.load_format!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            raise ValueError(f"model.seed must be an integer in 0..2^63-1, got {self.seed!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"model.max_model_len must be >= 1, got {self.max_model_len}")


BIT_BUDGET_CONTROLS = ("fixed", "hold")
# Where a page's bytes lie in KV memory: "page_major" (the default), one buffer whose pages hold every layer's
# bytes together (a KV transfer moves one NIXL region per run of pages), or "layer_major", one buffer per layer (a
# page's layers far apart: one region per run of pages per layer; a pull of scattered pages at load is thousands).
# Workers with different layouts never share pages.
KV_LAYOUTS = ("layer_major", "page_major")


@dataclass(slots=True, frozen=True)
class KVCacheConfig:
    """KV cache format and size. ``page_size`` None means the dtype's default."""

    dtype: str = "bf16"
    page_size: int | None = None
    bit_budget: float | None = None
    memory_fraction: float = 0.9
    memory_bytes: int | None = None  # explicit pool budget; overrides memory_fraction
    global_scale: str = "static"
    allow_emulation: bool = False
    # A `kvserving calibrate` file (kvserving.calibration): the triaxial bits table for
    # bit_budget and the fp8/nvfp4 global scales; None = the default table, scales 1 or measured at start.
    calibration: str | None = None
    # Triaxial: re-store a cached 4-bit page at 2 bits when a later request's tags want 2
    # (kv_manager age-down; docs/kv-cache.md). Ignored by the one-precision formats.
    age_down: bool = True
    # Triaxial: "hold" (the default) moves the table's cut so the pages held average bit_budget
    # (worker/bit_budget.py); "fixed" stores what the bits table for bit_budget gives on any traffic.
    # Ignored by the one-precision formats.
    bit_budget_control: str = "hold"
    layout: str = "page_major"  # KV_LAYOUTS

    def __post_init__(self) -> None:
        if self.layout not in KV_LAYOUTS:
            raise ValueError(f"kv_cache.layout must be one of {KV_LAYOUTS}, got {self.layout!r}")
        if not isinstance(self.age_down, bool):
            raise ValueError(f"kv_cache.age_down must be true or false, got {self.age_down!r}")
        if self.bit_budget_control not in BIT_BUDGET_CONTROLS:
            raise ValueError(f"kv_cache.bit_budget_control must be one of {BIT_BUDGET_CONTROLS}, got {self.bit_budget_control!r}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache.dtype must be one of {KV_DTYPES}, got {self.dtype!r}")
        if self.page_size is not None:
            if not _is_power_of_two(self.page_size):
                raise ValueError(f"kv_cache.page_size must be a power of two, got {self.page_size}")
            if self.dtype == "triaxial" and self.page_size != TRIAXIAL_PAGE_SIZE:
                raise ValueError(f"kv_cache.page_size must be {TRIAXIAL_PAGE_SIZE} for triaxial, got {self.page_size}")
        if self.bit_budget is not None:
            if self.dtype != "triaxial":
                raise ValueError("kv_cache.bit_budget is only valid with dtype 'triaxial'")
            if not 2.0 <= self.bit_budget <= 4.0:
                raise ValueError(f"kv_cache.bit_budget must be in [2, 4], got {self.bit_budget}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"kv_cache.memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ValueError(f"kv_cache.memory_bytes must be >= 1, got {self.memory_bytes}")
        if self.global_scale not in GLOBAL_SCALE_MODES:
            raise ValueError(f"kv_cache.global_scale must be one of {GLOBAL_SCALE_MODES}, got {self.global_scale!r}")
        if self.global_scale == "calibrated" and self.dtype not in ("fp8_e4m3", "nvfp4"):
            raise ValueError("kv_cache.global_scale 'calibrated' needs dtype fp8_e4m3 or nvfp4 (the formats with a global scale)")
        if self.calibration is not None and (not isinstance(self.calibration, str) or not self.calibration):
            raise ValueError(f"kv_cache.calibration must be a non-empty file path, got {self.calibration!r}")

    @property
    def effective_page_size(self) -> int:
        return self.page_size if self.page_size is not None else DEFAULT_PAGE_SIZE[self.dtype]

    @property
    def effective_bit_budget(self) -> float | None:
        if self.dtype != "triaxial":
            return None
        return self.bit_budget if self.bit_budget is not None else 2.7


@dataclass(slots=True, frozen=True)
class ReuseConfig:
    """Bidirectional KV reuse (DESIGN.md, Worker: kv_transfer_params).

    The gateway's lease must expire before the worker's retention, so
    ``lease_ttl_s`` < ``retention_ttl_s`` (the margin covers clock skew and a
    request in flight when the lease is checked).
    """

    bidirectional: bool = True
    retention_ttl_s: float = 480.0
    lease_ttl_s: float = 420.0
    recompute_threshold_tokens: int | str = 64  # tokens, or "auto": pull when measured faster than prefill
    # How long a prefill worker holds a prompt's pages for the decode worker to
    # READ, and the deadline of every NIXL READ (a frozen peer reports nothing).
    transfer_timeout_s: float = 10.0
    # The deadline of each phase (connect, each read, write) of a worker's HTTP
    # call to a peer (the agent fetch, the hold before a READ): a frozen lease
    # holder costs a pull this long, then a counted recompute
    # (``remote_unreachable``). A busy peer answers a hold after its engine
    # step: p50 30 ms, p99 0.7 s on a loaded 2-core CPU machine with four
    # 1.5-4K-token conversations in flight (docs/security.md). The hold's answer
    # is waited for longer once a prefill is measured, as long as recomputing
    # the offered tokens is predicted to take (``Puller.hold_wait_s``).
    peer_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"reuse.transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if self.peer_timeout_s <= 0:
            raise ValueError(f"reuse.peer_timeout_s must be > 0, got {self.peer_timeout_s}")
        if self.retention_ttl_s <= 0:
            raise ValueError(f"reuse.retention_ttl_s must be > 0, got {self.retention_ttl_s}")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"reuse.lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.lease_ttl_s >= self.retention_ttl_s:
            raise ValueError(f"reuse.lease_ttl_s ({self.lease_ttl_s}) must be < reuse.retention_ttl_s ({self.retention_ttl_s})")
        t = self.recompute_threshold_tokens
        if t != "auto" and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise ValueError(f'reuse.recompute_threshold_tokens must be an integer >= 0 or "auto", got {t!r}')


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """Continuous batching limits. ``chunk_size`` caps prompt tokens per sequence per step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunk_size: int = 512

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"scheduler.{name} must be >= 1, got {value}")


@dataclass(slots=True, frozen=True)
class GatewayConfig:
    """Where the gateway finds workers: a static list (local) or headless Services (cluster)."""

    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    prefill_service: str | None = None
    decode_service: str | None = None
    worker_port: int = 8000
    # Bearer keys; empty = no authentication (/health, /ready, /metrics are always open).
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 1024 * 1024
    health_interval_s: float = 2.0  # worker /ready polling period
    dns_refresh_s: float = 10.0  # headless Services re-resolved this often
    request_timeout_s: float = 600.0  # one upstream request, end to end
    connect_timeout_s: float = 2.0
    # Deadlines of one worker request (docs/gateway-errors.md): its response headers, which a
    # worker sends when it admits the request (before its KV pull), and the longest gap between
    # two of its stream's events, keep-alive comments included.
    first_byte_timeout_s: float = 20.0
    event_timeout_s: float = 15.0
    # On SIGTERM: how long streams in flight may still run before each ends with an error event.
    drain_grace_s: float = 20.0  # with the 5 s for the last bytes, within Kubernetes' default 30 s
    lease_heartbeat_s: float = 30.0  # renew active conversations' leases this often
    max_leases: int = 100_000  # lease-table entries; the least recently active is released beyond it
    max_inflight_per_worker: int = 256  # a lease holder busier than this is "overloaded"
    # What the gateway keeps between turns (its memory): conversation records (gateway/conversations.py),
    # least recently used forgotten first; each is charged the longest of its held ids, its kept
    # prompt prefix and its kept render (4 characters a token), ~60-80 bytes a token in all forms.
    max_conversations: int = 10_000
    max_kept_tokens: int = 4_000_000

    def __post_init__(self) -> None:
        if not 1 <= self.worker_port <= 65535:
            raise ValueError(f"gateway.worker_port must be in 1..65535, got {self.worker_port}")
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ValueError("gateway.api_keys must be non-empty strings")
        for name in ("max_body_bytes", "max_leases", "max_inflight_per_worker", "max_conversations", "max_kept_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"gateway.{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "health_interval_s",
            "dns_refresh_s",
            "request_timeout_s",
            "connect_timeout_s",
            "lease_heartbeat_s",
            "first_byte_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"gateway.{name} must be > 0, got {getattr(self, name)}")
        if not self.event_timeout_s >= 2 * STREAM_KEEPALIVE_S:
            raise ValueError(
                f"gateway.event_timeout_s must be >= {2 * STREAM_KEEPALIVE_S:g} (workers send a keep-alive "
                f"every {STREAM_KEEPALIVE_S:g} s), got {self.event_timeout_s}"
            )
        if not self.drain_grace_s >= 0:
            raise ValueError(f"gateway.drain_grace_s must be >= 0, got {self.drain_grace_s}")


@dataclass(slots=True, frozen=True)
class SecurityConfig:
    """Who may touch the KV (DESIGN.md, Security).

    Credentials are read from files (Secrets mounted as files, never in this
    config or a ConfigMap): the config names only where they are.
    """

    # The deployment's internal credential: every worker ``/internal/*`` route
    # requires it as a Bearer token; the gateway and peer workers send it.
    internal_token_file: str | None = None
    # Gateway API keys, one per line (a mounted Secret); added to ``gateway.api_keys``.
    api_keys_file: str | None = None
    # Reuse (prefix-cache hits, leases, identity) never crosses tenants unless set.
    tenants_share_cache: bool = False
    # Longest pin a peer may put on a lease's pages for one READ.
    max_hold_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("internal_token_file", "api_keys_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"security.{name} must be a non-empty path or null, got {value!r}")
        if not isinstance(self.tenants_share_cache, bool):
            raise ValueError(f"security.tenants_share_cache must be true or false, got {self.tenants_share_cache!r}")
        if not self.max_hold_s > 0:
            raise ValueError(f"security.max_hold_s must be > 0, got {self.max_hold_s}")

    def read_internal_token(self) -> str | None:
        """The internal credential (the file's text, whitespace stripped); None when no file is
        named. ValueError, one line, when the file cannot be read or holds nothing."""
        if self.internal_token_file is None:
            return None
        try:
            token = Path(self.internal_token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"security.internal_token_file {self.internal_token_file}: cannot read it "
                f"({getattr(exc, 'strerror', None) or type(exc).__name__})"
            ) from None
        if not token:
            raise ValueError(f"security.internal_token_file {self.internal_token_file}: the file is empty")
        return token


@dataclass(slots=True, frozen=True)
class ServingConfig:
    """The whole engine-config file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        # sort_keys: the operator hashes this text to roll pods on a change.
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServingConfig:
        if not isinstance(data, dict):
            raise ValueError(f"engine config must be a JSON object, got {type(data).__name__}")
        sections = {f.name: f for f in fields(cls)}
        unknown = set(data) - set(sections)
        if unknown:
            raise ValueError(f"engine config has unknown sections: {sorted(unknown)}")
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            section_cls = _SECTION_TYPES[name]
            if not isinstance(value, dict):
                raise ValueError(f"engine config section {name!r} must be an object")
            known = {f.name for f in fields(section_cls)}
            bad = set(value) - known
            if bad:
                raise ValueError(f"engine config section {name!r} has unknown keys: {sorted(bad)}")
            for key, item in value.items():
                _check_type(f"{name}.{key}", _FIELD_TYPES[section_cls][key], item)
            value = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
            kwargs[name] = section_cls(**value)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> ServingConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"engine config is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> ServingConfig:
        """The engine config in the JSON file ``path`` (``kvserving config`` writes one); a ValueError names the file."""
        return cls.from_dict(read_json_file(path, "engine config", missing="kvserving config writes one"))


_SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "kv_cache": KVCacheConfig,
    "reuse": ReuseConfig,
    "scheduler": SchedulerConfig,
    "gateway": GatewayConfig,
    "security": SecurityConfig,
}


# What a field's annotation accepts from JSON, and how an error names it. A bool is not a
# number here (JSON true is no count); an integral float is accepted where an int is declared.
_KINDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "tuple[str, ...]": "a list of strings",
    "None": "null",
}
_FIELD_TYPES: dict[type, dict[str, str]] = {cls: {f.name: str(f.type) for f in fields(cls)} for cls in _SECTION_TYPES.values()}


def _accepts(kind: str, value: Any) -> bool:
    if kind == "None":
        return value is None
    if kind == "bool" or isinstance(value, bool):
        return kind == "bool" and isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if kind == "float":
        return isinstance(value, int | float)
    if kind == "str":
        return isinstance(value, str)
    if kind == "tuple[str, ...]":
        return isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
    return True  # an annotation this table does not know: the dataclass checks it


def _check_type(where: str, annotation: str, value: Any) -> None:
    """ValueError naming the key when a JSON value has the wrong type (before the dataclass compares it)."""
    kinds = [k.strip() for k in annotation.split("|")]
    if not any(_accepts(k, value) for k in kinds):
        want = " or ".join(_KINDS.get(k, k) for k in kinds)
        raise ValueError(f"engine config {where} must be {want}, got {json.dumps(value)}")
