"""Stored responses (and a delivery's request and status token) at rest: plain, or
sealed with AES-256-GCM (`store.encryption_key`).

A sealed response (status, headers and body together) is an envelope:

    0x01 | key id (4 bytes) | nonce (12 random bytes) | ciphertext | GCM tag (16 bytes)

The key id (the first 4 bytes of HMAC-SHA256(key, "key id")) picks the key that
opens it, so reading needs no trial decryption, and names the key in messages
without revealing it. The associated data is the envelope's first 5 bytes and the
record's digest (route, scope and key), so a ciphertext copied into another
record's field does not open. New responses are sealed with `encryption_key`;
`previous_encryption_keys` only open old ones.

A delivery's stored request and its status token are sealed the same way, with
their kind (KIND_REQUEST, KIND_TOKEN) added to the associated data: a sealed
request copied into a response's field (or a token into the request's) does not
open. Responses have the empty kind, so every response stored before still opens.

A plain response (what `StoredResponse.encode` writes, always starting with `[`) is
what a store without `encryption_key` writes and reads. With `encryption_key` set, a
plain response is unreadable: nothing this gateway wrote looks like that, so it was
written by whoever can write to the store, and replaying it would let them answer
callers in the upstream's name. `store.read_unencrypted: true` reads plain responses
anyway while encryption is being turned on (responses stored before expire after
their route's `response_ttl`; then turn it off). With only
`previous_encryption_keys` (encryption being turned off) responses are written plain,
so plain ones are read.

A response that cannot be read (its key is no longer configured, or the bytes were
changed) raises `Unreadable`: the stores keep the record and say why, the engine
answers a problem, and nothing is replayed wrongly or run again.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from typing import TYPE_CHECKING

from gateway.records import StoredRequest, StoredResponse

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

VERSION = b"\x01"
KEY_BYTES = 32
KEY_ID_BYTES = 4
NONCE_BYTES = 12
TAG_BYTES = 16
_HEADER = 1 + KEY_ID_BYTES
KEYGEN_HINT = "generate one with `idempotency-gateway keygen` (32 random bytes, urlsafe base64)"

#: What a sealed value is, authenticated with it (responses: empty, as before kinds).
KIND_RESPONSE = b""
KIND_REQUEST = b"\x00request"
KIND_TOKEN = b"\x00token"
_NOUNS = {KIND_RESPONSE: "response", KIND_REQUEST: "request", KIND_TOKEN: "status token"}


class Unreadable(ValueError):
    """A stored response that cannot be read. The message names no secret."""


def new_key() -> str:
    """A fresh key: 32 random bytes as urlsafe base64 (44 characters)."""
    return base64.urlsafe_b64encode(os.urandom(KEY_BYTES)).decode()


def parse_key(text: str) -> bytes:
    """The 32 bytes of a key written as base64 (urlsafe or standard, padding optional).
    ValueError says what is wrong without quoting the text."""
    compact = "".join(text.split())
    if not compact:
        raise ValueError(
            "is empty: if it comes from ${VAR}, that variable is not set; set it, or "
            "remove the setting to store responses unencrypted"
        )
    alphabet = b"+/" if ("+" in compact or "/" in compact) else b"-_"
    try:
        padded = compact + "=" * (-len(compact) % 4)
        raw = base64.b64decode(padded.encode("ascii"), altchars=alphabet, validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise ValueError(f"is not base64 text; {KEYGEN_HINT}") from None
    if len(raw) != KEY_BYTES:
        raise ValueError(
            f"is {len(raw)} bytes once decoded; an AES-256 key is {KEY_BYTES} bytes "
            f"(44 characters of base64); {KEYGEN_HINT}"
        )
    return raw


def key_id(key: bytes) -> bytes:
    """A short, public name for a key: it identifies the key without revealing it."""
    return hmac.new(key, b"idempotency-gateway key id", hashlib.sha256).digest()[:KEY_ID_BYTES]


class ResponseCodec:
    """Writes and reads stored responses for a store: plain without keys, sealed
    with the first key otherwise. `writer` seals (None: write plain); it and every
    key in `readers` open. With a `writer`, plain responses are refused unless
    `read_plain` (store.read_unencrypted)."""

    def __init__(
        self,
        writer: bytes | None = None,
        readers: tuple[bytes, ...] = (),
        *,
        read_plain: bool = False,
    ) -> None:
        self._writer: tuple[bytes, AESGCM] | None = None
        self._readers: dict[bytes, AESGCM] = {}
        self._refuse_plain = writer is not None and not read_plain
        keys = ((writer,) if writer is not None else ()) + readers
        if keys:
            # Imported only when a key is set: plain deployments never load it.
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            for key in keys:
                self._readers[key_id(key)] = AESGCM(key)
        if writer is not None:
            self._writer = (key_id(writer), self._readers[key_id(writer)])

    @property
    def encrypting(self) -> bool:
        return self._writer is not None

    @property
    def writer_id(self) -> str:
        return self._writer[0].hex() if self._writer is not None else ""

    def seal(self, digest: str, kind: bytes, plain: bytes) -> bytes:
        """`plain` as stored in record `digest`: sealed with the writer key, if any."""
        if self._writer is None:
            return plain
        kid, aead = self._writer
        header = VERSION + kid
        nonce = os.urandom(NONCE_BYTES)
        return header + nonce + aead.encrypt(nonce, plain, _associated(header, digest, kind))

    def open(self, digest: str, kind: bytes, data: bytes) -> bytes:
        """What `seal(digest, kind, ...)` was given. Unreadable if it does not open,
        or is plain while plain values are refused."""
        if data[:1] == VERSION:
            return self._open(digest, data, kind)
        if self._refuse_plain:
            raise Unreadable(PLAIN_REFUSED)
        return data

    def encode(self, digest: str, response: StoredResponse) -> bytes:
        return self.seal(digest, KIND_RESPONSE, response.encode())

    def decode(self, digest: str, data: bytes) -> StoredResponse:
        if data[:1] == VERSION:
            data = self._open(digest, data)
        elif self._refuse_plain:
            _plain(data)  # which refusal: unencrypted, or not a response at all
            raise Unreadable(PLAIN_REFUSED)
        return _plain(data)

    def encode_request(self, digest: str, request: StoredRequest) -> bytes:
        return self.seal(digest, KIND_REQUEST, request.encode())

    def decode_request(self, digest: str, data: bytes) -> StoredRequest:
        plain = self.open(digest, KIND_REQUEST, data)
        try:
            return StoredRequest.decode(plain)
        except ValueError:
            raise Unreadable("the stored bytes are damaged: not a stored request") from None

    def encode_token(self, digest: str, token: str) -> bytes:
        return self.seal(digest, KIND_TOKEN, token.encode())

    def decode_token(self, digest: str, data: bytes) -> str:
        try:
            return self.open(digest, KIND_TOKEN, data).decode("ascii")
        except UnicodeDecodeError:
            raise Unreadable("the stored bytes are damaged: not a status token") from None

    def _open(self, digest: str, data: bytes, kind: bytes = KIND_RESPONSE) -> bytes:
        noun = _NOUNS.get(kind, "value")
        if len(data) < _HEADER + NONCE_BYTES + TAG_BYTES:
            raise Unreadable(f"the stored bytes are damaged: too short for an encrypted {noun}")
        header, nonce = data[:_HEADER], data[_HEADER : _HEADER + NONCE_BYTES]
        kid = header[1:].hex()
        aead = self._readers.get(header[1:])
        if aead is None:
            configured = ", ".join(k.hex() for k in self._readers)
            raise Unreadable(
                f"it was encrypted with key id {kid}, which is not configured "
                + (f"(configured: {configured})" if configured else "(no key is configured)")
            )
        from cryptography.exceptions import InvalidTag

        try:
            sealed = data[_HEADER + NONCE_BYTES :]
            return aead.decrypt(nonce, sealed, _associated(header, digest, kind))
        except InvalidTag:
            raise Unreadable(
                f"it does not decrypt with key id {kid}: it was changed in the store, or "
                "copied from another record"
            ) from None


PLAIN_REFUSED = (
    "it is stored unencrypted while store.encryption_key is set: it was stored before "
    "encryption was turned on (set store.read_unencrypted: true to read those until "
    "they expire), or written by someone with write access to the store"
)


def _plain(data: bytes) -> StoredResponse:
    try:
        return StoredResponse.decode(data)
    except ValueError:
        raise Unreadable("the stored bytes are damaged: not a stored response") from None


def _associated(header: bytes, digest: str, kind: bytes = KIND_RESPONSE) -> bytes:
    """Authenticated with the ciphertext: the envelope header (version, key id), the
    record it belongs to, and what it is (a digest is hex, so no kind can be confused
    with part of another digest)."""
    return header + digest.encode() + kind


PLAIN = ResponseCodec()
