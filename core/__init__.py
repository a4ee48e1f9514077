"""The shared engine core: what the prefill and decode connectors and the router share.

* :mod:`core.config` - the one typed config tree (composed from the sections the
  transport and the store own);
* :mod:`core.params` - the versioned ``kv_transfer_params`` schema;
* :mod:`core.telemetry` - the per-node event log and the connectors' Prometheus metrics;
* :mod:`core.fingerprint` - what makes two engines' KV exchangeable;
* :mod:`core.placement` - CPU placement of the connectors' helper threads;
* :mod:`core.connector_base` - the vLLM connector plumbing both roles share (needs torch
  and vLLM; the router never imports it).
"""
