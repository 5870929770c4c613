"""Can the Ray cluster place a job's workers: never (no node, or not all nodes together, has what they need), not
now (busy), or yes. Decided before submission from the cluster's per-node totals and usage (the Ray dashboard's
`/api/cluster_status`, what `ray status` shows), so a job Ray could never place fails at once and one that must
wait stays queued with its reason instead of holding a running slot with its placement group pending."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from moetune.api.models.parallelism import ParallelDims

# The field a user changes when a resource is short: GPUs per worker, or the number of workers.
_PARAM_OF = {"GPU": "parallelism.gpus_per_worker"}


@dataclass(frozen=True)
class NodeResources:
    total: dict[str, float]
    used: dict[str, float]

    def free(self) -> dict[str, float]:
        return {name: amount - self.used.get(name, 0.0) for name, amount in self.total.items()}


@dataclass(frozen=True)
class Shortage:
    param: str  # the job field to change
    message: str


def nodes_from_cluster_status(status: dict) -> list[NodeResources]:
    """Per-node resources from `/api/cluster_status`'s `loadMetricsReport.usageByNode` ({node: {name: [used,
    total]}}); empty until the head's monitor has reported (seconds after start)."""
    by_node = ((status.get("clusterStatus") or {}).get("loadMetricsReport") or {}).get("usageByNode") or {}
    return [NodeResources(total={name: float(pair[1]) for name, pair in usage.items()},
                          used={name: float(pair[0]) for name, pair in usage.items()})
            for usage in by_node.values()]


def _workers_fitting(bundle: dict[str, float], capacities: Iterable[dict[str, float]]) -> int:
    """How many bundles fit, node by node (a worker's bundle never spans two nodes)."""
    return sum(min(math.floor(cap.get(name, 0.0) / amount + 1e-9) for name, amount in bundle.items() if amount)
               for cap in capacities)


def _amounts(bundle: dict[str, float]) -> str:
    return " + ".join(f"{amount:g} {name}" for name, amount in bundle.items() if amount)


def _short_resource(bundle: dict[str, float], capacities: list[dict[str, float]]) -> str:
    """The resource that limits the fit most (its name goes into the message and picks the field)."""
    return min((name for name, amount in bundle.items() if amount),
               key=lambda name: sum(math.floor(c.get(name, 0.0) / bundle[name] + 1e-9) for c in capacities))


def never_placeable(par: ParallelDims, nodes: list[NodeResources]) -> Shortage | None:
    """Why the cluster as it is could never place the job's workers, or None."""
    bundle, totals = par.worker_resources(), [n.total for n in nodes]
    if _workers_fitting(bundle, totals) >= par.num_workers:
        return None
    name = _short_resource(bundle, totals)
    largest = max((t.get(name, 0.0) for t in totals), default=0.0)
    if largest < bundle[name]:
        return Shortage(_PARAM_OF.get(name, "parallelism.num_workers"),
                        f"each worker needs {_amounts(bundle)}, but no node of the Ray cluster has more than "
                        f"{largest:g} {name}")
    return Shortage("parallelism.num_workers",
                    f"{par.num_workers} workers need {par.num_workers * bundle[name]:g} {name} "
                    f"({_amounts(bundle)} each), but the Ray cluster's nodes hold at most "
                    f"{_workers_fitting(bundle, totals)} such workers ({sum(t.get(name, 0.0) for t in totals):g} "
                    f"{name} in all)")


def wait_reason(par: ParallelDims, nodes: list[NodeResources], held: dict[str, float]) -> str | None:
    """Why the job cannot start now, or None. `held`: what this control plane's running jobs hold, counted even
    before Ray's usage report (seconds behind) shows them."""
    bundle = par.worker_resources()
    frees = [n.free() for n in nodes]
    reported_used = {name: sum(n.used.get(name, 0.0) for n in nodes) for name in bundle}
    unreported = {name: max(held.get(name, 0.0) - reported_used[name], 0.0) for name in bundle}
    free_in_all = {name: sum(f.get(name, 0.0) for f in frees) - unreported[name] for name in bundle}
    fits_by_node = _workers_fitting(bundle, frees) >= par.num_workers
    if fits_by_node and all(free_in_all[name] >= par.num_workers * bundle[name] for name in bundle if bundle[name]):
        return None
    name = min((n for n in bundle if bundle[n]), key=lambda n: free_in_all[n] / bundle[n])
    return (f"waiting for cluster resources: {par.num_workers} workers need {par.num_workers * bundle[name]:g} "
            f"{name}, {max(free_in_all[name], 0.0):g} {name} free now")
