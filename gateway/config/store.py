"""The store section: where records live (memory, Redis, Sentinel, Cluster,
PostgreSQL, SQLite), how to reach it, and the keys that encrypt stored responses.

In the file Sentinel and Cluster are blocks of their own (`sentinel: {master, nodes,
password}`, `cluster: {nodes}`); the object has them as `sentinel_*` and
`cluster_nodes`, which is what the Redis store reads; `sqlite: {synchronous}` is
`sqlite_synchronous`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import field
from typing import Annotated, Any, ClassVar, Literal

from gateway.config.addresses import HostPorts, StoreUrl
from gateway.config.issues import Loc, Problems, loc_path
from gateway.config.sections import Section, settings
from gateway.config.text import kind, show, unknown_setting
from gateway.config.types import (
    Check,
    Duration,
    Flag,
    OneOf,
    OptionalText,
    Secret,
    Text,
    Whole,
    text,
)
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


PemFile = Annotated[str, Check(_pem_file, {"type": "string"}, written="path of a PEM file")]
_BASE64 = {"type": "string", "description": "32 bytes in base64: idempotency-gateway keygen"}
EncryptionKey = Annotated[bytes, Check(_key, _BASE64, written="key: 32 bytes in base64")]
EncryptionKeys = Annotated[
    tuple[bytes, ...],
    Check(_keys, {"type": "array", "items": {"anyOf": [_BASE64]}}, written="list of keys"),
]


@settings
class TLSConfig(Section):
    """TLS to the store, for `rediss://`, Sentinel, Cluster and `postgresql://`:
    `tls:` alone means TLS with the defaults (the system's CAs, the server's certificate
    checked)."""

    example = "store.tls: {...}"
    written = "mapping, or nothing"

    ca_file: PemFile = ""
    """The CA certificates the server's certificate is checked against; unset: the
    system's."""
    cert_file: PemFile = ""
    """A client certificate, with `key_file`, for mutual TLS."""
    key_file: PemFile = ""
    """The client certificate's private key."""
    verify: Flag = True
    """`false`: encrypt, but do not check the server's certificate or host name."""

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


#: The SQLite file a config with no store URL uses, in the config file's directory: the
#: place the operator already chose, writable by whoever wrote the config, and the same
#: for every working directory and user (docs/decisions/sqlite.md says why).
DEFAULT_SQLITE_FILE = "idempotency-gateway.db"


def default_store_url(source: str) -> str:
    """The `sqlite://` URL of DEFAULT_SQLITE_FILE beside the config file `source`."""
    folder = os.path.dirname(os.path.abspath(source))
    return "sqlite://" + os.path.join(folder, DEFAULT_SQLITE_FILE)


def is_default_store(store: StoreConfig, source: str) -> bool:
    """Whether `store` is the one a config with no store URL gets."""
    return store.kind == "sqlite" and store.url == default_store_url(source)


#: What `memory://` keeps, said at start and by `check-config`.
MEMORY_KEEPS_NOTHING = (
    "it keeps nothing: a restart forgets every key and every queued delivery "
    "(for the demo and tests)"
)


#: The PostgreSQL store's connections per process when max_connections is unset
#: (asyncpg's own pool defaults to 10 as well).
POSTGRES_POOL = 10


@settings
class StoreConfig(Section):
    """`store:`, where records live (described at `Config.store`)."""

    example = "store: {...}"
    written_at: ClassVar[dict[str, Loc]] = {
        "sentinel_master": ("sentinel", "master"),
        "sentinel_nodes": ("sentinel", "nodes"),
        "sentinel_password": ("sentinel", "password"),
        "cluster_nodes": ("cluster", "nodes"),
        "sqlite_synchronous": ("sqlite", "synchronous"),
    }
    blocks: ClassVar[dict[str, str]] = {
        "sentinel": "Redis behind Sentinel, instead of `url`. A failover is followed "
        "without a restart, and requests during the switch get 503. Set "
        "`wait_for_replicas: 1` with it: replication is asynchronous, so without it a "
        "failover can lose a fresh claim and let its key run twice.",
        "cluster": "Redis Cluster, instead of `url`. Records are spread over 64 hash "
        "tags; every script touches one, and listings read each tag's indexes, never "
        "the keyspace.",
        "sqlite": "The SQLite store's settings, with a `sqlite://` URL.",
    }

    url: StoreUrl = f"sqlite://{DEFAULT_SQLITE_FILE}"
    """Unset (and no `sentinel` or `cluster`): SQLite in `idempotency-gateway.db` in
    the config file's directory, durable with nothing else to run; `run` logs the
    file's path at start. `sqlite:///path/gateway.db` (one file on this host, shared by
    `--workers`; after `sqlite://` comes the path: absolute after three slashes, else
    relative to the working directory; its schema is applied on start), `redis://`,
    `rediss://` (TLS), `unix:///path.sock`, `postgresql://` (`postgres://`; needs `pip
    install 'idempotency-gateway[postgres]'` and `idempotency-gateway store migrate`
    once), or `memory://` (one process, for the demo and tests: it keeps nothing, a
    restart forgets every key and every queued delivery). Give one of `url`,
    `sentinel` or `cluster`."""
    prefix: OptionalText = "idem:"
    """Put before every name the store writes, so gateways can share one Redis; on
    PostgreSQL a column: gateways with different prefixes share the tables."""
    socket_timeout: Duration = 2.0
    """Bounds every store call. On Redis each call is retried once, so a hung Redis
    costs a request about twice this, then 503. On PostgreSQL it is also the server's
    `statement_timeout` (half of it the `lock_timeout`), and a call that runs out of
    time is not retried. On SQLite it is how long a write waits for the file's lock
    while another process holds it, then 503."""
    connect_timeout: Duration = 2.0
    """The longest opening a connection to the store may take."""
    max_connections: Annotated[int, Whole(1, 10000)] | None = None
    """Store connections per process; calls queue for a free one, up to twice
    `socket_timeout`. The notification subscriber (and PostgreSQL's listener) has a
    connection of its own, outside this number, so 1 works. Unset: 64 on Redis (one
    pipelined connection carries the request path's scripts; the rest is listings,
    `wait_for_replicas` and the cluster) and 10 on PostgreSQL, where each connection
    is a backend process: size it to the database's cores, not to the callers."""
    wait_for_replicas: Annotated[int, Whole(0, 16)] = 0
    """Replicas that must confirm a claim (Redis `WAIT`) before the request is sent:
    with 1, a failover cannot lose a claim and let its key run twice, and a master
    that has lost all its replicas fails closed until one is back: a claim no replica
    confirms within half of `socket_timeout` is released and answered 503 (nothing was
    sent), and an async route's accept, already stored, is kept and answered 202
    `accepted-unconfirmed`. With a `redis://` URL whose server has replicas, Sentinel
    or a Cluster. Redis only: on PostgreSQL, name the standbys in the server's
    `synchronous_standby_names`."""
    username: OptionalText = ""
    """The user to sign in as (a Redis ACL user); the URL's, if it has one, wins."""
    password: Secret = field(default="", repr=False)
    """The store's password (write `${REDIS_PASSWORD}`); the URL's, if it has one,
    wins. Never printed by `check-config`, an error or the logs."""
    tls: TLSConfig | None = None
    """TLS to the store (below); unset: as the URL says (`rediss://`,
    `?sslmode=require`)."""
    sentinel_master: Text = ""
    """The name Sentinel knows the master by, e.g. `mymaster`."""
    sentinel_nodes: HostPorts = ()
    """The Sentinels' addresses, e.g. `["10.0.0.1:26379", "10.0.0.2:26379"]`."""
    sentinel_password: Secret = field(default="", repr=False)
    """The Sentinels' own password, if they have one."""
    cluster_nodes: HostPorts = ()
    """Addresses of cluster nodes to start from, e.g. `["10.0.0.1:7000"]`."""
    encryption_key: EncryptionKey = field(default=b"", repr=False)
    """Seals every stored response (status, headers, body), queued request and status
    token with AES-256-GCM, bound to its record. 32 random bytes in urlsafe base64 from
    `idempotency-gateway keygen`, written `${GATEWAY_ENCRYPTION_KEY}`. Key names,
    states, timestamps, reasons and history are not encrypted. Unset: stored plain."""
    previous_encryption_keys: EncryptionKeys = field(default=(), repr=False)
    """Older keys that still open what they sealed. To rotate: (1) add the new key here
    on every replica, (2) make it `encryption_key` and move the old one here, (3) drop
    the old one once the longest `response_ttl` has passed; each step is a restart."""
    read_unencrypted: Flag = False
    """With `encryption_key` set, still replay responses stored unencrypted: a setting
    for turning encryption on over existing records; remove it once the longest
    `response_ttl` has passed. Without it such a response gets 500
    `stored-response-unreadable` and its record is kept."""
    sqlite_synchronous: Annotated[Literal["full", "normal"], OneOf()] = "full"
    """How the SQLite store commits (`store.sqlite.synchronous`): `full` (the default)
    syncs the write-ahead log to disk at every commit, so a committed claim or
    completion survives a power cut. `normal` syncs it only at checkpoints: commits cost
    less, a crash of the gateway still loses nothing, but a power cut or an OS crash can
    lose the last commits, and their keys run again."""
    allow_eviction: Flag = False
    """Start and report ready even if Redis may evict records (a `maxmemory-policy`
    other than `noeviction`). An evicted record is a key that runs again; without this,
    such a Redis is logged at start with the fix and `/readyz` answers 503."""

    @property
    def pool_size(self) -> int:
        """max_connections as set, else the store's default. PostgreSQL runs a process per
        connection: on a small machine a few busy backends commit more per second than
        many that take turns (docs/decisions/postgres-pool.md)."""
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
        if self.url.startswith("sqlite://"):
            return "sqlite"
        return "postgres" if self.url.startswith(("postgresql://", "postgres://")) else "redis"

    @classmethod
    def yaml_names(cls) -> tuple[str, ...]:
        return (
            "url", "prefix", "socket_timeout", "connect_timeout", "max_connections",
            "username", "password", "tls", "sentinel", "cluster", "wait_for_replicas",
            "encryption_key", "previous_encryption_keys", "read_unencrypted", "allow_eviction",
            "sqlite",
        )  # fmt: skip

    @classmethod
    def report_order(cls) -> tuple[str, ...]:
        return (
            "url", "prefix", "username", "password", "socket_timeout", "connect_timeout",
            "max_connections", "wait_for_replicas", "read_unencrypted", "allow_eviction", "tls",
            "sentinel", "cluster", "sqlite", "encryption_key", "previous_encryption_keys",
        )  # fmt: skip

    @classmethod
    def from_yaml(cls, given: dict[str, Any], problems: Problems) -> dict[str, Any]:
        kwargs = {
            name: value
            for name, value in given.items()
            if name not in ("sentinel", "cluster", "sqlite")
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
        if "sqlite" in given:
            sqlite = _block(given["sqlite"], "sqlite", ("synchronous",), problems)
            if sqlite is not None and "synchronous" in sqlite:
                kwargs["sqlite_synchronous"] = sqlite["synchronous"]
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
        # Sentinel and Cluster leave `url` at its default, which is SQLite's: the URL
        # names the store only when no other topology is given.
        url = str(values.get("url", "")) if topologies in ([], ["url"]) else ""
        if url.startswith(("postgresql://", "postgres://")):
            _check_postgres(given, problems)
        elif url.startswith("memory://"):
            _check_memory(given, problems)
        if "sqlite" in given and not url.startswith("sqlite://"):
            problems.add(("sqlite",), "is the SQLite store's; remove it, or use a sqlite:// url")
        if url.startswith("sqlite://") and given.get("wait_for_replicas"):
            problems.add(
                ("wait_for_replicas",),
                "a SQLite store is one file on this host and has no replicas to wait for; "
                "remove it",
            )
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


def _check_memory(given: dict[str, Any], problems: Problems) -> None:
    if given.get("wait_for_replicas"):
        problems.add(
            ("wait_for_replicas",),
            "memory:// keeps records in this process and has no replicas to wait for; "
            "remove it, or use a Redis store with replicas",
        )


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
