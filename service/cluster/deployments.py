"""What was deployed, kept in the database so that it outlives the Serve app: Ray keeps the app's config only as
long as its head runs, so a Ray head restart (or `moetune down` / `up`) used to leave every deployed model unserved
until someone deployed it again.

The deploy routes record the bases they made Serve run (DeployedBaseRow, service/store/deployments.py); the
scheduler's leader checks every `RESTORE_CHECK_S` whether Serve still runs each of them and deploys the missing ones
again, its first pass included, so a control plane that starts (`moetune up`) or that finds the Serve app gone
brings it back.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from moetune.service.api_exception import APIException
from moetune.service.cluster import serve_deploy
from moetune.service.store import DeployedBaseRow

if TYPE_CHECKING:
    from moetune.service.settings import Settings
    from moetune.service.store import Store

log = logging.getLogger(__name__)

RESTORE_CHECK_S = 10.0  # one GET to the Ray dashboard per period, and only while something was deployed


def recorded(store: Store) -> dict[str, str]:
    """The bases deployed so far, {name: uri}."""
    with store._write() as s:
        return {row.name: row.uri for row in s.scalars(select(DeployedBaseRow))}


def deploy(store: Store, settings: Settings, bases: dict[str, str]) -> str:
    """Makes the Serve app serve `bases` ({name: uri}) besides what it serves, then records them (only once Ray
    accepted them: a refused deploy answers 503 and leaves nothing to bring back); returns the app's status."""
    status = serve_deploy.deploy(settings.ray_address, settings.serve_url, settings.callback_url, bases,
                                 settings.s3_endpoint_url)
    for name, uri in bases.items():
        try:
            with store._write() as s:
                s.merge(DeployedBaseRow(name=name, uri=uri, deployed_at=time.time()))
        except IntegrityError:  # another replica recorded the same base between our read and insert
            pass
    return status


class DeploymentRestorer:
    """The scheduler step that deploys the recorded bases Serve does not run (any more)."""

    def __init__(self, store: Store, settings: Settings, every_s: float = RESTORE_CHECK_S):
        self.store = store
        self.settings = settings
        self.every_s = every_s
        self._next_check = 0.0  # monotonic; 0: the first pass checks at once

    def restore(self) -> dict[str, str]:
        """Deploys again the recorded bases the Serve app lacks; returns them ({} when none or not checked)."""
        if time.monotonic() < self._next_check:
            return {}
        self._next_check = time.monotonic() + self.every_s
        wanted = recorded(self.store)
        if not wanted:
            return {}
        try:
            app = serve_deploy.current_app(self.settings.ray_address)
            if app is not None and app["status"] == "DELETING":
                return {}  # a PUT now would race the deletion: the next check deploys once it is gone
            served = app["args"].get("bases", {}) if app else {}
            missing = {name: uri for name, uri in wanted.items() if served.get(name) != uri}
            if missing:
                log.warning("the Serve app does not run %s (Ray head restarted, or the app was deleted): "
                            "deploying again", ", ".join(sorted(missing)))
                deploy(self.store, self.settings, missing)
            return missing
        except APIException as exc:  # Ray down: the jobs wait for it too; checked again next period
            log.info("could not check the Serve app: %s", exc.message)
            return {}
