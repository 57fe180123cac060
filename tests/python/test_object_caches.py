"""The process-wide object caches are keyed on every argument that changes the object's behaviour: for each argument
of flatep.buffer.shared_buffer, flatep.pools.shared_pools and flatep.distributed.transport_for, two calls that differ
only in that argument get different objects (each built with its own value), and calls with equal arguments (spelled
differently where the argument has several spellings) get the same object. A test also fails when one of these
functions gains an argument that no case here varies.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_object_caches.py
"""

import inspect

import pytest
import torch

import flatep
from flatep import testing, virtual
from flatep.buffer import shared_buffer
from flatep.distributed import transport_for
from flatep.pools import shared_pools

S, H, E, K = 8, 16, 4, 2
CUDA = torch.cuda.is_available() and flatep._C.has_cuda


@pytest.fixture(autouse=True)
def fresh_caches():
    testing.release_all()
    yield
    testing.release_all()


def one_virtual_rank():
    """A group other than None (the single-process default): a world of one virtual rank on the CPU."""
    return virtual.virtual_ranks(1, "cpu", timeout_s=30)[0]


# shared_buffer: (argument, base value, another value, how the Buffer shows the value)
_SERVING_POOLS = []


def serving_pools():
    """Serving pools of the default group (one rank, epn = E, B = 1), made once: the Buffer made from them takes their
    num_slots and view_stride."""
    if not _SERVING_POOLS:
        _SERVING_POOLS.append(flatep.ExpertPools(None, E, [(H, 8)], num_slots=1))
    return _SERVING_POOLS[0]


BUFFER_BASE = dict(num_tokens=S, hidden=H, num_experts=E, topk=K, align=1, capacity_factor=1.0, planner="balanced",
                   pools=None, device="cpu", num_sms=None, stream_priority=0)
# A callable value is made when the test runs (pools are collective objects).
BUFFER_OTHER = dict(num_tokens=S + 4, hidden=H + 8, num_experts=2 * E, topk=K + 1, align=8, capacity_factor=1.25,
                    planner="greedy", pools=serving_pools, num_sms=3, stream_priority=-1)
BUFFER_SEEN = dict(num_tokens="num_tokens", hidden="hidden", num_experts="num_experts", topk="topk", align="align",
                   capacity_factor="capacity_factor", planner="planner", num_sms="num_sms")


def make_buffer(group=None, **changes):
    return shared_buffer(group, **{**BUFFER_BASE, **changes})


def test_shared_buffer_cases_cover_every_argument():
    params = set(inspect.signature(shared_buffer).parameters)
    assert params == {"group"} | set(BUFFER_BASE), "a new shared_buffer argument needs a case here (and in its key)"
    assert set(BUFFER_OTHER) | {"device"} == set(BUFFER_BASE)  # device: test_shared_objects_per_device


@pytest.mark.parametrize("name", sorted(BUFFER_OTHER))
def test_shared_buffer_differs_in_each_argument(name):
    base = make_buffer()
    value = BUFFER_OTHER[name]() if callable(BUFFER_OTHER[name]) else BUFFER_OTHER[name]
    other = make_buffer(**{name: value})
    assert other is not base, f"shared_buffer: {name}={value!r} got the Buffer of {BUFFER_BASE[name]!r}"
    if name in BUFFER_SEEN:
        assert getattr(other, BUFFER_SEEN[name]) == value
        assert getattr(base, BUFFER_SEEN[name]) == (BUFFER_BASE[name] if name != "num_sms" else base.num_sms)
    if name == "pools":  # the Buffer takes the pools' layout
        assert (other.num_slots, other.view_stride, other.serving) == (1, value.view_stride, True)
        assert (base.num_slots, base.serving) == (E, False)
    assert make_buffer(**{name: value}) is other  # and it is cached too
    assert make_buffer() is base


def test_shared_buffer_differs_in_group_and_equal_arguments_share():
    base = make_buffer()
    rank = one_virtual_rank()
    assert make_buffer(rank) is not base and make_buffer(rank).group is rank
    assert make_buffer(rank) is make_buffer(rank)
    # The same arguments spelled differently: the same Buffer.
    assert make_buffer(device=None) is base
    assert make_buffer(device=torch.device("cpu")) is base
    assert make_buffer(capacity_factor=1) is base
    # Every layer of one shape gets the one Buffer; a layer asking for another planner gets its own.
    testing.release_all()
    a = flatep.nn.MoE(H, 8, E, K, num_tokens=S, align=1)
    b = flatep.nn.MoE(H, 8, E, K, num_tokens=S, align=1)
    greedy = flatep.nn.MoE(H, 8, E, K, num_tokens=S, align=1, planner="greedy")
    assert a.buffer is b.buffer and greedy.buffer is not a.buffer
    assert a.buffer.planner == "balanced" and greedy.buffer.planner == "greedy"


# shared_pools: (argument, base value, another value)
POOLS_BASE = dict(experts_per_rank=2, projections=[(H, 16), (8, H)], device="cpu", num_sms=None, stream_priority=0,
                  num_slots=None)
POOLS_OTHER = dict(experts_per_rank=3, projections=[(H, 8), (8, H)], num_sms=5, stream_priority=-1, num_slots=1)


def make_pools(group=None, **changes):
    args = {**POOLS_BASE, **changes}
    return shared_pools(group, args.pop("experts_per_rank"), args.pop("projections"), **args)


def test_shared_pools_cases_cover_every_argument():
    params = set(inspect.signature(shared_pools).parameters)
    assert params == {"group"} | set(POOLS_BASE), "a new shared_pools argument needs a case here (and in its key)"
    assert set(POOLS_OTHER) | {"device"} == set(POOLS_BASE)


@pytest.mark.parametrize("name", sorted(POOLS_OTHER))
def test_shared_pools_differ_in_each_argument(name):
    base = make_pools()
    other = make_pools(**{name: POOLS_OTHER[name]})
    assert other is not base, f"shared_pools: {name}={POOLS_OTHER[name]!r} got the pools of {POOLS_BASE[name]!r}"
    if name == "experts_per_rank":
        assert other.experts_per_rank == 3 and base.experts_per_rank == 2
    if name == "projections":
        assert other.projections == [(H, 8), (8, H)] and base.projections == [(H, 16), (8, H)]
    if name == "num_sms":
        assert other.num_sms == 5
    assert make_pools(**{name: POOLS_OTHER[name]}) is other
    assert make_pools() is base


def test_shared_pools_differ_in_group_and_equal_arguments_share():
    base = make_pools()
    rank = one_virtual_rank()
    assert make_pools(rank) is not base and make_pools(rank).group is rank
    assert make_pools(device=None) is base
    assert make_pools(projections=((H, 16), (8, H))) is base  # a tuple of tuples: the same projections
    assert make_pools(projections=[[H, 16], [8, H]]) is base


def test_transport_for_is_keyed_on_group_and_device_not_timeout():
    single = transport_for(None, "cpu")
    assert transport_for(None, None) is single and transport_for(None, torch.device("cpu")) is single
    # timeout_s is not part of the key: it is applied to the cached transport (documented).
    assert transport_for(None, "cpu", timeout_s=12.5) is single and single.timeout_s == 12.5
    rank = one_virtual_rank()
    assert transport_for(rank, "cpu") is rank.transport and rank.transport is not single
    params = set(inspect.signature(transport_for).parameters)
    assert params == {"group", "device", "timeout_s"}, "a new transport_for argument needs a case here"


def _process_groups(rank, world_size):
    import torch.distributed as dist

    world = transport_for(None, "cpu")
    assert transport_for(dist.group.WORLD, "cpu") is world  # None means the default group
    sub = dist.new_group([0])
    other = transport_for(sub, "cpu")
    assert other is not world and transport_for(sub, "cpu") is other
    assert shared_buffer(sub, S, H, E, K, align=1) is not shared_buffer(None, S, H, E, K, align=1)
    assert shared_pools(sub, 2, [(H, 8)]) is not shared_pools(None, 2, [(H, 8)])


def test_transports_and_shared_objects_differ_per_process_group():
    testing.spawn(_process_groups, 1)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA and FlatEP built with CUDA")
def test_shared_objects_per_device():
    cpu_buffer, cpu_pools, cpu_transport = make_buffer(), make_pools(), transport_for(None, "cpu")
    gpu_buffer, gpu_pools = make_buffer(device="cuda"), make_pools(device="cuda")
    assert gpu_buffer is not cpu_buffer and gpu_buffer.device.type == "cuda"
    assert gpu_pools is not cpu_pools and gpu_pools.device.type == "cuda"
    assert transport_for(None, "cuda") is not cpu_transport
    assert make_buffer(device=torch.device("cuda", torch.cuda.current_device())) is gpu_buffer
    assert make_pools(device="cuda:%d" % torch.cuda.current_device()) is gpu_pools
