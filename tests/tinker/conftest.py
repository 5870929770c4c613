"""The e2e tests' real stack (one `moetune server`, the session's Ray head and S3 server) for the Tinker tests."""

from tests.e2e.conftest import control_plane, tiny_assets  # noqa: F401 - fixtures, shared with tests/e2e
