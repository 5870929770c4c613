"""`/readyz`: whether each dependency of the control plane answers now (database, Ray Jobs API, object storage).
A dependency that does not is also counted in the dependency-error metric (the alert's source)."""

from __future__ import annotations

from collections.abc import Callable

from moetune.api import storage
from moetune.service.cluster.ray_jobs import RayJobs
from moetune.service.settings import Settings
from moetune.service.store import Store


def storage_reachable(settings: Settings) -> bool:
    """The bucket of the default output location answers (exists or not: a missing bucket is a job's 422)."""
    try:
        fs, path = storage.filesystem(settings.default_output_uri, settings.s3_endpoint_url, quick=True,
                                      listings_cache=False)
        fs.info(path.split("/", 1)[0])  # exists() would answer False for an endpoint that is down
        return True
    except (FileNotFoundError, PermissionError):  # storage answered
        return True
    except Exception:  # noqa: BLE001 - unreachable or timing out: not ready
        return False


def dependency_status(store: Store, ray: RayJobs, settings: Settings,
                      count_error: Callable[[str], None]) -> dict[str, bool]:
    """Whether each dependency answers; Ray only where this replica runs the scheduler (an API-only replica
    submits nothing)."""
    status = {"database": store.ping(), "storage": storage_reachable(settings)}
    if settings.scheduler_enabled:
        status["ray"] = ray.reachable()
    for dependency, up in status.items():
        if not up and dependency != "ray":  # RayJobs counts its own failed calls
            count_error(dependency)
    return status
