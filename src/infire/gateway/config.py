"""gateway.toml: providers, gateways, tokens, prices and the store, checked on load.
docs/gateway.md has every key; in short:

[store]
path = "gateway.db"            # SQLite (log, cache, counters), relative to this file
redis_url = "redis://..."      # optional: cache and rate-limit counters in Redis instead

[gateways.prod]                # the {gateway} of every route; at least one
request_timeout_ms = 30000     # to the first byte of the upstream answer
max_attempts = 2               # retries: 1-5 attempts per step
retry_delay_ms = 200
backoff = "exponential"        # constant | linear | exponential
cache_ttl_s = 0                # cache answers this long by default (0: only when asked)
authentication = true          # requests need a gateway token
limits = [{ kind = "requests", limit = 600, window_s = 60, technique = "fixed" }]

[providers.openai]             # the {provider} of the routes
kind = "openai"                # openai (any OpenAI-compatible API) | workers-ai | infire
base_url = "https://api.openai.com/v1"
api_key_env = "OPENAI_API_KEY" # the key is read from the environment, never logged

[tokens.team-a]                # a gateway token, known by its SHA-256 only
sha256 = "..."
limits = [{ kind = "tokens", limit = 100000, window_s = 3600, technique = "sliding" }]

[prices."openai/gpt-4o-mini"]  # USD per million tokens
input = 0.15
output = 0.60

[circuit_breaker]
failures = 5                   # consecutive failed attempts that open it
cooldown_s = 30

[server]
max_body_bytes = 4194304
admin_sha256 = "..."           # the admin token's SHA-256: logs, analytics, metrics, dashboard
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infire.errors import InfireError
from infire.gateway.limits import KINDS as LIMIT_KINDS
from infire.gateway.limits import TECHNIQUES, Limit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover (3.10)
    import tomli as tomllib

KINDS = ("openai", "workers-ai", "infire")
BACKOFFS = ("constant", "linear", "exponential")
MAX_ATTEMPTS = 5
RESERVED = ("compat", "analytics", "logs")  # path words the routes use after {gateway}
RESERVED_GATEWAYS = ("dashboard", "metrics", "health")  # the gateway's own routes
_SECTIONS = ("circuit_breaker", "gateways", "prices", "providers", "server", "store", "tokens")


class ConfigError(InfireError):
    """A gateway.toml that cannot be used, with the file and the key named."""


@dataclass(frozen=True, slots=True)
class Provider:
    """An upstream API: where it is and how to authenticate to it."""

    name: str
    kind: str
    base_url: str  # without a trailing slash
    api_key_env: str | None = None

    def api_key(self) -> str | None:
        """The key from the environment (None when unset)."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def auth_headers(self) -> dict[str, str]:
        key = self.api_key()
        return {"authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True, slots=True)
class Retry:
    """Attempts per step and the wait between them."""

    max_attempts: int = 1
    retry_delay_ms: int = 0
    backoff: str = "constant"

    def delay_s(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1 = the second attempt)."""
        factor = {"constant": 1, "linear": retry, "exponential": 2 ** (retry - 1)}[self.backoff]
        return self.retry_delay_ms * factor / 1000


@dataclass(frozen=True, slots=True)
class Gateway:
    """Per-gateway defaults; request headers override them."""

    name: str
    request_timeout_ms: int = 60_000
    retry: Retry = field(default_factory=Retry)
    cache_ttl_s: int = 0  # 0: answers are cached only when a request asks (cf-aig-cache-ttl)
    authentication: bool = False  # every request needs a gateway token
    limits: tuple[Limit, ...] = ()  # on all of this gateway's traffic


@dataclass(frozen=True, slots=True)
class Token:
    """A gateway token (known by its SHA-256 only) and its own limits."""

    name: str
    sha256: str
    gateways: tuple[str, ...] = ()  # empty: every gateway
    limits: tuple[Limit, ...] = ()


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million input and output tokens."""

    input: float
    output: float


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything `infire gateway` needs."""

    providers: dict[str, Provider]
    gateways: dict[str, Gateway]
    store: Path
    prices: dict[str, Price] = field(default_factory=dict)  # "provider/model"
    max_body_bytes: int = 4 * 1024**2
    breaker_failures: int = 5
    breaker_cooldown_s: float = 30.0
    redis_url: str | None = None  # cache and rate-limit counters there; None: the SQLite store
    tokens: dict[str, Token] = field(default_factory=dict)  # by SHA-256
    admin_sha256: str | None = None  # the read routes need this token; None: they are open


def load_config(path: Path) -> GatewayConfig:
    """Read and check a gateway.toml; ConfigError naming the file and key when wrong."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return parse_config(raw, path)


def parse_config(raw: dict[str, Any], path: Path) -> GatewayConfig:
    """A GatewayConfig from parsed TOML (path: where relative paths start, and for errors)."""
    check = _Checks(path)
    for key in raw:
        if key not in _SECTIONS:
            raise check.fail(key, f"unknown section (expected one of {', '.join(_SECTIONS)})")
    providers = _providers(check, check.table("providers", raw.get("providers", {})))
    gateways = _gateways(check, check.table("gateways", raw.get("gateways", {})))
    prices = _prices(check, check.table("prices", raw.get("prices", {})))
    store = check.table("store", raw.get("store", {}))
    store_path = Path(store.get("path", "gateway.db"))
    if not store_path.is_absolute():
        store_path = path.parent / store_path
    breaker = check.table("circuit_breaker", raw.get("circuit_breaker", {}))
    server = check.table("server", raw.get("server", {}))
    redis_url = store.get("redis_url")
    if redis_url is not None and (not isinstance(redis_url, str) or not redis_url.startswith(
            ("redis://", "rediss://", "unix://"))):  # fmt: skip
        raise check.fail("store.redis_url", "must be a redis:// URL (leave it out for SQLite only)")
    tokens = _tokens(check, check.table("tokens", raw.get("tokens", {})), gateways)
    admin = _admin_sha256(check, server, gateways)
    return GatewayConfig(
        providers, gateways, store_path, prices,
        int(check.number("server.max_body_bytes", server.get("max_body_bytes", 4 * 1024**2), 1)),
        int(check.number("circuit_breaker.failures", breaker.get("failures", 5), 1)),
        float(check.number("circuit_breaker.cooldown_s", breaker.get("cooldown_s", 30.0), 0)),
        redis_url, tokens, admin,
    )  # fmt: skip


class _Checks:
    """The checks of one file's values; each error names the file and the key."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: {key}: {problem}")

    def table(self, key: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key, "must be a table")
        return value

    def known(self, key: str, spec: dict[str, Any], keys: set[str]) -> None:
        unknown = set(spec) - keys
        if unknown:
            raise self.fail(key, f"unknown keys {sorted(unknown)}")

    def number(self, key: str, value: Any, low: float, high: float | None = None) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"must be a number, not {value!r}")
        if value < low or (high is not None and value > high):
            raise self.fail(key, f"{value} is out of range ({low} to {high or 'any'})")
        return value

    def digest(self, key: str, value: Any) -> str:
        if not isinstance(value, str) or len(value) != 64 or not all(
                c in "0123456789abcdef" for c in value.lower()):  # fmt: skip
            raise self.fail(key, "must be the token's SHA-256 in hex (64 characters): "
                            'printf %s "$TOKEN" | sha256sum')  # fmt: skip
        return value.lower()

    def limits(self, key: str, value: Any) -> tuple[Limit, ...]:
        if not isinstance(value, list):
            raise self.fail(key, "must be a list of {kind, limit, window_s, technique}")
        return tuple(self.limit(f"{key}[{i}]", spec) for i, spec in enumerate(value))

    def limit(self, key: str, spec: Any) -> Limit:
        spec = self.table(key, spec)
        kind, technique = spec.get("kind"), spec.get("technique", "fixed")
        if kind not in LIMIT_KINDS:
            raise self.fail(f"{key}.kind", f"{kind!r} is not one of {', '.join(LIMIT_KINDS)}")
        if technique not in TECHNIQUES:
            raise self.fail(f"{key}.technique",
                            f"{technique!r} is not one of {', '.join(TECHNIQUES)}")  # fmt: skip
        self.known(key, spec, {"kind", "limit", "window_s", "technique"})
        return Limit(kind, int(self.number(f"{key}.limit", spec.get("limit"), 1)),
                     float(self.number(f"{key}.window_s", spec.get("window_s"), 0.001)),
                     technique)  # fmt: skip


def _providers(check: _Checks, section: dict[str, Any]) -> dict[str, Provider]:
    providers = {}
    for name, spec in section.items():
        key = f"providers.{name}"
        spec = check.table(key, spec)
        if name in RESERVED:
            raise check.fail(key, f"{name!r} is reserved for a route")
        kind = spec.get("kind")
        if kind not in KINDS:
            raise check.fail(f"{key}.kind", f"{kind!r} is not one of {', '.join(KINDS)}")
        base = spec.get("base_url")
        if not isinstance(base, str) or not base.startswith(("http://", "https://")):
            raise check.fail(f"{key}.base_url", "must be an http:// or https:// URL")
        env = spec.get("api_key_env")
        if env is not None and not isinstance(env, str):
            raise check.fail(f"{key}.api_key_env", "must be the name of an environment variable")
        check.known(key, spec, {"kind", "base_url", "api_key_env"})
        providers[name] = Provider(name, kind, base.rstrip("/"), env)
    if not providers:
        raise check.fail("providers", "at least one provider is needed")
    return providers


def _gateways(check: _Checks, section: dict[str, Any]) -> dict[str, Gateway]:
    gateways = {name: _gateway(check, name, spec) for name, spec in section.items()}
    if not gateways:
        raise check.fail("gateways", "at least one gateway is needed, e.g. [gateways.default]")
    return gateways


def _gateway(check: _Checks, name: str, spec: Any) -> Gateway:
    key = f"gateways.{name}"
    spec = check.table(key, spec)
    if name in RESERVED_GATEWAYS:
        raise check.fail(key, f"{name!r} is reserved for a route")
    check.known(key, spec, {"request_timeout_ms", "max_attempts", "retry_delay_ms", "backoff",
                            "cache_ttl_s", "authentication", "limits"})  # fmt: skip
    backoff = spec.get("backoff", "constant")
    if backoff not in BACKOFFS:
        raise check.fail(f"{key}.backoff", f"{backoff!r} is not one of {', '.join(BACKOFFS)}")
    retry = Retry(
        int(check.number(f"{key}.max_attempts", spec.get("max_attempts", 1), 1, MAX_ATTEMPTS)),
        int(check.number(f"{key}.retry_delay_ms", spec.get("retry_delay_ms", 0), 0)),
        backoff,
    )
    timeout = int(
        check.number(f"{key}.request_timeout_ms", spec.get("request_timeout_ms", 60_000), 1)
    )
    ttl = int(check.number(f"{key}.cache_ttl_s", spec.get("cache_ttl_s", 0), 0))
    authentication = spec.get("authentication", False)
    if not isinstance(authentication, bool):
        raise check.fail(f"{key}.authentication", "must be true or false")
    return Gateway(name, timeout, retry, ttl, authentication,
                   check.limits(f"{key}.limits", spec.get("limits", [])))  # fmt: skip


def _prices(check: _Checks, section: dict[str, Any]) -> dict[str, Price]:
    prices = {}
    for name, spec in section.items():
        key = f"prices.{name}"
        spec = check.table(key, spec)
        if "/" not in name:
            raise check.fail(key, "name it provider/model")
        prices[name] = Price(float(check.number(f"{key}.input", spec.get("input", 0), 0)),
                             float(check.number(f"{key}.output", spec.get("output", 0), 0)))  # fmt: skip
    return prices


def _tokens(check: _Checks, section: dict[str, Any],
            gateways: dict[str, Gateway]) -> dict[str, Token]:  # fmt: skip
    """The gateway tokens, by SHA-256."""
    tokens = {}
    for name, spec in section.items():
        key = f"tokens.{name}"
        spec = check.table(key, spec)
        sha256 = check.digest(f"{key}.sha256", spec.get("sha256"))
        allowed = spec.get("gateways", [])
        if not isinstance(allowed, list) or any(g not in gateways for g in allowed):
            raise check.fail(f"{key}.gateways",
                             f"must list configured gateways ({', '.join(gateways)})")  # fmt: skip
        check.known(key, spec, {"sha256", "gateways", "limits"})
        tokens[sha256] = Token(name, sha256, tuple(allowed),
                               check.limits(f"{key}.limits", spec.get("limits", [])))  # fmt: skip
    return tokens


def _admin_sha256(check: _Checks, server: dict[str, Any],
                  gateways: dict[str, Gateway]) -> str | None:  # fmt: skip
    """[server] admin_sha256, required when a gateway has authentication."""
    check.known("server", server, {"max_body_bytes", "admin_sha256"})
    admin = server.get("admin_sha256")
    if admin is not None:
        admin = check.digest("server.admin_sha256", admin)
    for name, gateway in gateways.items():
        if gateway.authentication and admin is None:
            raise check.fail(f"gateways.{name}.authentication",
                             "a gateway with authentication needs [server] admin_sha256, so "
                             "that its logs and analytics are not open to anyone")  # fmt: skip
    return admin
