"""A chain's disk as a read-only NBD export on a unix socket: the children of one snapshot
boot on qcow2 overlays whose backing file is this export, so their disk blocks come from
the chain's chunks on first access (the local store, else the hub; ``ChunkSource``
verifies each) and no disk image is assembled. docs/engine.md, "Disk over NBD".

Protocol (github.com/NetworkBlockDevice/nbd doc/proto.md), the subset QEMU's client uses:

* handshake: fixed newstyle (with ``NO_ZEROES``); options ``GO`` and ``INFO`` (export size
  and flags, block sizes when asked), ``EXPORT_NAME``, ``STRUCTURED_REPLY``, ``LIST``,
  ``ABORT``; every other option is answered ``ERR_UNSUP``. One export, ``disk`` (the empty
  default name also selects it).
* transmission: ``READ`` (structured replies: data chunks and holes, zero ranges are holes
  and cost no fetch; simple replies when the client did not negotiate them), ``FLUSH``
  (nothing to flush: success), ``DISC``; ``WRITE``, ``TRIM`` and ``WRITE_ZEROES`` are
  refused with ``EPERM`` (the export is read-only: a child writes to its own overlay).
  Any other command gets ``EINVAL``.

A chunk that cannot be read (missing and the hub gone, or failing verification) fails that
read with ``EIO``, is logged and kept in ``NbdServer.failures`` with its digest and the
client's pid; the connection and the server go on. Client input is untrusted: a wrong
magic, unknown client flags, an option longer than ``MAX_OPTION_BYTES`` or more than
``MAX_OPTIONS`` options end the connection (after an error reply where the protocol has
one); a request past the export's end or longer than the block size limit gets
``EINVAL``; a write's payload over ``MAX_REQUEST_BYTES`` ends the connection instead of
being read; a client has ``HANDSHAKE_TIMEOUT`` seconds to choose the export.

Threads: per connection, one reads its requests and up to ``MAX_READS_PER_CONNECTION``
answer its reads, so a read waiting for a chunk from the hub does not hold up the client's
next one, and a client that stops reading its replies (a frozen QEMU) blocks only its own
threads. Replies may come out of order (handles tell them apart); each message is sent
whole.

Memory: the ``ChunkSource``'s LRU of decompressed chunks (16 x 2 MiB, shared), plus the
reads being answered, at most ``MAX_READS_PER_CONNECTION`` per connection, each at most
``MAX_BLOCK_BYTES`` (``MAX_REQUEST_BYTES`` for a client that did not ask for the block
sizes). A structured
reply goes run by run: the pieces of a request that chunks provide, joined across gaps
under ``MIN_HOLE_BYTES`` (sent as zeros; larger gaps are holes), one data chunk per run,
straight from the decoded chunk when the run is one piece, else through a buffer of the
run's length. A simple reply is built in one buffer of the request's length. At most
``MAX_CONNECTIONS`` clients at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from forkd.engine.lazy.chunks import ChunkSource
from forkd.engine.lazy.layout import ImageLayout, Segment
from forkd.engine.qemu import create_overlay
from forkd.errors import InvalidInput
from forkd.pack.imagemap import PAGE_SIZE

log = logging.getLogger(__name__)

EXPORT_NAME = "disk"
SOCKET_NAME = "disk.nbd.sock"

# Limits (docs/engine.md, "Disk over NBD").
MAX_CONNECTIONS = 256  # one per child QEMU; more are closed at once
MAX_READS_PER_CONNECTION = 4  # a client's reads answered at once, each by its own thread
MAX_OPTIONS = 32  # options one client may send before it must choose the export
MAX_OPTION_BYTES = 4096 + 64  # the longest option we read: an export name (<= 4096) + header
MIN_BLOCK_BYTES = 1  # any alignment is served
PREFERRED_BLOCK_BYTES = 4096
MAX_BLOCK_BYTES = 2 << 20  # advertised; one chunk's worth of image
MAX_REQUEST_BYTES = 32 << 20  # what the protocol lets a client send without block sizes
HANDSHAKE_TIMEOUT = 30.0  # seconds a client may take to reach the transmission phase
ERROR_MESSAGE_BYTES = 1024
KEPT_ERRORS = 64
ACCEPT_RETRY_SECONDS = 0.1
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL

# -- protocol constants (doc/proto.md, "Values") ------------------------------------------
NBDMAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
OPTION_REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
STRUCTURED_REPLY_MAGIC = 0x668E33EF

FLAG_FIXED_NEWSTYLE = 1 << 0
FLAG_NO_ZEROES = 1 << 1
CLIENT_FLAGS = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES

FLAG_HAS_FLAGS = 1 << 0
FLAG_READ_ONLY = 1 << 1
FLAG_SEND_FLUSH = 1 << 2
FLAG_CAN_MULTI_CONN = 1 << 8
TRANSMISSION_FLAGS = FLAG_HAS_FLAGS | FLAG_READ_ONLY | FLAG_SEND_FLUSH | FLAG_CAN_MULTI_CONN

OPT_EXPORT_NAME = 1
OPT_ABORT = 2
OPT_LIST = 3
OPT_INFO = 6
OPT_GO = 7
OPT_STRUCTURED_REPLY = 8

REP_ACK = 1
REP_SERVER = 2
REP_INFO = 3
REP_ERR_UNSUP = (1 << 31) + 1
REP_ERR_INVALID = (1 << 31) + 3
REP_ERR_UNKNOWN = (1 << 31) + 6
REP_ERR_TOO_BIG = (1 << 31) + 9

INFO_EXPORT = 0
INFO_BLOCK_SIZE = 3

CMD_READ = 0
CMD_WRITE = 1
CMD_DISC = 2
CMD_FLUSH = 3
CMD_TRIM = 4
CMD_WRITE_ZEROES = 6
WRITING_COMMANDS = (CMD_WRITE, CMD_TRIM, CMD_WRITE_ZEROES)

REPLY_FLAG_DONE = 1 << 0
REPLY_TYPE_NONE = 0
REPLY_TYPE_OFFSET_DATA = 1
REPLY_TYPE_OFFSET_HOLE = 2
REPLY_TYPE_ERROR = (1 << 15) + 1

EPERM = 1
EIO = 5
EINVAL = 22

_OPTION = struct.Struct(">QII")  # magic, option, length
_OPTION_REPLY = struct.Struct(">QIII")  # magic, option, reply type, length
_REQUEST = struct.Struct(">IHHQQI")  # magic, flags, type, handle, offset, length
_SIMPLE_REPLY = struct.Struct(">IIQ")  # magic, error, handle
_CHUNK = struct.Struct(">IHHQI")  # magic, flags, type, handle, length
DRAIN_BYTES = 1 << 16
MIN_HOLE_BYTES = 64 << 10  # a gap between data pieces sent as a hole, not as zeros
Piece = tuple[int, int, Segment]  # ImageLayout.pieces: (offset in the request, bytes, segment)


@dataclass(frozen=True)
class ReadFailure:
    """A read that failed because a chunk could not be had: which client (the QEMU's pid,
    from the socket's peer credentials; 0 if unknown), which chunk, and why."""

    pid: int
    digest: str
    message: str


class _Hangup(Exception):
    """The connection ends here: the peer left, or broke the protocol (logged)."""


class NbdServer:
    """The read-only export of one image layout on a unix socket; a thread per client."""

    def __init__(self, layout: ImageLayout, socket_path: Path,
                 on_access: Callable[[str], None] | None = None) -> None:
        """``on_access(digest)`` is called before each chunk a read needs is read (the
        prefetch records the order); if it raises, that read fails like the chunk's."""
        if len(str(socket_path)) > UNIX_PATH_MAX:
            raise InvalidInput(f"NBD socket path {socket_path} is longer than the "
                               f"{UNIX_PATH_MAX} bytes a unix socket address holds; use a "
                               "shorter run directory ($FORKD_RUN)")
        self.layout = layout
        self.socket_path = socket_path
        self.on_access = on_access
        self._failures: deque[ReadFailure] = deque(maxlen=KEPT_ERRORS)
        self._lock = threading.Lock()
        self._clients: dict[socket.socket, threading.Thread] = {}
        # Every client thread not yet joined: one that has left _clients (its connection
        # ended, its place is free) may still be finishing; close() waits for it too.
        self._threads: set[threading.Thread] = set()
        self._closing = False
        socket_path.unlink(missing_ok=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(str(socket_path))
            os.chmod(socket_path, 0o600)  # the disk may hold secrets: its owner (QEMU) only
            self._inode = os.stat(socket_path).st_ino  # close removes this one only
            self._listener.listen(64)
        except OSError:
            self._listener.close()
            raise
        self._acceptor = threading.Thread(target=self._accept, name=f"nbd {socket_path.name}",
                                          daemon=True)
        self._acceptor.start()

    @property
    def failures(self) -> list[ReadFailure]:
        """The most recent failed reads (at most ``KEPT_ERRORS``), oldest first."""
        with self._lock:
            return list(self._failures)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._clients)

    def close(self) -> None:
        """Stop accepting, drop every connection, wait for the threads; idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            clients = list(self._clients.items())
            threads = list(self._threads)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._acceptor.join()
        for sock, _ in clients:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join()
        with contextlib.suppress(OSError):
            if os.stat(self.socket_path).st_ino == self._inode:  # not a later export's
                self.socket_path.unlink()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._closing:
                    return
                log.warning("%s: accept failed (%s); retrying", self.socket_path, exc)
                time.sleep(ACCEPT_RETRY_SECONDS)  # e.g. out of file descriptors for a moment
                continue
            with self._lock:
                refuse = self._closing or len(self._clients) >= MAX_CONNECTIONS
                if not refuse:
                    thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                              name=f"nbd client {self.socket_path.name}")
                    self._clients[sock] = thread
                    self._threads = {t for t in self._threads if t.is_alive()}
                    self._threads.add(thread)
                    thread.start()  # under the lock: close() never joins an unstarted thread
            if refuse:
                log.warning("%s: refusing a client: %d connections already (the limit)",
                            self.socket_path, MAX_CONNECTIONS)
                sock.close()

    def _serve(self, sock: socket.socket) -> None:
        try:
            _Session(self, sock).run()
        finally:
            with self._lock:
                self._clients.pop(sock, None)
            sock.close()

    def record_failure(self, failure: ReadFailure) -> None:
        log.error("%s", failure.message)
        with self._lock:
            self._failures.append(failure)


class _Session:
    """One client: the handshake, then its requests. Its thread reads the requests and
    answers all but reads itself; reads go to the connection's own workers (at most
    ``MAX_READS_PER_CONNECTION``), so a read waiting for the hub does not hold up the next,
    and a client that stops reading its replies blocks only its own threads. Replies may
    come out of order (the protocol allows it); each message is sent whole, under the
    connection's send lock."""

    def __init__(self, server: NbdServer, sock: socket.socket) -> None:
        self.server = server
        self.layout = server.layout
        self.sock = sock
        self.structured = False
        self.max_request = MAX_REQUEST_BYTES
        self.pid = _peer_pid(sock)
        self._send_lock = threading.Lock()
        self._read_slots = threading.BoundedSemaphore(MAX_READS_PER_CONNECTION)
        self._reads = ThreadPoolExecutor(max_workers=MAX_READS_PER_CONNECTION,
                                         thread_name_prefix="nbd read")

    def run(self) -> None:
        try:
            self.sock.settimeout(HANDSHAKE_TIMEOUT)
            if not self._handshake():
                return
            self.sock.settimeout(None)
            self._transmission()
        except (_Hangup, OSError) as exc:
            if str(exc):
                log.info("%s: client connection ends: %s", self.server.socket_path, exc)
        finally:
            self._reads.shutdown(wait=True)  # every read answered (or failed) before it closes

    # -- I/O ------------------------------------------------------------------
    def _recv(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise _Hangup("")  # the client closed its end
            got += k
        return bytes(buf)

    def _send(self, *parts: bytes | bytearray | memoryview) -> None:
        """All of ``parts``, in order, with as few system calls as the socket allows."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        with self._send_lock:
            while views:
                sent = self.sock.sendmsg(views)
                while views and sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                if sent:
                    views[0] = views[0][sent:]

    # -- handshake ------------------------------------------------------------
    def _handshake(self) -> bool:
        """True when the client chose the export (transmission follows)."""
        self._send(struct.pack(">QQH", NBDMAGIC, IHAVEOPT, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))
        (client_flags,) = struct.unpack(">I", self._recv(4))
        if client_flags & ~CLIENT_FLAGS:
            raise _Hangup(f"unknown client flags {client_flags:#x}")
        no_zeroes = bool(client_flags & FLAG_NO_ZEROES)
        for _ in range(MAX_OPTIONS):
            magic, option, length = _OPTION.unpack(self._recv(_OPTION.size))
            if magic != IHAVEOPT:
                raise _Hangup(f"bad option magic {magic:#x}")
            if length > MAX_OPTION_BYTES:
                self._option_reply(option, REP_ERR_TOO_BIG,
                                   f"option of {length} bytes; at most {MAX_OPTION_BYTES}")
                raise _Hangup(f"option {option} of {length} bytes, over {MAX_OPTION_BYTES}")
            data = self._recv(length)
            if option == OPT_EXPORT_NAME:
                if data.decode(errors="replace") not in (EXPORT_NAME, ""):
                    raise _Hangup(f"unknown export {data[:64]!r}")
                self._send(struct.pack(">QH", self.layout.size, TRANSMISSION_FLAGS),
                           b"" if no_zeroes else bytes(124))
                return True
            if self._option(option, data):
                return True
        raise _Hangup(f"more than {MAX_OPTIONS} options")

    def _option(self, option: int, data: bytes) -> bool:
        """Answer one option; True after a successful ``GO``."""
        if option in (OPT_GO, OPT_INFO):
            return self._info(option, data) and option == OPT_GO
        if option == OPT_STRUCTURED_REPLY:
            if data:
                self._option_reply(option, REP_ERR_INVALID, "STRUCTURED_REPLY takes no data")
            else:
                self.structured = True
                self._option_reply(option, REP_ACK)
        elif option == OPT_LIST:
            if data:
                self._option_reply(option, REP_ERR_INVALID, "LIST takes no data")
            else:
                name = EXPORT_NAME.encode()
                self._option_reply(option, REP_SERVER, struct.pack(">I", len(name)) + name)
                self._option_reply(option, REP_ACK)
        elif option == OPT_ABORT:
            self._option_reply(option, REP_ACK)
            raise _Hangup("")
        else:
            self._option_reply(option, REP_ERR_UNSUP, f"option {option} is not supported")
        return False

    def _info(self, option: int, data: bytes) -> bool:
        """``GO``/``INFO``: name length, name, count of info requests, the requests."""
        if len(data) < 6:
            self._option_reply(option, REP_ERR_INVALID, "option data too short")
            return False
        (name_length,) = struct.unpack_from(">I", data)
        if name_length > len(data) - 6:
            self._option_reply(option, REP_ERR_INVALID, "export name longer than the option")
            return False
        name = data[4 : 4 + name_length]
        (count,) = struct.unpack_from(">H", data, 4 + name_length)
        if len(data) != 6 + name_length + 2 * count:
            self._option_reply(option, REP_ERR_INVALID, "info request count does not match")
            return False
        if name.decode(errors="replace") not in (EXPORT_NAME, ""):
            self._option_reply(option, REP_ERR_UNKNOWN, f"no export {name[:64]!r}; "
                               f"this server has {EXPORT_NAME!r}")
            return False
        asked = struct.unpack_from(f">{count}H", data, 6 + name_length)
        self._option_reply(option, REP_INFO,
                           struct.pack(">HQH", INFO_EXPORT, self.layout.size, TRANSMISSION_FLAGS))
        if INFO_BLOCK_SIZE in asked:
            self._option_reply(option, REP_INFO, struct.pack(
                ">HIII", INFO_BLOCK_SIZE, MIN_BLOCK_BYTES, PREFERRED_BLOCK_BYTES, MAX_BLOCK_BYTES))
            if option == OPT_GO:  # the client promised to keep to them
                self.max_request = MAX_BLOCK_BYTES
        self._option_reply(option, REP_ACK)
        return True

    def _option_reply(self, option: int, reply: int, data: bytes | str = b"") -> None:
        payload = data.encode() if isinstance(data, str) else data
        self._send(_OPTION_REPLY.pack(OPTION_REPLY_MAGIC, option, reply, len(payload)), payload)

    # -- transmission -----------------------------------------------------------
    def _transmission(self) -> None:
        while True:
            magic, _flags, command, handle, offset, length = _REQUEST.unpack(
                self._recv(_REQUEST.size))
            if magic != REQUEST_MAGIC:
                raise _Hangup(f"bad request magic {magic:#x}")
            if command == CMD_DISC:
                return
            if command == CMD_READ:
                self._read_slots.acquire()
                self._reads.submit(self._read_task, handle, offset, length)
            elif command == CMD_FLUSH:
                self._status(handle, 0)
            elif command in WRITING_COMMANDS:
                if command == CMD_WRITE:
                    self._drain(length)
                self._status(handle, EPERM, "the export is read-only; write to an overlay")
            else:
                self._status(handle, EINVAL, f"command {command} is not supported")

    def _read_task(self, handle: int, offset: int, length: int) -> None:
        """One read, on a worker; a broken connection wakes the request reader."""
        try:
            self._read(handle, offset, length)
        except OSError:
            self._hang_up()
        except Exception:  # a bug: drop this client (it would wait forever), keep the export
            log.exception("%s: answering a read of client pid %d failed", self.server.socket_path,
                          self.pid)
            self._hang_up()
        finally:
            self._read_slots.release()

    def _hang_up(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _drain(self, length: int) -> None:
        """Read and drop a write's payload, bounded."""
        if length > MAX_REQUEST_BYTES:
            raise _Hangup(f"write payload of {length} bytes, over {MAX_REQUEST_BYTES}")
        while length:
            length -= len(self._recv(min(length, DRAIN_BYTES)))

    def _status(self, handle: int, error: int, message: str = "") -> None:
        """A reply with no data: success or an error."""
        if self.structured and error:
            self._error_chunk(handle, error, message)
        else:
            self._send(_SIMPLE_REPLY.pack(SIMPLE_REPLY_MAGIC, error, handle))

    def _error_chunk(self, handle: int, error: int, message: str) -> None:
        text = message.encode()[:ERROR_MESSAGE_BYTES].decode(errors="ignore").encode()  # UTF-8
        payload = struct.pack(">IH", error, len(text)) + text
        self._send(_CHUNK.pack(STRUCTURED_REPLY_MAGIC, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, handle,
                               len(payload)), payload)

    def _read(self, handle: int, offset: int, length: int) -> None:
        size = self.layout.size
        if length == 0 or length > self.max_request or offset > size or length > size - offset:
            self._read_error(handle, EINVAL, f"read of {length} bytes at {offset}: the export "
                             f"has {size} bytes and a read takes 1 to {self.max_request}")
            return
        if self.structured:
            self._read_structured(handle, offset, length)
        else:
            self._read_simple(handle, offset, length)

    def _read_error(self, handle: int, error: int, message: str) -> None:
        if self.structured:  # a read is never answered with a simple reply then
            self._error_chunk(handle, error, message)
        else:
            self._send(_SIMPLE_REPLY.pack(SIMPLE_REPLY_MAGIC, error, handle))

    def _chunk_bytes(self, digest: str) -> bytes | None:
        """A chunk's uncompressed bytes, or None (recorded) when it cannot be had."""
        try:
            if self.server.on_access is not None:
                self.server.on_access(digest)
            return self.layout.source.read(digest)
        except Exception as exc:  # any failure of one chunk fails one read, not the server
            self.server.record_failure(ReadFailure(
                self.pid, digest, f"{self.server.socket_path}: disk chunk {digest} cannot be "
                f"read for client pid {self.pid}: {exc}"))
            return None

    def _read_structured(self, handle: int, offset: int, length: int) -> None:
        """A data chunk per run of provided pieces, a hole between runs, then DONE."""
        pos = 0
        for start, stop, pieces in _runs(self.layout.pieces(offset, length)):
            if start > pos:
                self._hole(handle, offset + pos, start - pos)
            data = self._run_bytes(offset, start, stop, pieces)
            if data is None:
                self._error_chunk(handle, EIO, f"a disk chunk of the {length} bytes at "
                                  f"{offset} cannot be read (the server's log names it)")
                return
            self._send(_CHUNK.pack(STRUCTURED_REPLY_MAGIC, 0, REPLY_TYPE_OFFSET_DATA, handle,
                                   8 + stop - start), struct.pack(">Q", offset + start), data)
            pos = stop
        if pos < length:
            self._hole(handle, offset + pos, length - pos)
        self._send(_CHUNK.pack(STRUCTURED_REPLY_MAGIC, REPLY_FLAG_DONE, REPLY_TYPE_NONE, handle,
                               0))

    def _run_bytes(self, offset: int, start: int, stop: int, pieces: list[Piece]
                   ) -> bytes | bytearray | memoryview | None:
        """Bytes ``[start, stop)`` of the request at ``offset`` (zero where no piece is),
        or None when a chunk cannot be read. One piece that covers it all is a view of its
        chunk: no copy."""
        if len(pieces) == 1 and pieces[0][0] == start and pieces[0][1] == stop - start:
            at, n, seg = pieces[0]
            data = self._chunk_bytes(seg.digest)
            if data is None:
                return None
            begin = _chunk_offset(seg, offset + at)
            return memoryview(data)[begin : begin + n]
        out = bytearray(stop - start)
        for at, n, seg in pieces:
            data = self._chunk_bytes(seg.digest)
            if data is None:
                return None
            begin = _chunk_offset(seg, offset + at)
            out[at - start : at - start + n] = memoryview(data)[begin : begin + n]
        return out

    def _hole(self, handle: int, offset: int, length: int) -> None:
        self._send(_CHUNK.pack(STRUCTURED_REPLY_MAGIC, 0, REPLY_TYPE_OFFSET_HOLE, handle, 12),
                   struct.pack(">QI", offset, length))

    def _read_simple(self, handle: int, offset: int, length: int) -> None:
        """The whole range in one buffer (the error, if any, must come before the data)."""
        data = self._run_bytes(offset, 0, length, self.layout.pieces(offset, length))
        if data is None:
            self._send(_SIMPLE_REPLY.pack(SIMPLE_REPLY_MAGIC, EIO, handle))
            return
        self._send(_SIMPLE_REPLY.pack(SIMPLE_REPLY_MAGIC, 0, handle), data)


def _peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a unix socket (0 when unknown)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return 0
    return int(struct.unpack("3i", creds)[0])


def _runs(pieces: list[Piece]) -> Iterator[tuple[int, int, list[Piece]]]:
    """Group a request's pieces (sorted) into runs: (start, stop, pieces), a gap of less
    than ``MIN_HOLE_BYTES`` inside a run (sent as zeros), larger gaps between runs (holes).
    A fragmented image then costs one data chunk per run, not one per 4 KiB piece."""
    run: list[Piece] = []
    for piece in pieces:
        if run and piece[0] - (run[-1][0] + run[-1][1]) >= MIN_HOLE_BYTES:
            yield run[0][0], run[-1][0] + run[-1][1], run
            run = []
        run.append(piece)
    if run:
        yield run[0][0], run[-1][0] + run[-1][1], run


def _chunk_offset(seg: Segment, image_offset: int) -> int:
    """Where image byte ``image_offset`` (inside ``seg``) sits in the segment's chunk."""
    return seg.chunk_page * PAGE_SIZE + image_offset - seg.page * PAGE_SIZE


class DiskExport:
    """A chain's disk served over NBD for the children of one snapshot (``start_disk_export``)."""

    def __init__(self, server: NbdServer) -> None:
        self.server = server
        self.socket = server.socket_path

    @property
    def size(self) -> int:
        return self.server.layout.size

    @property
    def errors(self) -> list[str]:
        """The most recent failed reads, each naming its chunk and client pid."""
        return [f.message for f in self.server.failures]

    @property
    def failures(self) -> list[ReadFailure]:
        """The same as records: which child's QEMU (pid) could not read which chunk."""
        return self.server.failures

    def backing_spec(self) -> str:
        """What a qcow2 overlay names as its backing file (format raw): QEMU's NBD URL."""
        return f"nbd+unix:///{EXPORT_NAME}?socket={self.socket}"

    def create_overlay(self, path: Path) -> None:
        """An empty qcow2 overlay at ``path`` on this export: the child's writes land in it,
        never in the export (which refuses writes). Written with the export's size: nothing
        connects to the export to learn it."""
        create_overlay(path, self.backing_spec(), "raw", self.size)

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> DiskExport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_disk_export(source: ChunkSource, run_dir: Path, *,
                      on_access: Callable[[str], None] | None = None) -> DiskExport:
    """Serve the disk of ``source``'s chain on ``run_dir/disk.nbd.sock`` until ``close``;
    ``on_access(digest)`` hears of each chunk a read touches, in order."""
    if not any("disk" in link.manifest.maps for link in source.chain):
        raise InvalidInput(f"{source.name} has no disk image to export")
    layout = ImageLayout(source, "disk")
    run_dir.mkdir(parents=True, exist_ok=True)
    return DiskExport(NbdServer(layout, run_dir.resolve() / SOCKET_NAME, on_access))
