"""The decode worker's install side: the receive pool and one install task per load.

Each install task blocks on its transfer's events (driving the backend's progress
itself when the backend is poll-driven) and scatters every verified chunk into the
engine's paged KV cache the moment it arrives. Tasks run on their own threads;
the model thread only starts them and collects results - except for a load vLLM runs
synchronously (``LoadSpec.now``: its transfer had wholly landed), which the model thread
installs itself before the step's forward, waiting on nothing but the queued chunks.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from kvrelay.common.errors import ChecksumError, ConfigError, KVRelayError, TransferTimeout
from kvrelay.common.keys import chunk_keys_from_digest
from kvrelay.common.wire import HEADER_SIZE
from kvrelay.core.config import KVRelayConfig
from kvrelay.core.drain import DrainPhase, read_phase
from kvrelay.core.logs import bind
from kvrelay.core.placement import place_helper_thread
from kvrelay.core.ranks import Piece, part_transfer_id
from kvrelay.core.telemetry import unbind_gauge
from kvrelay.core.worker_base import WorkerBase
from kvrelay.decode.install import install_verified
from kvrelay.decode.saver import DecodeSaver, SaveSpec
from kvrelay.decode.specs import LoadSpec
from kvrelay.kernels.span import Span
from kvrelay.transport.backends import make_receiver_backend
from kvrelay.transport.config import TransportConfig
from kvrelay.transport.events import ChunkArrival, ChunkRejected, Refusal, TransferDone, TransferFailed
from kvrelay.transport.pool import Placement, receive_pool_bytes
from kvrelay.transport.receiver import Receiver

log = logging.getLogger("vllm.kvrelay.decode")

# An Alloc that reaches D before D's worker has registered its transfer (``expect``, which
# names the chunks this request holds) waits this long for it. Registration normally
# follows within a step; on a loaded host a prefix-cached P can be faster than that.
REGISTER_WAIT_S = 0.5
# A synchronous load's chunks have all landed; its events are already queued. Should one be
# missing after all (an orphaned transfer dropped meanwhile), the model thread waits no longer
# than this for it, and the rest is recomputed.
NOW_WAIT_S = 0.05
@dataclass
class _Part:
    """One sub-transfer of a load: the piece (head range) one prefill rank sends this rank."""

    piece: Piece
    transfer_id: str
    keys: list[bytes]          # one piece key per chunk
    span: Span                 # where the piece's heads sit in a local block
    installed: set[int] = field(default_factory=set)
    failed: dict[int, str] = field(default_factory=dict)


@dataclass
class _Load:
    spec: LoadSpec
    n_chunks: int
    parts: list[_Part]
    cancelled: threading.Event = field(default_factory=threading.Event)
    running: int = 0           # install tasks (one per part) not yet ended
    t_start: float = 0.0
    span: Any = None           # kvrelay.install (tracing on)

    def failed(self) -> dict[int, str]:
        """Chunk -> why, for every chunk some piece of which failed (all-or-nothing per chunk)."""
        out: dict[int, str] = {}
        for part in self.parts:
            for c, why in part.failed.items():
                out.setdefault(c, why)
        return out


def install_threads(cfg: KVRelayConfig, vllm_config: Any) -> int:
    """One install thread for every part of every load the engine can have at once: each load
    part waits on its own thread for its prefill node, so a load whose chunks have landed never
    queues behind loads stalled on a slow or dead P. (Threads start only as loads need them.)"""
    seqs = int(getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", 0) or 256)
    return max(32, 2 * seqs * max(1, cfg.engine.prefill_tp))


def _busy_slots(pool: Any) -> int:
    st = pool.stats()
    return int(st.leased + st.filled + st.held)


class InstallWorker(WorkerBase):
    role = "decode"

    def __init__(self, cfg: KVRelayConfig, vllm_config: Any) -> None:
        super().__init__(cfg, vllm_config)
        self.receiver: Receiver | None = None
        self._loads: dict[str, _Load] = {}
        self._pool = ThreadPoolExecutor(max_workers=install_threads(cfg, vllm_config), thread_name_prefix="kvrelay-install")
        self._saved: set[str] = set()
        self.saver: DecodeSaver | None = None
        if cfg.store.enabled and cfg.store.save_decoded:
            self.saver = DecodeSaver(cfg, self.blocks_per_chunk, self.events, self._save_done)

    def busy(self) -> bool:
        return bool(self._loads) or (self.saver is not None and self.saver.busy())

    def landed(self) -> frozenset[str]:
        """Transfers (the router's ids) of which every piece this rank receives has landed intact."""
        if self.receiver is None or self.ranks is None:
            return frozenset()
        parts, pieces = self.receiver.landed(), list(self.ranks.pieces)
        incoming = self.ranks.incoming()
        bases = parts | {tid.rsplit("#p", 1)[0] for tid in parts if "#p" in tid}    # one sender / several
        return frozenset(b for b in bases if all(part_transfer_id(b, pc, pieces) in parts for pc in incoming))

    def _save_done(self, req_id: str) -> None:
        with self._lock:
            self._saved.add(req_id)
            self._progress.set()

    def take_saved(self) -> set[str]:
        """Requests whose decode-side save ended: vLLM may free their blocks."""
        with self._lock:
            done, self._saved = self._saved, set()
        return done

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register(kv_caches)
        assert self.layout is not None
        slot = HEADER_SIZE + self.layout.chunk_bytes(self.blocks_per_chunk)
        self.receiver = self._make_receiver(slot)
        if self.saver is not None:
            self.saver.bind(self.layout, self.fingerprint)
        pool, receiver = self.receiver.pool, self.receiver
        self.metrics.pool_leased.set_function(lambda: _busy_slots(pool))
        self.metrics.pool_slots.set(pool.stats().slots)
        self.metrics.receiver_entries.set_function(lambda: sum(receiver.tracked().values()))
        for cause in Refusal:
            self.metrics.refusals.bind(functools.partial(receiver.stats.refusals.__getitem__, cause.value), cause.value)
        log.info("kvrelay decode: receiving on %s (%s), pool %d slots x %d B", self.receiver.endpoint,
                 self.cfg.transport.backend.value, self.receiver.pool.stats().slots, slot)

    def _make_receiver(self, slot: int) -> Receiver:
        """Build the Receiver on a placed helper thread, so the threads it starts (control
        loop, backend receive/poll threads) inherit the helper's CPUs, not the engine's pin."""
        box: list[Receiver | BaseException] = []

        def build() -> None:
            place_helper_thread(self.cfg.connector.helper_cpus)
            try:
                tc = self.cfg.transport
                size = receive_pool_bytes(int(tc.pool_bytes), slot, self.vllm_config.model_config.max_model_len,
                                          self.cfg.chunk_tokens)
                tc = msgspec.structs.replace(tc, pool_bytes=size, **self._rank_ports())
                backend = make_receiver_backend(tc)
                box.append(Receiver(tc, self.cfg.timeouts, backend, self.transfer_digest,
                                    slot_bytes=slot, consumer_wait_s=REGISTER_WAIT_S, verify_payload=False,
                                    closing=self._stopping, placement=self._placement(tc, backend.writes_device_pool)))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                box.append(exc)

        t = threading.Thread(target=build, name="kvrelay-recv-init")
        t.start()
        t.join()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _placement(self, tc: TransportConfig, writes_device: bool) -> Placement:
        """Where the receive pool lives: the KV cache's device (transport.pool_device) or host
        pages on the NUMA node of the engine (connector.numa_node)."""
        assert self.layout is not None
        device = tc.pool_on(str(self.layout.device), writes_device)
        return Placement(device, None if device is not None else self.numa_node)

    def _rank_ports(self) -> dict[str, int]:
        """Rank r listens on the node's control (and tcp data) port + r: prefill ranks find
        every decode rank from the one endpoint the router announces (core/ranks.py)."""
        assert self.ranks is not None
        tc, r = self.cfg.transport, self.ranks.rank
        if self.ranks.tp > 1 and tc.control_port == 0:
            raise ConfigError(f"a decode engine with tensor-parallel size {self.ranks.tp} needs a fixed "
                              "transport.control_port (rank r listens on control_port + r)")
        return {"control_port": tc.control_port + r if tc.control_port else 0,
                "data_port": tc.data_port + r if tc.data_port else 0}

    def _parts(self, spec: LoadSpec) -> list[_Part]:
        """The sub-transfers this rank receives for ``spec``: one per prefill rank that sends it heads."""
        assert self.ranks is not None
        base = chunk_keys_from_digest(spec.token_ids, self.transfer_digest, self.cfg.chunk_tokens, spec.namespace)
        return [_Part(t.piece, t.transfer_id, t.keys, t.span)
                for t in (self.ranks.transfer(pc, spec.transfer_id, base) for pc in self.ranks.incoming())]

    def _stopping(self) -> str:
        """Why new transfers are refused: the node's drain reached STOPPING (core/drain.py)."""
        if read_phase(self.cfg.connector.drain_file) is DrainPhase.STOPPING:
            return "the decode node is stopping (graceful drain)"
        return ""

    # ---------------------------------------------------------------- model thread
    def start(self, loads: list[LoadSpec], cancelled: list[str], saves: list[SaveSpec]) -> None:
        if saves and self.saver is not None:
            self.saver.submit(saves)
        for spec in loads:
            parts = self._parts(spec)
            load = _Load(spec, -(-len(spec.token_ids) // self.cfg.chunk_tokens), parts, running=len(parts),
                         t_start=time.monotonic(),
                         span=self.spans.start("kvrelay.install", spec.traceparent, request_id=spec.req_id,
                                               transfer_id=spec.transfer_id, tokens=spec.num_tokens))
            with self._lock:
                self._loads[spec.req_id] = load
            assert self.receiver is not None
            for part in parts:     # chunks wholly inside this request's own local prefix-cache hit are not sent
                self.receiver.expect(part.transfer_id, held=part.keys[:self._first_chunk(load)])
            self.metrics.inflight.labels("decode").inc()
            self.events.write("load_start", req=spec.req_id, transfer=spec.transfer_id, tokens=spec.num_tokens,
                              now=spec.now)
            for part in parts:
                if spec.now:                      # landed: installed here, before this step's forward
                    self._run(load, part, NOW_WAIT_S)
                else:
                    self._pool.submit(self._run_placed, load, part)
        for rid in cancelled:
            with self._lock:
                victim = self._loads.get(rid)
            if victim is not None:
                victim.cancelled.set()
                assert self.receiver is not None
                for part in victim.parts:
                    self.receiver.abort(part.transfer_id, "request aborted on the decode node")

    # ---------------------------------------------------------------- install task
    def _first_chunk(self, load: _Load) -> int:
        return load.spec.local_tokens // self.cfg.chunk_tokens

    def _run_placed(self, load: _Load, part: _Part) -> None:
        place_helper_thread(self.cfg.connector.helper_cpus)
        self._run(load, part)

    def _run(self, load: _Load, part: _Part, wait_s: float | None = None) -> None:
        """Install ``part``, then settle the load if it was the last; ``wait_s``: the longest wait
        for any one event (None: the configured first-chunk and per-chunk timeouts)."""
        with bind(load.spec.req_id, part.transfer_id):      # on every log line (log_format: json)
            try:
                self._receive(load, part, wait_s)
            except Exception as exc:  # noqa: BLE001 - never leave the request waiting forever
                log.exception("install of %s crashed", load.spec.req_id)
                self._fail_rest(load, part, f"internal error: {exc!r}")
            finally:
                assert self.receiver is not None
                self.receiver.finish(part.transfer_id)
                with self._lock:
                    load.running -= 1
                    last = load.running == 0
                if last:                          # every piece of every chunk settled: all or nothing
                    self._complete(load)

    def _receive(self, load: _Load, part: _Part, wait_s: float | None = None) -> None:
        assert self.receiver is not None
        tid, first, n = part.transfer_id, self._first_chunk(load), load.n_chunks
        timeout = wait_s or self.cfg.connector.first_chunk_s
        while len(part.installed) + len(part.failed) < n - first and not load.cancelled.is_set():
            try:
                ev = self.receiver.next_event(tid, timeout)
            except TransferTimeout as exc:
                self._fail_rest(load, part, str(exc))
                return
            timeout = wait_s or self.cfg.timeouts.chunk_s
            if isinstance(ev, ChunkArrival) and ev.chunk_index < first:
                self.receiver.release(ev)         # pushed early (before D said what it holds): not needed
            elif isinstance(ev, ChunkArrival):
                self._install(load, part, ev)
            elif isinstance(ev, ChunkRejected):
                part.failed.setdefault(ev.chunk_index, f"{ev.reason.value}: {ev.detail}")
                self.metrics.chunks.labels("decode", ev.reason.value).inc()
            elif isinstance(ev, TransferFailed):
                self._fail_rest(load, part, f"{ev.reason.value}: {ev.detail}")
                return
            elif isinstance(ev, TransferDone):
                for c in ev.held:
                    part.installed.add(c)
                if len(part.installed) + len(part.failed) < n - first:
                    self._fail_rest(load, part, "transfer ended with chunks missing")
                return
        if load.cancelled.is_set():
            self._fail_rest(load, part, "cancelled")

    def _install(self, load: _Load, part: _Part, ev: ChunkArrival) -> None:
        assert self.receiver is not None and self.layout is not None
        c = ev.chunk_index
        try:
            if c >= len(part.keys) or ev.key != part.keys[c]:
                raise KVRelayError(f"chunk {c} key mismatch: not this prompt's KV (misrouted)")
            blocks = self.chunk_block_ids(load.spec.block_ids, len(load.spec.token_ids), c)
            if ev.header.num_blocks != len(blocks) or ev.header.num_layers != self.layout.num_layers:
                raise KVRelayError(f"chunk {c} shape {ev.header.num_layers}x{ev.header.num_blocks} blocks; "
                                   f"expected {self.layout.num_layers}x{len(blocks)}")
            t0, w0 = time.monotonic(), time.time()
            skip = max(0, load.spec.local_tokens // self.block_size - c * self.blocks_per_chunk)
            assert self.receiver is not None and self.layout is not None
            install_verified(self.layout, ev, self.receiver.payload(ev), blocks[skip:], skip, part.span,
                             self.receiver.data_mac)
            part.installed.add(c)
            self.metrics.load_latency.observe(time.monotonic() - t0)
            self.metrics.chunks.labels("decode", "installed").inc()
            self.metrics.bytes.labels("decode").inc(ev.header.payload_len)
            self.events.write("install", req=load.spec.req_id, transfer=load.spec.transfer_id, chunk=c,
                              t_start=w0, t_end=time.time())
        except KVRelayError as exc:
            part.failed.setdefault(c, str(exc))
            self.metrics.chunks.labels("decode", "checksum" if isinstance(exc, ChecksumError) else "invalid").inc()
        finally:
            self.receiver.release(ev)

    def _fail_rest(self, load: _Load, part: _Part, reason: str) -> None:
        for c in range(self._first_chunk(load), load.n_chunks):
            if c not in part.installed:
                part.failed.setdefault(c, reason)

    def _complete(self, load: _Load) -> None:
        spec, n = load.spec, len(load.spec.token_ids)
        T = self.cfg.chunk_tokens
        failed = load.failed()
        bad = min(failed) if failed else None
        loaded = (min(n, bad * T) if bad is not None else n) - spec.local_tokens
        loaded = max(loaded, 0)
        errors: set[int] = set()
        if bad is not None and not load.cancelled.is_set():
            start_block = max(bad * self.blocks_per_chunk, spec.local_tokens // self.block_size)
            errors = set(spec.block_ids[start_block:-(-n // self.block_size)])
            log.warning("request %s: %d/%d chunks failed (first: chunk %d, %s); recomputing %d tokens",
                        spec.req_id, len(failed), load.n_chunks, bad, failed[bad],
                        spec.num_tokens - loaded)
        self.metrics.tokens_loaded.inc(loaded)
        self.metrics.tokens_recomputed.inc(spec.num_tokens - loaded)
        self.metrics.transfer_latency.observe(time.monotonic() - load.t_start)
        self.metrics.inflight.labels("decode").dec()
        self.events.write("load_done", req=spec.req_id, transfer=spec.transfer_id, prompt_tokens=n, now=spec.now,
                          local_tokens=spec.local_tokens, loaded_tokens=loaded,
                          recomputed_tokens=spec.num_tokens - loaded, chunks=load.n_chunks,
                          failed={str(k): v for k, v in sorted(failed.items())})
        self.spans.end(load.span, f"{len(failed)} chunks failed" if failed else "",
                       loaded_tokens=loaded, recomputed_tokens=spec.num_tokens - loaded, chunks=load.n_chunks)
        if not failed and self.inspect is not None and self.layout is not None:
            self.inspect("decode", self.ranks.rank if self.ranks else 0, spec.req_id, self.layout,
                         spec.block_ids[:-(-n // self.block_size)])
        with self._lock:
            self._loads.pop(spec.req_id, None)
        self.settled(spec.req_id, errors, finished=not spec.now)     # a synchronous load is vLLM's already

    def close(self) -> None:
        for load in list(self._loads.values()):
            load.cancelled.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.saver is not None:
            self.saver.close()
        if self.receiver is not None:
            self.receiver.close()
            unbind_gauge(self.metrics.pool_leased)      # process-wide gauges: nothing reads a closed pool
            unbind_gauge(self.metrics.receiver_entries)
            self.metrics.refusals.unbind()
        super().close()
