"""The run's Accelerator: processes, devices, mixed precision, gradient accumulation and trackers; and the CPU
threads of each process."""

import os

import torch
from accelerate import Accelerator

from normlab.train.machine import available_cpus


def cpu_threads(setting, device_type: str, local_processes: int, env=os.environ) -> int | None:
    """Intra-op threads per process of a CPU run (None off CPU): `setting` (train.cpu_threads), else the user's
    OMP_NUM_THREADS (not the 1 `accelerate launch` exports without GPUs), else the physical cores this process may
    use (its affinity) split between the machine's processes, as `accelerate launch --cpu` picks. Not lowered for
    other processes' load: the count would then change with a load average, and the results' last bits with it;
    passive OpenMP waits (normlab/train/cpu_share.py) are what let two runs share the cores (docs/performance.md)."""
    if device_type != "cpu":
        return None
    if setting is not None:
        return setting
    omp = env.get("OMP_NUM_THREADS", "").strip()
    launched = "ACCELERATE_MIXED_PRECISION" in env  # set by every `accelerate launch`
    if omp.isdigit() and int(omp) >= 1 and (int(omp) > 1 or not launched):
        return int(omp)
    import psutil  # (accelerate's dependency)

    cpus = available_cpus()
    return max(1, min(psutil.cpu_count(logical=False) or cpus, cpus) // max(1, local_processes))


def fsdp_float32_buffers(accelerator) -> None:
    """Keep buffers float32 under FSDP (version 1) with bf16/fp16, which casts them to the compute dtype: the BN
    family's running statistics would round away most of their small updates in half precision."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if getattr(policy, "buffer_dtype", None) not in (None, torch.float32):
        import dataclasses

        plugin.mixed_precision_policy = dataclasses.replace(policy, buffer_dtype=torch.float32)


def make_accelerator(cfg=None, trackers=()):
    """The accelerator and the CPU threads. `cfg`: a training run's config (gradient accumulation, mixed
    precision, threads, TF32, trackers, project directory); None: evaluation's, with accelerate's defaults."""
    t = cfg.train if cfg is not None else None
    # Several processes on a machine without GPUs (configs/accelerate/cpu_2proc.yaml): CPU processes, gloo.
    cpu_processes = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available()
    accelerator = Accelerator(
        cpu=cpu_processes,
        gradient_accumulation_steps=t.grad_accum_steps if t else 1,
        mixed_precision=t.mixed_precision if t else None,  # None: what `accelerate launch` was given
        log_with=list(trackers) or None,
        project_dir=cfg.output_dir if cfg is not None else None,
    )
    threads = cpu_threads(t.cpu_threads if t else None, accelerator.device.type,
                          int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)))
    if threads is not None:
        torch.set_num_threads(threads)
    if accelerator.device.type == "cuda":
        torch.set_float32_matmul_precision("high" if t and t.tf32 else "highest")  # high = TF32 matmuls
    fsdp_float32_buffers(accelerator)
    return accelerator
