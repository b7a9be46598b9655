"""Configuration: YAML in, frozen pydantic dataclasses out, validated once.

`load_config(path)` is the way in (`parse_config(data, source)` for data already
loaded). Every error names the file, the YAML path (`routes[2].key.body`) and what
to do about it; all errors in a file are reported together so a user fixes them in
one pass, with the line and column of each (`config.yaml:14:7: routes[2].key.body`).

The package, by file: `model` (the whole file, server, admin), `store`, `routes` (and
`defaults:`), `keys` (key sources and periods), `types`, `units` and `http` (value
types: durations, sizes, names; statuses, methods, headers, request parts, networks),
`addresses` (listen addresses, URLs), `paths` and
`templates` (the path pattern and key template grammars, which the router and
gateway.keying use too), `sections` (how a YAML mapping becomes settings), `issues`
(problems and their messages), `loading` (YAML, positions, ${VAR}), `summary`
(`check-config`'s text) and `schema` (the JSON Schema of the file).
"""

from gateway.config.addresses import mask_url
from gateway.config.admin import CREDENTIAL_HEADERS, AdminConfig, OperatorConfig
from gateway.config.delivery import DeliveryConfig, DeliveryMode, RetryConfig
from gateway.config.http import DEFAULT_CACHE_STATUSES, REQUEST_PARTS, IPNetwork
from gateway.config.keys import (
    HASH_KEY_LENGTH,
    KeySource,
    KeySourceKind,
    KeySpec,
    Period,
    parse_period,
)
from gateway.config.loading import load_config, parse_config
from gateway.config.model import Config, ServerConfig
from gateway.config.routes import ReconcileConfig, Route
from gateway.config.store import StoreConfig, TLSConfig
from gateway.config.summary import describe
from gateway.config.types import (
    ConcurrentPolicy,
    MissingKeyPolicy,
    StoreErrorPolicy,
    UnknownOutcomePolicy,
)
from gateway.config.units import parse_duration, parse_size

__all__ = [
    "CREDENTIAL_HEADERS",
    "DEFAULT_CACHE_STATUSES",
    "HASH_KEY_LENGTH",
    "REQUEST_PARTS",
    "AdminConfig",
    "ConcurrentPolicy",
    "Config",
    "DeliveryConfig",
    "DeliveryMode",
    "IPNetwork",
    "KeySource",
    "KeySourceKind",
    "KeySpec",
    "MissingKeyPolicy",
    "OperatorConfig",
    "Period",
    "ReconcileConfig",
    "RetryConfig",
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
