"""The gatekeeper's challenges are stateless cookies: a flood of challenge requests stores
nothing and cannot push out an honest sender's challenge (a unit test of the state machine,
with an injected clock)."""

from __future__ import annotations

import os

from kvrelay.common.secrets import KeyUse, derive_key
from kvrelay.transport import protocol as P
from kvrelay.transport.events import Refusal
from kvrelay.transport.sessions import Gatekeeper

SECRET = os.urandom(32)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def hello(ident: bytes, challenge: bytes, secret: bytes = SECRET) -> P.Hello:
    h = P.Hello(sender_id=ident.decode(), fingerprint=b"f" * 32, backend="tcp", nonce=os.urandom(32),
                challenge=challenge)
    return P.sign_hello(derive_key(secret, KeyUse.HELLO), h)


def gate() -> tuple[Gatekeeper, Clock, list[Refusal]]:
    clock, refusals = Clock(), []
    return Gatekeeper(SECRET, 10.0, lambda cause, _: refusals.append(cause), clock), clock, refusals


def test_a_challenge_flood_does_not_evict_an_honest_senders_challenge():
    g, clock, refusals = gate()
    honest = g.challenge(b"p-honest")
    for i in range(10_000):                       # anyone who reaches the control port may ask
        g.challenge(f"attacker-{i}".encode())
    assert g.authenticate(b"p-honest", hello(b"p-honest", honest)) is None and not refusals
    assert len(g._used) == 1                      # memory grows with authenticated Hellos only
    assert g.authenticate(b"p-honest", hello(b"p-honest", honest)) is not None    # single use
    assert refusals == [Refusal.REPLAY]


def test_a_challenge_is_bound_to_its_identity_its_expiry_and_the_secret():
    g, clock, refusals = gate()
    c = g.challenge(b"p1")
    assert g.authenticate(b"p2", hello(b"p2", c)) is not None             # issued to another socket
    forged = c[:-1] + bytes([c[-1] ^ 1])
    assert g.authenticate(b"p1", hello(b"p1", forged)) is not None        # a cookie it did not issue
    other = Gatekeeper(SECRET, 10.0, lambda *_: None, clock).challenge(b"p1")
    assert g.authenticate(b"p1", hello(b"p1", other)) is not None         # another process's cookie
    assert refusals == [Refusal.REPLAY] * 3
    assert g.authenticate(b"p1", hello(b"p1", c, secret=os.urandom(32))) is not None   # wrong secret
    assert refusals[-1] is Refusal.BAD_MAC and not g._used                # a bad MAC uses nothing up
    assert g.authenticate(b"p1", hello(b"p1", c)) is None                 # still good for the honest one
    late = g.challenge(b"p1")
    clock.t += 10.5
    assert g.authenticate(b"p1", hello(b"p1", late)) is not None          # expired
    assert not g._used                                                    # the used one expired too
