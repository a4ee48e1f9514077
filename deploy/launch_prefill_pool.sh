#!/usr/bin/env bash
# Start a pool of N prefill vLLM servers (PrefillConnector) on this host.
#
#   deploy/launch_prefill_pool.sh [-n N] [--config deploy/example.yaml] [--engine.model ID] [...]
#
# Node i serves HTTP on deploy.base_port + i. Every kvrelay config key is a flag
# (kvrelay serve --help). Needs the shared secret (KVRELAY_SECRET or --transport.secret_file).
# Prefill nodes need no fixed transfer port: they connect to the decode node named in each
# request's kv_transfer_params. SIGTERM drains every node gracefully (README: Graceful
# drain); Ctrl-C stops them at once.
exec bash "$(dirname "$0")/_pool.sh" prefill "$@"
