"""The HTTP server: OpenAI and Workers AI APIs over the async engine, health and metrics."""

from infire.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
