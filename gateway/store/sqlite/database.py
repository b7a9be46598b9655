"""The SQLite store's connection: one per process, in a thread of its own, with group
commit.

SQLite's API blocks, so no call runs on the event loop: every operation is a function
of the connection, queued to the store's thread and answered through a future. The
thread takes every operation waiting when it is free and runs them in one
transaction (`BEGIN IMMEDIATE`, the file's write lock, taken once) and commits once:
one fsync carries the claims and completions of many callers. An operation that fails
(a full disk, a constraint, a fault in its code) fails alone: its batch is rolled back
whole and run again with each operation inside a savepoint of its own, so the failed
one is rolled back to its savepoint and the others commit. A batch runs without
savepoints first because an operation rarely fails and a savepoint is two statements
more per operation; an operation may so run more than once before its transaction
commits, and is a function of what it reads (its last run's result is its answer). A
commit that fails fails the whole batch, and nothing of it is answered as done. A
result reaches its caller only after the commit returned, so nothing is forwarded on
a claim that is not on disk; a batch's answers reach the event loop in one wake-up,
not one per caller.

docs/decisions/sqlite.md says why a thread of the store's own and not aiosqlite
(tests/benchmarks/sqlite_driver.py measures both).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import queue
import sqlite3
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from gateway.errors import StoreError

log = logging.getLogger("gateway.store")

T = TypeVar("T")
Operation = Callable[[sqlite3.Connection], Any]

#: The most operations one transaction carries: a bound on how long the write lock is
#: held and how much one failed commit takes with it.
MAX_BATCH = 256

#: The SQLite result codes that say the file cannot take a write: the disk (or
#: max_page_count) is full, the file or its directory is read-only, or I/O failed.
_WRITE_REFUSED = {
    sqlite3.SQLITE_FULL: "the disk is full (or the file reached its size limit)",
    sqlite3.SQLITE_READONLY: "the file is read-only",
    sqlite3.SQLITE_IOERR: "an I/O error",
    sqlite3.SQLITE_CANTOPEN: "the file cannot be opened",
    sqlite3.SQLITE_BUSY: "another process holds the file's lock",
    sqlite3.SQLITE_LOCKED: "the file is locked",
    sqlite3.SQLITE_CORRUPT: "the file is damaged",
    sqlite3.SQLITE_NOTADB: "the file is not a database",
}


def describe(exc: sqlite3.Error) -> str:
    """What went wrong, in the gateway's words: SQLite's own text can quote a
    statement, so only its result code is named."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    if primary in _WRITE_REFUSED:
        return _WRITE_REFUSED[primary]
    name = getattr(exc, "sqlite_errorname", "") or type(exc).__name__
    return f"SQLite error {name}"


class FileWatch:
    """Whether the file at `path` is still the one the store's connection writes.

    A connection keeps the file it opened: deleted, replaced (a backup restored over
    it, a `mv`) or truncated under a running gateway, SQLite goes on committing to what
    it holds open, and every later open of the path (a restart, another worker) finds
    none of it: each key it held runs again. Its write-ahead log deleted loses the
    commits not yet copied into the file the same way. None of this can be undone from
    inside, so once seen every operation is refused (503, or fail_open) until the
    gateway is restarted, and the readiness check fails."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.wal = path.with_name(path.name + "-wal")
        self._file: tuple[int, int] | None = None
        self._wal: tuple[int, int] | None = None
        self._size = 0
        #: why the file is not the store's any more, once seen ("" while it is)
        self.lost = ""

    def start(self) -> None:
        """Note the file the connection opened (after it opened it)."""
        found = os.stat(self.path)
        self._file = (found.st_dev, found.st_ino)
        self._size = found.st_size

    def check(self) -> str:
        """Why the file is not the store's any more ("" while it is)."""
        if self.lost or self._file is None:
            return self.lost
        try:
            found = os.stat(self.path)
        except FileNotFoundError:
            return self._lose("was deleted")
        except OSError:
            return ""  # not readable now (a permission): SQLite's own errors say so
        if (found.st_dev, found.st_ino) != self._file:
            return self._lose("was replaced by another file")
        if found.st_size < self._size:
            # The store never shrinks its file (no VACUUM): only a truncation does.
            return self._lose(f"was truncated (from {self._size} to {found.st_size} bytes)")
        self._size = found.st_size
        try:
            wal = os.stat(self.wal)
        except FileNotFoundError:
            # SQLite removes the log only when the last connection closes, and this
            # one is open: gone after it was seen, someone removed it.
            return self._lose("lost its write-ahead log (-wal)") if self._wal else ""
        except OSError:
            return ""
        if self._wal is None:
            self._wal = (wal.st_dev, wal.st_ino)
        elif (wal.st_dev, wal.st_ino) != self._wal:
            return self._lose("lost its write-ahead log (-wal, replaced)")
        return ""

    def _lose(self, what: str) -> str:
        self.lost = (
            f"the SQLite store's file {self.path} {what} while the gateway ran: what is "
            "written now would be lost, so nothing is. Restore the file (and its -wal) "
            "from a backup and restart the gateway; a restart without it starts an empty "
            "store, and the keys it held run again"
        )
        log.error("%s", self.lost)
        return self.lost


class _Turn:
    """One wait for the write lock handed to the waiting thread."""

    __slots__ = ("abandoned", "done", "granted", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.granted = False
        self.abandoned = False


class WriteTurns:
    """The turns of the gateway processes on one file at its write lock, in the
    kernel's queue.

    SQLite's own wait for a lock another connection holds is a sleep between tries that
    grows to 100 ms (its busy handler). Two workers that each commit back to back starve
    each other that way: one sleeps while the other takes the lock again in the moment
    between its transactions, for seconds (tests/benchmarks/sqlite.py at `--workers 2`:
    p99 of 0.6-2.5 s and requests timed out). So while other processes share the file,
    each transaction first takes an exclusive `flock` on a file beside it
    (`gateway.db-lock`): a process that waits sleeps in the kernel and is woken when the
    holder lets go. SQLite's lock stays the guarantee; this only orders the processes,
    so a lock file that cannot be opened leaves SQLite's wait alone, and a process
    alone on the file takes no turn (two system calls per transaction saved).

    The wait is bounded: a holder that stopped (SIGSTOP, a debugger) must not leave this
    process's callers without an answer. The blocking `flock` runs in a thread of its
    own, and a turn not given within the deadline is given up (the batch is answered
    with a StoreError); the waiting thread lets go of an abandoned turn as soon as it
    gets it. Every `flock` goes through one descriptor, and the store's thread takes a
    turn itself (without waiting) only while no wait is under way: a lock taken twice
    through one descriptor is one lock, released by either."""

    def __init__(self, database: Path) -> None:
        self.path = database.with_name(database.name + "-lock")
        #: whether other processes share the file (set by the store from its notices)
        self.shared = False
        self.held = False
        self._fd: int | None = None
        self._waits: queue.SimpleQueue[_Turn | None] = queue.SimpleQueue()
        self._waiting = 0
        self._mutex = threading.Lock()
        self._thread: threading.Thread | None = None

    def open(self) -> None:
        try:
            # Not through a link: nothing is written to the file, but O_CREAT through a
            # dangling link would make a file wherever it points.
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
            self._fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            log.warning(
                "the SQLite store cannot open its lock file %s (%s): workers sharing the "
                "file wait for its lock in SQLite's own way, which can starve one of them",
                self.path,
                exc.strerror or exc,
            )
            return
        self._thread = threading.Thread(target=self._wait_turns, name="sqlite-turns", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._waits.put(None)
        # The descriptor is left to the process's exit: the waiting thread may be in
        # `flock` on it still, behind a holder that stopped.

    def take(self, deadline: float) -> bool:
        """On the store's thread, before a transaction: True once this process has the
        turn (or takes none: alone on the file, or no lock file); False if it did not
        come within `deadline` seconds."""
        if self._fd is None or not self.shared:
            return True
        with self._mutex:
            waiting = self._waiting
        if not waiting:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.held = True
                return True
            except BlockingIOError:
                pass
            except OSError:
                return True  # no turns to be had: SQLite's lock alone
        turn = _Turn()
        with self._mutex:
            self._waiting += 1
        self._waits.put(turn)
        if not turn.done.wait(deadline):
            with turn.lock:
                if not turn.done.is_set():
                    turn.abandoned = True
                    return False
        self.held = turn.granted
        return True

    def give(self) -> None:
        """After the transaction's commit or rollback: the next process's turn."""
        if self.held and self._fd is not None:
            self.held = False
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _wait_turns(self) -> None:
        assert self._fd is not None
        while (turn := self._waits.get()) is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                granted = True
            except OSError:
                granted = False  # no turns to be had: SQLite's lock alone
            with turn.lock:
                if turn.abandoned:
                    if granted:
                        fcntl.flock(self._fd, fcntl.LOCK_UN)
                else:
                    turn.granted = granted
                    turn.done.set()
            with self._mutex:
                self._waiting -= 1


class _Stop:
    pass


_STOP = _Stop()


class _Call:
    """An operation queued by a caller on `loop`, answered through `future` (an
    asyncio future: only the loop's thread touches its state)."""

    __slots__ = ("future", "loop", "operation")

    def __init__(
        self, operation: Operation, future: asyncio.Future[Any], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.operation = operation
        self.future = future
        self.loop = loop


def _settle(answers: list[tuple[_Call, Any, BaseException | None]]) -> None:
    """On the loop: give each caller its answer (one still waiting: a cancelled caller
    is gone)."""
    for call, result, error in answers:
        if call.future.done():
            continue
        if error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(result)


class Database:
    """The store's connection to `path` in its thread. `setup(conn)` runs first, on
    the thread (the pragmas, the schema's check and migrations)."""

    def __init__(
        self,
        path: Path,
        *,
        timeout: float,
        setup: Callable[[sqlite3.Connection], None],
        max_batch: int = MAX_BATCH,
    ) -> None:
        self.path = path
        self.timeout = timeout
        self.max_batch = max_batch
        self._setup = setup
        self._queue: queue.SimpleQueue[_Call | _Stop] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._opened: Future[None] = Future()
        self.watch = FileWatch(path)
        self.turns = WriteTurns(path)
        #: the answers of the batch under way, handed to the loop in one wake-up
        self._answers: list[tuple[_Call, Any, BaseException | None]] = []
        #: transactions committed and operations they carried (the group commit's figure)
        self.commits = 0
        self.operations = 0
        #: the writes the transaction under way runs just before its commit (`defer`)
        self._deferred: dict[Hashable, tuple[str, tuple[Any, ...]]] = {}

    async def open(self) -> None:
        """Start the thread and open the file; raises what `setup` raised (a
        SchemaError), or StoreError if the file cannot be opened."""
        self._thread = threading.Thread(target=self._main, name="sqlite-store", daemon=True)
        self._thread.start()
        await asyncio.wrap_future(self._opened)

    async def close(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            return
        self._queue.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    async def run(self, operation: Callable[[sqlite3.Connection], T], what: str) -> T:
        """`operation(conn)`'s result once its transaction is committed; StoreError if
        the file refused it or the commit failed (nothing of it was kept)."""
        if self._thread is None or not self._thread.is_alive():
            raise StoreError(f"the SQLite store at {self.path} is not open ({what})")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put(_Call(operation, future, loop))
        try:
            return await future
        except (sqlite3.Error, OverflowError) as exc:
            # OverflowError: a number past SQLite's 64 bits (a duration config refuses),
            # refused by the driver before anything was written.
            reason = describe(exc) if isinstance(exc, sqlite3.Error) else "a value out of range"
            raise StoreError(f"the SQLite store at {self.path}: {what} failed: {reason}") from exc

    def defer(self, key: Hashable, statement: str, parameters: tuple[Any, ...]) -> None:
        """From an operation (on the thread): run `statement` once just before its
        transaction commits, in place of what was deferred for `key` before in it. A
        row that many operations of a batch would each write (a route's last success)
        is so written once per commit; an operation that fails takes back what it
        deferred, and a commit that fails fails its batch whole as ever."""
        self._deferred[key] = (statement, parameters)

    # -- the thread ----------------------------------------------------------------

    def _main(self) -> None:
        if not self._opened.set_running_or_notify_cancel():
            return  # the start was cancelled before the thread ran
        try:
            conn = sqlite3.connect(
                self.path, timeout=self.timeout, isolation_level=None, check_same_thread=True
            )
        except sqlite3.Error as exc:
            self._opened.set_exception(
                StoreError(f"the SQLite store cannot open {self.path}: {describe(exc)}")
            )
            return
        try:
            self._setup(conn)
        except BaseException as exc:
            conn.close()
            self._opened.set_exception(exc)
            return
        try:
            self.watch.start()
        except OSError as exc:
            conn.close()
            self._opened.set_exception(
                StoreError(f"the SQLite store cannot open {self.path}: {exc.strerror or exc}")
            )
            return
        self.turns.open()
        self._opened.set_result(None)
        try:
            self._serve(conn)
        finally:
            self.turns.close()
            conn.close()

    def _serve(self, conn: sqlite3.Connection) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, _Stop):
                return
            batch = [item]
            stop = False
            while len(batch) < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(more, _Stop):
                    stop = True
                    break
                batch.append(more)
            try:
                self._commit(conn, batch)
            except BaseException as exc:
                # Not an operation's failure (those are its caller's): the connection's.
                # Every caller not yet answered is told, and the thread serves on.
                log.exception("the SQLite store's thread failed a batch")
                answered = {id(call) for call, _, _ in self._answers}
                failed = StoreError(f"{self.path}: the store failed")
                self._answers += [(c, None, failed) for c in batch if id(c) not in answered]
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                if not isinstance(exc, Exception):
                    self._flush()
                    raise
            self._flush()
            if stop:
                return

    def _flush(self) -> None:
        """Hand the batch's answers to their loops: one wake-up per loop, not per caller."""
        answers, self._answers = self._answers, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Call, Any, BaseException | None]]]
        by_loop = {}
        for answer in answers:
            by_loop.setdefault(answer[0].loop, []).append(answer)
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a loop that closed: nobody waits
                loop.call_soon_threadsafe(_settle, items)

    def _commit(self, conn: sqlite3.Connection, batch: list[_Call]) -> None:
        pending, guarded = batch, False
        while pending:
            pending, guarded = self._transaction(conn, pending, guarded)

    def _transaction(
        self, conn: sqlite3.Connection, batch: list[_Call], guarded: bool
    ) -> tuple[list[_Call], bool]:
        """`_locked_transaction` in this process's turn at the write lock."""
        if not self.turns.take(self.timeout):
            busy = StoreError(
                f"the SQLite store at {self.path}: another gateway process held the file's "
                f"write lock for {self.timeout:g}s (is one stopped?)"
            )
            self._answers += [(call, None, busy) for call in batch]
            return [], False
        try:
            return self._locked_transaction(conn, batch, guarded)
        finally:
            self.turns.give()

    def _locked_transaction(
        self, conn: sqlite3.Connection, batch: list[_Call], guarded: bool
    ) -> tuple[list[_Call], bool]:
        """Run `batch` in one transaction and answer its callers, each operation in a
        savepoint if `guarded`; what is left to run in a transaction of its own (after
        SQLite undid this one whole, or after an operation failed in one unguarded),
        and whether that one is guarded."""
        self._deferred = {}
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            self._answers += [(call, None, exc) for call in batch]
            return [], False
        # Under the write lock: no other worker's checkpoint or commit moves the files.
        lost = self.watch.check()
        if lost:
            conn.execute("ROLLBACK")
            self._answers += [(call, None, StoreError(lost)) for call in batch]
            return [], False
        done: list[tuple[_Call, Any, BaseException | None]] = []
        for i, call in enumerate(batch):
            if call.future.cancelled():
                continue  # its caller is gone: it never runs
            deferred = self._deferred
            try:
                if guarded:
                    deferred = dict(deferred)
                    conn.execute("SAVEPOINT op")
                result = call.operation(conn)
                if guarded:
                    conn.execute("RELEASE op")
                done.append((call, result, None))
            except Exception as exc:
                self._deferred = deferred
                if not guarded and conn.in_transaction:
                    # What it wrote before it failed cannot be told from the others'
                    # writes: the batch goes whole, and runs again in savepoints. (A
                    # rollback that fails is the connection's failure: `_serve` answers.)
                    conn.execute("ROLLBACK")
                    return batch, True
                if conn.in_transaction:
                    try:
                        conn.execute("ROLLBACK TO op")
                        conn.execute("RELEASE op")
                    except sqlite3.Error:
                        pass  # the commit below fails, and says so to every caller
                if not conn.in_transaction:
                    # SQLite rolled the whole transaction back (a full disk, an I/O
                    # error): what ran before in it is undone too, so it failed the same
                    # way; the operations after it get a transaction of their own.
                    self._answers += [(call, None, exc)]
                    self._answers += [(earlier, None, exc) for earlier, _, _ in done]
                    return batch[i + 1 :], False
                done.append((call, None, exc))
        try:
            for statement, parameters in self._deferred.values():
                conn.execute(statement, parameters)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            self._answers += [(call, None, exc) for call, _, _ in done]
            return [], False
        self.commits += 1
        self.operations += len(done)
        self._answers += done
        return [], False
