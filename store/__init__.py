"""The multi-tier KV store: chunk records addressed by key, in CPU, disk and Redis tiers.

Owns the record format and its keyed MAC (``records``), the tiers (``tiers``), the
eviction policies (``policy``), the store itself with its deferred flushes (``store``), the
store-event schema and publisher (``events``) and its config section (``config``).

May import: ``kvrelay.common`` only (it sits beside ``kvrelay.transport``, not on it).
"""
