"""kvrelay: disaggregated prefill/decode serving for vLLM.

The ``kvrelay`` package holds what the whole distribution shares: the typed
configuration tree (:mod:`kvrelay.config`) and the command line
(:mod:`kvrelay.cli`). The transport layer lives in the top-level ``transport``
package; the engine connectors in ``prefill`` and ``decode``.
"""

__version__ = "0.1.0"
