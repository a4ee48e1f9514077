"""The consumer connector: vLLM's decode node installs pushed chunks and decodes.

Owns the scheduler half and the connector (``connector``), the scheduler-to-worker
messages (``messages``), the install thread (``installer``) and decode-side saves to the
store (``saver``).

May import: ``kvrelay.core``, ``kvrelay.kernels``, ``kvrelay.store``, ``kvrelay.transport``,
``kvrelay.common`` - never ``kvrelay.prefill``.
"""
