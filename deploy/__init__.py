"""Operator tools: the local stack launcher, the drain supervisor, probes, manifests.

Owns the launcher behind ``kvrelay up`` (``launch``), the drain supervisor ``kvrelay
serve`` runs (``drain``), probes (``probe``), the Kubernetes manifests (``k8s``), the
dashboard renderer (``dashboard``), the tiny model (``tiny_model``) and warmup
(``warmup``); the shell scripts and monitoring files next to them drive the same code.

May import: everything below it (``router``, ``core``, ``store``, ``transport``,
``common``) - not ``bench`` or the CLI.
"""
