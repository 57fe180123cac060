"""The one timer of the Python benchmarks (issue 61): CUDA-event timing of a callable, of every virtual rank's work on
its own stream from a gated start, of graph replays, and the CPU backend's wall clock in their place.

A driver adds benchmarks/common to sys.path and imports it as `bench_timing` (the C++ drivers' helpers of the same
folder are common/timing.hpp and common/cuda_timing.cuh). Times are milliseconds unless a name says otherwise.

  stamp(cuda) / elapsed_ms(a, b)     a point in time (a recorded event, or perf_counter) and the time between two
  wall_ms(fn)                        (ms, fn()) by the host's clock: the CPU fallback, and host-side phases
  time_calls(fn, iters, warmup)      [ms] of fn() over iters calls after warmup, events on the current stream
  time_on_stream(stream, fn)         (ms, fn()) between two events on one stream, waiting for the second
  gate_cycles(device, seconds)       the spin that holds every rank's stream until the host enqueued all of them
  ranks_together(streams, fn, ...)   every rank's fn(r) on its stream from a gated start: per-rank ms, results, and
                                     the host's enqueue time (graph replays: fn = the rank's graph.replay)
  summary(times)                     median, min and max
"""

import statistics
import time
from dataclasses import dataclass, field

import torch


def event():
    """A CUDA event that records time."""
    return torch.cuda.Event(enable_timing=True)


def stamp(cuda):
    """Now: an event recorded on the current stream (cuda), else the host clock."""
    if cuda:
        e = event()
        e.record()
        return e
    return time.perf_counter()


def elapsed_ms(a, b):
    """Milliseconds from stamp a to stamp b (events: after both completed)."""
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def wall_ms(fn):
    """(milliseconds fn() took by the host's clock, its result)."""
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def time_calls(fn, iters, warmup=0, before=None):
    """[ms] of fn() on the current stream, one per timed call (each waited for: a device synchronize) after `warmup`
    untimed calls; before(), when given, runs before each timed call, outside its time."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        start, stop = event(), event()
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return times


def time_on_stream(stream, fn):
    """(ms between an event before and one after fn() on `stream`, fn()'s result); waits for the second event.
    fn enqueues its work on `stream` itself (the caller makes it current)."""
    a, b = event(), event()
    a.record(stream)
    out = fn()
    b.record(stream)
    b.synchronize()
    return a.elapsed_time(b), out


def gate_cycles(device, seconds):
    """GPU cycles of `seconds` at the device's SM clock (torch.cuda._sleep's unit)."""
    khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 1_980_000)
    return int(seconds * khz * 1e3)


@dataclass
class RankTimes:
    ms: list  # per rank: from the start to the rank's end
    out: list = field(default_factory=list)  # fn(r) per rank
    enqueue_ms: float = 0.0  # host time enqueuing every rank's fn (and finish)

    @property
    def max_ms(self):
        return max(self.ms)


def ranks_together(streams, fn, cycles, finish=None, enter=None, gate_stream=None, sync=None):
    """fn(r) of every rank at once, each on its own stream (enqueued from this thread, rank by rank), then finish(r)
    when given (on rank r's stream after every rank's fn). A gate spins `cycles` first (longer than the host takes to
    enqueue every rank), so that the ranks start together (as R processes would) instead of in host launch order:
      gate_stream None: on every rank's stream, each timed from its own start event after it;
      a gate stream:    on that stream, one start event every rank's stream waits for (a common start).
    enter(r): the context that makes rank r's stream (and device) current; default torch.cuda.stream(streams[r]).
    sync(): waits for every rank's work (default torch.cuda.synchronize(): the current device's).
    Returns RankTimes after sync(); the caller synchronizes before, where it must."""
    R = len(streams)
    enter = enter if enter is not None else (lambda r: torch.cuda.stream(streams[r]))
    ends = [event() for _ in range(R)]
    if gate_stream is not None:
        start = event()
        with torch.cuda.stream(gate_stream):
            torch.cuda._sleep(cycles)
            start.record(gate_stream)
        starts = [start] * R
    else:
        starts = [event() for _ in range(R)]
        for r in range(R):
            with enter(r):
                torch.cuda._sleep(cycles)
            starts[r].record(streams[r])
    t0 = time.perf_counter()
    out = [None] * R
    for r in range(R):
        if gate_stream is not None:
            streams[r].wait_event(start)
        with enter(r):
            out[r] = fn(r)
    if finish is not None:
        for r in range(R):
            with enter(r):
                finish(r)
    for r in range(R):
        ends[r].record(streams[r])
    enqueue_ms = (time.perf_counter() - t0) * 1e3
    (sync if sync is not None else torch.cuda.synchronize)()
    return RankTimes([starts[r].elapsed_time(ends[r]) for r in range(R)], out, enqueue_ms)


def summary(times):
    """{median, min, max} of a list of times (statistics.median: an even count's two middle values averaged)."""
    return dict(median=statistics.median(times), min=min(times), max=max(times))
