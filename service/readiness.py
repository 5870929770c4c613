"""`/readyz`: whether each dependency of the control plane answers now (database, Ray Jobs API, object storage,
which must also still hold the newest uploaded files).
A dependency that does not is also counted in the dependency-error metric (the alert's source)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from moetune.api import storage
from moetune.service.cluster.ray_jobs import RayJobs
from moetune.service.settings import Settings
from moetune.service.store import Store

log = logging.getLogger(__name__)
_FILES_CHECKED = 3  # the newest uploads: a cheap sign that storage holds what the database references


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


def storage_holds_newest_files(store: Store, settings: Settings) -> bool:
    """The objects of the newest uploaded files exist: storage that came back empty (an in-memory server restarted,
    a wrong bucket) is not ready although it answers."""
    missing = []
    for file in store.newest_files(_FILES_CHECKED):
        fs, path = storage.filesystem(file.uri, settings.s3_endpoint_url, quick=True, listings_cache=False)
        try:
            fs.info(path)
        except FileNotFoundError:
            missing.append(file.uri)
        except Exception:  # noqa: BLE001 - unreachable: storage_reachable says so
            return False
    if missing:
        log.warning("storage lacks the objects of uploaded files %s", ", ".join(missing))
    return not missing


def dependency_status(store: Store, ray: RayJobs, settings: Settings,
                      count_error: Callable[[str], None]) -> dict[str, bool]:
    """Whether each dependency answers; Ray only where this replica runs the scheduler (an API-only replica
    submits nothing)."""
    status = {"database": store.ping()}
    status["storage"] = storage_reachable(settings) and (not status["database"]
                                                         or storage_holds_newest_files(store, settings))
    if settings.scheduler_enabled:
        status["ray"] = ray.reachable()
    for dependency, up in status.items():
        if not up and dependency != "ray":  # RayJobs counts its own failed calls
            count_error(dependency)
    return status
