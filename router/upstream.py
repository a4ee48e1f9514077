"""The router's engine client: the HTTP session, both pools, the metrics and the signer.

One :class:`EngineClient` per router owns everything a request path needs to talk to engines;
the paths themselves (:mod:`kvrelay.router.decode_path`, :mod:`kvrelay.router.split_path`)
are small classes that take it and own no shared state.

* :meth:`EngineClient.send` - POST and read, once more if a pooled connection turned out to be
  closed before the engine saw the request (keep-alive race).
* :meth:`EngineClient.open_decode` - POST to a decode node and return the open response. A node
  that is draining (503 with ``X-Kvrelay-Draining``, :mod:`kvrelay.core.drain`) or refuses the
  connection has not seen the request, so it goes to the next healthy decode node - without
  pull params: the KV was pushed to the first one, the new node computes the prompt itself.
  Clients see no error for a node that leaves. A decode node that refuses the router's own
  transfer params (400 with ``X-Kvrelay-Params-Refused``: expired in a long queue, say) gets
  the request again without them and computes the prompt itself; the client never sees it.
* Any answer carrying ``X-Kvrelay-Draining`` takes its node out of rotation at once (the
  health loop puts it back when ``/health`` says 200 again).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

import aiohttp
import orjson

from kvrelay.core.config import KVRelayConfig
from kvrelay.core.drain import DRAINING_HEADER
from kvrelay.core.params import PARAMS_REFUSED_HEADER, ParamsSigner, PullParams, PushParams, params_dict
from kvrelay.core.tracing import inject, with_traceparent
from kvrelay.router.breaker import Breaker
from kvrelay.router.job import Job
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.pools import Node, NoHealthyNode, Pool

log = logging.getLogger("kvrelay.router")
_T = TypeVar("_T")
UPSTREAM_RCVBUF = 256 * 1024      # bytes the kernel holds per engine connection (no autotuning past it)


def _upstream_socket(addr_info: Any) -> socket.socket:
    """aiohttp's socket factory: a connection to an engine with a bounded receive buffer."""
    family, kind, proto = addr_info[0], addr_info[1], addr_info[2]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UPSTREAM_RCVBUF)
    return sock


def never_sent(exc: Exception) -> bool:
    """The request never reached the engine: a pooled keep-alive connection the engine had just
    closed (aiohttp could not write the body, or the peer hung up before any answer)."""
    return isinstance(exc, aiohttp.ServerDisconnectedError) or "write request body" in str(exc)


def note_draining(node: Node, r: aiohttp.ClientResponse) -> bool:
    """Take ``node`` out of rotation if its answer says it drains; True if it refused the request."""
    if DRAINING_HEADER not in r.headers:
        return False
    if node.healthy:
        log.info("%s is %s: out of rotation", node.url, r.headers[DRAINING_HEADER])
    node.healthy = False
    return r.status == 503


class Answer(NamedTuple):
    """A prefill node's JSON answer (:meth:`EngineClient.ask`)."""

    status: int | None               # None: the node failed (no answer)
    body: Any
    params_refused: bool = False     # the engine refused the router's own transfer params (e.g. not allowed)
    draining: bool = False           # the node drains: it takes no new work


class EngineClient:
    """What every request path shares: ``session`` (made by :meth:`open`), the pools, the
    metrics, the params signer, the nodes' circuit breaker (shared by both pools) and each
    decode node's context limit."""

    def __init__(self, cfg: KVRelayConfig, prefill: Pool, decode: Pool, metrics: RouterMetrics,
                 signer: ParamsSigner) -> None:
        self.cfg, self.prefill, self.decode, self.metrics, self.signer = cfg, prefill, decode, metrics, signer
        self.breaker: Breaker = prefill.breaker
        self.session: aiohttp.ClientSession | None = None
        self.context_limits: dict[str, int] = {}       # decode node URL -> its max_model_len

    def open(self) -> aiohttp.ClientSession:
        """The HTTP session to the engines (inside the running loop). ``sock_read`` is silence,
        not total length: a long generation streams for as long as it needs. Each connection's
        receive buffer is :data:`UPSTREAM_RCVBUF`: what an engine sends while its client does not
        read waits on the engine's side, not in the router."""
        rc = self.cfg.router
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=rc.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=rc.upstream_connections,
                                         keepalive_timeout=rc.upstream_keepalive_s, socket_factory=_upstream_socket)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector,
                                             json_serialize=lambda o: orjson.dumps(o).decode())
        return self.session

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def judge(self, node: Node, status: int | None) -> None:
        """Tell the circuit breaker how ``node`` answered. A node *fails* only when it gave no
        answer (``status`` None: refused, dropped, timed out) or a gateway error (502/503/504
        without a drain header - a drain is not a failure); any other answer, a 500 or a 4xx
        included, is the engine judging the request, so a client cannot take nodes out by
        sending requests vLLM refuses."""
        if status is None or (status in (502, 503, 504) and node.healthy):
            self.breaker.failure(node.url)
        else:
            self.breaker.success(node.url)

    def answer_headers(self, job: Job, p_url: str) -> dict[str, str]:
        """The headers of a client's answer: its X-Request-Id, and the prefill node's URL only with
        ``router.expose_nodes`` (internal addresses stay inside by default)."""
        headers = job.ids.headers()
        if self.cfg.router.expose_nodes:
            if p_url:
                headers["X-Kvrelay-Prefill"] = p_url
            headers["X-Kvrelay-Decode"] = job.decode.url
        return headers

    def node_failed(self, what: str, node: Node, detail: BaseException | str) -> str:
        """What a client is told of a node's failure: the node's address and the error's text
        (which often names a host) only with ``router.expose_nodes``; the log has them always."""
        text = f"{type(detail).__name__}: {detail}" if isinstance(detail, BaseException) else detail
        log.warning("%s %s failed: %s", what, node.url, text)
        if self.cfg.router.expose_nodes:
            return f"{what} {node.url} failed: {text}"
        kind = type(detail).__name__ if isinstance(detail, BaseException) else detail
        return f"{what} failed ({kind})"

    def signed(self, params: PullParams | PushParams) -> dict[str, Any]:
        """``kv_transfer_params`` for an engine: signed, with the request's trace context beside them."""
        return with_traceparent(params_dict(self.signer.sign(params)))

    def arm_stall(self, r: aiohttp.ClientResponse) -> None:
        """From now on, D's silence past ``router.stall_timeout_s`` on ``r`` raises
        asyncio.TimeoutError: aiohttp's own read timeout on the connection, rearmed by every byte
        D sends, which costs the hop nothing per event. Called once D's first piece is in: the
        timer armed before had the session's timeout; this one is ``r``'s alone (aiohttp sets it
        again for the next request on the connection). aiohttp stops it while its buffer holds
        reading (the router busy writing to a slow client), which cannot be the case here: the
        router has just been waiting for a piece."""
        protocol = r.connection.protocol if r.connection is not None else None
        if protocol is not None:
            protocol.read_timeout = self.cfg.router.stall_timeout_s or None
            protocol.start_timeout()

    async def context_limit(self, node: Node) -> int | None:
        """The decode node's ``max_model_len`` (from its ``/v1/models``, asked once; None if unknown)."""
        limits = self.context_limits
        if node.url not in limits:
            assert self.session is not None
            try:
                async with self.session.get(f"{node.url}/v1/models") as r:
                    limits[node.url] = int((await r.json())["data"][0]["max_model_len"])
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError, ValueError):
                return None                   # asked again next time
        return limits[node.url]

    async def ask(self, node: Node, endpoint: str, body: dict[str, Any], rid: str) -> Answer:
        """POST and read a JSON answer; ``Answer(None, None)`` when the node failed."""
        node.outstanding += 1

        async def read(r: aiohttp.ClientResponse) -> Answer:
            draining = note_draining(node, r)
            return Answer(r.status, await r.json(loads=orjson.loads, content_type=None),
                          PARAMS_REFUSED_HEADER in r.headers, draining)
        try:
            return await self.send(f"{node.url}{endpoint}", body, rid, read)
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as exc:
            node.failures += 1
            log.warning("prefill on %s failed for %s: %r", node.url, rid, exc)
            return Answer(None, None)
        finally:
            node.outstanding -= 1

    async def send(self, url: str, body: dict[str, Any], rid: str,
                    read: Callable[[aiohttp.ClientResponse], Awaitable[_T]]) -> _T:
        """POST ``body`` and ``read`` the answer (see :meth:`_post_url`)."""
        async with await self._post_url(url, body, rid) as r:
            return await read(r)

    async def _post(self, node: Node, path: str, body: dict[str, Any], rid: str) -> aiohttp.ClientResponse:
        return await self._post_url(f"{node.url}{path}", body, rid)

    async def _post_url(self, url: str, body: dict[str, Any], rid: str) -> aiohttp.ClientResponse:
        """POST; once more if a pooled connection turned out to be closed before the engine saw
        the request (keep-alive race). Other errors propagate. Returns the open response (the
        caller releases it)."""
        assert self.session is not None
        for attempt in (1, 2):
            try:
                return await self.session.post(url, json=body, headers=inject({"X-Request-Id": rid}))
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
                if attempt == 2 or not never_sent(exc):
                    raise
                log.info("%s: a pooled connection was closed under %s (%r); retrying", url, rid, exc)
        raise AssertionError("unreachable")

    async def open_decode(self, node: Node, path: str, body: dict[str, Any],
                           rid: str) -> tuple[Node, aiohttp.ClientResponse]:
        """POST to decode ``node`` (its ``outstanding`` already counted); a draining or vanished node
        hands the request to the next healthy one (see the module docstring). Returns the node that
        answered - ``outstanding`` moved to it - and its open response. On an exception the count
        is back on ``node``, where the caller takes it off: load counts never drift."""
        first, current = node, [node]
        try:
            return await self._redirecting(current, path, body, rid)
        except BaseException:
            if current[0] is not first:
                current[0].outstanding -= 1
                first.outstanding += 1
            raise

    async def _redirecting(self, current: list[Node], path: str, body: dict[str, Any],
                           rid: str) -> tuple[Node, aiohttp.ClientResponse]:
        """:meth:`open_decode`'s loop; ``current[0]`` is the node that holds the count."""
        tried = list[Node]()
        while True:
            node = current[0]
            tried.append(node)
            refused: Exception | None = None
            try:
                r = await self._post(node, path, body, rid)
                if r.status == 400 and PARAMS_REFUSED_HEADER in r.headers and "kv_transfer_params" in body:
                    r.release()                               # our own params refused (e.g. expired in a queue):
                    log.warning("%s refused the transfer params of %s (%s); it computes the prompt itself",
                                node.url, rid, r.headers[PARAMS_REFUSED_HEADER])
                    self.metrics.errors.labels("params_refused").inc()
                    body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
                    r = await self._post(node, path, body, rid)
            except aiohttp.ClientConnectorError as exc:
                node.healthy, refused = False, exc            # nothing listens: the health loop brings it back
            else:
                if not note_draining(node, r):
                    return node, r
            try:
                nxt = self.decode.pick(exclude=tuple(tried))
            except NoHealthyNode:
                if refused is not None:
                    raise refused from None
                return node, r                                # the 503 itself, unread: no node left to take it
            if refused is None:
                r.release()
            log.info("decode node %s %s; %s goes to %s", node.url, "is gone" if refused else "is draining", rid,
                     nxt.url)
            self.metrics.errors.labels("decode_redirected").inc()
            node.outstanding -= 1
            nxt.outstanding += 1
            current[0], body = nxt, {k: v for k, v in body.items() if k != "kv_transfer_params"}
