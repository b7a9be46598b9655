"""The store section: where records live (memory, Redis, Sentinel, Cluster,
PostgreSQL), how to reach it, and the keys that encrypt stored responses.

In the file Sentinel and Cluster are blocks of their own (`sentinel: {master, nodes,
password}`, `cluster: {nodes}`); the object has them as `sentinel_*` and
`cluster_nodes`, which is what the Redis store reads.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import field
from typing import Annotated, Any, ClassVar

from gateway.config.addresses import HostPorts, StoreUrl
from gateway.config.issues import Loc, Problems, loc_path
from gateway.config.sections import Section, settings
from gateway.config.text import kind, show, unknown_setting
from gateway.config.types import Check, Duration, Flag, OptionalText, Secret, Text, Whole, text
from gateway.encryption import key_id, parse_key


def _pem_file(value: object) -> str:
    path = text(value)
    if not os.path.isfile(path):
        raise ValueError(f"no file at {show(path)}; give the path of a PEM file")
    return path


def _key(value: object) -> bytes:
    """Messages never quote a key: they name its place, what is wrong, and how to make
    a good one."""
    if isinstance(value, bytes):
        return value  # from Python
    if not isinstance(value, str):
        what = "nothing (null)" if value is None else f"a {type(value).__name__}"
        raise ValueError(f'expected a key as text, got {what}; write e.g. "${{GATEWAY_KEY}}"')
    return parse_key(value)


def _keys(value: object) -> tuple[bytes, ...]:
    if isinstance(value, tuple):
        return tuple(_key(item) for item in value)  # from Python
    if not isinstance(value, list):
        # Never kind(value): a key given without brackets would be quoted.
        raise ValueError('expected a list; write e.g. previous_encryption_keys: ["${OLD_KEY}"]')
    keys: list[bytes] = []
    problems = Problems()
    for i, item in enumerate(value):
        try:
            keys.append(_key(item))
        except ValueError as exc:
            problems.add((i,), str(exc))
    problems.raise_if_any()
    return tuple(keys)


PemFile = Annotated[str, Check(_pem_file, {"type": "string"})]
_BASE64 = {"type": "string", "description": "32 bytes in base64: idempotency-gateway keygen"}
EncryptionKey = Annotated[bytes, Check(_key, _BASE64)]
EncryptionKeys = Annotated[
    tuple[bytes, ...], Check(_keys, {"type": "array", "items": {"anyOf": [_BASE64]}})
]


@settings
class TLSConfig(Section):
    example = "store.tls: {...}"

    ca_file: PemFile = ""
    cert_file: PemFile = ""  # a client certificate, with key_file, for mutual TLS
    key_file: PemFile = ""
    verify: Flag = True  # false: encrypt but do not check the server's certificate

    @classmethod
    def check(
        cls,
        values: dict[str, Any],
        given: dict[str, Any],
        inherited: frozenset[str],
        problems: Problems,
    ) -> dict[str, Any]:
        if ("cert_file" in given) != ("key_file" in given):
            problems.add(
                (), "cert_file and key_file go together (a client certificate and its key)"
            )
        return {}


#: The PostgreSQL store's connections per process when max_connections is unset
#: (asyncpg's own pool defaults to 10 as well).
POSTGRES_POOL = 10


@settings
class StoreConfig(Section):
    example = "store: {...}"
    written_at: ClassVar[dict[str, Loc]] = {
        "sentinel_master": ("sentinel", "master"),
        "sentinel_nodes": ("sentinel", "nodes"),
        "sentinel_password": ("sentinel", "password"),
        "cluster_nodes": ("cluster", "nodes"),
    }

    url: StoreUrl = "memory://"  # memory://, redis://, rediss://, unix://, postgresql://
    prefix: OptionalText = "idem:"
    socket_timeout: Duration = 2.0
    connect_timeout: Duration = 2.0
    #: per process; requests queue for one. Unset: 64 on Redis (one pipelined connection
    #: carries the request path) and POSTGRES_POOL on PostgreSQL (see pool_size)
    max_connections: Annotated[int, Whole(1, 10000)] | None = None
    #: replicas that must confirm a claim (Redis WAIT) before the request is sent:
    #: with 1, a failover cannot lose a claim and let its key run twice
    wait_for_replicas: Annotated[int, Whole(0, 16)] = 0
    username: OptionalText = ""  # Redis ACL user; the URL's, if it has one, wins
    password: Secret = field(default="", repr=False)
    tls: TLSConfig | None = None
    sentinel_master: Text = ""
    sentinel_nodes: HostPorts = ()
    sentinel_password: Secret = field(default="", repr=False)
    cluster_nodes: HostPorts = ()
    #: 32-byte AES-256-GCM key that seals new stored responses (b"": stored plain)
    encryption_key: EncryptionKey = field(default=b"", repr=False)
    #: older keys that still open responses they sealed, after a rotation
    previous_encryption_keys: EncryptionKeys = field(default=(), repr=False)
    #: with an encryption key set, still read responses stored unencrypted (a
    #: migration setting: turn it off once the longest response_ttl has passed)
    read_unencrypted: Flag = False
    #: start and report ready even if Redis may evict keys (maxmemory-policy other
    #: than noeviction): an evicted record is a key that runs again
    allow_eviction: Flag = False

    @property
    def pool_size(self) -> int:
        """max_connections as set, else the store's default. PostgreSQL runs a process per
        connection: on a small machine a few busy backends commit more per second than
        many that take turns (docs/performance.md, session 11)."""
        if self.max_connections is not None:
            return self.max_connections
        return POSTGRES_POOL if self.kind == "postgres" else 64

    @property
    def kind(self) -> str:
        if self.sentinel_nodes:
            return "sentinel"
        if self.cluster_nodes:
            return "cluster"
        if self.url.startswith("memory://"):
            return "memory"
        return "postgres" if self.url.startswith(("postgresql://", "postgres://")) else "redis"

    @classmethod
    def yaml_names(cls) -> tuple[str, ...]:
        return (
            "url", "prefix", "socket_timeout", "connect_timeout", "max_connections",
            "username", "password", "tls", "sentinel", "cluster", "wait_for_replicas",
            "encryption_key", "previous_encryption_keys", "read_unencrypted", "allow_eviction",
        )  # fmt: skip

    @classmethod
    def report_order(cls) -> tuple[str, ...]:
        return (
            "url", "prefix", "username", "password", "socket_timeout", "connect_timeout",
            "max_connections", "wait_for_replicas", "read_unencrypted", "allow_eviction", "tls",
            "sentinel", "cluster", "encryption_key", "previous_encryption_keys",
        )  # fmt: skip

    @classmethod
    def from_yaml(cls, given: dict[str, Any], problems: Problems) -> dict[str, Any]:
        kwargs = {
            name: value for name, value in given.items() if name not in ("sentinel", "cluster")
        }
        if "tls" in kwargs and kwargs["tls"] is None:
            kwargs["tls"] = {}  # `tls:` alone: TLS with the defaults
        if "sentinel" in given:
            sentinel = _block(
                given["sentinel"], "sentinel", ("master", "nodes", "password"), problems
            )
            if sentinel is not None:
                if "master" not in sentinel:
                    problems.add(("sentinel", "master"), "name the master, e.g. master: mymaster")
                kwargs["sentinel_master"] = sentinel.get("master", "")
                kwargs["sentinel_nodes"] = sentinel.get("nodes")
                kwargs["sentinel_password"] = sentinel.get("password", "")
        if "cluster" in given:
            cluster = _block(given["cluster"], "cluster", ("nodes",), problems)
            if cluster is not None:
                kwargs["cluster_nodes"] = cluster.get("nodes")
        return kwargs

    @classmethod
    def check(
        cls,
        values: dict[str, Any],
        given: dict[str, Any],
        inherited: frozenset[str],
        problems: Problems,
    ) -> dict[str, Any]:
        topologies = [name for name in ("url", "sentinel", "cluster") if name in given]
        if len(topologies) > 1:
            problems.add(
                (), f"give one of url, sentinel or cluster, not {' and '.join(topologies)}"
            )
        url = str(values.get("url", ""))
        if url.startswith(("postgresql://", "postgres://")):
            _check_postgres(given, problems)
        written: list[tuple[Loc, object]] = []
        if "encryption_key" in given:
            written.append((("encryption_key",), given["encryption_key"]))
        if isinstance(given.get("previous_encryption_keys"), list):
            for i, item in enumerate(given["previous_encryption_keys"]):
                written.append((("previous_encryption_keys", i), item))
        found: list[tuple[Loc, bytes]] = []
        for loc, value in written:
            try:
                key = _key(value)
            except ValueError:
                continue  # reported with the setting
            _check_key(key, loc, found, problems)
        return {}


def _check_postgres(given: dict[str, Any], problems: Problems) -> None:
    if importlib.util.find_spec("asyncpg") is None:
        problems.add(
            ("url",),
            "a PostgreSQL store needs its driver, which is not installed: "
            "pip install 'idempotency-gateway[postgres]'",
        )
    if given.get("wait_for_replicas"):
        problems.add(
            ("wait_for_replicas",),
            "is Redis's WAIT; on PostgreSQL, name the standbys in the server's "
            "synchronous_standby_names (every commit then waits for them) and remove it",
        )


def _check_key(key: bytes, loc: Loc, found: list[tuple[Loc, bytes]], problems: Problems) -> None:
    for other_loc, other in found:
        where = "store." + loc_path(other_loc)
        if other == key:
            problems.add(loc, f"is the same key as {where}; list each key once")
            return
        if key_id(other) == key_id(key):
            problems.add(loc, f"has the same key id as {where}; generate a new key")
            return
    found.append((loc, key))


def _block(
    value: object, name: str, names: tuple[str, ...], problems: Problems
) -> dict[str, Any] | None:
    block = {} if value is None else value
    if not isinstance(block, dict):
        message = (
            f"expected a mapping (name: value), got {kind(block)}; write e.g. store.{name}: {{...}}"
        )
        problems.add((name,), message)
        return None
    for setting in block:
        if setting not in names:
            problems.add(
                (name, str(setting)), unknown_setting(str(setting), sorted(names)), name=True
            )
    return block
