"""Chunks on the move: the sender and receiver, the receive pool, the control protocol.

Owns the receive pool (``pool``), the versioned control protocol (``protocol``), the decode
side's sessions and handshake checks (``sessions``), the receiver's records of granted,
parked and dead transfers (``ledger``), the refusal and slot events (``events``),
``Sender`` / ``Receiver`` and the data-plane backends behind one contract with declared
capabilities (``backends/``), and its own config sections (``config``).

May import: ``kvrelay.common`` only. The store sits beside it, not inside it.
"""
