"""Moving an answer to another decode node mid-stream (the split path's continuation).

A decode node D continues an answer as a token-id completion (:mod:`kvrelay.router.split`)
and streams each piece with its token ids (``return_token_ids``). The router keeps, per
request, a :class:`Progress`: every token id and text piece the client has been given.
When D fails - a refused or dropped connection, a 5xx, an error event, a stream that
ends without a finish reason, or silence past ``router.stall_timeout_s`` - the answer
resumes on another decode node from *prompt + token 1 + every token sent so far*, with
the budget less what was sent (:func:`resume_body`). The new node recomputes that
context (no push), and the client's stream goes on with no duplicate and no missing
token; usage counts the whole answer.

Exactness: a greedy continuation (``temperature: 0``) is token-identical to an
uninterrupted one - the same context gives the same next token. A sampled answer without
a seed goes on as a valid sample of the same distribution, but not the tokens the dead
node would have drawn; seeded requests never take the split path. Either way the client
gets the continuation; :class:`Outcome` counts which kind it was.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Cause(str, enum.Enum):
    """Why a decode node's continuation failed (``kvrelay_router_migrations_total{cause}``)."""

    CONNECT = "connect"            # connection refused, reset or dropped
    HTTP_5XX = "http_5xx"          # the node answered a server error
    ERROR_EVENT = "error_event"    # the stream carried an error event
    EARLY_END = "early_end"        # the stream ended without a finish reason
    STALL = "stall"                # silent longer than router.stall_timeout_s
    HTTP_4XX = "http_4xx"          # the node refused the continuation itself: not a node failure, never moved


MOVABLE = frozenset({Cause.CONNECT, Cause.HTTP_5XX, Cause.ERROR_EVENT, Cause.EARLY_END, Cause.STALL})
NO_ANSWER = frozenset({Cause.CONNECT, Cause.STALL, Cause.EARLY_END})   # the node's own failure, to its breaker


class Outcome(str, enum.Enum):
    """How a request that lost its decode node ended (``kvrelay_router_migrated_requests_total``)."""

    EXACT = "exact"                # greedy: token-identical to an uninterrupted answer
    SAMPLED = "sampled"            # unseeded sampling: a valid continuation, not the same tokens
    FAILED = "failed"              # out of attempts or of nodes: the client got an error


@dataclass
class Progress:
    """What the client has been given of D's continuation (token 1 aside)."""

    ids: list[int] = field(default_factory=list)     # token ids, in order
    text: list[str] = field(default_factory=list)    # their text pieces
    finish: str | None = None
    stop: Any = None
    decoded: int = 0               # completion tokens counted by the nodes (the whole continuation)
    base: int = 0                  # tokens of the continuation before the current node's segment
    failure: str = ""              # why the current segment failed ("" = it did not)
    cause: Cause | None = None
    migrations: int = 0
    tracked: bool = True           # every piece came with its token ids (else nothing can be continued)
    fingerprint: str | None = None # the nodes' system_fingerprint, when one has said it

    def note(self, event: dict[str, Any]) -> bool:
        """What one event of a node's stream says besides its pieces (an error, usage, the
        fingerprint); False for an error event (the segment failed: nothing else in it counts)."""
        if event.get("error"):
            self.fail(Cause.ERROR_EVENT, f"the decode node sent an error: {event['error']}")
            return False
        if event.get("usage"):
            self.decoded = self.base + int(event["usage"]["completion_tokens"])
        if event.get("system_fingerprint"):
            self.fingerprint = event["system_fingerprint"]
        return True

    def take(self, event: dict[str, Any]) -> list[tuple[str, str | None, Any]]:
        """Record one event of D's token-id completion; returns the (text, finish, stop) pieces it adds."""
        if not self.note(event):
            return []
        pieces = []
        for c in event.get("choices", ()):
            self.add(c.get("token_ids"), c["text"], c.get("finish_reason"), c.get("stop_reason"))
            pieces.append((c["text"], self.finish, self.stop))
        return pieces

    def add(self, ids: list[int] | None, text: str, finish: str | None, stop: Any) -> None:
        """One piece the client is given: its token ids (None: the node did not say), text and reasons."""
        if ids is None and text:
            self.tracked = False           # a node that does not say which tokens it sent: never continued
        self.ids.extend(ids or ())
        self.text.append(text)
        self.finish, self.stop = finish, stop

    def fail(self, cause: Cause, message: str) -> None:
        """Record the segment's failure (the first cause stays). A stream that already gave its
        ``finish_reason`` is complete whatever happens after it (a drop before ``[DONE]``, a late
        error event): never a failure, never continued past the finish."""
        if self.finish is not None:
            self.decoded = max(self.decoded, len(self.ids))      # its usage event may be what was lost
            return
        if not self.failure:
            self.failure, self.cause = message, cause

    def resumed(self) -> None:
        """A new segment starts on another node."""
        self.failure, self.cause, self.base = "", None, len(self.ids)
        self.decoded = self.base
        self.migrations += 1


def resume_body(first_body: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """The continuation for the next node: the first segment's request (:func:`kvrelay.router.split.decode_body`)
    with every token sent so far appended to its prompt and taken off its budget, and no
    transfer params (the new node computes that context itself)."""
    body = {k: v for k, v in first_body.items() if k != "kv_transfer_params"}
    body["prompt"] = [*first_body["prompt"], *progress.ids]
    body["max_tokens"] = first_body["max_tokens"] - len(progress.ids)
    return body


def outcome(body: dict[str, Any], failed: bool) -> Outcome:
    """How a migrated request ended: exact only for greedy sampling (``temperature`` 0)."""
    if failed:
        return Outcome.FAILED
    return Outcome.EXACT if body.get("temperature") == 0 else Outcome.SAMPLED
