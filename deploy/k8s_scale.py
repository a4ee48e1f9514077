"""The optional objects of ``kvrelay deploy k8s``: autoscaling per engine pool and a Gateway API route.

* ``--autoscale-prefill MIN:MAX`` / ``--autoscale-decode MIN:MAX``: a ``HorizontalPodAutoscaler``
  (``autoscaling/v2``) per pool on vLLM's own queue, ``vllm:num_requests_waiting``, averaged
  over the pool's pods (``--autoscale-waiting``, 2 by default). Requests waiting are what a
  disaggregated pool lacks: a prefill pool that falls behind queues prompts, and a decode pool
  with no free KV blocks or sequence slots queues continuations. The HPA reads the metric
  through the custom metrics API, so the cluster needs an adapter that serves it
  (prometheus-adapter; the rule is in docs/guide/deploy.md) under ``--autoscale-metric``
  (``vllm_num_requests_waiting``). Scale-down is slow on purpose: one pod per two minutes
  after five minutes of low queues, since each leaving pod drains its streams first. The
  pool's Deployment then carries no ``replicas``, so a re-apply never fights the autoscaler.
* ``--gateway NAME`` or ``NAMESPACE/NAME``: an ``HTTPRoute`` (``gateway.networking.k8s.io/v1``)
  from that Gateway to the router Service for ``/v1`` (``/health`` and ``/metrics`` stay
  inside the cluster). Its request timeout is disabled (``0s``): an answer streams for as long
  as it takes, and the router's own ``router.request_timeout_s`` and ``stall_timeout_s`` bound
  a silent upstream. ``--hostname`` (repeatable) narrows the route to those host names.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

from kvrelay.common.errors import ConfigError
from kvrelay.deploy.k8s_pods import DNS_LABEL, DNS_NAME, K8sOptions

WAITING_METRIC = "vllm_num_requests_waiting"        # vllm:num_requests_waiting, as an adapter serves it
_HOSTNAME = re.compile(r"(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class Bounds:
    """An autoscaled pool's replica bounds."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, flag: str) -> Bounds:
        low, sep, high = text.partition(":")
        if not sep or not low.isdigit() or not high.isdigit() or not 1 <= int(low) <= int(high):
            raise ConfigError(f"{flag} {text!r}: expected MIN:MAX replicas with 1 <= MIN <= MAX, e.g. 2:8")
        return cls(int(low), int(high))


@dataclass(frozen=True)
class ScaleOptions:
    """What ``kvrelay deploy k8s`` adds on request (nothing by default)."""

    prefill: Bounds | None = None
    decode: Bounds | None = None
    waiting: float = 2.0                 # requests waiting per pod the autoscaler aims at
    metric: str = WAITING_METRIC
    gateway: str = ""                    # NAME or NAMESPACE/NAME of a Gateway; "" renders no route
    hostnames: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.waiting > 0:
            raise ConfigError(f"--autoscale-waiting must be above 0, got {self.waiting:g}")
        if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", self.metric):
            raise ConfigError(f"--autoscale-metric {self.metric!r} is not a metric name")
        ns, _, name = self.gateway.rpartition("/")
        if self.gateway and (not DNS_NAME.fullmatch(name) or (ns and not DNS_LABEL.fullmatch(ns))):
            raise ConfigError(f"--gateway {self.gateway!r}: expected NAME or NAMESPACE/NAME of a Gateway")
        for host in self.hostnames:
            if not _HOSTNAME.fullmatch(host) or len(host) > 253:
                raise ConfigError(f"--hostname {host!r} is not a host name (a leading '*.' is allowed)")

    def bounds(self, role: str) -> Bounds | None:
        return self.prefill if role == "prefill" else self.decode


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--autoscale-prefill", default="", metavar="MIN:MAX",
                   help="a HorizontalPodAutoscaler for the prefill pool on vLLM's waiting requests (needs a "
                        "custom metrics adapter; see docs/guide/deploy.md)")
    p.add_argument("--autoscale-decode", default="", metavar="MIN:MAX", help="the same for the decode pool")
    p.add_argument("--autoscale-waiting", type=float, default=2.0, metavar="N",
                   help="requests waiting per pod that the autoscalers aim at (default 2)")
    p.add_argument("--autoscale-metric", default=WAITING_METRIC, metavar="NAME",
                   help=f"the Pods metric the autoscalers read (default {WAITING_METRIC})")
    p.add_argument("--gateway", default="", metavar="[NAMESPACE/]NAME",
                   help="also render a Gateway API HTTPRoute from this Gateway to the router's /v1 API")
    p.add_argument("--hostname", action="append", default=[], metavar="HOST",
                   help="host names the HTTPRoute answers for (repeatable; default: the Gateway's)")


def options_from_args(args: argparse.Namespace) -> ScaleOptions:
    return ScaleOptions(
        prefill=Bounds.parse(args.autoscale_prefill, "--autoscale-prefill") if args.autoscale_prefill else None,
        decode=Bounds.parse(args.autoscale_decode, "--autoscale-decode") if args.autoscale_decode else None,
        waiting=args.autoscale_waiting, metric=args.autoscale_metric, gateway=args.gateway,
        hostnames=tuple(args.hostname))


def autoscaler(role: str, bounds: Bounds, scale: ScaleOptions, opts: K8sOptions) -> dict[str, Any]:
    """The pool's HPA: average waiting requests per pod at ``scale.waiting``; up fast, down slowly."""
    target = {"type": "AverageValue", "averageValue": _quantity(scale.waiting)}
    behavior = {"scaleUp": {"stabilizationWindowSeconds": 60,
                            "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
                "scaleDown": {"stabilizationWindowSeconds": 300,
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]}}
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": opts.meta(role, role),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": opts.name(role)},
                     "minReplicas": bounds.low, "maxReplicas": bounds.high,
                     "metrics": [{"type": "Pods", "pods": {"metric": {"name": scale.metric}, "target": target}}],
                     "behavior": behavior}}


def http_route(port: int, scale: ScaleOptions, opts: K8sOptions) -> dict[str, Any]:
    """The router's OpenAI API behind ``scale.gateway``, with no request timeout (answers stream)."""
    ns, _, name = scale.gateway.rpartition("/")
    parent = {"name": name, **({"namespace": ns} if ns else {})}
    rule = {"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
            "backendRefs": [{"name": opts.name("router"), "port": port}],
            "timeouts": {"request": "0s"}}
    spec: dict[str, Any] = {"parentRefs": [parent], "rules": [rule]}
    if scale.hostnames:
        spec["hostnames"] = list(scale.hostnames)
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": opts.meta("router", "router"),
            "spec": spec}


def _quantity(value: float) -> str:
    """A Kubernetes quantity for ``value`` (milli-units below 1000 where it has a fraction)."""
    return str(int(value)) if value == int(value) else f"{round(value * 1000)}m"
