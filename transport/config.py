"""The transport's own settings: the data plane, the receive pool and every deadline.

Same role as ``store/config.py`` and ``core/config.py``: a room's own config sections.

The transport owns these sections; they are built from the ground floor's config types
(:mod:`kvrelay.common.config_fields`) and the shared engine core composes them into the one
tree (:mod:`kvrelay.core.config`). ``Receiver``, ``Sender`` and the backends take only
:class:`TransportConfig` and :class:`TimeoutConfig`, never the whole tree.
"""

from __future__ import annotations

import enum

import msgspec

from kvrelay.common.config_fields import MiB, Port, Positive, Seconds, Section, Size
from kvrelay.common.errors import ConfigError
from kvrelay.common.secrets import KeyUse, derive_key, load_secret
from kvrelay.common.wire import DataMac


class TransportKind(str, enum.Enum):
    NIXL = "nixl"
    TCP = "tcp"
    SHM = "shm"
    UCX = "ucx"


class NixlErrorMode(str, enum.Enum):
    NONE = "none"
    PEER = "peer"


class TimeoutConfig(Section, frozen=True):
    """All deadlines of the transport, in seconds."""

    lease_s: Seconds = 10.0          # a slot not filled+consumed within this is reclaimed
    alloc_wait_s: Seconds = 5.0      # back-pressure: how long Alloc waits for free slots
    peer_s: Seconds = 3.0            # no heartbeat/traffic for this long -> peer declared dead
    heartbeat_s: Seconds = 0.5       # sender heartbeat interval
    connect_s: Seconds = 5.0         # control-plane handshake deadline
    chunk_s: Seconds = 10.0          # one chunk write must complete within this

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.heartbeat_s * 2 > self.peer_s:
            raise ConfigError(f"timeouts.heartbeat_s={self.heartbeat_s} must be at most half of timeouts.peer_s="
                              f"{self.peer_s}: one late heartbeat would declare a live sender dead")
        if self.lease_s < self.chunk_s:
            raise ConfigError(f"timeouts.lease_s={self.lease_s} is shorter than timeouts.chunk_s={self.chunk_s}: "
                              "a slot would be reclaimed while its chunk may still legally be in flight")


class PoolDevice(str, enum.Enum):
    """Where a decode node's receive pool lives."""

    AUTO = "auto"        # device memory where the backend can write it (nixl) and the KV cache is on a GPU
    HOST = "host"        # pinned host pages (the store's tiers, hosts without GPUDirect RDMA)
    GPU = "gpu"          # the KV cache's device: chunks land in HBM, the install is device to device


class TransportConfig(Section, frozen=True):
    """The data plane and the decode node's receive pool."""

    backend: TransportKind = TransportKind.NIXL
    pool_bytes: Size = 0             # decode receive pool; 0 = auto (sized from the engine, see decode)
    host: str = "127.0.0.1"
    advertise_host: str = ""         # the address peers reach this node at ("" = host; required if host is 0.0.0.0)
    control_port: Port = 0           # 0 = pick a free port
    data_port: Port = 0              # tcp backend listener; 0 = pick a free port
    nixl_error_mode: NixlErrorMode = NixlErrorMode.NONE
    secret_file: str = ""            # 0600 file holding the shared secret (or env KVRELAY_SECRET); no default
    allowed_decode: list[str] = msgspec.field(default_factory=list)  # prefill: push targets allowed
    max_message_bytes: Positive = 1 * MiB       # control frames above this are rejected
    pool_device: PoolDevice = PoolDevice.AUTO   # decode: the receive pool in host memory or on the GPU
    data_mac: bool = False           # every pushed chunk carries a keyed MAC, checked before D installs it

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.data_mac and self.pool_device is PoolDevice.GPU:
            raise ConfigError("transport.data_mac is checked on the host, over the bytes D installs: it needs "
                              "transport.pool_device host (or auto, which then keeps the pool on the host)")
        if self.pool_device is PoolDevice.GPU and self.backend is not TransportKind.NIXL:
            raise ConfigError(f"transport.pool_device gpu needs one-sided writes into device memory: "
                              f"transport.backend nixl (not {self.backend.value}), or pool_device host")

    def pool_on(self, kv_device: str, writes_device: bool) -> str | None:
        """The receive pool's device for a decode engine whose KV cache is on ``kv_device``, whose
        backend can (``writes_device``) land writes in device memory; None: host pages."""
        on_gpu = kv_device.startswith("cuda")
        if self.pool_device is PoolDevice.GPU and not on_gpu:
            raise ConfigError(f"transport.pool_device gpu, but this decode engine's KV cache is on {kv_device}")
        if self.pool_device is PoolDevice.HOST or self.data_mac or not (on_gpu and writes_device):
            return None
        return kv_device

    def data_signer(self, secret: bytes | None = None) -> DataMac | None:
        """The data-frame MAC when ``data_mac`` is on (keyed from ``secret``, else the loaded
        shared secret); None when off."""
        if not self.data_mac:
            return None
        return DataMac(derive_key(load_secret(self) if secret is None else secret, KeyUse.DATA))

    def advertised_host(self) -> str:
        """The data-plane address a decode node announces (after the authenticated Hello).

        ``advertise_host`` when set, else ``host``. Raises :class:`ConfigError` when ``host``
        binds every address and nothing says which one peers can reach."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in WILDCARD_HOSTS:
            raise ConfigError(f"transport.host={self.host!r} binds every address, so it cannot be announced to "
                              "prefill nodes: set transport.advertise_host to the address they reach this node at "
                              "(the pod IP, the host's address on the transfer network)")
        return self.host


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})

FIELD_HELP: dict[str, str] = {
    'transport.backend': 'data plane: nixl (UCX one-sided WRITE), tcp, shm (same host) or ucx',
    'transport.pool_bytes': ("decode node's pinned receive pool (e.g. 4GiB); 0 = auto: two prompts of "
                             "max_model_len, at least 256MiB. Start-up fails if it cannot hold one such prompt. Faulted in "
                             "at start-up: all of it counts against the node's memory limit from the start"),
    'transport.host': "address the decode node's transfer endpoint binds to",
    'transport.advertise_host': ("the address the decode node announces to prefill nodes for its data plane (a "
                                 "pod IP, a NAT address); '' = transport.host. Required when host binds every "
                                 "address (0.0.0.0 / ::)"),
    'transport.control_port': "decode node's ZeroMQ control port (0 = any free port)",
    'transport.data_port': "tcp backend's data listener port (0 = any free port)",
    'transport.nixl_error_mode': 'UCX error handling for nixl: none or peer (same on both sides)',
    'transport.secret_file': ("file (mode 0600) holding the deployment's shared secret; the env var KVRELAY_SECRET "
                              "wins. No default: nodes refuse to start without one"),
    'transport.allowed_decode': ("prefill: decode transfer endpoints (tcp://host:port) it may push to; [] = the "
                                 "decode nodes router.decode names"),
    'transport.max_message_bytes': 'control frames larger than this are rejected',
    'transport.data_mac': ("sign every pushed chunk with a keyed MAC (BLAKE2b, from the shared secret) that D checks "
                           "before installing it: protects KV on the wire against forgery, at one more pass over "
                           "each chunk on each side; off: checksums catch accidents only (set it on both roles)"),
    'transport.pool_device': "decode receive pool: auto (GPU memory with nixl on a GPU engine, else pinned host "
                             "pages), host, or gpu (chunks land in HBM; the install is device to device)",
    'timeouts.lease_s': 'a slot not filled and consumed within this is reclaimed (seconds)',
    'timeouts.alloc_wait_s': 'back-pressure: how long an Alloc may wait for free slots',
    'timeouts.peer_s': 'a sender silent this long is declared dead; its transfers fail',
    'timeouts.heartbeat_s': 'sender heartbeat interval',
    'timeouts.connect_s': 'control-plane handshake deadline',
    'timeouts.chunk_s': 'one chunk write must complete (and the next chunk arrive) within this',
}
