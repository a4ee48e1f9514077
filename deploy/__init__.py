"""Operator tools: the local stack launcher, the drain supervisor, probes, manifests.

Owns the launcher behind ``kvrelay up`` (``launch``), the drain supervisor ``kvrelay
serve`` runs (``drain``), probes (``probe``), the Kubernetes manifests (``k8s``), the
dashboard renderer (``dashboard``), the tiny model (``tiny_model``) and warmup
(``warmup``); the shell scripts and monitoring files next to them drive the same code.

May import: everything below it (``router``, ``core``, ``store``, ``transport``,
``common``) - not ``bench`` or the CLI.
"""

if __name__ != "kvrelay.deploy":   # the folder imported under its old top-level name (from the repository root)
    raise ImportError(f"kvrelay's modules live under the kvrelay namespace: import kvrelay.deploy, not {__name__}")
