"""The shipped Grafana dashboard, checked offline against Grafana's dashboard model as far
as it goes, and against the metrics the code exports (so it cannot drift from them)."""

from __future__ import annotations

import json
import re
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest
from metric_states import agent_registry, coordinator, series_names

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ringmaster.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
METRIC = re.compile(r"ringmaster_[a-z_]+")
MATCHER = re.compile(r'(\w+)\s*(?:=~|!~|!=|=)\s*"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
LABEL_VALUES = re.compile(r"label_values\([^,]+,\s*(\w+)\)")
PANEL_TYPES = {"timeseries", "stat", "table", "gauge", "bargauge", "state-timeline"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and template variable queries."""
    found = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append(variable["query"]["query"])
    return found


def test_top_level(dashboard: dict[str, Any]) -> None:
    for key in ("title", "panels", "schemaVersion", "templating", "time", "uid"):
        assert key in dashboard, key
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert set(dashboard["time"]) == {"from", "to"}
    assert isinstance(dashboard["templating"]["list"], list)


def test_panels(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        assert panel["type"] in PANEL_TYPES, panel["type"]
        assert panel["title"], panel
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"}, panel["title"]
        assert all(isinstance(v, int) and v >= 0 for v in grid.values()), panel["title"]
        assert grid["w"] >= 1 and grid["x"] + grid["w"] <= 24 and grid["h"] >= 1, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def test_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    def cells(p: dict[str, Any]) -> set[tuple[int, int]]:
        g = p["gridPos"]
        return {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }

    for a, b in combinations(dashboard["panels"], 2):
        assert not cells(a) & cells(b), (a["title"], b["title"])


def test_one_datasource_everywhere(dashboard: dict[str, Any]) -> None:
    [variable] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["name"] == "datasource" and variable["query"] == "prometheus"
    for panel in dashboard["panels"]:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert all(t["datasource"] == DATASOURCE for t in panel["targets"]), panel["title"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE, variable["name"]


def test_variables_used_are_defined(dashboard: dict[str, Any]) -> None:
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    used = {m for e in exprs(dashboard) for m in re.findall(r"\$(\w+)", e)}
    assert used <= defined, used - defined


def test_every_metric_is_one_the_code_exports(dashboard: dict[str, Any]) -> None:
    exported = series_names(agent_registry()) | series_names(coordinator()[0])
    used = {name for e in exprs(dashboard) for name in METRIC.findall(e)}
    assert used, "no metric found: the pattern or the file is wrong"
    assert used <= exported, f"not exported by any daemon: {sorted(used - exported)}"


def test_every_label_is_one_the_code_exports(dashboard: dict[str, Any]) -> None:
    """A filter, grouping or legend on a label no series carries shows nothing: ``job``
    is the scrape target's, the training job's id is ``job_name``."""
    registries = (agent_registry(), coordinator()[0])
    exported = {k for r in registries for f in r.collect() for s in f.samples for k in s.labels}
    used = set()
    for e in exprs(dashboard):
        used |= set(MATCHER.findall(e)) | set(LABEL_VALUES.findall(e))
        used |= {label.strip() for group in GROUPING.findall(e) for label in group.split(",")}
    legends = [t.get("legendFormat", "") for p in dashboard["panels"] for t in p["targets"]]
    used |= {label for legend in legends for label in LEGEND.findall(legend)}
    assert {"node", "bucket", "le"} <= used, "the patterns or the file are wrong"
    assert used <= exported, f"not exported by any daemon: {sorted(used - exported)}"


def test_the_signals_operators_watch_first(dashboard: dict[str, Any]) -> None:
    """GPU utilisation (band 75-95 %), PCIe bandwidth and NVMe latency, at the top."""
    by_metric = {METRIC.findall(t["expr"])[0]: p for p in dashboard["panels"] for t in p["targets"]}
    util = by_metric["ringmaster_gpu_utilization_ratio"]
    steps = [s["value"] for s in util["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert steps == [None, 0.75, 0.95]
    nvme = by_metric["ringmaster_nvme_latency_seconds"]
    assert nvme["fieldConfig"]["defaults"]["unit"] == "s"
    pcie = by_metric["ringmaster_gpu_pcie_throughput_bytes_per_second"]
    for panel in (util, nvme, pcie):
        assert panel["gridPos"]["y"] <= 12, panel["title"]
    assert "ringmaster_job_goodput_gpu_seconds_total" in by_metric
