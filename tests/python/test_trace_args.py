"""flatep.trace.RoutingTrace and synthesise_topk refusing what they cannot record or replay, each with its exact
one-line ValueError naming the argument and the value, and the trace still usable after (issue 62: branches no CPU
test took). A bad shape, id, count, step, layer, rank or token count; a save with a layer missing; a file of
another format.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_trace_args.py
"""

import re

import numpy as np
import pytest
import torch

from flatep.trace import RoutingTrace, synthesise_topk

R, E, K, S, L = 2, 4, 2, 3, 2


def refused(call, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        call()


def routing(seed=0):
    """[R, S, K]: every token two distinct experts."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)]) for _ in range(R)])


def test_the_constructor_refuses_shapes_it_cannot_keep():
    refused(lambda: RoutingTrace(0, E, K, S, L), "RoutingTrace: num_ranks must be an int >= 1, got 0")
    refused(lambda: RoutingTrace(R, E, True, S, L), "RoutingTrace: topk must be an int >= 1, got True")
    refused(lambda: RoutingTrace(R, E, K, 2.0, L), "RoutingTrace: num_tokens must be an int >= 1, got 2.0")
    refused(lambda: RoutingTrace(1, 32768, K, S, L),
            "RoutingTrace: num_experts must be at most 32767 (ids kept as int16), got 32768")
    refused(lambda: RoutingTrace(R, E, 5, S, L), "RoutingTrace: topk must be at most num_experts=4, got 5")
    refused(lambda: RoutingTrace(3, E, K, S, L),
            "RoutingTrace: num_experts must be a multiple of num_ranks=3 (each rank owns E/R experts), got 4")
    refused(lambda: RoutingTrace(R, E, K, S, L, record_tokens=4),
            "RoutingTrace: record_tokens must be None or an int in [0, 3], got 4")
    refused(lambda: RoutingTrace(R, E, K, S, L, record_tokens=False),
            "RoutingTrace: record_tokens must be None or an int in [0, 3], got False")
    assert RoutingTrace(1, 300, K, S, L).id_dtype == np.int16


def test_record_refuses_bad_steps_layers_ids_and_counts_and_keeps_what_it_had():
    t = RoutingTrace(R, E, K, S, L)
    idx = routing()
    refused(lambda: t.record(1, 0, idx),
            "RoutingTrace.record: step must be an int in [0, 0] (steps are recorded in order), got 1")
    refused(lambda: t.record(0, 2, idx), "RoutingTrace.record: layer must be an int in [0, 1], got 2")
    refused(lambda: t.record(0, 0, idx[:, :2]), "RoutingTrace.record: topk_idx must be [R=2, 3, K=2], got [2, 2, 2]")
    refused(lambda: t.record(0, 0, idx + E), "RoutingTrace.record: expert ids must be in [0, 4), got [4, 7]")
    refused(lambda: t.record(0, 0, None),
            "RoutingTrace.record: topk_idx is needed (this trace keeps the ids of 3 token(s) per rank; a trace with "
            "record_tokens=0 takes counts alone)")
    refused(lambda: t.record(0, 0, idx, counts=torch.zeros(R, E + 1)),
            "RoutingTrace.record: counts must be [R=2, E=4], got [2, 5]")
    refused(lambda: t.record(0, 0, idx, counts=torch.full((R, E), 2)),
            "RoutingTrace.record: each rank's counts must be in [0, S=3] and sum to S*K = 6, got sums [8, 8]")
    assert t.num_steps == 0
    t.record(0, 0, list(idx))  # a list of R [S, K] tensors
    refused(lambda: t.save("/nonexistent/never-written.npz"), "RoutingTrace.save: step 0 lacks layer(s) [1]")
    t.record(0, 1, idx)
    assert torch.equal(t.topk_idx(0, 1, 1), idx[1])


def test_a_counts_only_trace_replays_a_routing_with_the_exact_counts(tmp_path):
    t = RoutingTrace(R, E, K, S, 1, record_tokens=0)
    counts = torch.tensor([[3, 1, 2, 0], [0, 2, 1, 3]])
    t.record(0, 0, counts=counts)
    path = tmp_path / "trace.npz"
    t.save(path)
    back = RoutingTrace.load(path)
    assert torch.equal(back.counts(0, 0), counts)
    idx = back.topk_idx(0, 0, 1)
    assert torch.equal(torch.bincount(idx.flatten(), minlength=E), counts[1])
    assert torch.equal(back.topk_idx(0, 0, 0, num_tokens=0), torch.zeros(0, K, dtype=torch.int64))
    refused(lambda: back.topk_idx(0, 0, 0, num_tokens=2),
            "RoutingTrace.topk_idx: num_tokens must be at most the 0 recorded tokens, or S=3 (synthesised from the "
            "counts), got 2")
    refused(lambda: back.topk_idx(0, 0, 0, num_tokens=-1),
            "RoutingTrace.topk_idx: num_tokens must be None or an int >= 0, got -1")
    refused(lambda: back.topk_idx(0, 0, 2), "RoutingTrace: rank must be an int in [0, 1], got 2")
    refused(lambda: back.topk_idx(0, 0, True), "RoutingTrace: rank must be an int in [0, 1], got True")
    refused(lambda: back.counts(1, 0), "RoutingTrace: step must be an int in [0, 0], got 1")
    refused(lambda: back.maxvio(0, -1), "RoutingTrace: layer must be an int in [0, 0], got -1")


def test_load_refuses_a_file_of_another_format(tmp_path):
    path = tmp_path / "other.npz"
    np.savez_compressed(path, counts=np.zeros((0, 1, R, E), np.int32), topk_idx=np.zeros((0, 1, R, 0, K), np.uint8),
                        metadata=np.array('{"format": "other/1"}'))
    refused(lambda: RoutingTrace.load(path),
            f"RoutingTrace.load: {path} has format 'other/1', expected 'flatep.trace/1'")


def test_synthesise_topk_refuses_counts_no_routing_has():
    refused(lambda: synthesise_topk([3, 2], 2), "synthesise_topk: the counts sum to 5, not a multiple of topk=2")
    refused(lambda: synthesise_topk([3, 1], 0), "synthesise_topk: the counts sum to 4, not a multiple of topk=0")
    assert synthesise_topk([2, 1, 1], 2).tolist() == [[0, 1], [0, 2]]
