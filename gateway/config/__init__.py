"""Configuration: YAML in, frozen dataclasses out, validated once.

`load_config(path)` is the way in (`parse_config(data, source)` for data already
loaded). Every error names the file, the YAML path (`routes[2].key.body`) and what
to do about it; all errors in a file are reported together so a user fixes them in
one pass.
"""

from gateway.config.addresses import mask_url
from gateway.config.keys import (
    HASH_KEY_LENGTH,
    KeySource,
    KeySourceKind,
    KeySpec,
    MissingKeyPolicy,
    Period,
    parse_period,
)
from gateway.config.loading import load_config, parse_config
from gateway.config.model import AdminConfig, Config, ServerConfig
from gateway.config.route_settings import DEFAULT_CACHE_STATUSES, ReconcileConfig
from gateway.config.routes import ConcurrentPolicy, Route, StoreErrorPolicy, UnknownOutcomePolicy
from gateway.config.store import StoreConfig, TLSConfig
from gateway.config.summary import describe
from gateway.config.types import REQUEST_PARTS, IPNetwork, parse_duration, parse_size

__all__ = [
    "DEFAULT_CACHE_STATUSES",
    "HASH_KEY_LENGTH",
    "REQUEST_PARTS",
    "AdminConfig",
    "ConcurrentPolicy",
    "Config",
    "IPNetwork",
    "KeySource",
    "KeySourceKind",
    "KeySpec",
    "MissingKeyPolicy",
    "Period",
    "ReconcileConfig",
    "Route",
    "ServerConfig",
    "StoreConfig",
    "StoreErrorPolicy",
    "TLSConfig",
    "UnknownOutcomePolicy",
    "describe",
    "load_config",
    "mask_url",
    "parse_config",
    "parse_duration",
    "parse_period",
    "parse_size",
]
