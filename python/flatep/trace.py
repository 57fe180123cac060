"""flatep.trace: a compact routing trace of a training run, to replay a real router's routing elsewhere.

Per step and per MoE layer the trace keeps

* always: the exact counts ``[R, E]`` (entries of each rank's tokens per expert), the numbers a planner (FlatEP's
  Buffer.plan, an EPLB, a capacity model) works from;
* optionally: the top-K expert ids of every rank's tokens, all of them or the first ``record_tokens`` of each rank
  (uint8 when E <= 256, int16 otherwise).

One file (``.npz``, numpy's compressed archive; no pickle) holds the arrays and the metadata (R, E, K, S, layers,
steps, seed, the model's shape and anything else the recorder adds).

Recording (every rank's routing of one step and layer, e.g. gathered on rank 0)::

    trace = flatep.trace.RoutingTrace(num_ranks=R, num_experts=E, topk=K, num_tokens=S, num_layers=L,
                                      record_tokens=None, seed=0, meta={"hidden": H})
    trace.record(step, layer, [topk_idx_of_rank_0, ..., topk_idx_of_rank_R-1])   # each [S, K] (or [R, S, K])
    trace.record(step, layer, first_ids, counts=counts)  # or the first T >= record_tokens ids and the exact [R, E]
    trace.save("routing.npz")

Replaying::

    trace = flatep.trace.RoutingTrace.load("routing.npz")
    trace.num_steps, trace.num_layers, trace.num_ranks, trace.num_experts, trace.topk, trace.num_tokens
    trace.counts(step, layer)                    # [R, E] int64, exact
    trace.maxvio(step, layer)                    # the router's imbalance: max_e T_e / mean_e T_e - 1 (T = counts summed
    trace.maxvio()                               #   over ranks); with no arguments [steps, layers] as a numpy array
    trace.loads(step, layer)                     # [R] rows per home rank without replicas (the all-to-all's loads)
    idx = trace.topk_idx(step, layer, rank)      # [S, K] int64: this rank's routing (see below)
    plan = buffer.plan(idx.to(device))           # e.g. FlatEP's plan of the recorded step

``topk_idx(step, layer, rank, num_tokens=None)`` (num_tokens None: S):

* num_tokens <= the recorded tokens per rank (all S, or record_tokens): the recorded ids of the rank's first
  num_tokens tokens, exactly.
* num_tokens == S when fewer were recorded: a routing synthesised from the exact counts of the rank, with exactly
  those counts (so anything that depends on the counts only, as FlatEP's plan loads and every EPLB, replays
  exactly; which token went where is not kept). The rule (:func:`synthesise_topk`): lay the rank's S*K entries out
  by ascending expert id, each expert's ``counts[rank, e]`` entries together, and deal entry j to token j mod S as
  its choice j // S. An expert has at most S entries on a rank (a token picks K distinct experts), so its entries
  fall on distinct tokens: every token gets K distinct experts, in ascending order.
* anything else: a ValueError.
"""

import json

import numpy as np
import torch

FORMAT = "flatep.trace/1"


def synthesise_topk(counts, topk):
    """A routing [S, K] int64 with exactly the per-expert `counts` [E] (sum S*K, each at most S; S = sum / K): the
    entries laid out by ascending expert id and dealt round-robin, entry j to token j mod S as its choice j // S
    (module docstring). Every token gets K distinct experts in ascending order."""
    counts = torch.as_tensor(counts, dtype=torch.int64).flatten()
    total = int(counts.sum())
    if topk < 1 or total % topk:
        raise ValueError(f"synthesise_topk: the counts sum to {total}, not a multiple of topk={topk}")
    num_tokens = total // topk
    if int(counts.min()) < 0 or int(counts.max()) > num_tokens:
        raise ValueError(f"synthesise_topk: every count must be in [0, S={num_tokens}] (a token picks distinct "
                         f"experts), got min {int(counts.min())}, max {int(counts.max())}")
    entries = torch.repeat_interleave(torch.arange(counts.numel()), counts)  # [S*K], ascending expert ids
    return entries.view(topk, num_tokens).t().contiguous()  # entry j -> token j % S, choice j // S


def _maxvio(counts):
    """max_e T_e / mean_e T_e - 1 over the experts, T = counts summed over ranks (0 when no entries)."""
    per_expert = np.asarray(counts, dtype=np.float64).reshape(-1, np.shape(counts)[-1]).sum(0)
    mean = per_expert.mean()
    return float(per_expert.max() / mean - 1.0) if mean > 0 else 0.0


class RoutingTrace:
    """A routing trace (module docstring). Build one to record, or RoutingTrace.load(path) to replay.

    Args:
        num_ranks, num_experts, topk, num_tokens: R, E, K and S (tokens per rank per step, every step alike).
        num_layers: MoE layers per step (layer indices 0 .. L-1, in the model's order).
        record_tokens: None (default): every token's ids; an int T in [0, S]: the first T tokens of each rank
            (0: counts only).
        seed: the run's seed (metadata).
        meta: a JSON-serialisable dict saved with the trace (the model's shape, the command, ...).
    """

    def __init__(self, num_ranks, num_experts, topk, num_tokens, num_layers, record_tokens=None, seed=0, meta=None):
        for name, value, low in (("num_ranks", num_ranks, 1), ("num_experts", num_experts, 1), ("topk", topk, 1),
                                 ("num_tokens", num_tokens, 1), ("num_layers", num_layers, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"RoutingTrace: {name} must be an int >= {low}, got {value!r}")
        if num_experts > 32767:
            raise ValueError(f"RoutingTrace: num_experts must be at most 32767 (ids kept as int16), got {num_experts}")
        if topk > num_experts:
            raise ValueError(f"RoutingTrace: topk must be at most num_experts={num_experts}, got {topk}")
        if num_experts % num_ranks:
            raise ValueError(f"RoutingTrace: num_experts must be a multiple of num_ranks={num_ranks} (each rank owns "
                             f"E/R experts), got {num_experts}")
        if record_tokens is None:
            record_tokens = num_tokens
        valid = not isinstance(record_tokens, bool) and isinstance(record_tokens, int)
        if not valid or not 0 <= record_tokens <= num_tokens:
            raise ValueError(f"RoutingTrace: record_tokens must be None or an int in [0, {num_tokens}], got "
                             f"{record_tokens!r}")
        self.num_ranks, self.num_experts, self.topk = num_ranks, num_experts, topk
        self.num_tokens, self.num_layers, self.record_tokens = num_tokens, num_layers, record_tokens
        self.seed = int(seed)
        self.meta = dict(meta or {})
        json.dumps(self.meta)  # fails now, not at save time, when it is not JSON-serialisable
        self.id_dtype = np.uint8 if num_experts <= 256 else np.int16
        self._counts = []  # per step: [L, R, E] int32
        self._ids = []  # per step: [L, R, T, K] id_dtype
        self._filled = []  # per step: [L] bool

    # ---- recording ----

    @property
    def num_steps(self):
        return len(self._counts)

    def _step_arrays(self, step):
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= self.num_steps:
            raise ValueError(f"RoutingTrace.record: step must be an int in [0, {self.num_steps}] (steps are recorded "
                             f"in order), got {step!r}")
        if step == self.num_steps:
            L, R, E, T, K = self.num_layers, self.num_ranks, self.num_experts, self.record_tokens, self.topk
            self._counts.append(np.zeros((L, R, E), dtype=np.int32))
            self._ids.append(np.zeros((L, R, T, K), dtype=self.id_dtype))
            self._filled.append(np.zeros(L, dtype=bool))
        return self._counts[step], self._ids[step], self._filled[step]

    def record(self, step, layer, topk_idx=None, counts=None):
        """Records every rank's routing of (step, layer). Steps are recorded in order (step = num_steps starts one).

        topk_idx: every rank's expert ids, [R, S, K] (or a list of R [S, K]); with `counts` given, the first T >=
            record_tokens tokens of each rank suffice ([R, T, K]), and None when record_tokens is 0.
        counts: [R, E] the exact per-rank per-expert counts (each rank's sum S*K); None: counted from topk_idx, which
            must then hold all S tokens of every rank."""
        R, S, K, E, T = self.num_ranks, self.num_tokens, self.topk, self.num_experts, self.record_tokens
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"RoutingTrace.record: layer must be an int in [0, {self.num_layers - 1}], got {layer!r}")
        idx = None
        if topk_idx is not None:
            idx = torch.stack([torch.as_tensor(t) for t in topk_idx]) if isinstance(topk_idx, (list, tuple)) else \
                torch.as_tensor(topk_idx)
            idx = idx.detach().to("cpu", torch.int64)
            tokens = S if counts is None else f">= {T}"
            if idx.dim() != 3 or idx.shape[0] != R or idx.shape[2] != K or \
                    (idx.shape[1] != S if counts is None else idx.shape[1] < T):
                raise ValueError(f"RoutingTrace.record: topk_idx must be [R={R}, {tokens}, K={K}], got "
                                 f"{list(idx.shape)}")
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= E):
                raise ValueError(f"RoutingTrace.record: expert ids must be in [0, {E}), got [{int(idx.min())}, "
                                 f"{int(idx.max())}]")
        elif T or counts is None:
            raise ValueError(f"RoutingTrace.record: topk_idx is needed (this trace keeps the ids of {T} token(s) per "
                             f"rank; a trace with record_tokens=0 takes counts alone)")
        if counts is None:
            counts = torch.stack([torch.bincount(idx[r].flatten(), minlength=E) for r in range(R)])
        counts = torch.as_tensor(counts).detach().to("cpu", torch.int64)
        if tuple(counts.shape) != (R, E):
            raise ValueError(f"RoutingTrace.record: counts must be [R={R}, E={E}], got {list(counts.shape)}")
        if int(counts.min()) < 0 or int(counts.max()) > S or counts.sum(1).ne(S * K).any():
            raise ValueError(f"RoutingTrace.record: each rank's counts must be in [0, S={S}] and sum to S*K = "
                             f"{S * K}, got sums {counts.sum(1).tolist()}")
        step_counts, ids, filled = self._step_arrays(step)
        step_counts[layer] = counts.numpy()
        if T:
            ids[layer] = idx[:, :T].numpy().astype(self.id_dtype)
        filled[layer] = True

    # ---- files ----

    def metadata(self):
        return dict(format=FORMAT, num_ranks=self.num_ranks, num_experts=self.num_experts, topk=self.topk,
                    num_tokens=self.num_tokens, num_layers=self.num_layers, num_steps=self.num_steps,
                    record_tokens=self.record_tokens, seed=self.seed, meta=self.meta)

    def save(self, path):
        """Writes the trace to `path` (numpy's compressed .npz: arrays 'counts' [steps, L, R, E] int32, 'topk_idx'
        [steps, L, R, T, K] uint8/int16, 'metadata' a JSON string). Every recorded step must have all its layers."""
        for step, filled in enumerate(self._filled):
            if not filled.all():
                raise ValueError(f"RoutingTrace.save: step {step} lacks layer(s) {np.flatnonzero(~filled).tolist()}")
        L, R, E, T, K = self.num_layers, self.num_ranks, self.num_experts, self.record_tokens, self.topk
        counts = np.stack(self._counts) if self._counts else np.zeros((0, L, R, E), np.int32)
        ids = np.stack(self._ids) if self._ids else np.zeros((0, L, R, T, K), self.id_dtype)
        with open(path, "wb") as f:
            np.savez_compressed(f, counts=counts, topk_idx=ids, metadata=np.array(json.dumps(self.metadata())))

    @classmethod
    def load(cls, path):
        """The trace saved at `path`."""
        with np.load(path, allow_pickle=False) as data:
            try:
                meta = json.loads(str(data["metadata"]))
                counts, ids = data["counts"], data["topk_idx"]
            except KeyError as e:
                raise ValueError(f"RoutingTrace.load: {path} is not a routing trace (no {e})") from None
        if meta.get("format") != FORMAT:
            raise ValueError(f"RoutingTrace.load: {path} has format {meta.get('format')!r}, expected {FORMAT!r}")
        trace = cls(meta["num_ranks"], meta["num_experts"], meta["topk"], meta["num_tokens"], meta["num_layers"],
                    record_tokens=meta["record_tokens"], seed=meta["seed"], meta=meta["meta"])
        trace._counts = list(counts)
        trace._ids = list(ids.astype(trace.id_dtype, copy=False))
        trace._filled = [np.ones(trace.num_layers, dtype=bool) for _ in range(len(counts))]
        return trace

    # ---- replay ----

    def _check(self, step, layer, rank=None):
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < self.num_steps:
            raise ValueError(f"RoutingTrace: step must be an int in [0, {self.num_steps - 1}], got {step!r}")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"RoutingTrace: layer must be an int in [0, {self.num_layers - 1}], got {layer!r}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                                 or not 0 <= rank < self.num_ranks):
            raise ValueError(f"RoutingTrace: rank must be an int in [0, {self.num_ranks - 1}], got {rank!r}")

    def counts(self, step, layer):
        """[R, E] int64: entries of each rank's tokens per expert in (step, layer), exact."""
        self._check(step, layer)
        return torch.from_numpy(self._counts[step][layer].astype(np.int64))

    def loads(self, step, layer):
        """[R] int64: rows each home rank computes in (step, layer) without replicas (its experts' entries)."""
        c = self.counts(step, layer)
        return c.sum(0).view(self.num_ranks, self.num_experts // self.num_ranks).sum(1)

    def maxvio(self, step=None, layer=None):
        """The router's imbalance in (step, layer): max_e T_e / mean_e T_e - 1, T_e the entries of expert e over every
        rank (flatep.testing.maxvio's definition). With no arguments: a [steps, layers] numpy array."""
        if step is None and layer is None:
            out = np.zeros((self.num_steps, self.num_layers))
            for s in range(self.num_steps):
                for l in range(self.num_layers):
                    out[s, l] = _maxvio(self._counts[s][l])
            return out
        self._check(step, layer)
        return _maxvio(self._counts[step][layer])

    def topk_idx(self, step, layer, rank, num_tokens=None):
        """[num_tokens, K] int64: rank's routing in (step, layer); recorded ids, or a synthesised routing with the
        exact counts (module docstring)."""
        self._check(step, layer, rank)
        S = self.num_tokens
        num_tokens = S if num_tokens is None else num_tokens
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"RoutingTrace.topk_idx: num_tokens must be None or an int >= 0, got {num_tokens!r}")
        if num_tokens <= self.record_tokens:
            return torch.from_numpy(self._ids[step][layer, rank, :num_tokens].astype(np.int64))
        if num_tokens == S:
            return synthesise_topk(self._counts[step][layer, rank], self.topk)
        raise ValueError(f"RoutingTrace.topk_idx: num_tokens must be at most the {self.record_tokens} recorded "
                         f"tokens, or S={S} (synthesised from the counts), got {num_tokens}")

    def __repr__(self):
        return (f"RoutingTrace(R={self.num_ranks}, E={self.num_experts}, K={self.topk}, S={self.num_tokens}, "
                f"layers={self.num_layers}, steps={self.num_steps}, record_tokens={self.record_tokens})")
