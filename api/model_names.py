"""Model names as OpenAI spells them: a base's registered name, and `ft:<base>:<suffix or tenant>:<job id>`.

Pure string rules shared by the control plane, the serving app and the SDK (no registry here: see
service/base_models.py for the name -> URI map).
"""

from __future__ import annotations

import re
from typing import NamedTuple

FT_PREFIX = "ft:"
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
BASE_NAME_PATTERN = r"[A-Za-z0-9_.-]+"  # no ':' (it separates the parts of an ft: name) and no '/'


class FineTunedName(NamedTuple):
    base: str
    owner: str  # the job's suffix, else its tenant
    job_id: str


def derive_base_name(uri: str) -> str:
    """A checkpoint URI's last folder, made name-safe: `s3://b/models/Kimi-Linear-48B/` -> `Kimi-Linear-48B`."""
    last = uri.split("://", 1)[-1].rstrip("/").rsplit("/", 1)[-1]
    return _NAME_CHARS.sub("-", last).strip("-") or "model"


def fine_tuned_name(base: str, suffix: str | None, tenant: str, job_id: str) -> str:
    owner = _NAME_CHARS.sub("-", suffix or tenant)
    return f"{FT_PREFIX}{base}:{owner}:{job_id}"


def parse_fine_tuned_name(name: str) -> FineTunedName | None:
    """`ft:base:owner:ftjob-…` -> its parts; None for anything else (a base name, a typo)."""
    if not name.startswith(FT_PREFIX):
        return None
    parts = name.removeprefix(FT_PREFIX).split(":")
    if len(parts) != 3 or not all(parts):
        return None
    return FineTunedName(*parts)
