"""The consumer connector: vLLM's decode node installs pushed chunks and decodes.

Owns the scheduler half and the connector (``connector``), the scheduler-to-worker
messages (``messages``), the install thread (``installer``) and decode-side saves to the
store (``saver``).

May import: ``kvrelay.core``, ``kvrelay.kernels``, ``kvrelay.store``, ``kvrelay.transport``,
``kvrelay.common`` - never ``kvrelay.prefill``.
"""

if __name__ != "kvrelay.decode":   # the folder imported under its old top-level name (from the repository root)
    raise ImportError(f"kvrelay's modules live under the kvrelay namespace: import kvrelay.decode, not {__name__}")
