"""The producer connector: vLLM's prefill node computes a prompt's KV and pushes it.

Owns the scheduler half and the connector (``connector``), the scheduler-to-worker
messages (``messages``), the push thread (``pusher``) and its gather buffers (``staging``),
the store worker that saves chunks and loads hits (``store_worker``), and the store's
lookup client and service (``lookup``, ``store_service``).

May import: ``kvrelay.core``, ``kvrelay.kernels``, ``kvrelay.store``, ``kvrelay.transport``,
``kvrelay.common`` - never ``kvrelay.decode``.
"""
