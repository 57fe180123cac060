"""Streams, events and SM budgets of Buffer and ExpertPools ops (design §3, "Streams and events").

CPU tests: the CPU backend runs every op synchronously on the host, so streams are no-ops there: comm_stream is None,
stream must be None, an EventHandle's event is None (done: query() is True, wait() and current_stream_wait() return at
once), and every result equals the default path's bitwise. num_sms is validated and kept per Buffer / per call (it has
no effect on the CPU backend's numbers).

GPU tests (marker cuda): dispatch / combine (forward and backward) on each virtual rank's comm_stream, ordered by
events, bitwise equal to the default-stream path, eagerly and replayed from a CUDA graph captured with the side stream;
and a small num_sms gives the same bits.

Reproduce: python3 -m pytest -q tests/python/test_streams.py (add -m cuda on a GPU for the device part only)
"""

import pytest
import torch

import flatep
from flatep import ops, testing
from flatep.buffer import EventHandle

import mp_cases

CUDA_SKIP = mp_cases.cuda_unavailable_reason()
S, H, E, K = 64, 64, 8, 2


def _inputs(seed, s=S, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    idx = testing.sample_topk(E, s, K, 0, sigma=0.7, seed=seed).long()
    x = torch.randn(s, H, generator=g).to(torch.bfloat16)
    w = torch.rand(s, K, generator=g)
    gout = torch.randn(s, H, generator=g).to(torch.bfloat16)
    if requires_grad:
        x.requires_grad_()
        w.requires_grad_()
    return idx, x, w, gout


def _bits(t):
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


# ---- CPU: the semantics where streams are no-ops ----


def test_cpu_async_finish_returns_done_handles_and_the_default_bits():
    buf = flatep.Buffer(None, S, H, E, K, align=1)
    assert buf.comm_stream is None
    idx, x, w, _ = _inputs(1)
    plan = buf.plan(idx)
    rx, rw, cu = buf.dispatch(plan, x, w)
    out = buf.combine(plan, rx, rw)

    plan2, h0 = buf.plan(idx, stream=buf.comm_stream, async_finish=True)
    assert isinstance(h0, EventHandle) and h0.event is None and h0.query()
    rx2, rw2, cu2, h1 = buf.dispatch(plan2, x, w, stream=buf.comm_stream, previous_event=h0, async_finish=True)
    h1.wait()
    h1.current_stream_wait()
    out2, h2 = buf.combine(plan2, rx2, rw2, previous_event=h1, async_finish=True)
    ev, h3 = buf.entry_values(plan2, rw2, async_finish=True)
    assert torch.equal(cu, cu2)
    assert torch.equal(_bits(rx), _bits(rx2)) and torch.equal(rw, rw2)
    assert torch.equal(_bits(out), _bits(out2))
    assert torch.equal(ev, buf.entry_values(plan, rw))
    # stream given without async_finish: the plain results, no handle
    rx3, rw3, cu3 = buf.dispatch(plan2, x, w, stream=buf.comm_stream)
    assert torch.equal(_bits(rx3), _bits(rx))


def test_cpu_backward_with_stream_arguments_matches_default():
    buf = flatep.Buffer(None, S, H, E, K, align=4)
    results = []
    for kwargs in ({}, {"async_finish": True, "num_sms": 3}):
        idx, x, w, gout = _inputs(2, requires_grad=True)
        plan = buf.plan(idx)
        got = buf.dispatch(plan, x, w, **kwargs)
        rx, rw = got[0], got[1]
        y = (rx.float() * 1.5).to(torch.bfloat16)
        got = buf.combine(plan, y, rw, **kwargs)
        out = got[0] if kwargs else got
        (out.float() * gout.float()).sum().backward()
        results.append((out, x.grad, w.grad))
    for a, b in zip(*results):
        assert torch.equal(_bits(a), _bits(b))


def test_cpu_stream_and_event_arguments_are_checked():
    buf = flatep.Buffer(None, S, H, E, K)
    idx, x, w, _ = _inputs(3)
    plan = buf.plan(idx)
    with pytest.raises(ValueError, match="dispatch: stream must be None on the CPU backend"):
        buf.dispatch(plan, x, w, stream=object())
    with pytest.raises(ValueError, match="combine: previous_event must be None, a flatep EventHandle"):
        buf.combine(plan, torch.zeros(buf.num_recv_rows, H, dtype=torch.bfloat16), previous_event=42)


def test_cpu_num_sms_per_buffer_and_per_call():
    assert flatep.Buffer(None, S, H, E, K).num_sms == 0  # FLATEP_NUM_SMS unset: no cap
    buf = flatep.Buffer(None, S, H, E, K, num_sms=16)
    assert buf.num_sms == 16
    idx, x, w, _ = _inputs(4)
    plan = buf.plan(idx, num_sms=2)
    buf.dispatch(plan, x, w, num_sms=5)
    buf.dispatch(plan, x, w, num_sms=-1)  # -1: the Buffer's budget, as None
    assert buf.num_sms == 16  # a per-call budget applies to that call only
    buf.num_sms = 0
    assert buf.num_sms == 0
    # not an int (what only Python sees): Python's one line, before anything runs
    for bad in (1.5, True, "8", 1 << 40):
        with pytest.raises(ValueError, match=r"Buffer: num_sms must be an int in \[0, 1048576\]"):
            flatep.Buffer(None, S, H, E, K, num_sms=bad)
        with pytest.raises(ValueError, match=r"dispatch: num_sms must be an int in \[0, 1048576\]"):
            buf.dispatch(plan, x, w, num_sms=bad)
    with pytest.raises(ValueError, match="num_sms must be an int"):
        buf.num_sms = None
    # an int out of range: the C++ check's one line (written once, in the runtime), naming the op and the value
    for bad in (-2, 1 << 21):
        with pytest.raises(ValueError, match=rf"Buffer: num_sms .*must be in \[0, 1048576\], got {bad}$"):
            flatep.Buffer(None, S, H, E, K, num_sms=bad)
        with pytest.raises(ValueError, match=rf"dispatch: num_sms .*must be in \[0, 1048576\], got {bad}$"):
            buf.dispatch(plan, x, w, num_sms=bad)
        with pytest.raises(ValueError, match=rf"Buffer: num_sms .*must be in \[0, 1048576\], got {bad}$"):
            buf.num_sms = bad
    with pytest.raises(ValueError, match=r"Buffer: num_sms .*must be in \[0, 1048576\], got -1$"):
        buf.num_sms = -1  # an object's budget has no "default" to fall back to
    assert buf.num_sms == 0
    with pytest.raises(ValueError, match="Buffer: stream_priority must be an int"):
        flatep.Buffer(None, S, H, E, K, stream_priority="high")
    with pytest.raises(ValueError, match=r"ExpertPools: num_sms .*must be in \[0, 1048576\], got -2$"):
        flatep.ExpertPools(None, E, [(H, 16)], num_sms=-2)
    with pytest.raises(ValueError, match=r"ExpertPools: num_sms must be an int in \[0, 1048576\]"):
        flatep.ExpertPools(None, E, [(H, 16)], num_sms=2.0)


class _Recorder:
    """Stands for a C++ object (flatep._C.Buffer / ExpertPools): forwards everything to it, and records the name and
    keywords of every method call and the name of every attribute set."""

    def __init__(self, target):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "calls", [])
        object.__setattr__(self, "sets", [])

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            self.calls.append((name, dict(kwargs)))
            return value(*args, **kwargs)

        return call

    def __setattr__(self, name, value):
        self.sets.append(name)
        setattr(self._target, name, value)

    def launches(self, ops):
        """[(op, stream, num_sms)] of the recorded calls of `ops`, in order."""
        return [(n, kw.get("stream"), kw.get("num_sms")) for n, kw in self.calls if n in ops]


BUFFER_OPS = ("plan", "dispatch", "dispatch_fp8", "combine", "entry_values", "combine_grad")
POOLS_OPS = ("prefetch", "reduce_grad", "write_grads")


def test_cpu_num_sms_reaches_the_cpp_call_and_leaves_the_buffer_alone(monkeypatch):
    """Every op passes its stream and the call's num_sms (-1 without one) to the C++ op as keywords, its backward the
    forward's, and never sets the C++ object's budget: buffer.num_sms stays what it was."""
    buf = flatep.Buffer(None, S, 128, E, K, align=4, num_sms=16)
    rec = _Recorder(buf._buffer)
    monkeypatch.setattr(buf, "_buffer", rec)
    g = torch.Generator().manual_seed(6)
    idx = testing.sample_topk(E, S, K, 0, sigma=0.7, seed=6).long()
    x = torch.randn(S, 128, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.rand(S, K, generator=g).requires_grad_()

    plan = buf.plan(idx, num_sms=2)
    rx, rw, _ = buf.dispatch(plan, x, w, num_sms=5)  # autograd records it: backward with 5 too
    y = (rx.float() * 1.5).to(torch.bfloat16)
    out = buf.combine(plan, y, rw, num_sms=7)  # weighted: backward is a dispatch and combine_grad, with 7
    out.float().sum().backward()
    with torch.no_grad():
        buf.entry_values(plan, rw.detach(), num_sms=0)
        buf.dispatch(plan, x.detach(), w.detach(), fp8=True, num_sms=3)
        buf.combine(plan, y.detach(), None)  # the default path: -1
        buf.dispatch(plan, x.detach(), None, num_sms=-1)
    assert rec.launches(BUFFER_OPS) == [
        ("plan", 0, 2), ("dispatch", 0, 5), ("combine", 0, 7),
        ("dispatch", 0, 7), ("combine_grad", 0, 7),  # combine's backward
        ("combine", 0, 5), ("entry_values", 0, 5),  # dispatch's backward
        ("entry_values", 0, 0), ("dispatch_fp8", 0, 3), ("combine", 0, -1), ("dispatch", 0, -1),
    ]
    assert rec.sets == [] and buf.num_sms == 16
    buf.check_status()
    assert rec.calls[-1] == ("check_status", {"stream": 0})

    pools = flatep.ExpertPools(None, E, [(128, 16), (16, 128)], num_sms=9)
    layer = pools.register_layer()
    prec = _Recorder(pools._pools)
    monkeypatch.setattr(pools, "_pools", prec)
    grad = torch.zeros(2 * E, 128, 16)
    pools.prefetch(plan, layer, num_sms=1)
    pools.write_grads(plan, layer, 0, grad, accumulate=True, async_finish=True, num_sms=4)
    pools.reduce_grad(plan, layer)
    assert prec.launches(POOLS_OPS) == [("prefetch", 0, 1), ("write_grads", 0, 4), ("reduce_grad", 0, -1)]
    assert prec.sets == [] and pools.num_sms == 9


@pytest.mark.skipif(not ops.AVAILABLE, reason=f"torch {torch.__version__} has no torch.library.custom_op")
def test_cpu_custom_ops_pass_num_sms_to_the_cpp_call(monkeypatch):
    """The torch.compile path (the methods through torch.ops.flatep.*, called eagerly here): the ops' num_sms int
    reaches the C++ call, -1 for none, the backward's the forward's."""
    buf = flatep.Buffer(None, S, H, E, K, align=4, num_sms=16)
    rec = _Recorder(buf._buffer)
    monkeypatch.setattr(buf, "_buffer", rec)
    monkeypatch.setattr(ops, "compiling", lambda: True)  # what the methods see while torch.compile traces
    idx, x, w, _ = _inputs(7, requires_grad=True)
    plan = buf.plan(idx, num_sms=2)
    rx, rw, _ = buf.dispatch(plan, x, w, num_sms=5)
    out = buf.combine(plan, rx, None)
    out.float().sum().backward()
    assert rec.launches(BUFFER_OPS) == [
        ("plan", 0, 2), ("dispatch", 0, 5), ("combine", 0, -1),
        ("dispatch", 0, -1),  # combine's backward (unweighted: a dispatch)
        ("combine", 0, 5), ("entry_values", 0, 5),  # dispatch's backward
    ]
    assert rec.sets == [] and buf.num_sms == 16


def test_cpu_pools_ops_take_stream_arguments():
    F = 16
    buf = flatep.Buffer(None, S, H, E, K, align=1)
    pools = flatep.ExpertPools(None, E, [(H, F), (F, H)], num_sms=7)
    assert pools.num_sms == 7 and pools.comm_stream is None
    layer = pools.register_layer()
    with torch.no_grad():
        layer.own_weights(0).copy_(torch.randn(E, H, F))
        layer.own_weights(1).copy_(torch.randn(E, F, H))
    idx, _, _, _ = _inputs(5)
    plan = buf.plan(idx)
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(2 * E, H, F, generator=g), torch.randn(2 * E, F, H, generator=g)]
    assert pools.prefetch(plan, layer) is None
    h = pools.prefetch(plan, layer, stream=pools.comm_stream, async_finish=True, num_sms=1)
    assert isinstance(h, EventHandle) and h.query()
    for p in (0, 1):
        pools.write_grads(plan, layer, p, grads[p], accumulate=True, previous_event=h, num_sms=2)
    h = pools.reduce_grad(plan, layer, async_finish=True)
    assert h.event is None and pools.num_sms == 7
    want = [layer.own_grads(p).clone() for p in (0, 1)]
    for p in (0, 1):
        layer.own_grads(p).zero_()
        pools.write_grads(plan, layer, p, grads[p], accumulate=True)
    pools.reduce_grad(plan, layer)
    for p in (0, 1):
        assert torch.equal(layer.own_grads(p), want[p])


# ---- GPU: side streams, events and CUDA graphs on virtual ranks ----

R = 2


def _gpu_setup(num_sms=None):
    from flatep import virtual

    device = torch.device("cuda", 0)
    group = virtual.virtual_ranks(R, device, timeout_s=30)
    bufs = virtual.run_threads(
        R, lambda r: flatep.Buffer(group[r], S, H, E, K, align=4, device=device, num_sms=num_sms,
                                   stream_priority=-1)
    )
    streams = [torch.cuda.Stream(device) for _ in range(R)]
    return device, bufs, streams


def _step_default(buf, idx, x, w):
    plan = buf.plan(idx)
    rx, rw, cu = buf.dispatch(plan, x, w)
    y = (rx.float() * 1.5).to(torch.bfloat16)
    return buf.combine(plan, y, rw), rx, cu


def _step_side(buf, idx, x, w, num_sms=None):
    """plan and dispatch on comm_stream (async), the expert stand-in on the current stream, combine on comm_stream
    after an event of the current stream; the current stream waits on the last handle."""
    comm = buf.comm_stream
    plan, h = buf.plan(idx, stream=comm, async_finish=True, num_sms=num_sms)
    rx, rw, cu, h = buf.dispatch(plan, x, w, stream=comm, previous_event=h, async_finish=True, num_sms=num_sms)
    h.current_stream_wait()
    y = (rx.float() * 1.5).to(torch.bfloat16)
    ready = torch.cuda.Event()
    ready.record()
    out, h = buf.combine(plan, y, rw, stream=comm, previous_event=ready, async_finish=True, num_sms=num_sms)
    h.current_stream_wait()
    return out, rx, cu


def _gpu_inputs(device, trial):
    ins = []
    for r in range(R):
        idx, x, w, gout = _inputs(100 * trial + r)
        ins.append((idx.to(device), x.to(device), w.to(device), gout.to(device)))
    return ins


def _run_all(bufs, streams, ins, step, **kw):
    outs = []
    for r in range(R):
        with torch.cuda.stream(streams[r]), torch.no_grad():
            outs.append(step(bufs[r], *ins[r][:3], **kw))
    torch.cuda.synchronize()
    return outs


def _same(a, b, what):
    out_a, rx_a, cu_a = a
    out_b, rx_b, cu_b = b
    assert torch.equal(cu_a, cu_b), what
    end = int(cu_a[-1])
    assert torch.equal(_bits(rx_a[:end]), _bits(rx_b[:end])), f"{what}: recv_x"
    assert torch.equal(_bits(out_a), _bits(out_b)), f"{what}: combine output"


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_side_stream_with_events_is_bitwise_the_default_path():
    device, bufs, streams = _gpu_setup()
    budgets = [b.num_sms for b in bufs]  # FLATEP_NUM_SMS or 0
    for trial in range(3):
        ins = _gpu_inputs(device, trial)
        want = _run_all(bufs, streams, ins, _step_default)
        got = _run_all(bufs, streams, ins, _step_side)
        small = _run_all(bufs, streams, ins, _step_side, num_sms=2)  # a small SM budget: the same bits
        for r in range(R):
            _same(got[r], want[r], f"trial {trial} rank {r}")
            _same(small[r], want[r], f"trial {trial} rank {r} num_sms=2")
    for b, budget in zip(bufs, budgets):
        assert b.num_sms == budget  # per-call budgets never touch the Buffer's
        b.check_status()


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_side_stream_backward_is_bitwise_the_default_path():
    device, bufs, streams = _gpu_setup()
    ins = _gpu_inputs(device, 7)
    results = []
    for kwargs in ({}, {"stream": "comm"}):
        per_rank = []
        leaves = []
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                idx, x, w, gout = ins[r]
                x = x.clone().requires_grad_()
                w = w.clone().requires_grad_()
                kw = {"stream": bufs[r].comm_stream, "num_sms": 4} if kwargs else {}
                plan = bufs[r].plan(idx, **kw)
                rx, rw, _ = bufs[r].dispatch(plan, x, w, **kw)
                y = (rx.float() * 1.5).to(torch.bfloat16)
                out = bufs[r].combine(plan, y, rw, **kw)
                leaves.append((x, w, out, gout))
        for r in range(R):  # every rank's backward enqueued from this thread: rank r's ops on its own streams
            x, w, out, gout = leaves[r]
            with torch.cuda.stream(streams[r]):
                torch.autograd.backward(out, gout)
        torch.cuda.synchronize()
        for x, w, out, _ in leaves:
            per_rank.append((out.detach(), x.grad, w.grad))
        results.append(per_rank)
    for r in range(R):
        for a, b in zip(results[0][r], results[1][r]):
            assert torch.equal(_bits(a), _bits(b)), f"rank {r}"


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_side_stream_step_replays_from_a_cuda_graph_bitwise():
    device, bufs, streams = _gpu_setup()
    static_in = [tuple(t.clone() for t in row) for row in _gpu_inputs(device, 0)]
    _run_all(bufs, streams, static_in, _step_side)  # warm-up outside capture
    graphs, static_out = [], []
    for r in range(R):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=streams[r], capture_error_mode="global"), torch.no_grad():
            static_out.append(_step_side(bufs[r], *static_in[r][:3]))
        graphs.append(graph)
    torch.cuda.synchronize()
    for trial in range(1, 4):
        ins = _gpu_inputs(device, trial)
        for r in range(R):
            for dst, src in zip(static_in[r], ins[r]):
                dst.copy_(src)
        torch.cuda.synchronize()
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        replayed = [tuple(t.clone() for t in o) for o in static_out]
        want = _run_all(bufs, streams, ins, _step_default)
        for r in range(R):
            _same(replayed[r], want[r], f"graph trial {trial} rank {r}")
    for b in bufs:
        b.check_status()


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")
def test_gpu_each_cpp_call_gets_the_stream_it_runs_on_and_the_calls_num_sms(monkeypatch):
    """On a device Buffer the C++ op is handed the cudaStream_t of the stream the op runs on (the current one, or the
    side stream given: also for the backward) and the call's num_sms; the Buffer's budget is never set."""
    device = torch.device("cuda", 0)
    buf = flatep.Buffer(None, S, H, E, K, align=4, device=device, num_sms=16)
    rec = _Recorder(buf._buffer)
    monkeypatch.setattr(buf, "_buffer", rec)
    idx, x, w, _ = _inputs(8, requires_grad=True)
    idx, x, w = idx.to(device), x.detach().to(device).requires_grad_(), w.detach().to(device).requires_grad_()
    work, comm = torch.cuda.Stream(device), buf.comm_stream
    with torch.cuda.stream(work):
        plan, h = buf.plan(idx, stream=comm, async_finish=True, num_sms=3)
        rx, rw, _ = buf.dispatch(plan, x, w, previous_event=h)  # the current stream, the Buffer's budget
        out = buf.combine(plan, rx, rw, stream=comm, num_sms=2)
        out.float().sum().backward()  # combine's backward on comm with 2, dispatch's on the current stream
    torch.cuda.synchronize()
    side, current = comm.cuda_stream, work.cuda_stream
    assert rec.launches(BUFFER_OPS) == [
        ("plan", side, 3), ("dispatch", current, -1), ("combine", side, 2),
        ("dispatch", side, 2), ("combine_grad", side, 2), ("combine", current, -1), ("entry_values", current, -1),
    ]
    assert rec.sets == [] and buf.num_sms == 16
    buf.check_status()
