"""Node and process resources, read at scrape time: network bytes, memory, process RSS, GPU memory."""

from __future__ import annotations

from pathlib import Path

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# A cgroup "no limit" reads as "max" (v2) or a huge page-rounded number (v1).
_CGROUP_LIMITS = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def peak_rss_bytes() -> int:
    """The peak resident memory of this process image (VmHWM). Not ru_maxrss: Linux carries that over fork and exec,
    so a process started by a big one (a pytest worker, a raylet) would report its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # no procfs: the kernel's own figure (KiB on Linux-likes)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_bytes() -> tuple[int, int]:
    """(limit, used) of the memory this node's workers may use: the container's cgroup limit and usage when
    one is set below the machine's RAM (a Kubernetes pod), else the machine's total and used RAM."""
    ram = psutil.virtual_memory()
    for limit_file, usage_file in _CGROUP_LIMITS:
        try:
            raw = Path(limit_file).read_text().strip()
            limit = int(raw) if raw != "max" else ram.total
            if limit < ram.total:
                return limit, int(Path(usage_file).read_text())
        except (OSError, ValueError):
            continue
    return ram.total, ram.total - ram.available


class _LabelledCollector(Collector):
    def __init__(self, labels: dict[str, str]):
        self.names, self.values = list(labels), list(labels.values())

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self.names)
        g.add_metric(self.values, value)
        return g


class NodeCollector(_LabelledCollector):
    """Per-node series (network, memory): only the node leader registers it, so a node is counted once."""

    def collect(self):
        sent = CounterMetricFamily("moetune_node_network_sent_bytes", "Bytes sent by the node, per interface",
                                   labels=[*self.names, "device"])
        received = CounterMetricFamily("moetune_node_network_received_bytes",
                                       "Bytes received by the node, per interface", labels=[*self.names, "device"])
        for device, io in psutil.net_io_counters(pernic=True).items():
            sent.add_metric([*self.values, device], io.bytes_sent)
            received.add_metric([*self.values, device], io.bytes_recv)
        limit, used = memory_bytes()
        yield sent
        yield received
        yield self._gauge("moetune_node_memory_limit_bytes",
                          "Memory the node's workers may use (container limit, else RAM)", limit)
        yield self._gauge("moetune_node_memory_used_bytes", "Memory in use on the node (container, else RAM)", used)
        yield self._gauge("moetune_node_memory_available_bytes", "limit - used", limit - used)


class ProcessCollector(_LabelledCollector):
    """Per-rank series: this worker process's RSS and, on CUDA, its GPU memory."""

    def __init__(self, labels: dict[str, str], device):
        super().__init__(labels)
        self.device, self.process = device, psutil.Process()

    def collect(self):
        yield self._gauge("moetune_process_resident_memory_bytes", "Resident memory of the worker process",
                          self.process.memory_info().rss)
        if self.device.type != "cuda":
            return
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        yield self._gauge("moetune_gpu_memory_allocated_bytes", "GPU memory held by tensors",
                          torch.cuda.memory_allocated(self.device))
        yield self._gauge("moetune_gpu_memory_reserved_bytes", "GPU memory reserved by PyTorch's caching allocator",
                          torch.cuda.memory_reserved(self.device))
        yield self._gauge("moetune_gpu_memory_peak_bytes", "Peak GPU memory held by tensors since the worker started",
                          torch.cuda.max_memory_allocated(self.device))
        yield self._gauge("moetune_gpu_memory_used_bytes", "GPU memory in use by every process on the device",
                          total - free)
        yield self._gauge("moetune_gpu_memory_total_bytes", "GPU memory of the device", total)
