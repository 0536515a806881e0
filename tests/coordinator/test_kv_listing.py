"""Listing a bucket's records while they are being written: every key, every time.

A new leader loads its jobs from such a listing and ``status`` its nodes; heartbeats and
progress rewrite those records all the while. A listing that ends early forgets a job.
Against a real nats-server; ``status`` through the real CLI."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import nats
import pytest
from test_ctl_input import ctl

from coordinator.embedded_nats import NatsServer
from coordinator.kvstore import KvCasStore, ensure_layout, live_keys

pytestmark = pytest.mark.anyio
KEYS = [f"node-{i}" for i in range(8)]


async def test_every_listing_during_writes_has_every_key(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    writer_nc = await nats.connect(nats_server.url)
    try:
        buckets = await ensure_layout(nc.jetstream(), "local")
        for key in KEYS:
            await buckets.nodes.put(key, b"{}")
        await buckets.nodes.put("gone", b"{}")
        await buckets.nodes.delete("gone")
        writes = (await ensure_layout(writer_nc.jetstream(), "local")).nodes
        stop = asyncio.Event()
        written = [0]

        async def rewrite() -> None:
            while not stop.is_set():
                await writes.put(KEYS[written[0] % len(KEYS)], b'{"n": %d}' % written[0])
                written[0] += 1

        writer = asyncio.create_task(rewrite())
        listings, overlapped = [], 0
        for _ in range(200):
            before = written[0]
            listings.append(await live_keys(buckets.nodes))
            overlapped += written[0] > before  # a write landed while this listing ran
        stop.set()
        await writer
        assert overlapped > 0  # the listings really ran beside the writes
        assert all(listing == sorted([*KEYS, "gone"]) for listing in listings), listings
        store = KvCasStore(buckets.nodes)
        assert await store.get("gone") is None  # listed (its marker), read as absent
        assert await KvCasStore(buckets.jobs).keys() == []  # an empty bucket lists nothing
    finally:
        await writer_nc.close()
        await nc.close()


@pytest.mark.slow
async def test_status_names_a_record_it_cannot_read(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        buckets = await ensure_layout(nc.jetstream(), "local")
        await buckets.nodes.put("node-x", b"{not json")
        await buckets.jobs.put("job-x", b'{"id": 7}')
    finally:
        await nc.close()
    listed = await asyncio.to_thread(ctl, nats_server.url, "status", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["nodes"] == []
    warnings = listed.stderr.splitlines()
    assert any(w.startswith("warning: nodes record 'node-x' does not decode") for w in warnings)
    assert any(w.startswith("warning: jobs record 'job-x' does not decode") for w in warnings)
    one = await asyncio.to_thread(ctl, nats_server.url, "status", "job-x", cwd=tmp_path)
    assert one.returncode == 1 and "Traceback" not in one.stderr, one.stderr
    lines = one.stderr.strip().splitlines()
    assert len(lines) == 1 and "jobs record 'job-x' does not decode" in lines[0], lines
