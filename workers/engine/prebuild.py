"""`python -m moetune.workers.engine.prebuild`: compiles the C++ op DeepSpeed would otherwise JIT-build in the first job
(`deepspeed.init_distributed` loads shm_comm on CPU: ~40 s on 2 cores) into this virtualenv's extensions folder,
where every worker looks for it (moetune.workers.settings.use_prebuilt_ops)."""

from __future__ import annotations

import time

from moetune.workers.settings import use_prebuilt_ops


def main() -> None:
    extensions = use_prebuilt_ops()
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    started = time.perf_counter()
    ShareMemCommBuilder().load(verbose=False)
    print(f"DeepSpeed shm_comm op ready in {extensions} "
          f"({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
