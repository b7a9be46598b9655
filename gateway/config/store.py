"""The store section: where records live (memory, Redis, Sentinel, Cluster), how to
reach it, and the keys that encrypt stored responses."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from gateway.config.addresses import parse_listen, store_url_problem
from gateway.config.issues import INVALID, Issues, section
from gateway.config.text import show
from gateway.config.types import duration_value
from gateway.sealing import key_id, parse_key


@dataclass(frozen=True, slots=True)
class TLSConfig:
    ca_file: str = ""
    cert_file: str = ""  # a client certificate, with key_file, for mutual TLS
    key_file: str = ""
    verify: bool = True  # false: encrypt but do not check the server's certificate


@dataclass(frozen=True, slots=True)
class StoreConfig:
    url: str = "memory://"  # memory://, redis://, rediss://, unix://; unused with sentinel/cluster
    prefix: str = "idem:"
    socket_timeout: float = 2.0
    connect_timeout: float = 2.0
    max_connections: int = 64  # per process; requests queue for a free one
    #: replicas that must confirm a claim (Redis WAIT) before the request is sent:
    #: with 1, a failover cannot lose a claim and let its key run twice
    wait_for_replicas: int = 0
    username: str = ""  # Redis ACL user; the URL's, if it has one, wins
    password: str = field(default="", repr=False)
    tls: TLSConfig | None = None
    sentinel_master: str = ""
    sentinel_nodes: tuple[tuple[str, int], ...] = ()
    sentinel_password: str = field(default="", repr=False)
    cluster_nodes: tuple[tuple[str, int], ...] = ()
    #: 32-byte AES-256-GCM key that seals new stored responses (b"": stored plain)
    encryption_key: bytes = field(default=b"", repr=False)
    #: older keys that still open responses they sealed, after a rotation
    previous_encryption_keys: tuple[bytes, ...] = field(default=(), repr=False)
    #: with an encryption key set, still read responses stored unencrypted (a
    #: migration setting: turn it off once the longest response_ttl has passed)
    read_unencrypted: bool = False
    #: start and report ready even if Redis may evict keys (maxmemory-policy other
    #: than noeviction): an evicted record is a key that runs again
    allow_eviction: bool = False

    @property
    def kind(self) -> str:
        if self.sentinel_nodes:
            return "sentinel"
        if self.cluster_nodes:
            return "cluster"
        return "memory" if self.url.startswith("memory://") else "redis"


def _store(value: object, issues: Issues) -> StoreConfig | None:
    names = (
        "url", "prefix", "socket_timeout", "connect_timeout", "max_connections",
        "username", "password", "tls", "sentinel", "cluster", "wait_for_replicas",
        "encryption_key", "previous_encryption_keys", "read_unencrypted", "allow_eviction",
    )  # fmt: skip
    raw = section(value, "store", issues, names)
    if raw is None:
        return None
    kwargs: dict[str, Any] = {}
    if "url" in raw:
        url = issues.text(raw["url"], "store.url")
        problem = store_url_problem(url) if url is not None else None
        if problem:
            issues.add("store.url", problem)
        kwargs["url"] = INVALID if url is None or problem else url
    for name in ("prefix", "username", "password"):
        if name in raw:
            text = issues.text(raw[name], f"store.{name}", empty_ok=True, secret=name == "password")
            kwargs[name] = INVALID if text is None else text
    for name in ("socket_timeout", "connect_timeout"):
        if name in raw:
            kwargs[name] = duration_value(raw[name], f"store.{name}", issues)
    if "max_connections" in raw:
        number = issues.integer(raw["max_connections"], "store.max_connections", 1, 10000)
        kwargs["max_connections"] = INVALID if number is None else number
    if "wait_for_replicas" in raw:
        number = issues.integer(raw["wait_for_replicas"], "store.wait_for_replicas", 0, 16)
        kwargs["wait_for_replicas"] = INVALID if number is None else number
    for name in ("read_unencrypted", "allow_eviction"):
        if name in raw:
            enabled = issues.boolean(raw[name], f"store.{name}")
            kwargs[name] = INVALID if enabled is None else enabled
    if "tls" in raw:
        kwargs["tls"] = _tls(raw["tls"], issues)
    if "sentinel" in raw:
        sentinel = section(
            raw["sentinel"], "store.sentinel", issues, ("master", "nodes", "password")
        )
        if sentinel is not None:
            if "master" not in sentinel:
                issues.add("store.sentinel.master", "name the master, e.g. master: mymaster")
            master = issues.text(sentinel.get("master", ""), "store.sentinel.master")
            kwargs["sentinel_master"] = INVALID if master is None else master
            kwargs["sentinel_nodes"] = _nodes(sentinel.get("nodes"), "store.sentinel.nodes", issues)
            password = issues.text(
                sentinel.get("password", ""), "store.sentinel.password", empty_ok=True, secret=True
            )
            kwargs["sentinel_password"] = INVALID if password is None else password
    if "cluster" in raw:
        cluster = section(raw["cluster"], "store.cluster", issues, ("nodes",))
        if cluster is not None:
            kwargs["cluster_nodes"] = _nodes(cluster.get("nodes"), "store.cluster.nodes", issues)
    topologies = [name for name in ("url", "sentinel", "cluster") if name in raw]
    if len(topologies) > 1:
        issues.add("store", f"give one of url, sentinel or cluster, not {' and '.join(topologies)}")
    kwargs.update(_encryption_keys(raw, issues))
    return None if INVALID in kwargs.values() else StoreConfig(**kwargs)


def _encryption_keys(raw: dict[str, Any], issues: Issues) -> dict[str, Any]:
    """store.encryption_key and store.previous_encryption_keys. Messages never quote
    a key: they name its place, what is wrong, and how to make a good one."""
    found: list[tuple[str, bytes]] = []  # (YAML path, key)

    def one(value: object, path: str) -> Any:
        if not isinstance(value, str):
            what = "nothing (null)" if value is None else f"a {type(value).__name__}"
            issues.add(path, f'expected a key as text, got {what}; write e.g. "${{GATEWAY_KEY}}"')
            return INVALID
        try:
            key = parse_key(value)
        except ValueError as exc:
            issues.add(path, str(exc))
            return INVALID
        for other_path, other in found:
            if other == key:
                issues.add(path, f"is the same key as {other_path}; list each key once")
                return INVALID
            if key_id(other) == key_id(key):
                issues.add(path, f"has the same key id as {other_path}; generate a new key")
                return INVALID
        found.append((path, key))
        return key

    kwargs: dict[str, Any] = {}
    if "encryption_key" in raw:
        kwargs["encryption_key"] = one(raw["encryption_key"], "store.encryption_key")
    if "previous_encryption_keys" in raw:
        path = "store.previous_encryption_keys"
        value = raw["previous_encryption_keys"]
        if not isinstance(value, list):
            # Never kind(value): a key given without brackets would be quoted.
            issues.add(path, 'expected a list; write e.g. previous_encryption_keys: ["${OLD_KEY}"]')
            kwargs["previous_encryption_keys"] = INVALID
        else:
            keys = [one(item, f"{path}[{i}]") for i, item in enumerate(value)]
            kwargs["previous_encryption_keys"] = INVALID if INVALID in keys else tuple(keys)
    return kwargs


def _tls(value: object, issues: Issues) -> Any:
    raw = section(value, "store.tls", issues, ("ca_file", "cert_file", "key_file", "verify"))
    if raw is None:
        return INVALID
    kwargs: dict[str, Any] = {}
    for name in ("ca_file", "cert_file", "key_file"):
        if name in raw:
            path = issues.text(raw[name], f"store.tls.{name}")
            if path is not None and not os.path.isfile(path):
                issues.add(
                    f"store.tls.{name}", f"no file at {show(path)}; give the path of a PEM file"
                )
                path = None
            kwargs[name] = INVALID if path is None else path
    if ("cert_file" in raw) != ("key_file" in raw):
        issues.add(
            "store.tls", "cert_file and key_file go together (a client certificate and its key)"
        )
    if "verify" in raw:
        verify = issues.boolean(raw["verify"], "store.tls.verify")
        kwargs["verify"] = INVALID if verify is None else verify
    return INVALID if INVALID in kwargs.values() else TLSConfig(**kwargs)


def _nodes(value: object, path: str, issues: Issues) -> Any:
    example = '["10.0.0.1:26379", "10.0.0.2:26379"]'
    items = issues.items_of(value, path, example) if value is not None else None
    if value is None:
        issues.add(path, f"list the nodes, e.g. nodes: {example}")
    if not items:
        if items is not None:
            issues.add(path, f"list at least one node, e.g. nodes: {example}")
        return INVALID
    nodes: list[tuple[str, int]] = []
    for i, item in enumerate(items):
        text = issues.text(item, f"{path}[{i}]")
        if text is None:
            return INVALID
        try:
            nodes.append(parse_listen(text))
        except ValueError as exc:
            issues.add(f"{path}[{i}]", str(exc))
            return INVALID
    return tuple(nodes)
