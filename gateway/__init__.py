"""Idempotency Gateway: a reverse proxy that makes scheduled and retried HTTP jobs
safe to run twice."""

from gateway.assembly import Gateway
from gateway.config import Config, load_config, parse_config
from gateway.errors import ConfigError, GatewayError, ProblemError, StoreError
from gateway.proxy.app import ProxyApp, create_app

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "Gateway",
    "GatewayError",
    "ProblemError",
    "ProxyApp",
    "StoreError",
    "create_app",
    "load_config",
    "parse_config",
]
