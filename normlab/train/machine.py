"""What machine a measurement ran on: the CPU's name, the versions and the device, for benchmark outputs."""

import os
import platform
from contextlib import suppress
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() is often just the architecture on Linux)."""
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def available_cpus() -> int:
    """The CPUs this process may run on: a taskset or a container's cpuset may allow fewer than the machine has."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none): other processes skew timings."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_info(device) -> dict:
    """CPU, cores, torch's threads, versions and the device (with the GPU's name on CUDA), and the load now."""
    import torch
    import transformers

    info = {
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "cuda_available": torch.cuda.is_available(),
        "load_average_start": load_average(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
