"""A node's drain state, shared by its supervisor and its engine's front door.

``kvrelay serve`` (:mod:`kvrelay.deploy.supervisor`) supervises a prefill or decode vLLM server. On
SIGTERM it writes the node's *drain file* (``connector.drain_file``) and the engine's
middleware (:mod:`kvrelay.core.guard`) reads it on every request, so both sides of one node
agree on its phase without any other channel:

========== =============================================================================
SERVING    no drain file: business as usual
DRAINING   ``/health`` answers 503 (out of rotation, not ready); a prefill node refuses new
           requests, a decode node only admits requests that carry pull params (their KV
           is already on its way here); every answer carries :data:`DRAINING_HEADER`,
           so a router that sees one takes the node out at once
STOPPING   the supervisor is stopping vLLM: every new request gets a 503, a decode node's
           receiver refuses new transfers; the requests still running finish (vLLM's
           ``--shutdown-timeout``)
========== =============================================================================

An operator can ``echo draining > FILE`` by hand to take a node out of rotation without
stopping it, and remove the file to put it back. Reading is one ``stat`` + a small read;
a missing or unreadable file means SERVING (a node never refuses work because of a
broken drain file).
"""

from __future__ import annotations

import enum
from pathlib import Path

from kvrelay.common.private_files import read_small, write_atomic

DRAINING_HEADER = "X-Kvrelay-Draining"


class DrainPhase(str, enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    STOPPING = "stopping"


def read_phase(path: str) -> DrainPhase:
    """The phase ``path`` records (SERVING when there is no such file, or it says nothing known)."""
    if not path:
        return DrainPhase.SERVING
    data = read_small(path, limit=64)
    if data is None:
        return DrainPhase.SERVING
    text = data.decode(errors="replace").strip()
    try:
        return DrainPhase(text or DrainPhase.DRAINING.value)     # an empty file (``touch``) drains
    except ValueError:
        return DrainPhase.DRAINING


def write_phase(path: str, phase: DrainPhase) -> None:
    """Record ``phase`` atomically (SERVING removes the file)."""
    if phase is DrainPhase.SERVING:
        Path(path).unlink(missing_ok=True)
        return
    write_atomic(path, (phase.value + "\n").encode())
