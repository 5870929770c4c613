"""The resume tests run on the driver tests' assets: the tiny model and datasets in a fresh bucket."""

from tests.workers.conftest import tiny_checkpoint  # noqa: F401 - fixture
from tests.workers.test_driver import assets  # noqa: F401 - fixture
