"""The published JSON schema of the adaptation report is the report model's own."""

import json

from moetune.api.report import AdaptationReport
from tests.support import REPO


def test_the_published_schema_is_the_models():
    published = json.loads((REPO / "docs" / "adaptation_report.schema.json").read_text())
    assert published == AdaptationReport.model_json_schema()
