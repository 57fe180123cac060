"""What the MoE-layer benchmarks (moe_layer.py, moe_layer_virtual.py) measure besides time: the caching allocator's
counters per phase, peak device memory per rank, and a torch.profiler capture of one step.

* Allocator counters (torch.cuda.memory_stats, summed over the devices): ``alloc_retries`` (an allocation that failed,
  after which the allocator freed its cached blocks and tried again: a synchronisation of every stream and, with
  expandable segments, unmapping and later mapping the memory again), ``device_allocs`` / ``device_frees`` (cudaMalloc
  calls or expandable-segment maps, and their frees / unmaps), ``sync_all_streams``. A phase whose time jumps with
  any of these non-zero spends it in the allocator, not in its kernels.
* Memory per rank: ``step_peak`` is the most bytes of torch tensors a rank holds during one step above what it held
  before the step (its activations, temporaries, receive buffers and gradients), what grows with the skew; the
  static part (FlatEP's symmetric buffer and pools; the baseline's weights and fp32 main gradients) is reported
  beside it. One process per rank: torch.cuda.max_memory_allocated after reset_peak_memory_stats. Virtual ranks (one
  process, one stream per rank): RankMemory.
"""

import gzip
import os

import torch

# torch.cuda.memory_stats key -> column name
ALLOC_COUNTERS = (
    ("num_alloc_retries", "alloc_retries"),
    ("num_device_alloc", "device_allocs"),
    ("num_device_free", "device_frees"),
    ("num_sync_all_streams", "sync_all_streams"),
)
GIB = float(1 << 30)


def alloc_counters(devices):
    """{column: count} summed over the CUDA devices among `devices` (empty dict without any)."""
    out = {}
    for index in sorted({d.index for d in devices if d.type == "cuda"}):
        stats = torch.cuda.memory_stats(index)
        for key, name in ALLOC_COUNTERS:
            out[name] = out.get(name, 0) + int(stats.get(key, 0))
    return out


def counters_delta(before, after):
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


class PhaseCounters:
    """Allocator counters accumulated per phase over the parts of one step (add(phase, before, after))."""

    def __init__(self):
        self.by_phase = {}

    def add(self, phase, before, after):
        acc = self.by_phase.setdefault(phase, {})
        for k, v in counters_delta(before, after).items():
            acc[k] = acc.get(k, 0) + v


class RankMemory:
    """Per-rank torch memory of R virtual ranks sharing devices, each allocating on its own stream (a rank's local
    work and its part of every collective phase run inside its stream). A snapshot of the caching allocator gives each
    rank's live bytes (the allocated blocks of its stream); it is taken again only when the devices' allocated total
    moved outside the parts followed here (tensors freed between phases). During a local part, where rank r runs
    alone on its device, the rise of max_memory_allocated over the part's start is rank r's, and so is the change of
    the allocated total. `step_peak[r]` is the most a rank held during the step above what it held at start()."""

    def __init__(self, streams, devices):
        self.rank_of = {(devices[r].index, s.cuda_stream): r for r, s in enumerate(streams)}
        self.devices = devices
        self.R = len(streams)
        self.held = [0] * self.R
        self.start_held = [0] * self.R
        self.step_peak = [0] * self.R
        self._total = None  # the allocated total when `held` was last exact

    def _allocated(self):
        return sum(torch.cuda.memory_allocated(i) for i in sorted({d.index for d in self.devices}))

    def snapshot(self):
        """[R] bytes of torch tensors each rank's stream holds now."""
        out = [0] * self.R
        for seg in torch.cuda.memory_snapshot():
            r = self.rank_of.get((seg.get("device"), seg.get("stream")))
            if r is not None:
                size = seg.get("allocated_size")
                if size is None:  # older snapshots: the allocated blocks themselves
                    size = sum(b["size"] for b in seg.get("blocks", []) if b.get("state") == "active_allocated")
                out[r] += int(size)
        return out

    def _refresh(self):
        total = self._allocated()
        if total != self._total:
            self.held, self._total = self.snapshot(), total

    def start(self):
        self._total = None
        self._refresh()
        self.start_held = list(self.held)
        self.step_peak = [0] * self.R

    def _note(self, r, held):
        self.step_peak[r] = max(self.step_peak[r], held - self.start_held[r])

    def local(self, r, fn):
        """fn() for rank r alone on its device, its peak noted; returns fn()'s result."""
        dev = self.devices[r]
        self._refresh()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        res = fn()
        torch.cuda.synchronize(dev)
        self._note(r, self.held[r] + torch.cuda.max_memory_allocated(dev) - base)
        self.held[r] += torch.cuda.memory_allocated(dev) - base
        self._total = self._allocated()
        self._note(r, self.held[r])
        return res

    def collective(self, fn):
        """fn() with every rank's part (allocating little besides its outputs): each rank's holdings before and
        after are noted; returns fn()'s result."""
        self._refresh()
        for r in range(self.R):
            self._note(r, self.held[r])
        res = fn()
        self._refresh()
        for r in range(self.R):
            self._note(r, self.held[r])
        return res


def tensor_bytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def profile_step(fn, out_dir, tag, devices, row_limit=40):
    """Runs fn() once under torch.profiler (CPU and CUDA activities) and writes into out_dir:
    <tag>_kernels.txt (the top `row_limit` ops and kernels by self CUDA time, then by CPU time: cudaMalloc / cudaFree /
    synchronisations show there), <tag>_phases.txt (the record_function ranges fn opened, e.g. one per phase and
    rank) and <tag>_trace.json.gz (the chrome trace). Returns (fn()'s result, [paths])."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if any(d.type == "cuda" for d in devices):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=False, profile_memory=True) as prof:
        res = fn()
        for d in devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
    averages = prof.key_averages()
    cuda_key = "self_cuda_time_total" if ProfilerActivity.CUDA in activities else "self_cpu_time_total"
    paths = []
    kernels = os.path.join(out_dir, f"{tag}_kernels.txt")
    with open(kernels, "w") as f:
        f.write(f"# {tag}: top {row_limit} by {cuda_key}\n")
        f.write(averages.table(sort_by=cuda_key, row_limit=row_limit, max_name_column_width=70))
        f.write(f"\n# {tag}: top {row_limit} by cpu_time_total (host time: allocator calls, synchronisations)\n")
        f.write(averages.table(sort_by="cpu_time_total", row_limit=row_limit, max_name_column_width=70))
    paths.append(kernels)
    phases = os.path.join(out_dir, f"{tag}_phases.txt")
    with open(phases, "w") as f:
        rows = [e for e in averages if e.key.startswith("phase/")]
        rows.sort(key=lambda e: e.key)
        f.write(f"# {tag}: record_function ranges (host time of each phase part; CUDA time of its kernels)\n")
        f.write(f"{'range':<40} {'calls':>6} {'cpu_total_ms':>13} {'cuda_total_ms':>14}\n")
        for e in rows:
            cuda_us = getattr(e, "cuda_time_total", 0) or getattr(e, "device_time_total", 0) or 0
            f.write(f"{e.key:<40} {e.count:>6} {e.cpu_time_total / 1e3:>13.3f} {cuda_us / 1e3:>14.3f}\n")
    paths.append(phases)
    trace = os.path.join(out_dir, f"{tag}_trace.json")
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        dst.write(src.read())
    os.remove(trace)
    paths.append(trace + ".gz")
    return res, paths


# CSV columns of these measurements (moe_layer.write_outputs)
MEMORY_COLUMNS = ["static_gb", "step_peak_gb", "peak_gb"]
ALLOC_COLUMNS = ["alloc_retries", "device_allocs"]


def memory_columns(static_bytes, step_peak_bytes):
    """An implementation's memory per rank at one maxvio: static (persistent), step peak (the largest over ranks and
    steps) and their sum, in GiB."""
    return dict(static_gb=round(static_bytes / GIB, 3), step_peak_gb=round(step_peak_bytes / GIB, 3),
                peak_gb=round((static_bytes + step_peak_bytes) / GIB, 3))


def alloc_columns(per_iteration):
    """A phase's allocator counters: the mean per timed iteration (each iteration's counts summed over ranks)."""
    n = max(len(per_iteration), 1)
    return {c: round(sum(it.get(c, 0) for it in per_iteration) / n, 2) for c in ALLOC_COLUMNS}
