"""The Grafana dashboards in examples/grafana reference only metrics pdserve exports (a renamed metric would leave a
panel empty without a word), and each is a dashboard Grafana can import: panels with PromQL targets on a
Prometheus datasource variable."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.servers import REPO

DASHBOARDS = sorted((REPO / "examples" / "grafana").glob("*.json"))
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def exported() -> set[str]:
    """Every series name the instances', routers' and planner's registries can export."""
    from pdserve.admission.metrics import AdmissionMetrics
    from pdserve.api.metrics import ServerMetrics
    from pdserve.planner.metrics import PlannerMetrics
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.registry import Registry

    server, router = ServerMetrics(), RouterMetrics(Registry()).prometheus
    AdmissionMetrics(server.registry, "pdserve")  # as api/serve.py and router/app.py add them, with admission on
    AdmissionMetrics(router, "pdserve_router")
    names = set()
    for registry in (server.registry, router, PlannerMetrics().registry):
        for family in registry.collect():
            names.add(family.name)
            names.update(family.name + s for s in SUFFIXES.get(family.type, ()))
    return names


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_a_dashboard_references_only_exported_metrics(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    assert any(v["type"] == "datasource" for v in dashboard["templating"]["list"])
    names = exported()
    for panel in dashboard["panels"]:
        assert panel["targets"], f"{path.name}: panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            used = set(re.findall(r"\bpdserve_[a-z0-9_]+", target["expr"]))
            assert used, f"{path.name}: {target['expr']!r} reads no pdserve metric"
            assert used <= names, f"{path.name}: panel {panel['title']!r} reads {sorted(used - names)}, not exported"
            for counter in (n for n in used if n.endswith(("_total", "_sum", "_count", "_bucket"))):
                assert re.search(rf"(rate|increase)\(\s*{counter}\b", target["expr"]), \
                    f"{path.name}: panel {panel['title']!r} reads counter {counter} without rate() or increase()"


def test_the_overview_pd_kv_admission_and_planner_dashboards_are_there() -> None:
    assert {p.name for p in DASHBOARDS} >= {"pdserve-overview.json", "pdserve-pd.json", "pdserve-kv-cache.json",
                                            "pdserve-admission.json", "pdserve-planner.json"}
