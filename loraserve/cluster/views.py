"""The cluster-wide views the ingress builds from the replicas' board posts (board.py)."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString


def pool_view(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """/admin/pool of a cluster: each replica's own /admin/pool, with its id, node and process id."""
    return {"replicas": [{"replica": s["replica"], "node": s["node"], "pid": s["pid"], **s["pool"]} for s in snapshots]}


def holders(snapshots: list[dict[str, Any]], adapter: str) -> list[dict[str, str]]:
    """The replicas holding `adapter` in memory: in a device slot, or read into host memory."""
    found = []
    for snapshot in snapshots:
        pool = snapshot["pool"]
        if any(resident["name"] == adapter for resident in pool["device_adapters"]):
            found.append({"replica": snapshot["replica"], "residency": "device"})
        elif adapter in pool["host_adapters"]:
            found.append({"replica": snapshot["replica"], "residency": "host"})
    return found


def merged_metrics(snapshots: list[dict[str, Any]]) -> str:
    """Every replica's Prometheus series in one exposition, each labelled `replica`; a family's HELP and TYPE once."""
    families: dict[str, tuple[str, str, list[str]]] = {}  # exposed name -> (help, type, sample lines)
    for snapshot in snapshots:
        for family in text_string_to_metric_families(snapshot["metrics"]):
            exposed = family.name + "_total" if family.type == "counter" else family.name
            lines = families.setdefault(exposed, (family.documentation, family.type, []))[2]
            for sample in family.samples:
                labels = {**sample.labels, "replica": snapshot["replica"]}
                rendered = ",".join(f'{key}="{_escaped(value)}"' for key, value in labels.items())
                lines.append(f"{sample.name}{{{rendered}}} {floatToGoString(sample.value)}")
    out = []
    for name, (documentation, kind, lines) in families.items():
        out += [f"# HELP {name} {_escaped(documentation, quote=False)}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"


def _escaped(text: str, quote: bool = True) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text
