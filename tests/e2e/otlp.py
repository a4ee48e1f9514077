"""A minimal OTLP/HTTP trace collector for the tests: the spans every process exported, parsed."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Collector:
    """POST /v1/traces (protobuf) on 127.0.0.1:``port``; ``spans`` grows as exports arrive."""

    def __init__(self, port: int) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                outer.add(req)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.endpoint = f"http://127.0.0.1:{port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, req: Any) -> None:
        for rs in req.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    with self.lock:
                        self.spans.append({"trace": s.trace_id.hex(), "id": s.span_id.hex(),
                                           "parent": s.parent_span_id.hex(), "name": s.name,
                                           "service": res.get("service.name", ""),
                                           "attrs": {a.key: _value(a.value) for a in s.attributes},
                                           "error": s.status.code == 2})

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
