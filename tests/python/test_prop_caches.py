"""Property tests of the process-wide object caches (hypothesis): for any two argument sets of
flatep.buffer.shared_buffer / flatep.pools.shared_pools, the calls return the same object exactly when the arguments
are equal up to the documented identities (an argument equal to its default, other spellings of one value: device
None / 'cpu' / torch.device('cpu'), capacity_factor 1 / 1.0, a pools' num_slots epn / None, a projection with
and without its default dtype, as a tuple or a list; a serving Buffer is one per pools object); the object returned has the arguments asked for; every argument
at its default spelled out gives the object of the call that leaves it out; and an argument the constructor refuses
(a bool or float where an int goes) raises the constructor's ValueError even when an object built from an equal
value (True == 1, 8.0 == 8) is cached. Transports: every spelling of the CPU device shares one, a virtual rank brings
its own.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_prop_caches.py
"""

import inspect

import pytest
import torch

pytest.importorskip("hypothesis")  # Debian's python3-hypothesis (scripts/setup.sh)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatep import testing, virtual
from flatep.buffer import Buffer, shared_buffer
from flatep.distributed import transport_for
from flatep.pools import ExpertPools, shared_pools

SETTINGS = settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
CPU_SPELLINGS = [None, "cpu", torch.device("cpu")]


pytestmark = pytest.mark.usefixtures("fresh_caches")


# ---- shared_buffer ----

E_VALUES = (4, 8)  # a one-rank world: epn = E


@st.composite
def buffer_args(draw):
    E = draw(st.sampled_from(E_VALUES))
    return dict(
        num_tokens=draw(st.sampled_from([6, 8])),
        hidden=draw(st.sampled_from([16, 24])),
        num_experts=E,
        topk=draw(st.sampled_from([1, 2])),
        align=draw(st.sampled_from([1, 8, 128])),
        capacity_factor=draw(st.sampled_from([1, 1.0, 1.25])),
        planner=draw(st.sampled_from(["balanced", "greedy", "owner"])),
        pools=draw(st.sampled_from([None, "training", 1, 0])),  # the pools' num_slots (made by materialise)
        device=draw(st.sampled_from(CPU_SPELLINGS)),
        num_sms=draw(st.sampled_from([None, 3])),
        stream_priority=draw(st.sampled_from([0, -1])),
    )


def materialise(a):
    """The Buffer arguments with the drawn pools made: the process's shared pools of that num_slots (one object per
    value, so equal draws give the same pools)."""
    kind = a["pools"]
    if kind is None:
        return a
    slots = None if kind == "training" else kind
    return dict(a, pools=shared_pools(None, a["num_experts"], [(16, 8)], num_slots=slots))


def buffer_identity(a):
    """The arguments up to the documented identities: equal exactly when the Buffers must be one."""
    return (a["num_tokens"], a["hidden"], a["num_experts"], a["topk"], a["align"], float(a["capacity_factor"]),
            a["planner"], a["pools"], "cpu", a["num_sms"], a["stream_priority"])


def check_buffer_has(buffer, a):
    epn = a["num_experts"]
    assert (buffer.num_tokens, buffer.hidden, buffer.num_experts, buffer.topk, buffer.align) == (
        a["num_tokens"], a["hidden"], a["num_experts"], a["topk"], a["align"])
    assert buffer.capacity_factor == float(a["capacity_factor"]) and buffer.planner == a["planner"]
    serving = a["pools"] not in (None, "training")
    assert buffer.num_slots == (a["pools"] if serving else epn)
    assert buffer.serving == serving
    assert buffer.device == torch.device("cpu")
    if a["num_sms"] is not None:
        assert buffer.num_sms == a["num_sms"]


@SETTINGS
@given(a=buffer_args(), b=buffer_args(),
       change=st.sampled_from(["same", "device", "capacity_factor", "independent"]))
def test_shared_buffer_shares_exactly_the_same_arguments(a, b, change):
    testing.release_all()  # each example starts from empty caches
    E = a["num_experts"]
    respell = {"device": [s for s in CPU_SPELLINGS if s is not a["device"]][0],
               "capacity_factor": {1: 1.0, 1.0: 1}.get(a["capacity_factor"], a["capacity_factor"])}
    if change != "independent":  # a's arguments, one of them respelled as the same value
        b = dict(a, **({change: respell[change]} if change in respell else {}))
    if a["pools"] is not None and b["pools"] is not None and a["num_experts"] != b["num_experts"]:
        b = dict(b, pools=None)  # pools are made per E: keep the draw meaningful
    first, second = shared_buffer(None, **materialise(a)), shared_buffer(None, **materialise(b))
    check_buffer_has(first, a)
    check_buffer_has(second, b)
    assert (first is second) == (buffer_identity(a) == buffer_identity(b)), (a, b)
    assert shared_buffer(None, **materialise(a)) is first  # and it stays cached


def test_shared_buffer_defaults_spelled_out_are_the_default_buffer():
    base = dict(num_tokens=8, hidden=16, num_experts=4, topk=2)
    plain = shared_buffer(None, **base)
    defaults = {n: p.default for n, p in inspect.signature(shared_buffer).parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert set(defaults) == {"align", "capacity_factor", "planner", "pools", "device", "num_sms",
                             "stream_priority"}, "a new argument with a default needs its identity checked here"
    for name, value in defaults.items():
        assert shared_buffer(None, **base, **{name: value}) is plain, f"{name}={value!r} spelled out"
    assert shared_buffer(None, **base, **defaults) is plain


# A bool or float where the Buffer takes an int: refused, even with an equal int's Buffer cached.
BAD_BUFFER_VALUES = [("num_tokens", 8.0), ("hidden", 16.0), ("num_experts", 4.0), ("topk", True), ("topk", 2.0),
                     ("align", True), ("capacity_factor", True), ("num_sms", True), ("stream_priority", False)]


@pytest.mark.parametrize("name,value", BAD_BUFFER_VALUES)
def test_shared_buffer_refuses_what_the_buffer_refuses_whatever_is_cached(name, value):
    base = dict(num_tokens=8, hidden=16, num_experts=4, topk=1, align=1, num_sms=1, stream_priority=0,
                pools=shared_pools(None, 4, [(16, 8)], num_slots=1))
    cached = shared_buffer(None, **base)
    args = {**base, name: value}
    with pytest.raises(ValueError) as direct:
        Buffer(None, **args)
    with pytest.raises(ValueError) as shared:
        shared_buffer(None, **args)
    assert str(shared.value) == str(direct.value) and "\n" not in str(direct.value)
    assert shared_buffer(None, **base) is cached


# ---- shared_pools ----

BF16, FP32 = torch.bfloat16, torch.float32


@st.composite
def pools_args(draw):
    epn = draw(st.sampled_from([2, 3]))
    shapes = draw(st.sampled_from([[(16, 8), (8, 16)], [(16, 16)], [(16, 8, FP32), (8, 16)]]))
    spelled = []
    for shape in shapes:
        style = draw(st.sampled_from(["tuple", "list", "dtype"]))
        if style == "dtype" and len(shape) == 2:
            shape = (*shape, BF16)
        spelled.append(list(shape) if style == "list" else tuple(shape))
    return dict(experts_per_rank=epn, projections=spelled if draw(st.booleans()) else tuple(spelled),
                device=draw(st.sampled_from(CPU_SPELLINGS)), num_sms=draw(st.sampled_from([None, 5])),
                stream_priority=draw(st.sampled_from([0, -1])), num_slots=draw(st.sampled_from([None, epn, 1])))


def pools_identity(a):
    epn = a["experts_per_rank"]
    shapes = tuple((int(p[0]), int(p[1]), p[2] if len(p) == 3 else BF16) for p in a["projections"])
    return (epn, shapes, a["num_sms"], a["stream_priority"], None if a["num_slots"] == epn else a["num_slots"])


def make_pools(a):
    return shared_pools(None, a["experts_per_rank"], a["projections"], device=a["device"], num_sms=a["num_sms"],
                        stream_priority=a["stream_priority"], num_slots=a["num_slots"])


@SETTINGS
@given(a=pools_args(), b=pools_args(), same=st.booleans())
def test_shared_pools_share_exactly_the_same_arguments(a, b, same):
    testing.release_all()  # each example starts from empty caches
    if same:  # b: a's values, each projection and the device spelled b's way
        b = dict(a, device=b["device"],
                 projections=[list(p) if isinstance(q, list) else tuple(p) for p, q in
                              zip(a["projections"], list(b["projections"]) * 3)])
    first, second = make_pools(a), make_pools(b)
    for pools, args in ((first, a), (second, b)):
        identity = pools_identity(args)
        assert pools.experts_per_rank == identity[0]
        assert pools.projections == [s[:2] for s in identity[1]] and pools.dtypes == [s[2] for s in identity[1]]
        assert pools.num_slots == (identity[0] if identity[4] is None else identity[4])
        if args["num_sms"] is not None:
            assert pools.num_sms == args["num_sms"]
    assert (first is second) == (pools_identity(a) == pools_identity(b)), (a, b)
    assert make_pools(a) is first


def test_shared_pools_defaults_spelled_out_are_the_default_pools():
    plain = shared_pools(None, 2, [(16, 8)])
    defaults = {n: p.default for n, p in inspect.signature(shared_pools).parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert set(defaults) == {"device", "num_sms", "stream_priority", "num_slots"}, \
        "a new argument with a default needs its identity checked here"
    for name, value in defaults.items():
        assert shared_pools(None, 2, [(16, 8)], **{name: value}) is plain, f"{name}={value!r} spelled out"
    assert shared_pools(None, 2, [(16, 8, BF16)], num_slots=2) is plain  # the default dtype, and num_slots = epn


BAD_POOLS = [dict(experts_per_rank=2.0), dict(experts_per_rank=True), dict(num_slots=True), dict(num_slots=1.0),
             dict(projections=[(16.0, 8)]), dict(projections=[(True, 16)]), dict(num_sms=True),
             dict(stream_priority=False)]


@pytest.mark.parametrize("bad", BAD_POOLS, ids=[str(b) for b in BAD_POOLS])
def test_shared_pools_refuse_what_the_pools_refuse_whatever_is_cached(bad):
    base = dict(experts_per_rank=1, projections=[(1, 16)], num_slots=1, num_sms=1, stream_priority=0)
    cached = shared_pools(None, **base)
    args = {**base, **bad}
    with pytest.raises(ValueError) as direct:
        ExpertPools(None, args.pop("experts_per_rank"), args.pop("projections"), **args)
    with pytest.raises(ValueError) as shared:
        shared_pools(None, **{**base, **bad})
    assert str(shared.value) == str(direct.value) and "\n" not in str(direct.value)
    assert shared_pools(None, **base) is cached


# ---- transports ----

@SETTINGS
@given(a=st.sampled_from(CPU_SPELLINGS), b=st.sampled_from(CPU_SPELLINGS),
       timeout=st.sampled_from([None, 5.0, 30]))
def test_transport_for_every_cpu_spelling_shares_and_a_virtual_rank_brings_its_own(a, b, timeout):
    single = transport_for(None, a, timeout_s=timeout)
    assert transport_for(None, b) is single
    rank = virtual.virtual_ranks(1, "cpu", timeout_s=30)[0]
    assert transport_for(rank, b) is rank.transport and rank.transport is not single
    # The objects built on them use them: a Buffer of the single world and one of the virtual rank.
    assert shared_buffer(None, 8, 16, 4, 1, device=a) is shared_buffer(None, 8, 16, 4, 1, device=b)
    assert shared_buffer(rank, 8, 16, 4, 1) is not shared_buffer(None, 8, 16, 4, 1)


def test_the_documented_identities_on_several_ranks():
    """num_slots = epn (= E / R, not E) is the default (training) pools on every rank of a world of 2; a Buffer made
    from serving pools takes their B and view stride."""
    ranks = virtual.virtual_ranks(2, "cpu", timeout_s=30)
    E, epn = 8, 4

    def on(r):
        training = shared_pools(ranks[r], epn, [(16, 8)])
        assert shared_pools(ranks[r], epn, [(16, 8)], num_slots=epn) is training
        plain = shared_buffer(ranks[r], 8, 16, E, 2)
        assert plain.num_slots == epn and plain.view_stride == epn
        with pytest.raises(ValueError, match=f"num_slots \\(B\\) must be -1 \\(= epn\\) or in \\[0, epn={epn}\\], got {E}"):
            shared_pools(ranks[r], epn, [(16, 8)], num_slots=E)
        serving = shared_pools(ranks[r], epn, [(16, 8)], num_slots=1)
        buffer = shared_buffer(ranks[r], 8, 16, E, 2, pools=serving)
        assert buffer is shared_buffer(ranks[r], 8, 16, E, 2, pools=serving) and buffer is not plain
        assert buffer.num_slots == 1 and buffer.view_stride == serving.view_stride
        return plain

    buffers = virtual.run_threads(2, on)
    assert buffers[0] is not buffers[1]
