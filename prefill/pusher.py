"""The prefill worker's push engine: one lane (a thread and its Sender) per decode node.

``PushWorker.on_step`` runs on the model thread at the end of every forward
(``wait_for_save``) and only records which chunks became ready; the lanes do the
network work, so the model thread never blocks on a decode node, and a dead or full
decode node (connect and Alloc may block for seconds) stalls only its own lane.

A failed push tells D (Abort), gives up on its writes still in flight and settles,
so vLLM frees its blocks. A failure that means D no longer knows this Sender (dead,
restarted, "unauthenticated") drops the lane's Sender; the next push reconnects.

Chunk ``c`` of a prompt covers tokens ``[c*T, min((c+1)*T, prompt_len))`` with
``T = chunk_tokens``, i.e. engine blocks ``[c*T/bs, ...)`` of the request's block
list. Its payload is ``[layer][block]`` whole blocks (opaque bytes).

How a chunk leaves (straight from the registered cache, or gathered; sent from the
store's record when it was saved too) is :mod:`kvrelay.prefill.payloads`; the lanes and
their Senders are :mod:`kvrelay.prefill.lanes`; the store itself is
:class:`~kvrelay.prefill.store_service.StoreService`, which this worker calls to save each
full chunk of a request the store wants and to load the store's hits before a forward.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrelay.common.errors import KVRelayError, TransferAborted, TransferTimeout, TransportError
from kvrelay.common.keys import chunk_keys, chunk_keys_from_digest
from kvrelay.common.wire import HEADER_SIZE
from kvrelay.core.config import KVRelayConfig
from kvrelay.core.logs import bind
from kvrelay.core.placement import place_helper_thread
from kvrelay.core.rank_view import RankView
from kvrelay.core.ranks import Piece, rank_endpoint
from kvrelay.core.telemetry import EventLog
from kvrelay.core.worker_base import WorkerBase
from kvrelay.kernels.layout import KVLayout
from kvrelay.kernels.span import Span
from kvrelay.prefill.lanes import Lane, Lanes, session_lost
from kvrelay.prefill.payloads import Chunk, ChunkBuffer, PayloadMaker, SavedChunk, load_hook, source_layout
from kvrelay.prefill.specs import PushSpec, StoreLoad
from kvrelay.prefill.staging import StagingPool, staging_slots
from kvrelay.prefill.store_service import StoreService
from kvrelay.transport.backends import make_sender_backend
from kvrelay.transport.backends.base import BlockPayload, Payload, SenderBackend, WriteHandle, WriteState
from kvrelay.transport.config import TransportConfig
from kvrelay.transport.sender import Allocation, PendingAlloc, Sender

log = logging.getLogger("vllm.kvrelay.prefill")

POLL_S = 0.0005       # a lane with writes in flight polls them this often
ALLOC_POLL_S = 0.005  # a lane waiting only for Alloc answers waits on its control socket this long


@dataclass(frozen=True)
class _Prepared:
    """A gathered chunk waiting for its send: the payload and its header, the buffer it lives
    in (given back when the write settles) and when the push of it started."""

    chunk: int
    num_blocks: int
    payload: Payload
    header: bytes
    keep: ChunkBuffer
    t0: float


@dataclass
class _Push:
    spec: PushSpec
    keys: list[bytes]
    n_chunks: int
    deadline: float
    lane: Lane
    alloc: Allocation | None = None
    pending: PendingAlloc | None = None   # Alloc sent, D's answer not in yet
    realloc: bool = False                 # the Alloc was sent again on a new session
    sender: Sender | None = None
    next_chunk: int = 0
    ready_chunks: int = 0
    inflight: list[tuple[WriteHandle, ChunkBuffer, float]] = field(default_factory=list)   # (handle, kept, t0)
    closing: bool = False        # the scheduler finished the request; report once settled
    failed: str = ""             # why the push failed ("" = it has not)
    span: object = None          # kvrelay.push (tracing on)
    # held while the lane gathers or writes this push's chunks, and while it fails: a
    # preemption (another thread) waits on it, so no gather of a freed block is under way
    guard: threading.RLock = field(default_factory=threading.RLock)
    piece: Piece | None = None   # the heads it sends to which decode rank (None: a store-only save)
    tid: str = ""                # its sub-transfer's id on that rank (core/ranks.py)
    push_keys: list[bytes] = field(default_factory=list)   # the piece's key of each chunk
    block_span: Span = Span(1, 0, 0, 0)     # where its heads sit in one block

    @property
    def whole(self) -> bool:
        """It sends whole blocks (equal TP: no re-sharding)."""
        return self.block_span.is_whole


def plan_pushes(spec: PushSpec, keys: list[bytes], transfer_digest: bytes, ranks: RankView, lanes: Lanes,
                deadline: float, chunk_tokens: int) -> list[_Push]:
    """A request's pushes on this rank: one per decode rank it feeds (none when its heads travel
    from a lower rank); a store-only request gets one push without a decode node. ``keys``: the
    store's keys (empty without a store)."""
    assert spec.token_ids is not None
    bpb, n = ranks.bytes_per_block, -(-len(spec.token_ids) // chunk_tokens)
    if not spec.push_to:
        return [_Push(spec, keys, n, deadline, lanes.lane_for(spec.push_to), block_span=Span.whole(bpb))]
    base = chunk_keys_from_digest(spec.token_ids, transfer_digest, chunk_tokens, spec.namespace)
    out = []
    for pc in ranks.outgoing():
        t = ranks.transfer(pc, spec.transfer_id, base)
        out.append(_Push(spec, keys, n, deadline, lanes.lane_for(rank_endpoint(spec.push_to, pc.dst)), piece=pc,
                         tid=t.transfer_id, push_keys=t.keys, block_span=t.span))
    return out


def allocate(p: _Push, lanes: Lanes, sizes: Callable[[], list[int]], events: EventLog) -> bool:
    """Send push ``p``'s Alloc, or collect D's answer; True once ``p.alloc`` is set. Never
    waits for D (only connecting a new Sender blocks): while D parks one Alloc for slots or
    for its consumer, the lane goes on writing the pushes already granted - a lane blocked
    there could hold up the very pushes whose slots the parked Alloc waits for. A session D
    no longer knows (it restarted) is replaced and the Alloc sent again once: nothing was
    written yet, so nothing is lost. ``sizes()``: each chunk's bytes; ``events``: the event log."""
    lane = p.lane
    if p.pending is None:
        p.sender = lanes.sender(lane)
        p.pending = p.sender.alloc_async(p.tid, p.push_keys, sizes(), early=p.spec.early)
    assert p.sender is not None
    try:
        alloc = p.sender.poll_alloc(p.pending)
    except KVRelayError as exc:
        if not session_lost(exc) or p.realloc:
            raise
        log.info("session to %s lost (%s); reconnecting", lane.endpoint, exc)
        if p.sender is lane.sender:
            lanes.drop_sender(lane)
        p.pending, p.realloc = None, True
        return False
    if alloc is None:
        return False
    p.alloc, p.pending = alloc, None
    events.write("push_alloc", req=p.spec.req_id, transfer=p.tid, chunks=p.n_chunks, held=list(p.alloc.held))
    return True


class PushWorker(WorkerBase):
    role = "prefill"

    def __init__(self, cfg: KVRelayConfig, vllm_config: Any,
                 make_backend: Callable[[TransportConfig], SenderBackend] = make_sender_backend) -> None:
        super().__init__(cfg, vllm_config)
        self._pushes: dict[str, list[_Push]] = {}     # request -> one push per decode rank it feeds
        self.lanes = Lanes(cfg.transport, cfg.timeouts, make_backend, self._run)
        self.payloads = PayloadMaker(load_hook(cfg.connector.push_hook), cfg.transport.data_signer())
        self.store: StoreService | None = None
        if cfg.store.active:
            self.store = StoreService(cfg, vllm_config, self.events)
        self._stop = False

    def busy(self) -> bool:
        return bool(self._pushes)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register(kv_caches)
        assert self.layout is not None
        if self.store is not None:
            self.store.bind(self.layout, self.fingerprint)
        self.lanes.source, self.lanes.fingerprint = source_layout(self.layout), self.transfer_digest
        slot = self.layout.chunk_bytes(self.blocks_per_chunk)
        self.payloads.staging = StagingPool(slot, staging_slots(slot, self.vllm_config.model_config.max_model_len,
                                                                self.cfg.chunk_tokens), self.numa_node)
        log.info("kvrelay prefill: %d layers, %d blocks x %d B, chunk %d tokens = %d B, backend %s",
                 self.layout.num_layers, self.layout.num_blocks, self.layout.bytes_per_block,
                 self.cfg.chunk_tokens, self.layout.chunk_bytes(self.blocks_per_chunk),
                 self.cfg.transport.backend.value)

    # ---------------------------------------------------------------- model thread
    def on_step(self, specs: list[PushSpec], finished: list[str]) -> None:
        """Record newly ready chunks (non-blocking)."""
        if specs and self.layout is not None and self.layout.device.type == "cuda":
            torch.cuda.current_stream().synchronize()     # KV of this step is written
        with self._lock:
            for spec in specs:
                self._update(spec)
            for rid in finished:
                pushes = self._pushes.get(rid)
                if not pushes:
                    self._pushes.pop(rid, None)
                    self.settled(rid)
                for p in pushes or ():
                    p.closing = True
            self._lock.notify_all()

    def _update(self, spec: PushSpec) -> None:
        pushes = self._pushes.get(spec.req_id)
        if pushes is None:
            if spec.token_ids is None:
                return                                    # first spec lost (should not happen)
            pushes = self._pushes[spec.req_id] = self._new_pushes(spec)
        T = self.cfg.chunk_tokens
        for p in pushes:
            p.spec = spec
            p.ready_chunks = p.n_chunks if spec.ready >= spec.prompt_len else spec.ready // T
        if spec.ready >= spec.prompt_len and self.inspect is not None and self.layout is not None:
            self.inspect("prefill", self.ranks.rank if self.ranks else 0, spec.req_id, self.layout,
                         spec.block_ids[:-(-spec.prompt_len // self.block_size)])

    def _new_pushes(self, spec: PushSpec) -> list[_Push]:
        assert spec.token_ids is not None and self.ranks is not None
        keys = (chunk_keys(spec.token_ids, self.fingerprint, self.cfg.chunk_tokens, spec.namespace)  # the store's
                if self.store is not None else [])
        pushes = plan_pushes(spec, keys, self.transfer_digest, self.ranks, self.lanes,
                             time.monotonic() + self.cfg.connector.free_deadline_s, self.cfg.chunk_tokens)
        for p in pushes:
            if p.piece is not None:
                p.span = self.spans.start("kvrelay.push", spec.traceparent, request_id=spec.req_id,
                                          transfer_id=p.tid, push_to=p.lane.endpoint, chunks=p.n_chunks)
            self.metrics.inflight.labels("prefill").inc()
        return pushes

    def load_from_store(self, loads: list[StoreLoad]) -> None:
        """Synchronous: this step's forward reads the loaded blocks (model thread)."""
        assert self.store is not None
        for ld in loads:
            failed = self.store.load_into(ld.req_id, ld.token_ids, ld.block_ids, ld.start, ld.end, ld.namespace)
            if failed:
                log.warning("request %s: %d blocks not loadable from the store; recomputing them",
                            ld.req_id, len(failed))
                with self._lock:
                    self._errors |= failed            # reported in this step (a sync load)

    # ---------------------------------------------------------------- lane threads
    def _run(self, lane: Lane) -> None:
        """One lane's loop: connect, allocate, write and settle the pushes to its decode node."""
        place_helper_thread(self.cfg.connector.helper_cpus)
        while True:
            with self._lock:
                if self._stop:
                    return
                work = [p for ps in self._pushes.values() for p in ps if p.lane is lane]
                if not any(p.inflight or p.next_chunk < p.ready_chunks or p.closing for p in work):
                    self._lock.wait(0.05)
                    continue
            for p in work:
                with bind(p.spec.req_id, p.tid or p.spec.transfer_id):     # on every log line (log_format: json)
                    try:
                        self._advance(p)
                    except KVRelayError as exc:
                        self._fail(p, exc)
                    except Exception as exc:  # noqa: BLE001 - a push bug must not kill the engine
                        log.exception("push of %s crashed", p.spec.req_id)
                        self._fail(p, exc)
                    self._maybe_settle(p)
            if any(p.inflight for p in work):
                time.sleep(POLL_S)                     # writes in flight: poll them again shortly
            elif lane.sender is not None and any(p.pending is not None for p in work):
                with contextlib.suppress(KVRelayError):
                    lane.sender.wait_replies(ALLOC_POLL_S)     # wakes as soon as D answers an Alloc

    def _advance(self, p: _Push) -> None:
        """Gather the ready chunks under the push's guard (preemption waits for a gather that
        reads its blocks), then send them with no lock held: a TCP send that blocks on a slow D
        never holds up preemption on P. A zero-copy payload (NIXL writes straight from the KV
        cache) is posted under the guard, since the write itself reads the blocks."""
        if p.failed:
            return
        if p.alloc is None and p.spec.push_to and not allocate(p, self.lanes, lambda: self._sizes(p), self.events):
            return                                    # D has not granted it yet
        with p.guard:
            if p.failed:                              # preempted while the Alloc was answered
                return
            copies: list[_Prepared] = []
            while p.next_chunk < p.ready_chunks:
                prepared = self._write(p, p.next_chunk)
                if prepared is not None and isinstance(prepared.payload, BlockPayload):
                    self._send(p, prepared)
                elif prepared is not None:
                    copies.append(prepared)
                p.next_chunk += 1
        for i, prepared in enumerate(copies):
            if p.failed:                              # preempted meanwhile: the copies go nowhere
                for rest in copies[i:]:
                    self.payloads.release(rest.keep, done=True)
                return
            self._send(p, prepared)
        with p.guard:
            self._poll_writes(p)

    def _poll_writes(self, p: _Push) -> None:
        for item in list(p.inflight):
            assert p.sender is not None
            handle, keep, t0 = item
            state = p.sender.poll(handle)
            if state is WriteState.FAILED:
                raise TransportError(f"chunk {handle.chunk_index} write failed: {handle.error}")
            if state is WriteState.DONE:
                p.inflight.remove(item)
                self.payloads.release(keep, done=True)
                self._on_written(p, handle.chunk_index, t0)

    def preempt(self, req_ids: list[str]) -> None:
        """vLLM preempted these requests and freed their blocks; the next forward may overwrite
        them. Runs on the model thread *before* that forward (``handle_preemptions``): each push
        is ended (D is told, and recomputes) once no gather is under way and no write still reads
        the blocks - a write that has not settled within ``timeouts.chunk_s`` is cancelled. Nothing
        more is gathered, pushed or stored for these requests."""
        with self._lock:
            pushes = [p for r in req_ids for p in self._pushes.get(r, ())]
        for p in pushes:
            with p.guard:
                deadline = time.monotonic() + self.cfg.timeouts.chunk_s
                while p.inflight and time.monotonic() < deadline:
                    try:
                        self._poll_writes(p)
                    except KVRelayError:
                        break                             # a failed write reads nothing any more
                    time.sleep(POLL_S)
                self.metrics.chunks.labels("prefill", "preempted").inc()
                self._fail(p, TransferAborted("the request was preempted on the prefill node (its blocks were freed)"))

    def _sizes(self, p: _Push) -> list[int]:
        layout = self.layout_or_fail()
        return [HEADER_SIZE + layout.num_layers * self.blocks_in_chunk(p.spec.prompt_len, c) * p.block_span.nbytes
                for c in range(p.n_chunks)]

    def layout_or_fail(self) -> KVLayout:
        if self.layout is None:
            raise KVRelayError("KV caches not registered yet")
        return self.layout

    def _write(self, p: _Push, c: int) -> _Prepared | None:
        """Store chunk ``c`` (if it is stored) and gather it for D; the send that remains, if any."""
        ids = self.chunk_block_ids(p.spec.block_ids, p.spec.prompt_len, c)
        full = len(ids) == self.blocks_per_chunk and (c + 1) * self.cfg.chunk_tokens <= p.spec.prompt_len
        saved = None
        if self.store is not None and full and 0 <= p.spec.store_from <= c * self.cfg.chunk_tokens:
            saved = self.store.save(p.keys[c], c, ids)        # the stored record's payload and checksum
        return self._gather(p, c, ids, saved) if p.spec.push_to else None

    def _gather(self, p: _Push, c: int, ids: list[int], saved: SavedChunk | None) -> _Prepared | None:
        assert p.alloc is not None and p.sender is not None
        if c in p.alloc.held:                                # D already has it (its prefix cache)
            self.metrics.chunks.labels("prefill", "held").inc()
            return None
        layout = self.layout_or_fail()
        t0 = time.monotonic()
        self.events.write("push_start", req=p.spec.req_id, transfer=p.tid, chunk=c)
        chunk = Chunk(p.push_keys[c], p.tid, c, ids, saved if p.whole else None,
                      None if p.whole else p.block_span)
        payload, header, keep = self.payloads.make(chunk, layout, p.sender.layout is not None and p.whole)
        return _Prepared(c, len(ids), payload, header, keep, t0)

    def _send(self, p: _Push, w: _Prepared) -> None:
        assert p.alloc is not None and p.sender is not None
        try:
            handle = p.sender.write_chunk(p.alloc, w.chunk, w.payload, num_layers=self.layout_or_fail().num_layers,
                                          num_blocks=w.num_blocks, header=w.header)
        except BaseException:
            self.payloads.release(w.keep, done=False)       # the backend may hold it: never lend it again
            raise
        if handle is not None:
            with p.guard:
                if not p.failed:
                    p.inflight.append((handle, w.keep, w.t0))
                    return
                p.sender.cancel(handle)                      # the push failed while this one was sent
            self.payloads.release(w.keep, done=False)
        else:                                                # receiver already holds it
            self.payloads.release(w.keep, done=True)
            self._on_written(p, w.chunk, w.t0)

    def _on_written(self, p: _Push, c: int, t0: float) -> None:
        dt = time.monotonic() - t0
        self.metrics.store_latency.observe(dt)
        self.metrics.chunks.labels("prefill", "pushed").inc()
        self.metrics.bytes.labels("prefill").inc(self.layout_or_fail().num_layers * p.block_span.nbytes
                                                 * self.blocks_in_chunk(p.spec.prompt_len, c))
        self.events.write("push_done", req=p.spec.req_id, transfer=p.tid, chunk=c,
                          seconds=round(dt, 6))

    def _fail(self, p: _Push, exc: BaseException) -> None:
        """Fail the push: tell D, give up on its writes in flight (so it can settle and vLLM
        can free its blocks), and drop the lane's Sender if its session is gone."""
        with p.guard:
            if not p.failed:
                self._fail_now(p, exc)

    def _fail_now(self, p: _Push, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        p.failed = reason
        log.warning("push of %s (transfer %s) failed: %s", p.spec.req_id, p.tid, reason)
        self.metrics.chunks.labels("prefill", "failed").inc(max(p.n_chunks - p.next_chunk, 1))
        self.events.write("push_failed", req=p.spec.req_id, transfer=p.tid, reason=reason)
        if p.sender is not None and p.pending is not None:
            with contextlib.suppress(KVRelayError):
                p.sender.abandon(p.pending)               # D parks it: give its slots back if granted
            p.pending = None
        elif p.sender is not None:
            p.sender.abort(p.tid, reason)
            for handle, _keep, _t0 in p.inflight:
                p.sender.cancel(handle)
        for _handle, keep, _t0 in p.inflight:
            self.payloads.release(keep, done=False)
        p.inflight.clear()
        if p.sender is not None and p.sender is p.lane.sender and session_lost(exc):
            self.lanes.drop_sender(p.lane)

    def _maybe_settle(self, p: _Push) -> None:
        complete = p.next_chunk >= p.n_chunks and not p.inflight
        if not p.failed and p.closing and not complete and p.next_chunk >= p.ready_chunks and not p.inflight:
            self._fail(p, TransferAborted("request finished before its prompt was computed"))
        if not p.failed and not complete and time.monotonic() > p.deadline:
            self.metrics.forced_frees.inc()
            self._fail(p, TransferTimeout(f"push not complete after free_deadline_s="
                                          f"{self.cfg.connector.free_deadline_s}"))
        settled = (complete or p.failed) and not p.inflight
        if settled and p.closing:
            with self._lock:
                rest = [q for q in self._pushes.get(p.spec.req_id, ()) if q is not p]
                if rest:
                    self._pushes[p.spec.req_id] = rest
                else:
                    self._pushes.pop(p.spec.req_id, None)
            if not rest:                                   # every decode rank's push settled
                self.settled(p.spec.req_id)
            self.spans.end(p.span, p.failed, pushed_chunks=p.next_chunk)
            self.metrics.inflight.labels("prefill").dec()
            self.events.write("push_end", req=p.spec.req_id, transfer=p.tid,
                              ok=not p.failed, chunks=p.n_chunks)

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self.lanes.close()
        if self.store is not None:
            self.store.close()
        super().close()
