"""Optional OpenTelemetry tracing: one trace per request, router -> prefill -> decode, with transfer spans.

Off by default (``tracing.endpoint: ""``); nothing here touches OpenTelemetry until it is on.

* The router opens a SERVER span ``kvrelay.request`` per completion (a child of the client's
  ``traceparent`` header if it sent one) and passes its context on: as the ``traceparent``
  header of every engine request (vLLM, started with ``--otlp-traces-endpoint``, hangs its
  ``llm_request`` spans under it) and as ``kv_transfer_params["traceparent"]``, beside the
  signed ``kvrelay`` entry (:data:`TRACEPARENT_KEY`; unsigned - it only names a trace).
* The connectors' workers open ``kvrelay.push`` (prefill) and ``kvrelay.install`` (decode)
  spans under that context, from the transfer's start to its end, with its outcome.

Spans go out in batches over OTLP (``tracing.protocol``: ``http/protobuf`` or ``grpc``).
Each process uses its own tracer provider (not the global one vLLM may set).
"""

from __future__ import annotations

import enum
import functools
import time
from typing import Any

TRACEPARENT_KEY = "traceparent"


class TraceProtocol(str, enum.Enum):
    HTTP = "http/protobuf"
    GRPC = "grpc"


@functools.cache
def installed() -> bool:
    """Whether OpenTelemetry is importable (the ``otel`` extra; a router-only install lacks it)."""
    import importlib.util

    return importlib.util.find_spec("opentelemetry") is not None


@functools.cache
def tracer(endpoint: str, protocol: TraceProtocol, service: str) -> Any:
    """This process's tracer exporting to ``endpoint`` (None when ``endpoint`` is empty);
    MissingDependency when tracing is asked for and OpenTelemetry is not installed."""
    if not endpoint:
        return None
    from kvrelay.common.optional import need

    need("opentelemetry.sdk.trace", "otel", f"tracing.endpoint {endpoint}")
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if protocol is TraceProtocol.GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter: Any = GrpcExporter(endpoint=endpoint, insecure=True)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter(endpoint=endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
    import atexit

    atexit.register(provider.shutdown)
    return provider.get_tracer("kvrelay")


def context_of(traceparent: str | None) -> Any:
    """The OpenTelemetry context a ``traceparent`` value names (None: a new trace)."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def traceparent_of(kv_transfer_params: dict[str, Any] | None) -> str:
    """The ``traceparent`` the router put beside its params ("" if none, or not a string)."""
    value = (kv_transfer_params or {}).get(TRACEPARENT_KEY, "")
    return value if isinstance(value, str) and len(value) < 128 else ""


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current span's ``traceparent`` to ``headers`` (nothing without a recording span)."""
    if not installed():
        return headers
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    TraceContextTextMapPropagator().inject(headers)
    return headers


def with_traceparent(params: dict[str, Any]) -> dict[str, Any]:
    """``kv_transfer_params`` plus the current span's ``traceparent`` (unchanged without one)."""
    carrier = inject({})
    if "traceparent" in carrier:
        params[TRACEPARENT_KEY] = carrier["traceparent"]
    return params


def annotate(**attrs: Any) -> None:
    """Set ``kvrelay.<key>`` attributes on the current span, if one is recording."""
    if not installed():
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({f"kvrelay.{k}": v for k, v in attrs.items()})


def request_span(tracer_: Any, name: str, headers: Any) -> Any:
    """A SERVER span for one request, child of the client's ``traceparent`` if any; a no-op
    context manager without a tracer."""
    import contextlib

    if tracer_ is None:
        return contextlib.nullcontext()
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract({k.lower(): v for k, v in headers.items()})
    return tracer_.start_as_current_span(name, context=parent, kind=SpanKind.SERVER)


class TransferSpans:
    """The connectors' spans: :meth:`start` when a transfer starts, :meth:`end` when it settles.
    Without a tracer (tracing off) both do nothing and cost nothing."""

    def __init__(self, endpoint: str, protocol: TraceProtocol, service: str) -> None:
        self._tracer = tracer(endpoint, protocol, service)

    def start(self, name: str, traceparent: str | None, **attrs: Any) -> Any:
        if self._tracer is None or not traceparent:
            return None
        from opentelemetry.trace import SpanKind

        return self._tracer.start_span(name, context=context_of(traceparent), kind=SpanKind.INTERNAL,
                                       attributes={f"kvrelay.{k}": v for k, v in attrs.items()},
                                       start_time=time.time_ns())

    def end(self, span: Any, error: str = "", **attrs: Any) -> None:
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        for k, v in attrs.items():
            span.set_attribute(f"kvrelay.{k}", v)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
