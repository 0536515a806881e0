"""A cloud metadata service on localhost, playing AWS (IMDSv2), GCP and Azure as far as
preemption notices go, for simulated nodes and tests.

* AWS: ``PUT /latest/api/token`` (with a TTL header) gives a token; ``GET
  /latest/meta-data/spot/instance-action`` needs it (401 without), answers 404 until a
  notice, then ``{"action": "terminate", "time": "<ISO 8601>"}``.
* GCP: ``GET /computeMetadata/v1/instance/preempted`` needs ``Metadata-Flavor: Google``,
  answers ``FALSE`` or ``TRUE``, with the ``Metadata-Flavor`` header back.
* Azure: ``GET /metadata/scheduledevents`` and ``/metadata/instance`` need ``Metadata:
  true``; a notice is a ``Preempt`` event whose ``NotBefore`` is the deadline.

``providers`` limits which of the three answer (the others 404), so detection can be tested;
``failing`` makes every answer that HTTP status; ``idle_timeout`` closes kept-alive
connections left idle that long, as real services do. A notice's deadline is counted from
``clock``'s wall time, so a test can give the agent's collector the same clock.
"""

from __future__ import annotations

import json
import secrets
import threading
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from ringmaster.clock import SYSTEM, Clock

PROVIDERS = ("aws", "gcp", "azure")
VM_NAME = "ringmaster-sim"


class MetadataServer:
    def __init__(
        self,
        providers: tuple[str, ...] = PROVIDERS,
        host: str = "127.0.0.1",
        idle_timeout: float | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.providers = providers
        self.clock = clock
        self.failing: int | None = None
        self.notice: tuple[str, datetime] | None = None  # (action, deadline)
        self.tokens: set[str] = set()
        self.requests: list[str] = []  # "METHOD path", for tests
        self._server = ThreadingHTTPServer((host, 0), _handler(self, idle_timeout))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> MetadataServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def preempt(self, in_s: float, action: str = "terminate") -> None:
        now = datetime.fromtimestamp(self.clock.time(), UTC).replace(microsecond=0)
        deadline = now + timedelta(seconds=round(in_s))
        self.notice = (action, deadline)

    def withdraw(self) -> None:
        self.notice = None


def _handler(service: MetadataServer, idle_timeout: float | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the clouds' metadata services do
        timeout = idle_timeout

        def log_message(self, format: str, *args: object) -> None:
            pass  # quiet: the simulator logs JSON lines on stderr

        def do_PUT(self) -> None:
            service.requests.append(f"PUT {self.path}")
            if service.failing:
                return self._send(service.failing, "failing")
            if self.path == "/latest/api/token" and "aws" in service.providers:
                if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._send(400, "missing TTL")
                token = secrets.token_urlsafe(16)
                service.tokens.add(token)
                return self._send(200, token)
            self._send(404, "not found")

        def do_GET(self) -> None:
            service.requests.append(f"GET {self.path}")
            if service.failing:
                return self._send(service.failing, "failing")
            path = urlsplit(self.path).path
            if path.startswith("/latest/") and "aws" in service.providers:
                return self._aws(path)
            if path.startswith("/computeMetadata/") and "gcp" in service.providers:
                return self._gcp(path)
            if path.startswith("/metadata/") and "azure" in service.providers:
                return self._azure(path)
            self._send(404, "not found")

        def _aws(self, path: str) -> None:
            if self.headers.get("X-aws-ec2-metadata-token") not in service.tokens:
                return self._send(401, "")
            if path != "/latest/meta-data/spot/instance-action" or service.notice is None:
                return self._send(404, "not found")
            action, deadline = service.notice
            body = {"action": action, "time": deadline.strftime("%Y-%m-%dT%H:%M:%SZ")}
            self._send(200, json.dumps(body), "application/json")

        def _gcp(self, path: str) -> None:
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403, "Missing Metadata-Flavor:Google header.")
            if path == "/computeMetadata/v1/instance/preempted":
                return self._send(200, "TRUE" if service.notice else "FALSE", google=True)
            self._send(200 if path == "/computeMetadata/v1/" else 404, "", google=True)

        def _azure(self, path: str) -> None:
            if self.headers.get("Metadata") != "true":
                return self._send(400, '{"error": "Bad request. Required metadata header"}')
            if path == "/metadata/instance/compute/name":
                return self._send(200, VM_NAME)
            if path == "/metadata/instance":
                return self._send(200, json.dumps({"compute": {"name": VM_NAME}}))
            if path != "/metadata/scheduledevents":
                return self._send(404, "not found")
            events = []
            if service.notice is not None:
                action, deadline = service.notice
                events.append(
                    {
                        "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
                        "EventType": "Preempt",
                        "ResourceType": "VirtualMachine",
                        "Resources": [VM_NAME],
                        "EventStatus": "Scheduled",
                        "NotBefore": format_datetime(deadline, usegmt=True),
                        "Description": f"simulated {action}",
                        "EventSource": "Platform",
                        "DurationInSeconds": -1,
                    }
                )
            self._send(200, json.dumps({"DocumentIncarnation": 1, "Events": events}))

        def _send(
            self, code: int, body: str, kind: str = "text/plain", google: bool = False
        ) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            if google:
                self.send_header("Metadata-Flavor", "Google")
            self.end_headers()
            self.wfile.write(data)

    return Handler
