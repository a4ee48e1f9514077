"""The router's section of the configuration tree (``router:``) and its enums.

Part of :mod:`kvrelay.core.config`'s tree (which re-exports everything here); a module of its own
so that each section's fields, checks and ``--help`` lines sit together.
"""

from __future__ import annotations

import enum
import re

import msgspec

from kvrelay.common.config_fields import MiB, NonNeg, Port, Positive, Seconds, Section, Share, Size
from kvrelay.common.errors import ConfigError

__all__ = ["FIELD_HELP", "FirstToken", "RouterConfig", "RoutingPolicy"]


class RoutingPolicy(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_OUTSTANDING = "least_outstanding"
    CACHE_AWARE = "cache_aware"       # prefill: the node holding the longest cached prefix, weighed by load


class FirstToken(str, enum.Enum):
    PREFILL = "prefill"       # the prefill node's sampled token 1 goes to the client at once; D continues
    DECODE = "decode"         # D computes every output token (the prompt's last token is recomputed)


_URL = r"(?:dns\+)?https?://[^\s=/]+:\d+/?"
_PREFILL_ENTRY = re.compile(rf"{_URL}(?:=tcp://[^\s=/]+:\d+)?")
_DECODE_ENTRY = re.compile(rf"{_URL}=tcp://[^\s=/]+:\d+")
_EVENTS_ENTRY = re.compile(r"https?://[^\s=/]+:\d+/?=(tcp://[^\s=/]+:\d+|ipc:///\S+)")
_ENTRY_HELP = {"prefill": "http://HOST:PORT[=tcp://HOST:EVENTS_PORT] (or dns+http://NAME:PORT...)",
               "decode": "http://HOST:PORT=tcp://HOST:KV_PORT (or dns+http://NAME:PORT=tcp://NAME:KV_PORT)"}


class RouterConfig(Section, frozen=True):
    """The OpenAI-compatible router and the pools it balances."""

    host: str = "127.0.0.1"
    port: Port = 8000
    policy: RoutingPolicy = RoutingPolicy.ROUND_ROBIN
    tokenizer: str = ""              # cache_aware: tokenizer (model path) used to compute chunk keys
    load_weight: float = 1.0         # cache_aware: cost of one queued prompt token on a node, in cached tokens
    prefill: list[str] = msgspec.field(default_factory=list)   # http://host:port of prefill servers
    decode: list[str] = msgspec.field(default_factory=list)    # "http://host:port=tcp://host:kvport"
    decode_first: bool | None = None  # pick D first by the prompt its prefix cache holds (vLLM KV events) and load;
                                      # None (auto): on where the router follows the engines' KV events
    disagg_min_tokens: NonNeg = 128  # decode_first: D serves alone when at most this many prompt tokens are left
    disagg_min_tokens_idle: NonNeg = 2048   # ... and this many while D has no request in flight (nothing to stall)
    disagg_idle_overlap: Share = 1.0  # ... unless more than this share of recent arrivals found D busy (1: off)
    decode_request_tokens: NonNeg = 256   # decode_first: a request D already serves weighs this many prompt tokens
    kv_events: list[str] = msgspec.field(default_factory=list)  # "http://engine:port=ipc:///path" (or =tcp://router-host:port) per engine
    kv_events_port: Port = 0         # decode_first: engines bind tcp://*:PORT, the router subscribes to each pool member
    index_max_blocks: Positive = 262144   # decode_first: blocks the KV index keeps per engine (oldest go first)
    health_interval_s: Seconds = 2.0
    health_timeouts: Positive = 3          # consecutive /health timeouts before a node leaves rotation
    dns_refresh_s: Seconds = 5.0           # dns+http:// pool entries are re-resolved this often
    request_timeout_s: Seconds = 600.0     # an upstream silent this long fails (a long stream is fine)
    upstream_connections: Positive = 512  # at most this many connections to one engine; more requests queue
    upstream_keepalive_s: Seconds = 3.0   # idle upstream connections close after this (below uvicorn's 5 s)
    api_keys: list[str] = msgspec.field(default_factory=list)   # bearer tokens clients must present ([] = open)
    api_keys_file: str = ""          # one key per line (0600), e.g. a mounted Secret; adds to api_keys / env
    tls_cert: str = ""               # PEM certificate: serve HTTPS (with tls_key)
    tls_key: str = ""
    max_body_bytes: Size = 8 * MiB   # larger request bodies get a JSON 413
    max_inflight: Positive = 128     # admitted requests per decode node; beyond, they queue
    max_queued: int = 256            # waiting requests beyond which a 429 is immediate
    queue_timeout_s: Seconds = 30.0  # a queued request waits at most this long, then 429
    rate_limit_rps: float = 0.0      # per API key (or client address) token bucket; 0 = off
    rate_limit_burst: int = 0        # bucket size (0 = 2 x rate_limit_rps, at least 1)
    params_ttl_s: Seconds = 900.0    # signed kv_transfer_params expire after this (>= request_timeout_s)
    first_token: FirstToken = FirstToken.DECODE    # who emits the first output token (see router/split.py)
    chat_parsers: bool = False       # the engines run a reasoning / tool-call parser: chat is never split
    expose_nodes: bool = False       # answers name their prefill node (X-Kvrelay-Prefill); for debugging only
    body_timeout_s: Seconds = 30.0   # a request body must arrive within this (then 408), before admission
    max_migrations: NonNeg = 2       # a decode node failing mid-answer: continue on another node this often (0 = off)
    stall_timeout_s: Seconds = 60.0  # a decode node silent this long mid-answer has failed (then it migrates)
    client_write_timeout_s: Seconds = 60.0   # a client that reads nothing of its stream this long is dropped
    max_inflight_per_client: NonNeg = 0      # open requests per API key (or client address); 0 = no limit
    prefill_attempts: Positive = 2   # prefill nodes tried for token 1 before the decode node serves alone
    breaker_failures: NonNeg = 3     # consecutive request failures that take a node out (0 = no breaker)
    breaker_backoff_s: Seconds = 2.0     # first time out; doubles each time the node fails again
    breaker_max_backoff_s: Seconds = 60.0

    @property
    def wires_kv_events(self) -> bool:
        """The engines publish their KV events for the router: ``decode_first`` true, or auto (the
        default) where the router is told to follow them (``kv_events`` or ``kv_events_port``,
        which ``kvrelay up`` and ``deploy k8s`` set)."""
        return self.decode_first is True or (self.decode_first is None and bool(self.kv_events or self.kv_events_port))

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, entries, shape in (("prefill", self.prefill, _PREFILL_ENTRY), ("decode", self.decode, _DECODE_ENTRY)):
            for entry in entries:
                if not shape.fullmatch(entry):
                    raise ConfigError(f"router.{key}: {entry!r} is not a node: expected {_ENTRY_HELP[key]}")
        for entry in self.kv_events:
            if not _EVENTS_ENTRY.fullmatch(entry):
                raise ConfigError(f"router.kv_events: {entry!r} is not an engine's events endpoint: expected "
                                  "http://HOST:PORT=ipc:///PATH (a socket the engine binds) or "
                                  "http://HOST:PORT=tcp://ROUTER_HOST:EVENTS_PORT (the engine's URL as in "
                                  "router.prefill or router.decode, then the endpoint the router binds and the "
                                  "engine's --kv-events-config names)")
        if self.params_ttl_s < self.request_timeout_s:
            raise ConfigError(f"router.params_ttl_s ({self.params_ttl_s:g}) must be at least router.request_timeout_s "
                              f"({self.request_timeout_s:g}): a request queued that long would lose its transfer")


FIELD_HELP: dict[str, str] = {
    'router.host': 'router listen address',
    'router.port': 'router port (OpenAI API at /v1)',
    'router.policy': 'node choice: round_robin, least_outstanding or cache_aware (prefill: least prompt work ahead of the first token - tokens not cached there plus tokens queued there)',
    'router.tokenizer': 'cache_aware: tokenizer (model path) for computing chunk keys (kvrelay up sets it)',
    'router.load_weight': 'cache_aware: what one prompt token queued on a prefill node costs, in cached tokens',
    'router.prefill': "prefill node URLs, e.g. '[http://h1:8100]', or 'http://h1:8100=tcp://h1:9300' with the node's store event port (kvrelay up fills this in); 'dns+http://name:port[=tcp://name:eventport]' stands for every address the name resolves to",
    'router.decode': "decode nodes as 'http://host:port=tcp://host:kvport' (kvrelay up fills this in), or 'dns+http://name:port=tcp://name:kvport' for every address of a headless Service",
    'router.health_interval_s': 'health-check period; failed nodes leave rotation until healthy',
    'router.upstream_keepalive_s': ("idle connections to engines are closed after this; keep it below the engines' "
                                    "own keep-alive (vLLM/uvicorn: 5 s) so a request never rides a connection the "
                                    "engine is closing"),
    'router.dns_refresh_s': "how often 'dns+http://name:port' pool entries (headless Services) are re-resolved",
    'router.health_timeouts': ('consecutive /health timeouts (a busy node) before a node leaves rotation; a refused '
                               'connection or an error status takes it out at once'),
    'router.request_timeout_s': 'an upstream (prefill or decode) silent this long fails the request; a long stream is fine',
    'router.upstream_connections': 'at most this many concurrent connections to one engine; further requests wait for one',
    'router.api_keys': ("bearer tokens clients must send (Authorization: Bearer KEY), as vLLM's --api-key; [] and no "
                        "KVRELAY_API_KEY = no authentication"),
    'router.api_keys_file': 'file of API keys, one per line (mode 0600), added to router.api_keys and KVRELAY_API_KEY',
    'router.tls_cert': 'PEM certificate chain: the router serves HTTPS (needs router.tls_key)',
    'router.tls_key': 'PEM private key for router.tls_cert',
    'router.max_body_bytes': 'request bodies larger than this get a JSON 413 (e.g. 8MiB)',
    'router.max_inflight': 'admission control: requests in flight per decode node; further ones queue',
    'router.max_queued': 'admission control: requests allowed to wait; beyond, a 429 with Retry-After',
    'router.queue_timeout_s': 'admission control: a queued request waits at most this long, then 429',
    'router.rate_limit_rps': 'per API key (or client address) token-bucket rate in requests/s; 0 = off',
    'router.rate_limit_burst': 'token-bucket size (0 = twice the rate, at least 1)',
    'router.params_ttl_s': 'the signed kv_transfer_params the router sends engines expire after this (>= request_timeout_s)',
    'router.chat_parsers': 'the engines run a reasoning or tool-call parser: chat requests are not split (decode path)',
    'router.first_token': ("decode (default): D emits every token, so no answer waits between token 1 and token 2 "
                           "for D to take it over (measured: ITL p99 within 1.2x vLLM's own PD flow); prefill: "
                           "stream token 1 from the prefill node at once and D continues from prompt + token 1 "
                           "(token 1 earlier, a longer first gap; requests with features that cannot be split "
                           "fall back per request)"),
    'connector.runtime_dir': ("private directory (0700, the service user's) for a node's shared state files: "
                              "gauge snapshots, drain files, vLLM's local sockets (one directory per node, removed when "
                              "the node stops); '' = /dev/shm/kvrelay-<uid>. kvrelay refuses to start "
                              "if it is a symlink, someone else's or open to other users"),
    'connector.drain_file': ("file holding the node's drain state; '' = one per node in connector.runtime_dir "
                             "(override to choose where). 'echo draining > FILE' takes a running node out of rotation, removing "
                             "it puts the node back"),
    'engine.drain_timeout_s': ("on SIGTERM a node drains (not ready, no new work, in-flight requests, loads and pushes "
                               "finish) for at most this long, then stops; also vLLM's --shutdown-timeout"),
    'engine.drain_quiet_s': 'on SIGTERM a node stops once it has had no request and no KV in use for this long',
    'log_format': ("text, or json: one JSON object per line with request_id and transfer_id, in the router, "
                   "kvrelay serve and the engines it starts (vLLM's own lines too)"),
    'tracing.endpoint': ("OTLP traces endpoint (e.g. http://otel-collector:4318/v1/traces): one trace per request, "
                         "router -> prefill -> decode, with transfer spans; the engines get --otlp-traces-endpoint. "
                         "'' = off"),
    'tracing.protocol': 'OTLP protocol: http/protobuf or grpc (then the endpoint is host:port)',
    'router.expose_nodes': ("answers carry X-Kvrelay-Prefill with the prefill node's URL (debugging; off by default: "
                            "internal addresses stay inside)"),
    'router.body_timeout_s': ("a client must send its whole request body within this many seconds, else 408; bodies "
                              "are read before admission, so slow clients never hold an admission slot"),
    'router.max_migrations': ("a decode node that fails mid-answer (connection lost, 5xx, error event, early end, "
                              "silence) hands the rest to another decode node, which continues from the tokens "
                              "already sent (the split path's answers, and streamed answers a decode node gives "
                              "itself, alone or after P's push, that the split path could continue); one that "
                              "fails before the client got anything is asked of another node; at most this many "
                              "times per request (0 = off: the client gets an error event)"),
    'router.stall_timeout_s': ("a decode node silent this long in the middle of an answer has failed (its answer "
                               "moves to another node); before its first piece router.request_timeout_s applies"),
    'router.client_write_timeout_s': ("a streaming client that reads nothing for this many seconds is dropped and its "
                                      "request aborted on the engines; the router buffers at most ~64 KiB toward a client "
                                      "(and 256 KiB from its engine), so a slow reader costs only itself (never a node failure or a "
                                      "migration)"),
    'router.max_inflight_per_client': ("requests one API key (or, without keys, one client address) may have open "
                                       "at once, streamed or not; more get a 429 (0 = no limit)"),
    'router.prefill_attempts': ("prefill nodes asked for token 1 (a failed, draining or refusing one is replaced); "
                                "with none left the decode node serves the request alone"),
    'router.breaker_failures': ("consecutive request failures that take a node out of rotation, independently of "
                                "/health (0 = no circuit breaker)"),
    'router.breaker_backoff_s': ("how long a node whose breaker opened stays out; doubles each time it fails again, "
                                 "then one probe request (half-open) brings it back"),
    'router.breaker_max_backoff_s': 'the longest a node whose breaker opened stays out',
    'router.decode_first': ("pick the decode node first, by the prompt tokens its prefix cache already holds (vLLM's "
                            "KV events, router.kv_events) against its load; if at most router.disagg_min_tokens are "
                            "left to compute it serves the request alone (no prefill node, no transfer). auto: on "
                            "where the router follows the engines' KV events and can tokenise prompts (kvrelay up and "
                            "deploy k8s wire both; a router given neither, or without the kvrelay[router] extra, "
                            "places by load and says why at start); true: on even with no events (by prompt length "
                            "and load)"),
    'router.disagg_min_tokens': ("decode_first: prompt tokens a decode node that is serving other requests may "
                                 "compute itself (it stalls their streams meanwhile); more and a prefill node computes "
                                 "them and pushes the chunks D lacks. Measure it: kvrelay calibrate"),
    'router.disagg_min_tokens_idle': ("decode_first: the same for a decode node with no request in flight, which "
                                      "stalls nobody: as long as D alone answers no slower than a prefill node plus "
                                      "the push (kvrelay calibrate)"),
    'router.disagg_idle_overlap': ("decode_first: disagg_min_tokens_idle applies only while at most this share of the "
                                   "decode node's recent requests (an average over about 16) arrived while it was busy: "
                                   "where arrivals overlap, a long prompt D computes alone stalls the next request's "
                                   "stream; a client that sends one request at a time never overlaps. 1 (off): the "
                                   "idle bound always applies. With token 1 from P, 0.1 cut the token 1->2 gap's p99 "
                                   "but sent more prompts through P, whose gaps raised the ITL p99 (bench serve)"),
    'router.decode_request_tokens': ("decode_first: how much one request a decode node is already serving weighs "
                                      "against the prompt tokens its cache saves, in prompt tokens (times load_weight)"),
    'router.kv_events': ("each engine's KV-cache events endpoint: 'http://engine:port=ipc:///path.sock' (the engine "
                         "binds that Unix socket, the router connects: kvrelay up puts it in connector.runtime_dir, "
                         "which no other user can enter) or 'http://engine:port=tcp://router-host:port' (the router "
                         "binds it and the engine connects). The events carry prompt token ids; frames over 16 MiB "
                         "are refused, and an endpoint the router cannot bind or connect leaves that engine placed by "
                         "load (kvrelay_router_kv_events_following = 0, an error in the log)"),
    'router.kv_events_port': ("decode_first where pool members come and go (Kubernetes): every engine publishes its "
                              "KV events on tcp://*:PORT and the router subscribes to each prefill and decode node it "
                              "knows at that node's host and PORT (keep the port closed to all but the routers: the "
                              "events carry prompt token ids); 0: only router.kv_events"),
    'router.index_max_blocks': "decode_first: cached blocks the router's KV index keeps per engine (oldest dropped first)",
}
