"""Socket-framed backends: ``tcp`` (payload on the stream) and ``shm`` (payload in shared memory).

Both keep **one persistent connection per sender**. Every chunk is announced by
a fixed, versioned frame (``FRAME``); what differs is where the bytes travel:

* ``tcp`` - the payload follows the frame on the stream. The sender posts frame,
  header and every ``[layer][block]`` region in one ``sendmsg`` (scatter/gather,
  no sender-side copy); the receiver ``recv_into``s straight into the slot.
* ``shm`` - same host. The sender attaches the receiver's pool segment and
  copies header + regions straight into the slot (one copy, the minimum), then
  sends the frame on a Unix socket as the arrival notification.

A connection proves itself before anything on it is read: its preamble names the
sender and presents the session's data token (:func:`kvrelay.transport.protocol.data_token`),
which D accepts once. Preambles are read by one gate thread (:mod:`kvrelay.transport.backends.gate`:
one overall deadline per connection, a cap on connections without one, accepting never
stops), so a connection costs a thread only once it has authenticated. A connection that
fails is closed and counted, and its close says nothing about the sender it named. The
sender's socket has a send timeout (``SEND_STALL_S``): a receiver that stops reading fails
the write, and the push frees its blocks, instead of hanging it. Every chunk frame presents the transfer's
grant token; D asks ``admit`` *before* reading the payload, and discards a refused
one without touching the slot.

An authenticated connection that closes while its sender has active transfers is
reported as a dead peer at once, without waiting for the heartbeat timeout.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import struct
import threading
from collections.abc import Callable

import msgspec
import xxhash

from kvrelay.common.errors import PeerDeadError, ProtocolError, TransportError
from kvrelay.common.wire import HEADER_SIZE
from kvrelay.transport.arenas import SharedArena
from kvrelay.transport.backends.base import (
    Payload,
    ReceiverBackend,
    ReceiverHooks,
    SenderBackend,
    WriteHandle,
    WriteState,
    host_buffers,
)
from kvrelay.transport.backends.gate import Gate
from kvrelay.transport.events import Refusal
from kvrelay.transport.pool import ReceivePool, SlotRef
from kvrelay.transport.protocol import Grant

log = logging.getLogger(__name__)
# magic, version, kind, pad, transfer tag, grant token, chunk, slot, gen, nbytes
FRAME = struct.Struct("<4sBBH16s16sIIIQ")
FRAME_MAGIC = b"KVRD"
FRAME_VERSION = 2               # 2: grant token; the preamble presents the session's data token
TOKEN_BYTES = 32                # the data token (HMAC-SHA256) in the preamble
PREAMBLE_S = 5.0                # a connection must present its whole preamble within this of its accept
MAX_PENDING = 256               # connections waiting for their preamble; beyond, the oldest is closed
SEND_STALL_S = 10.0             # a send that makes no progress this long fails (timeouts.chunk_s's default)
KIND_HELLO, KIND_CHUNK = 0, 1
MAX_SENDER_ID = 512
_DRAIN = 1 << 20
# Receive granularity: the hash is updated after each read, and every read returns to Python and
# re-takes the GIL (inside a vLLM worker, shared with the engine's own threads). 4 MiB: a chunk in
# one or two reads. The 5-8 ms per 2 MiB chunk once blamed on those re-takes was page faults in a
# fresh receive pool (see transport/pool.py: the pool is now populated at start-up).
_PIECE = 4 << 20


class SocketInfo(msgspec.Struct, frozen=True):
    family: str            # "inet" | "unix"
    address: str           # host or abstract unix name
    port: int = 0
    shm_name: str = ""


def _recv_exact(sock: socket.socket, view: memoryview, *, piece: int = 0,
                on_data: Callable[[int], None] | None = None) -> bool:
    """Fill ``view`` from the stream, at most ``piece`` bytes per read (0: no limit), calling
    ``on_data(bytes_so_far)`` after each read. False on EOF before the first byte; raises
    PeerDeadError on EOF mid-way."""
    got, total = 0, view.nbytes
    while got < total:
        n = sock.recv_into(view[got:], min(total - got, piece) if piece else 0)
        if n == 0:
            if got == 0:
                return False
            raise PeerDeadError(f"connection closed mid-frame ({got}/{total} bytes)")
        got += n
        if on_data is not None:
            on_data(got)
    return True


def _preamble_need(buf: bytes) -> int:
    """How long the preamble that starts with ``buf`` is (the frame first, then name and token)."""
    if len(buf) < FRAME.size:
        return FRAME.size
    magic, ver, kind, _, _, _, _, _, _, n = FRAME.unpack(buf[:FRAME.size])
    n = int(n)
    if magic != FRAME_MAGIC or ver != FRAME_VERSION or kind != KIND_HELLO or n > MAX_SENDER_ID:
        raise ValueError("data connection without a valid preamble")
    return FRAME.size + n + TOKEN_BYTES


def _recv_hashed(sock: socket.socket, view: memoryview, skip: int) -> int | None:
    """``_recv_exact`` in pieces that hashes the bytes past ``skip`` (the payload) while they
    are still in cache. Returns the xxh3_64 of ``view[skip:]``, or None on EOF before any byte."""
    h = xxhash.xxh3_64()
    hashed = skip

    def feed(got: int) -> None:
        nonlocal hashed
        if got > hashed:
            h.update(view[hashed:got])
            hashed = got

    return h.intdigest() if _recv_exact(sock, view, piece=_PIECE, on_data=feed) else None


def _as_bytes(view: memoryview) -> memoryview:
    """A flat byte view of ``view`` (typed or multi-dimensional regions, e.g. tensors)."""
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _sendmsg_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """``sendmsg`` a buffer list completely, resuming after partial sends (no copies)."""
    bufs = [_as_bytes(b) for b in bufs]
    while bufs:
        sent = sock.sendmsg(bufs[:512])
        while sent and bufs:
            if sent >= bufs[0].nbytes:
                sent -= bufs[0].nbytes
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][sent:]
                sent = 0


class SocketReceiver(ReceiverBackend):
    """Accepts one connection per sender and reads frames (and, for tcp, payloads)."""

    def __init__(self, *, inline_payload: bool, host: str = "127.0.0.1", port: int = 0, advertise: str = "") -> None:
        """``host``/``port``: where the tcp listener binds; ``advertise``: the address sent to
        senders (default ``host``)."""
        self.inline = inline_payload
        self.needs_shared_pool = not inline_payload
        if inline_payload:
            self._lsock = socket.create_server((host, port), backlog=64)
            self._info = SocketInfo("inet", advertise or host, self._lsock.getsockname()[1])
        else:
            self._lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            name = f"kvrelay-{id(self):x}-{threading.get_native_id()}"
            self._lsock.bind("\0" + name)
            self._lsock.listen(64)
            self._info = SocketInfo("unix", name)
        self._conns: set[socket.socket] = set()
        self._closed = threading.Event()
        self._pool: ReceivePool | None = None
        self._tokens: dict[str, bytes] = {}      # sender -> data token its next connection presents
        self._tokens_lock = threading.Lock()
        self._gate: Gate | None = None

    def start(self, pool: ReceivePool, hooks: ReceiverHooks) -> None:
        self._pool, self._hooks = pool, hooks
        if not self.inline:
            self._info = SocketInfo("unix", self._info.address, shm_name=pool.arena.name)
        self._gate = Gate(self._lsock, need=_preamble_need, check=self._check, serve=self._serve,
                          refused=self._refused, on_accept=self._tune, deadline_s=PREAMBLE_S, max_pending=MAX_PENDING)
        threading.Thread(target=self._gate.run, name="kvrelay-sock-gate", daemon=True).start()

    def info(self) -> bytes:
        return msgspec.msgpack.encode(self._info)

    def on_hello(self, sender_id: str, info: bytes, data_token: bytes) -> None:
        with self._tokens_lock:
            self._tokens[sender_id] = data_token

    def on_peer_gone(self, sender_id: str) -> None:
        with self._tokens_lock:
            self._tokens.pop(sender_id, None)

    def _serve(self, conn: socket.socket, sender: str) -> None:
        """An authenticated connection's frames (its own thread, from the gate)."""
        self._conns.add(conn)
        try:
            while self._read_chunk(conn, sender):
                pass
            reason = "data connection closed"
        except (OSError, TransportError) as exc:
            reason = f"data connection failed: {exc}"
        finally:
            self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()
        if not self._closed.is_set():
            self._hooks.peer_lost(sender, reason)

    def _tune(self, conn: socket.socket) -> None:
        if self.inline:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)

    def _refused(self, reason: str) -> None:
        self._hooks.refused(Refusal.UNAUTHENTICATED_DATA, reason)

    def _check(self, preamble: bytes) -> str | None:
        """The sender whose session token this preamble presents (single use), or None (refused, counted)."""
        n = len(preamble) - FRAME.size - TOKEN_BYTES
        name, token = preamble[FRAME.size:FRAME.size + n].decode(errors="replace"), preamble[FRAME.size + n:]
        with self._tokens_lock:
            want = self._tokens.get(name)
            if want is not None and hmac.compare_digest(want, token):
                del self._tokens[name]                   # single use
                return name
        self._refused(f"data connection for {name!r} without its session token")
        return None

    def _read_chunk(self, conn: socket.socket, sender: str) -> bool:
        assert self._pool is not None
        frame = bytearray(FRAME.size)
        got = conn.recv_into(frame, FRAME.size, socket.MSG_WAITALL)
        if got == 0:
            return False
        if got < FRAME.size:
            raise PeerDeadError(f"connection closed mid-frame ({got}/{FRAME.size} bytes)")
        magic, ver, kind, _, tag, token, chunk, slot, gen, nbytes = FRAME.unpack(frame)
        if magic != FRAME_MAGIC or ver != FRAME_VERSION or kind != KIND_CHUNK:
            raise ProtocolError(f"bad data frame (magic {magic!r}, version {ver}, kind {kind})")
        ref = SlotRef(slot, gen)
        if not self.inline:                 # shm: the bytes are already in the slot
            self._hooks.deliver(sender, tag, chunk, ref, token)
            return True
        if not HEADER_SIZE <= nbytes <= self._pool.slot_bytes:
            raise ProtocolError(f"frame of {nbytes} bytes does not fit a {self._pool.slot_bytes}-byte slot")
        if self._hooks.admit(sender, tag, chunk, ref, token) is not None:
            self._drain(conn, nbytes)       # refused (counted): the slot is not touched
            return True
        try:
            self._pool.begin_write(ref)
        except TransportError as exc:
            log.info("data frame for stale slot from %s: %s", sender, exc)
            self._drain(conn, nbytes)
            self._hooks.deliver(sender, tag, chunk, ref, token)      # counted as stale by the receiver
            return True
        try:
            payload_sum = _recv_hashed(conn, self._pool.view(ref, nbytes), HEADER_SIZE)
            if payload_sum is None:
                raise PeerDeadError("connection closed before payload")
        finally:
            self._pool.end_write(ref)
        self._hooks.deliver(sender, tag, chunk, ref, token, payload_sum)
        return True

    def _drain(self, conn: socket.socket, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, _DRAIN) or 1))
        while nbytes > 0:
            n = min(nbytes, scratch.nbytes)
            if not _recv_exact(conn, scratch[:n]):
                raise PeerDeadError("connection closed while draining")
            nbytes -= n

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._gate is not None:
            self._gate.close()
        with contextlib.suppress(OSError):
            self._lsock.shutdown(socket.SHUT_RDWR)
        self._lsock.close()
        for c in list(self._conns):
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


class SocketSender(SenderBackend):
    """Opens the persistent connection; tcp sends payloads inline, shm copies into the pool."""

    def __init__(self, *, inline_payload: bool) -> None:
        self.inline = inline_payload
        self._sock: socket.socket | None = None
        self._arena: SharedArena | None = None
        self._lock = threading.Lock()

    def connect(self, sender_id: str, receiver_info: bytes, slot_bytes: int, data_token: bytes) -> None:
        info = msgspec.msgpack.decode(receiver_info, type=SocketInfo)
        try:
            if info.family == "inet":
                sock = socket.create_connection((info.address, info.port), timeout=10)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            else:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect("\0" + info.address)
                self._arena = SharedArena(0, name=info.shm_name, create=False)
            sock.settimeout(SEND_STALL_S)          # a peer that stops reading fails the write, never hangs it
            name = sender_id.encode()
            sock.sendall(FRAME.pack(FRAME_MAGIC, FRAME_VERSION, KIND_HELLO, 0, b"\0" * 16, b"\0" * 16, 0, 0, 0,
                                    len(name)) + name + data_token)
        except OSError as exc:
            raise PeerDeadError(f"cannot open data connection to {info.address}: {exc}") from exc
        self._sock = sock

    def write(self, transfer_id: str, chunk_index: int, header: bytes, payload: Payload,
              grant: Grant) -> WriteHandle:
        if self._sock is None:
            raise TransportError("not connected")
        views = [memoryview(header)] + [memoryview(r) for r in host_buffers(payload)]
        nbytes = sum(v.nbytes for v in views)
        tag = header[40:56]                                   # transfer tag field of the chunk header
        frame = FRAME.pack(FRAME_MAGIC, FRAME_VERSION, KIND_CHUNK, 0, tag, grant.token, chunk_index, grant.slot,
                           grant.generation, nbytes)
        handle = WriteHandle(transfer_id, chunk_index, grant, nbytes)
        try:
            with self._lock:
                if self.inline:
                    _sendmsg_all(self._sock, [memoryview(frame), *views])
                else:
                    self._copy_into_slot(grant.offset, views)
                    self._sock.sendall(frame)
        except OSError as exc:
            handle.state, handle.error = WriteState.FAILED, str(exc)
            raise PeerDeadError(f"data connection lost while writing chunk {chunk_index}: {exc}") from exc
        handle.state = WriteState.DONE
        return handle

    def _copy_into_slot(self, offset: int, views: list[memoryview]) -> None:
        assert self._arena is not None
        dst = self._arena.buf
        for v in views:
            n = v.nbytes
            dst[offset:offset + n] = _as_bytes(v)
            offset += n

    def poll(self, handle: WriteHandle) -> WriteState:
        return handle.state

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
