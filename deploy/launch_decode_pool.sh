#!/usr/bin/env bash
# Start a pool of N decode vLLM servers (DecodeConnector) on this host.
#
#   deploy/launch_decode_pool.sh [-n N] [--config deploy/example.yaml] [--deploy.base_port 8200] [...]
#
# Node i serves HTTP on deploy.base_port + i and receives KV chunks on
# tcp://transport.host:(deploy.kv_base_port + i); list it to the router as
# "http://host:port=tcp://host:kvport". Every kvrelay config key is a flag.
# Every node and the router need the deployment's shared secret: KVRELAY_SECRET in the
# environment, or --transport.secret_file FILE (0600; `kvrelay secret FILE` makes one).
# SIGTERM drains every node gracefully (README: Graceful drain); Ctrl-C stops them at once.
exec bash "$(dirname "$0")/_pool.sh" decode "$@"
