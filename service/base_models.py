"""The registered base models: the names users write as `model` (jobs, inference) and see in `GET /v1/models`.

Configured by `MOETUNE_BASE_MODELS`, either JSON (`{"kimi-linear-48b": "s3://models/Kimi-Linear-48B"}`) or
`name=uri,name=uri`. A base that is not registered is still usable by its URI; its name is then derived from the
URI (api/model_names.derive_base_name).
"""

from __future__ import annotations

import json
import re
import time

from moetune.api.model_names import BASE_NAME_PATTERN, derive_base_name
from moetune.api.models.base import URI_SCHEMES


def parse_base_models(spec: str | dict[str, str]) -> dict[str, str]:
    """`'a=s3://x,b=s3://y'` or a JSON object (or a dict) -> {name: uri}; a malformed entry is a startup error."""
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("{"):
            spec = json.loads(text)
        else:
            spec = {}
            for number, entry in enumerate(filter(None, (e.strip() for e in text.split(","))), start=1):
                name, sep, uri = entry.partition("=")
                if not sep:
                    raise ValueError(f"base_models entry {number} must look like 'name=uri'")
                spec[name.strip()] = uri.strip()
    for name, uri in spec.items():
        if not re.fullmatch(BASE_NAME_PATTERN, name):
            raise ValueError(f"base_models: name {name!r} may only contain letters, digits, '-', '_' and '.'")
        if not isinstance(uri, str) or not uri.startswith(URI_SCHEMES):
            raise ValueError(f"base_models[{name!r}]: {uri!r} must be a URI starting with one of "
                             f"{', '.join(URI_SCHEMES)}")
    return dict(spec)


class BaseModels:
    """name <-> URI of the registered bases (built once from Settings.base_models)."""

    def __init__(self, uris_by_name: dict[str, str]):
        self.uris_by_name = dict(uris_by_name)
        self.created = int(time.time())  # OpenAI's `created` of a base: when this server registered it
        self._names_by_uri = {uri.rstrip("/"): name for name, uri in self.uris_by_name.items()}

    def uri(self, model: str) -> str | None:
        """A registered name's URI, a URI itself; None for an unknown name."""
        if model.startswith(URI_SCHEMES):
            return model
        return self.uris_by_name.get(model)

    def name(self, model: str) -> str:
        """A job's `model` as a base name: the registered name of a URI, else the name derived from it (a name
        stays itself)."""
        if not model.startswith(URI_SCHEMES):
            return model
        return self._names_by_uri.get(model.rstrip("/")) or derive_base_name(model)
