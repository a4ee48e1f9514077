"""The shared engine core: what the prefill and decode connectors and the router share.

Owns the one typed config tree, composed from the sections each package owns (``config``);
the signed ``kv_transfer_params`` (``params``); the engines' API-server front door that
checks them and turns work away while the node drains (``guard``, ``drain``); the event log
and the connectors' metrics (``telemetry``) and their path onto the engine's ``/metrics``
(``engine_stats``); JSON logs (``logs``); OpenTelemetry spans (``tracing``); the engine
fingerprint (``fingerprint``); helper-thread placement (``placement``); store records
gathered straight from the KV cache (``chunk_records``); the vLLM connector plumbing both
roles share (``connector_base``: needs torch and vLLM, the router never imports it); the
vLLM plugin (``vllm_plugin``).

May import: ``kvrelay.kernels``, ``kvrelay.store``, ``kvrelay.transport``, ``kvrelay.common``.
"""
