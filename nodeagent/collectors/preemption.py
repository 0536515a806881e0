"""Preemption notices from the cloud's metadata service: AWS spot ``instance-action``
(IMDSv2), GCP ``instance/preempted``, Azure Scheduled Events ``Preempt``.

A notice gives the job two minutes (AWS), thirty seconds (GCP) or so to make a durable
checkpoint, so it is polled every couple of seconds. The provider is a setting, or
detected (AWS's token endpoint, then GCP's ``Metadata-Flavor`` header, then Azure's
instance endpoint); off any cloud detection fails quickly and is retried only every
``redetect_s``, the collector reporting itself unavailable meanwhile.

A metadata service that errors makes the collection fail (the daemon records it), not a
notice. A deadline the provider does not give is counted from the sample's ``now``; the
waits (re-detection, the IMDSv2 token's life) run on the collector's clock.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from http.client import HTTPConnection, HTTPException, HTTPSConnection
from typing import Any
from urllib.parse import SplitResult, urlsplit

import msgspec

from nodeagent.collectors.base import CollectorUnavailable, Sample
from ringmaster.clock import SYSTEM, Clock

AWS_TOKEN_TTL_S = 21600
PROVIDERS = ("aws", "gcp", "azure")


class MetadataError(OSError):
    """The metadata service answered something unusable."""


class Notice(msgspec.Struct, kw_only=True):
    action: str  # terminate, stop, preempt, ...
    deadline: datetime  # UTC
    detail: str  # the provider's words or the event's id


class PreemptionSample(Sample, kw_only=True):
    provider: str
    notice: Notice | None = None


class PreemptionCollector:
    name = "preemption"

    def __init__(
        self,
        *,
        provider: str = "auto",
        interval_s: float = 2.0,
        timeout_s: float = 0.5,
        aws_url: str = "http://169.254.169.254",
        gcp_url: str = "http://metadata.google.internal",
        azure_url: str = "http://169.254.169.254",
        redetect_s: float = 300.0,
        gcp_deadline_s: float = 30.0,
        clock: Clock = SYSTEM,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._wanted = provider
        self._timeout = timeout_s
        self._urls = {"aws": aws_url.rstrip("/"), "gcp": gcp_url.rstrip("/")}
        self._urls["azure"] = azure_url.rstrip("/")
        self._redetect_s = redetect_s
        self._gcp_deadline_s = gcp_deadline_s
        self._provider: str | None = None if provider == "auto" else provider
        self._failed_at: float | None = None
        self._token: tuple[str, float] | None = None  # (IMDSv2 token, monotonic expiry)
        self._gcp_since: datetime | None = None
        self._azure_name: str | None = None
        self._connections: dict[str, HTTPConnection] = {}  # netloc → kept alive

    def collect(self, now: float) -> PreemptionSample:
        provider = self._provider or self._detect()
        at = datetime.fromtimestamp(now, UTC)
        match provider:
            case "aws":
                notice = self._aws()  # AWS says when
            case "gcp":
                notice = self._gcp(at)
            case _:
                notice = self._azure(at)
        return PreemptionSample(time=now, provider=provider, notice=notice)

    # -- plumbing ----------------------------------------------------------------------

    def _request(self, url: str, headers: dict[str, str], method: str = "GET") -> tuple[int, str]:
        """(status, body); 4xx answers are answers, anything else raises OSError."""
        status, body, _ = self._fetch(url, headers, method)
        return status, body

    def _fetch(
        self, url: str, headers: dict[str, str], method: str = "GET"
    ) -> tuple[int, str, dict[str, str]]:
        """One request on a kept-alive connection to the metadata service (a poll every
        two seconds should not cost a TCP handshake each); if the server had closed it,
        once more on a fresh one. 5xx answers raise."""
        parts = urlsplit(url)
        kept = self._connections.get(parts.netloc)
        try:
            if kept is not None:
                try:
                    answer = self._exchange(kept, parts, method, headers)
                except (OSError, HTTPException):
                    self._drop(parts.netloc)
                    answer = self._exchange(self._connect(parts), parts, method, headers)
            else:
                answer = self._exchange(self._connect(parts), parts, method, headers)
        except (OSError, HTTPException) as exc:
            self._drop(parts.netloc)
            raise MetadataError(f"{url}: {exc!r}") from None
        status, raw, got = answer
        if status >= 500:
            raise MetadataError(f"{url}: HTTP {status}")
        try:
            # JSON is UTF-8 (RFC 8259): an answer that is not is malformed, and a notice
            # read from a repaired one would drain a node on a guess.
            return status, raw.decode(), got
        except UnicodeDecodeError:
            raise MetadataError(f"{url}: answer is not UTF-8: {raw[:60]!r}") from None

    def _connect(self, parts: SplitResult) -> HTTPConnection:
        kind = HTTPSConnection if parts.scheme == "https" else HTTPConnection
        conn = self._connections[parts.netloc] = kind(parts.netloc, timeout=self._timeout)
        return conn

    def _exchange(
        self, conn: HTTPConnection, parts: SplitResult, method: str, headers: dict[str, str]
    ) -> tuple[int, bytes, dict[str, str]]:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request(method, target, headers=headers)
        response = conn.getresponse()
        body = response.read()
        if response.will_close:
            self._drop(parts.netloc)
        return response.status, body, dict(response.getheaders())

    def _drop(self, netloc: str) -> None:
        conn = self._connections.pop(netloc, None)
        if conn is not None:
            conn.close()

    def _detect(self) -> str:
        mono = self._clock.monotonic()
        if self._failed_at is not None and mono - self._failed_at < self._redetect_s:
            raise CollectorUnavailable("no cloud metadata service (tried aws, gcp, azure)")
        for provider, probe in (
            ("aws", self._aws_token),
            ("gcp", self._gcp_probe),
            ("azure", self._azure_probe),
        ):
            try:
                probe()
            except OSError:
                continue
            self._provider = provider
            return provider
        self._failed_at = mono
        raise CollectorUnavailable("no cloud metadata service (tried aws, gcp, azure)")

    # -- AWS ---------------------------------------------------------------------------

    def _aws_token(self) -> str:
        if self._token is not None and self._clock.monotonic() < self._token[1]:
            return self._token[0]
        headers = {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)}
        status, body = self._request(f"{self._urls['aws']}/latest/api/token", headers, "PUT")
        if status != 200 or not body:
            raise MetadataError(f"IMDSv2 token: HTTP {status}")
        self._token = (body.strip(), self._clock.monotonic() + AWS_TOKEN_TTL_S - 60)
        return self._token[0]

    def _aws(self) -> Notice | None:
        url = f"{self._urls['aws']}/latest/meta-data/spot/instance-action"
        status, body = self._request(url, {"X-aws-ec2-metadata-token": self._aws_token()})
        if status == 401:  # the token expired early (instance stopped and started)
            self._token = None
            status, body = self._request(url, {"X-aws-ec2-metadata-token": self._aws_token()})
        if status == 404:
            return None
        if status != 200:
            raise MetadataError(f"instance-action: HTTP {status}")
        try:
            doc = json.loads(body)
            action = str(doc.get("action") or doc["instance-action"])
            deadline = datetime.fromisoformat(doc["time"]).astimezone(UTC)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
            raise MetadataError(f"instance-action: unreadable {body[:120]!r}") from None
        return Notice(action=action, deadline=deadline, detail="spot instance-action")

    # -- GCP ---------------------------------------------------------------------------

    def _gcp_probe(self) -> None:
        url = f"{self._urls['gcp']}/computeMetadata/v1/"
        status, _, headers = self._fetch(url, {"Metadata-Flavor": "Google"})
        if status != 200 or headers.get("Metadata-Flavor") != "Google":
            raise MetadataError("not GCP's metadata server")

    def _gcp(self, now: datetime) -> Notice | None:
        url = f"{self._urls['gcp']}/computeMetadata/v1/instance/preempted"
        status, body = self._request(url, {"Metadata-Flavor": "Google"})
        if status != 200:
            raise MetadataError(f"instance/preempted: HTTP {status}")
        if body.strip() != "TRUE":
            self._gcp_since = None
            return None
        # GCP gives no deadline: preemption comes about 30 s after the flag turns TRUE.
        self._gcp_since = self._gcp_since or now
        deadline = self._gcp_since + timedelta(seconds=self._gcp_deadline_s)
        return Notice(action="terminate", deadline=deadline, detail="instance/preempted is TRUE")

    # -- Azure -------------------------------------------------------------------------

    def _azure_probe(self) -> None:
        url = f"{self._urls['azure']}/metadata/instance?api-version=2021-02-01"
        status, _ = self._request(url, {"Metadata": "true"})
        if status != 200:
            raise MetadataError(f"Azure instance metadata: HTTP {status}")

    def _azure(self, now: datetime) -> Notice | None:
        base, headers = self._urls["azure"], {"Metadata": "true"}
        if self._azure_name is None:
            url = f"{base}/metadata/instance/compute/name?api-version=2021-02-01&format=text"
            status, body = self._request(url, headers)
            self._azure_name = body.strip() if status == 200 else ""
        url = f"{base}/metadata/scheduledevents?api-version=2020-07-01"
        status, body = self._request(url, headers)
        if status != 200:
            raise MetadataError(f"scheduledevents: HTTP {status}")
        try:
            return self._azure_notice(json.loads(body)["Events"], now)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
            raise MetadataError(f"scheduledevents: unreadable {body[:120]!r}") from None

    def _azure_notice(self, events: list[Any], now: datetime) -> Notice | None:
        for event in events:
            resources = event.get("Resources") or []
            mine = not resources or not self._azure_name or self._azure_name in resources
            if event.get("EventType") == "Preempt" and mine:
                not_before = str(event.get("NotBefore") or "")
                deadline = parsedate_to_datetime(not_before) if not_before else now
                return Notice(
                    action="preempt",
                    deadline=deadline.astimezone(UTC),
                    detail=str(event.get("EventId", "")),
                )
        return None
