"""A session's saved weights (save_weights) as models the Serve app answers for, named
`ft:<base>:<weights name>:<session id>`: the tenant's for as long as the session's row is kept, closed or not."""

from __future__ import annotations

from moetune.api.model_names import fine_tuned_name
from moetune.api.serving import ModelObject, ServedModel
from moetune.service.base_models import BaseModels
from moetune.service.sessions import records
from moetune.service.store import Store

SESSION_ID_PREFIX = "ts_"


def _model(call, base_uri: str, tenant: str, base_models: BaseModels) -> ModelObject:
    base = base_models.name(base_uri)
    return ModelObject(id=fine_tuned_name(base, call.args["name"], tenant, call.session_id),
                       created=int(call.finished_at), owned_by=tenant,
                       moetune=ServedModel(base_model=base, base_model_uri=base_uri, adapter_uri=call.result["uri"]))


def saved_weights(store: Store, base_models: BaseModels, tenant: str, session_id: str | None = None,
                  name: str | None = None) -> list[ModelObject]:
    """The tenant's saved weights (of one session, under one name, given), newest first, one per name."""
    models, seen, bases = [], set(), {}
    for call in records.succeeded_calls(store, "save_weights", tenant, session_id):
        if (call.session_id, call.args["name"]) in seen or name not in (None, call.args["name"]):
            continue
        seen.add((call.session_id, call.args["name"]))
        if call.session_id not in bases:
            bases[call.session_id] = records.get_session(store, call.session_id).spec["model"]
        models.append(_model(call, bases[call.session_id], tenant, base_models))
    return models
