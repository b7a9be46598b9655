"""Notices between the processes on one SQLite file: a Unix datagram socket per process
in a folder beside the database (`gateway.db` -> `gateway.db-notices/`), so waiters and
delivery workers in other workers are woken without a polling loop.

After committed moves, the process that made them sends a datagram to every other
socket in the folder saying what changed (keys, deliveries made due, deliveries taken):
one for the moves answered in one turn of its event loop (a batch's answers arrive in
one wake-up), not one per move;
each process fans what it hears out to its own listeners (Notifier, DueFeed). Like
every store's notices they are hints, at most once: a full socket buffer drops one, a
process that starts reports `lost` so its workers rescan, and every listener re-reads
the store. A socket whose process died refuses the next datagram and is removed.

The folder is the gateway's (mode 0700, the gateway's user): one that is another
user's or open to others is not used (the store says so and waiters re-read). What
arrives is read as untrusted text all the same: anything but a well-formed notice is
dropped. A socket path longer than a Unix socket's 107 bytes is reached through the
folder's open descriptor (/proc/self/fd/N/name, Linux). Where a socket cannot be made
(a folder that cannot be written), the store logs it once and waiters fall back to
re-reading every Store.fallback_wait seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import stat
import time
from pathlib import Path

from gateway.records import KeyRef
from gateway.store.base import Store
from gateway.store.notices import Due, DueFeed, Notifier
from gateway.store.sqlite.rows import Effects

log = logging.getLogger("gateway.store")

#: How long a process reuses its list of the other sockets before it lists the folder
#: again: a worker that starts is told of changes within this.
PEERS_TTL = 1.0
#: The largest notice a process reads: a longer datagram is cut short and dropped.
MAX_NOTICE = 65536
#: The longest path a Unix socket's address holds (sun_path, less its terminating NUL).
MAX_SOCKET_PATH = 107
#: The most keys and deliveries one datagram names (well under MAX_NOTICE for keys and
#: routes of ordinary length; a longer notice is dropped, and its listeners re-read).
NOTICE_ITEMS = 64


def notice_folder(database: Path) -> Path:
    return database.with_name(database.name + "-notices")


#: What a process that starts sends the others: each lists the folder again at its next
#: notice (its list of the others is otherwise up to PEERS_TTL old, and would miss it).
HELLO = b'{"hello":1}'


def encode(effects: Effects) -> bytes:
    """One datagram for what one commit changed (no response: a waiter re-reads)."""
    doc = {
        "c": [digest for digest, _ in effects.changed],
        "d": [
            [due.ref.digest, due.ref.route, due.ref.key, due.due_ms, due.now_ms, due.origin]
            for due in effects.due
        ],
        "t": effects.taken,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(data: bytes) -> Effects | None:
    """What a datagram says, or None for anything that is not a notice."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    changed, due, taken = doc.get("c", []), doc.get("d", []), doc.get("t", [])
    if not (isinstance(changed, list) and isinstance(due, list) and isinstance(taken, list)):
        return None
    effects = Effects()
    effects.changed = [(digest, None) for digest in changed if isinstance(digest, str)]
    effects.taken = [digest for digest in taken if isinstance(digest, str)]
    for item in due:
        if (
            isinstance(item, list)
            and len(item) == 6
            and all(isinstance(part, str) for part in (*item[:3], item[5]))
            and all(type(part) is int for part in item[3:5])
        ):
            ref = KeyRef(item[0], item[1], item[2])
            effects.due.append(Due(ref, item[3], item[4], item[5]))
    return effects


def _not_private(folder: Path) -> str:
    """Why `folder` is not this user's alone ("" when it is)."""
    found = folder.lstat()
    if not stat.S_ISDIR(found.st_mode):
        return "not a folder"
    if found.st_uid != os.geteuid():
        return f"owned by another user (uid {found.st_uid})"
    if found.st_mode & 0o077:
        return f"open to other users (mode {stat.S_IMODE(found.st_mode):o})"
    return ""


class SqliteNotices:
    def __init__(self, database: Path, notifier: Notifier, due: DueFeed) -> None:
        self.folder = notice_folder(database)
        self.notifier = notifier
        self.due = due
        self._sock: socket.socket | None = None
        self._path: Path | None = None
        self._peers: list[str] = []
        self._peers_at = -PEERS_TTL
        self._folder_fd: int | None = None
        #: Set once this process hears the others (tests wait on it).
        self.subscribed = asyncio.Event()
        #: datagrams sent and dropped (a full buffer): the figures of the channel's cost
        self.sent = 0
        self.dropped = 0
        #: what this turn of the loop committed, sent together at its end
        self._pending = Effects()
        self._flushing = False

    def start(self) -> None:
        name = f"{os.getpid()}-{secrets.token_hex(4)}.sock"
        path = self.folder / name
        try:
            self.folder.mkdir(mode=0o700, exist_ok=True)
            shared = _not_private(self.folder)
            if shared:
                # Another user could read the notices there (keys, routes) or
                # pretend to be a worker: this process does without them.
                log.warning(
                    "the SQLite store's notice folder %s is %s: waiters in other workers "
                    "re-read every %.1f to %.1f s instead of being woken. Remove the "
                    "folder (the gateway makes it again, mode 0700)",
                    self.folder,
                    shared,
                    *Store.fallback_wait,
                )
                return
            if len(os.fsencode(path)) > MAX_SOCKET_PATH:
                self._folder_fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                sock.bind(self._address(name))
            except OSError:
                sock.close()
                raise
        except OSError as exc:
            log.warning(
                "the SQLite store cannot make its notice socket in %s (%s): waiters in "
                "other workers re-read every %.1f to %.1f s instead of being woken",
                self.folder,
                exc.strerror or str(exc),
                *Store.fallback_wait,
            )
            return
        sock.setblocking(False)
        self._sock, self._path = sock, path
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)
        self.subscribed.set()
        self._send(HELLO)
        self.due.lost()  # what was said before this socket existed: rescan

    def _address(self, name: str) -> str:
        if self._folder_fd is None:
            return str(self.folder / name)
        return f"/proc/self/fd/{self._folder_fd}/{name}"

    def close(self) -> None:
        if self._folder_fd is not None:
            os.close(self._folder_fd)
            self._folder_fd = None
        if self._sock is None:
            return
        try:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        except RuntimeError:
            pass  # the loop is gone: nothing reads any more
        self._sock.close()
        self._sock = None
        if self._path is not None:
            self._path.unlink(missing_ok=True)

    def publish(self, effects: Effects) -> None:
        """Tell every other process on the file what a commit changed, with what the
        other moves answered in this turn of the loop changed."""
        if self._sock is None or not (effects.changed or effects.due or effects.taken):
            return
        self._pending.changed += effects.changed
        self._pending.due += effects.due
        self._pending.taken += effects.taken
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        pending, self._pending, self._flushing = self._pending, Effects(), False
        n = NOTICE_ITEMS
        for start in range(0, max(len(pending.changed), len(pending.due), len(pending.taken)), n):
            part = Effects(
                pending.changed[start : start + n],
                pending.due[start : start + n],
                pending.taken[start : start + n],
            )
            self._send(encode(part))

    def _send(self, data: bytes) -> None:
        if self._sock is None:
            return  # closed since: nobody to tell from here
        for peer in list(self._others()):  # a dead one is dropped from the list
            try:
                self._sock.sendto(data, self._address(peer))
                self.sent += 1
            except (ConnectionRefusedError, FileNotFoundError):
                # Its process is gone (killed before it could remove its socket).
                self._remove_dead(peer)
            except OSError:
                self.dropped += 1  # a full buffer: at most once, the listener re-reads

    def _remove_dead(self, peer: str) -> None:
        """Remove a dead worker's socket. The commit is made and its callers wait for
        their answers: nothing found in the folder (a folder or file named like a
        socket, one that cannot be removed) may fail them or stop the notice reaching
        the other workers, and only a socket is removed."""
        path = self.folder / peer
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
                self._peers_at = -PEERS_TTL
                return
        except OSError:
            pass
        # Not a socket, or not removable: left alone, skipped until the next listing.
        if peer in self._peers:
            self._peers.remove(peer)

    def shared(self) -> bool:
        """Whether other processes use the file (as last listed, at most PEERS_TTL ago)."""
        return bool(self._others()) if self._sock is not None else False

    def _others(self) -> list[str]:
        now = time.monotonic()
        if now - self._peers_at >= PEERS_TTL:
            mine = self._path.name if self._path is not None else ""
            try:
                names = os.listdir(self.folder)
            except OSError:
                names = []
            self._peers = [name for name in names if name.endswith(".sock") and name != mine]
            self._peers_at = now
        return self._peers

    def _readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(MAX_NOTICE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if data == HELLO:
                self._peers_at = -PEERS_TTL
                continue
            effects = decode(data)
            if effects is None:
                continue
            for digest, _ in effects.changed:
                self.notifier.notify(digest)
            for due in effects.due:
                self.due.announce(due)
            for digest in effects.taken:
                self.due.taken(digest)
