"""Helpers shared by tests in more than one folder: with bench.support (what the benchmarks run too: the EP harness,
tiny models, quantized checkpoints, adapters, image batches, the fault proxy), the only place test code imports
helpers from.

Test files and conftest files import from `tests.support`, `bench.support` and the package, never from a test_*.py
file or another folder's conftest. Fixtures live in conftest files; what they and the tests share lives here:

- receiver: ReportReceiver, a loopback stand-in for the control plane's report endpoint;
- jobs: real jobs from the test process (driver env, run_job on the session's Ray head, the adapter's loss);
- control_plane: the control plane in a thread (RunningService) or as a `moetune server` process;
- prometheus: the shipped Prometheus config, its binaries and a small query client;
- families: the Kimi-K2 release's config.json around a tiny DeepSeek-V3;
- kda_cases: KDA inputs and the error metric of the kernel and swap tests;
- triton_child: Triton-backend tests run in a child pytest under TRITON_INTERPRET=1;
- triton_interpreter: that child's interpreter without its repeated patching of triton.language in a launch.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root
