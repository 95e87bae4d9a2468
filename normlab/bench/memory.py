"""Section 4: peak memory of one training step, NormLab against HF BERT, on the same batch."""

import torch

from normlab.bench.models import make_step, prepare
from normlab.bench.timer import sync

CUDA_METHOD = ("torch.cuda.max_memory_allocated during the 2nd step minus torch.cuda.memory_allocated at its "
               "start (tensor bytes on the GPU)")
CPU_METHOD = ("torch.profiler(profile_memory=True): running sum of every op's CPU allocations minus frees during "
              "the 2nd step, maximum above the bytes live at its start (exact tensor bytes; excludes "
              "allocator slack and the Python heap)")


def _step_peak_cpu(step, batch) -> int:
    """Peak bytes held by torch's CPU allocator during one step, above what was live when it started: every op's
    allocations and frees (torch.profiler) summed in start order; tensor bytes only, so identical run to run."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(batch)
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


def _step_peak_cuda(step, batch, device) -> int:
    """Peak bytes the CUDA allocator held during one step, above what was allocated when it started."""
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    step(batch)
    sync(device)
    return torch.cuda.max_memory_allocated(device) - start


def _resident_bytes(model, opt) -> int:
    """Parameters plus the AdamW state."""
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    return resident + sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                          if isinstance(v, torch.Tensor))


def bench_memory(accelerator, cfg, models: dict, batch: dict, device) -> dict:
    """Peak memory of one training step on the longest of the timed batches (the same batch for both). Measured
    on the second step (the first creates the AdamW state); `resident_bytes` = parameters + AdamW state,
    `step_peak_bytes` = the step's peak above that, `total_peak_bytes` = their sum. `models`: "normlab" and
    "hf_bert"."""
    out = {"what": "peak memory of one training step (lower is better)",
           "method": CUDA_METHOD if device.type == "cuda" else CPU_METHOD,
           "batch_shape": list(batch["input_ids"].shape)}
    for name, model in models.items():
        prepare(name, model, device)
        step, opt = make_step(accelerator, model, cfg.train)
        step(batch)  # creates the AdamW state
        resident = _resident_bytes(model, opt)
        peak = _step_peak_cuda(step, batch, device) if device.type == "cuda" else _step_peak_cpu(step, batch)
        out[name] = {"resident_bytes": resident, "step_peak_bytes": peak, "total_peak_bytes": resident + peak}
    out["ratio_total_normlab_over_hf"] = out["normlab"]["total_peak_bytes"] / out["hf_bert"]["total_peak_bytes"]
    out["ratio_step_normlab_over_hf"] = out["normlab"]["step_peak_bytes"] / out["hf_bert"]["step_peak_bytes"]
    return out
