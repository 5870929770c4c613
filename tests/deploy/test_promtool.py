"""The shipped Prometheus config and alert rules pass promtool's checks and the alerts' unit tests."""

import subprocess

import pytest

from tests.support.prometheus import PROMETHEUS_DIR, binary


@pytest.mark.parametrize("args", [["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"],
                                  ["test", "rules", "alerts_test.yml"]], ids=" ".join)
def test_promtool(args):
    done = subprocess.run([binary("promtool"), *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
