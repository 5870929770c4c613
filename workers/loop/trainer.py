"""The Ray Train trainer that the job's and the session's drivers run their worker groups with."""

from __future__ import annotations

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback


class TrainerWithoutRayData(TorchTrainer):
    """Ray Train's TorchTrainer less its Ray Data callback, which every run gets even with no datasets: moetune's
    workers read their own rows (workers.data), and the callback costs each run an actor that imports Ray Data
    (and starts Ray Data's autoscaling coordinator on the head) and sends Ray Data's context to every worker. A
    tiny 2-worker job on a local head: 25.5 -> 22.2 CPU-s, 23.7 -> 21.6 s (three runs each, alternating)."""

    def _create_default_callbacks(self):
        return [c for c in super()._create_default_callbacks() if not isinstance(c, DatasetsCallback)]
