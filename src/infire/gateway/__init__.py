"""The AI gateway: one endpoint in front of many AI providers (issue 5).

`infire gateway --config gateway.toml` serves create_app(load_config(path)), the app of a
GatewayApp: per-provider pass-through, the unified `compat/chat/completions` route and the
universal route of steps with retries, timeouts, fallbacks and a circuit breaker
(upstream.py), every request logged to SQLite with its usage and cost (store.py). Header
names follow Cloudflare AI Gateway's (`cf-aig-*`), so its clients work unchanged. Nothing
here imports the engine: the gateway installs alone as infire-gateway (gateway-dist/).
"""

from infire.gateway.app import GatewayApp, create_app
from infire.gateway.config import GatewayConfig, load_config

__all__ = ["GatewayApp", "GatewayConfig", "create_app", "load_config"]
