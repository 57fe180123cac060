"""Testing helpers: the routing generator of design §9 (bound from C++, so Python, C++ tests and benchmarks draw the
same routings), maxvio, a dense single-process MoE reference, and a launcher of R local processes.

    sigma = flatep.testing.sigma_for_maxvio(5.0, R, E, S, K, seed=1)
    topk_idx = flatep.testing.sample_topk(E, S, K, rank, sigma=sigma, seed=1)    # [S, K] int32 for this rank
    flatep.testing.maxvio(counts)                                                # counts [R, E] (or [E])
    pop = flatep.testing.drifting_popularity(E, steps, sigma=1.0, drift=0.05)    # [steps, E]: drifting skew
    topk_idx = flatep.testing.sample_topk_from(pop[t], S, K, rank, seed=t)       # step t's routing
"""

import os
import socket
import tempfile

import torch

from . import _C
from ._tensors import number_text

_BF16 = torch.bfloat16


# ---- routing generator ----


def popularity(num_experts, sigma=0.0, seed=0):
    """list[E] of expert popularities exp(sigma * z_e), z_e standard normal from `seed` (shared by all ranks)."""
    return _C.routing.popularity(num_experts, float(sigma), int(seed))


def sample_topk(num_experts, num_tokens, topk, rank, sigma=0.0, seed=0):
    """[num_tokens, topk] int32: per token, K distinct experts drawn without replacement with probability
    proportional to popularity(num_experts, sigma, seed); `rank` selects the rank's own random stream."""
    pop = popularity(num_experts, sigma, seed)
    return torch.from_numpy(_C.routing.sample_topk(pop, int(num_tokens), int(topk), int(seed), int(rank)))


def generate_counts(num_ranks, num_experts, num_tokens, topk, sigma=0.0, seed=0):
    """[R, E] int32 counts of the routing sample_topk gives every rank (what Buffer.plan all-gathers)."""
    counts = _C.routing.generate_counts(num_ranks, num_experts, num_tokens, topk, float(sigma), int(seed))
    return torch.from_numpy(counts)


def sigma_for_maxvio(target, num_ranks, num_experts, num_tokens, topk, seed=0):
    """sigma whose realised maxvio (generate_counts with this seed) is closest to `target` (bisection)."""
    return _C.routing.sigma_for_maxvio(float(target), num_ranks, num_experts, num_tokens, topk, int(seed))


def drifting_popularity(num_experts, num_steps, sigma=1.0, drift=0.05, shift_every=0, seed=0, layer=0):
    """[num_steps, E] expert popularities of one layer that drift as a served model's do (issue 60's traces).

    Log-popularity is a mean-reverting Gaussian random walk: z_0 ~ N(0, 1)^E, z_{t+1} = sqrt(1 - drift^2) z_t +
    drift * xi_t, xi_t ~ N(0, 1)^E, so every step's z is N(0, 1) (the skew stays at `sigma`: popularity
    exp(sigma * z_t) is log-normal, as sample_topk's at that sigma) while which experts are hot wanders, with a
    correlation time of about 1 / drift^2 steps. shift_every > 0: every shift_every steps z is drawn afresh (a
    sudden shift, e.g. a new kind of request). drift in [0, 1]; deterministic in (seed, layer)."""
    if not 0.0 <= drift <= 1.0:
        raise ValueError(f"drifting_popularity: drift must be in [0, 1], got {drift!r}")
    if num_steps < 1 or num_experts < 1 or shift_every < 0:
        raise ValueError(f"drifting_popularity: num_steps and num_experts must be >= 1 and shift_every >= 0, got "
                         f"{num_steps}, {num_experts}, {shift_every}")
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 7919 * int(layer) + 17)
    z = torch.randn(num_experts, generator=g, dtype=torch.float64)
    keep = (1.0 - drift * drift) ** 0.5
    out = torch.empty(num_steps, num_experts, dtype=torch.float64)
    for t in range(num_steps):
        if t and shift_every and t % shift_every == 0:
            z = torch.randn(num_experts, generator=g, dtype=torch.float64)
        elif t:
            z = keep * z + drift * torch.randn(num_experts, generator=g, dtype=torch.float64)
        out[t] = torch.exp(sigma * z)
    return out


def sample_topk_from(popularity, num_tokens, topk, rank, seed=0):
    """[num_tokens, topk] int32: per token, K distinct experts drawn without replacement with probability
    proportional to `popularity` (a list or 1-D tensor of E positive numbers); sample_topk's draw for any
    popularity (the same C++ generator: `rank` selects the rank's own stream)."""
    pop = [float(p) for p in torch.as_tensor(popularity).flatten().tolist()]
    return torch.from_numpy(_C.routing.sample_topk(pop, int(num_tokens), int(topk), int(seed), int(rank)))


def maxvio(counts, num_experts=None):
    """Router imbalance max_e(T_e / mean_e T_e) - 1 (0 = perfectly even).

    counts: [R, E] or [E] per-expert entry counts, or (with num_experts) a tensor of expert ids of any shape."""
    counts = torch.as_tensor(counts)
    if num_experts is not None:
        counts = torch.bincount(counts.flatten().long(), minlength=num_experts)
    if counts.dim() == 1:
        counts = counts.unsqueeze(0)
    return _C.routing.maxvio(counts.to(torch.int32).numpy())


# ---- dense reference ----
#
# An oracle: written from the contract (docs/design.md §6 "Expert FFN" and "FP8 rows", flatep.nn's module docstring),
# calling no function of flatep.nn or flatep.fp8, so that a bug there shows up as a difference instead of being
# carried into the reference (tests/python/test_dense_reference.py checks that it runs with those functions broken).
# Where nn.MoE and this reference round at the same points they use the same torch operations, so single-rank
# results agree bit for bit.

#: What DenseMoE accepts: (name, W1 columns per F). The first is the default.
_DENSE_ACTIVATIONS = (("swiglu", 2), ("silu", 1))
_E4M3_LARGEST = 448.0  # the largest finite e4m3 ("fn") value
_FP8_BLOCK = 128  # channels per FP8 scale


def _round_bf16(w):
    """Value rounded to bf16, gradient passed straight through in fp32 (the masters' gradients are not rounded)."""
    return w + (w.to(_BF16).float() - w).detach()


def _normal(generator, shape, fan_in):
    """N(0, 1/fan_in) draws of `shape` from `generator` (fp32)."""
    return torch.randn(*shape, generator=generator) / fan_in**0.5


def _dense_init(hidden, ffn, num_experts, seed, w1_cols, shared_ffn):
    """The documented init (flatep.nn.init_expert_weights and friends): generator seed s = seed * 1_000_003; the
    router [E, H] from s; expert e's W1 [H, cols] then W2 [F, H] from s + e + 1; the shared expert's W1, W2 from
    s + 500_000_009. W1 draws are N(0, 1/H), W2 draws N(0, 1/F)."""
    base = int(seed) * 1_000_003
    router = _normal(torch.Generator().manual_seed(base), (num_experts, hidden), hidden)
    w1 = torch.empty(num_experts, hidden, w1_cols * ffn)
    w2 = torch.empty(num_experts, ffn, hidden)
    for e in range(num_experts):
        g = torch.Generator().manual_seed(base + e + 1)
        w1[e] = _normal(g, (hidden, w1_cols * ffn), hidden)
        w2[e] = _normal(g, (ffn, hidden), ffn)
    shared = None
    if shared_ffn is not None:
        g = torch.Generator().manual_seed(base + 500_000_009)
        shared = (_normal(g, (hidden, w1_cols * shared_ffn), hidden), _normal(g, (shared_ffn, hidden), shared_ffn))
    return router, w1, w2, shared


def routing_weights(x, router_weight, topk, topk_idx=None):
    """The router of the contract, written out: logits = x @ router_weight.T in fp32, softmax over the E experts,
    the K largest probabilities (or those of the given topk_idx [s, K]), divided by their sum so that each row sums
    to 1. Returns (weights [s, K] fp32, topk_idx [s, K] int64)."""
    logits = torch.matmul(x.float(), router_weight.float().t())
    probs = torch.softmax(logits, dim=1)
    if topk_idx is None:
        chosen, idx = torch.topk(probs, topk, dim=1)
    else:
        idx = topk_idx.to(device=probs.device, dtype=torch.long)
        chosen = torch.gather(probs, 1, idx)
    total = chosen.sum(dim=1, keepdim=True)
    return chosen / total, idx


def _dense_ffn(rows, w1, w2, swiglu):
    """One FFN on fp32 rows holding bf16 values, weights holding bf16 values: h = rows @ W1 rounded to bf16; the
    activation (silu(gate) * up, gate = h's first F columns, or silu(h)) in fp32 rounded to bf16; y = a @ W2 rounded
    to bf16. Returns y in fp32 (bf16 values)."""
    h = torch.matmul(rows, w1).to(_BF16).float()
    if swiglu:
        f = h.shape[1] // 2
        a = torch.nn.functional.silu(h[:, :f]) * h[:, f:]
    else:
        a = torch.nn.functional.silu(h)
    return torch.matmul(a.to(_BF16).float(), w2).to(_BF16).float()


def _pow2(exponent):
    """2^exponent (int32 tensor, every value in the fp32 normal range) as exact fp32, built from its bits."""
    return ((exponent + 127) << 23).view(torch.float32)


def _nearest_e4m3(v):
    """fp32 values -> the nearest e4m3 value (fp32), ties to the even code, subnormals (multiples of 2^-9 below
    2^-6) kept, magnitudes from 448 up (Inf included) saturating to 448, NaN staying NaN, the sign kept (-0 too)."""
    magnitude = v.abs().clamp(max=2 * _E4M3_LARGEST)  # anything this large saturates anyway
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2^exponent, m in [0.5, 1): leading bit 2^(exponent - 1)
    step = (exponent.to(torch.int32) - 4).clamp(min=-9)  # 3 fraction bits; the subnormal step is 2^-9
    rounded = torch.round(magnitude * _pow2(-step)) * _pow2(step)  # exact scalings; round: half to even
    out = torch.copysign(rounded.clamp(max=_E4M3_LARGEST), v)
    return torch.where(torch.isnan(v), v, out)


def fp8_round_trip(rows):
    """fp32 rows holding bf16 values [N, H], H % 128 == 0 -> what an FP8 dispatch delivers once dequantised, by the
    rule of docs/design.md §6 ("FP8 rows"), written out on values: per block of 128 channels, amax = the largest
    finite |x| (0: scale and inverse 1), scale = amax / 448 and inverse = 448 / amax (fp32 divisions); q = the
    nearest e4m3 value of x * inverse (x / scale where the inverse is not finite); the value read back is q * scale
    in fp32, rounded to bf16. Returns fp32 (bf16 values)."""
    n, hidden = rows.shape
    blocks = rows.reshape(n, hidden // _FP8_BLOCK, _FP8_BLOCK)
    amax = torch.where(torch.isfinite(blocks), blocks.abs(), torch.zeros_like(blocks)).amax(dim=2, keepdim=True)
    largest = torch.full_like(amax, _E4M3_LARGEST)
    ones = torch.ones_like(amax)
    scale = torch.where(amax == 0, ones, amax / largest)
    inverse = torch.where(amax == 0, ones, largest / amax)
    scaled = torch.where(torch.isfinite(inverse), blocks * inverse, blocks / scale)
    return (_nearest_e4m3(scaled) * scale).to(_BF16).float().reshape(n, hidden)


def _round_fp8(rows):
    """fp8_round_trip with the gradient passed straight through (as nn.MoE's fp8 backward does)."""
    return rows + (fp8_round_trip(rows.detach()) - rows).detach()


class DenseMoE(torch.nn.Module):
    """Single-process MoE with every expert, the reference flatep.nn.MoE is held to.

    Written from the contract, sharing no function with the layer's path (see the section comment above): the router
    of routing_weights (fp32 softmax, top-K, renormalised over the K chosen), bf16 token rows, each expert's FFN
    rounded to bf16 at the documented points (h, the activation, y), fp32 weighted sum rounded to bf16; the same
    init as nn.MoE for the same seed. Parameters: router_weight [E, H], w1 [E, H, 2F] (activation='swiglu', the
    default: columns [0, F) gate, [F, 2F) up) or [E, H, F] (activation='silu'), w2 [E, F, H] (fp32, rounded to bf16
    where used, their gradients fp32).

    fp8=True: the experts' input rows are the FP8 round trip of the bf16 token rows (fp8_round_trip: what an FP8
    dispatch delivers, dequantised), the router still reads x; the rows' gradient passes straight through the
    quantisation. nn.MoE(fp8=True) is held to this at bf16 tolerance and to the fp8=False reference at the FP8
    tolerance (tests/python/test_moe_fp8.py).

    shared_ffn=F_s: nn.MoE's shared expert (same init for the same seed, the FFN above on the bf16 token rows with
    the weights rounded to bf16, never FP8: it is local), added to the routed output rounded to bf16:
    bf16(fp32(routed) + fp32(shared)). Parameters shared_w1 [H, 2F_s] (swiglu) or [H, F_s], shared_w2 [F_s, H], fp32.

    forward(x [N, H], topk_idx=None [N, K], chunks=1) -> [N, H] in x's dtype. `chunks` (a count, or a list of
    sizes) splits the router matmul the way the ranks compute it on their own tokens, so that both sides get the
    same logits bit for bit and pick the same experts.
    """

    def __init__(self, hidden, ffn, num_experts, topk, seed=0, activation="swiglu", fp8=False, shared_ffn=None):
        super().__init__()
        self.hidden, self.ffn, self.num_experts, self.topk = hidden, ffn, num_experts, topk
        columns = dict(_DENSE_ACTIVATIONS)
        if activation not in columns:
            names = ", ".join(repr(name) for name, _ in _DENSE_ACTIVATIONS)
            raise ValueError(f"DenseMoE: activation must be one of {names}, got {activation!r}")
        self.activation = activation
        if not isinstance(fp8, bool) or (fp8 and hidden % _FP8_BLOCK != 0):
            raise ValueError(f"DenseMoE: fp8 must be a bool, and fp8=True needs H % {_FP8_BLOCK} == 0; got "
                             f"fp8={fp8!r}, H={hidden}")
        self.fp8 = fp8
        router, w1, w2, shared = _dense_init(hidden, ffn, num_experts, seed, columns[activation], shared_ffn)
        self.router_weight = torch.nn.Parameter(router)
        self.w1 = torch.nn.Parameter(w1)
        self.w2 = torch.nn.Parameter(w2)
        self.shared_ffn = shared_ffn
        self.shared_w1 = self.shared_w2 = None
        if shared is not None:
            self.shared_w1 = torch.nn.Parameter(shared[0])
            self.shared_w2 = torch.nn.Parameter(shared[1])

    def forward(self, x, topk_idx=None, chunks=1):
        sizes = [len(c) for c in torch.arange(x.shape[0]).chunk(chunks)] if isinstance(chunks, int) else list(chunks)
        xs = x.split(sizes)
        idxs = topk_idx.split(sizes) if topk_idx is not None else [None] * len(xs)
        routed = [routing_weights(xc, self.router_weight, self.topk, ic) for xc, ic in zip(xs, idxs)]
        weights = torch.cat([w for w, _ in routed])
        idx = torch.cat([i for _, i in routed])
        rows = x.to(_BF16).float()
        swiglu = self.activation == "swiglu"
        expert_rows = _round_fp8(rows) if self.fp8 else rows
        w1, w2 = _round_bf16(self.w1), _round_bf16(self.w2)
        out = torch.zeros(x.shape[0], self.hidden, dtype=torch.float32, device=x.device)
        for e in range(self.num_experts):
            token, k = (idx == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            y = _dense_ffn(expert_rows[token], w1[e], w2[e], swiglu)
            out = out.index_add(0, token, weights[token, k].unsqueeze(1) * y)
        out = out.to(_BF16)
        if self.shared_ffn is not None:
            shared = _dense_ffn(rows, _round_bf16(self.shared_w1), _round_bf16(self.shared_w2), swiglu)
            out = (out.float() + shared).to(_BF16)
        return out.to(x.dtype)


# ---- multi-process launcher ----


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, init_file, fn, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        release_all()
        dist.destroy_process_group()


def release_all():
    """Drops the process's shared pools and transports and collects the FlatEP objects that only reference cycles
    still hold (layers and their pools), so their memory is released now, while CUDA is still up, rather than at
    interpreter exit. Call at the end of a process's work, before destroy_process_group."""
    import gc

    from .buffer import release_shared_buffers
    from .distributed import release_transports
    from .pools import release_shared_pools

    release_shared_buffers()
    release_shared_pools()
    release_transports()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def spawn_timeout_s():
    """The wall-clock limit of spawn(): FLATEP_SPAWN_TIMEOUT_S seconds (a positive number), or None (unset: no
    limit)."""
    text = os.environ.get("FLATEP_SPAWN_TIMEOUT_S", "")
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"FLATEP_SPAWN_TIMEOUT_S must be a positive number of seconds, got {text!r}")
    return value


def spawn(fn, world_size, *args):
    """Runs fn(rank, world_size, *args) in `world_size` fresh processes joined by a gloo process group (default
    group), like torchrun on one machine. fn must be importable (module level). Raises if any process fails, and
    TimeoutError (every process killed) if they are not all done within FLATEP_SPAWN_TIMEOUT_S seconds when that is
    set: a test that hangs then fails with its name instead of stopping the tests after it."""
    import time

    import torch.multiprocessing as mp

    limit = spawn_timeout_s()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        context = mp.spawn(_worker, args=(world_size, init_file, fn, args), nprocs=world_size, join=False)
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                for process in context.processes:
                    process.join()
                name = getattr(fn, "__qualname__", repr(fn))
                raise TimeoutError(
                    f"spawn: {name} on {world_size} process(es) did not finish within {number_text(limit)} s "
                    f"(FLATEP_SPAWN_TIMEOUT_S); its processes were killed"
                )
            if context.join(timeout=None if left is None else min(left, 5.0)):
                return


def _store_code(rank, world_size, fn, codes, *args):
    codes[rank] = fn(rank, world_size, *args)


def launch(fn, num_ranks, *args):
    """Runs fn(rank, world_size, *args) -> int (an exit code) on every rank of a gloo process group and returns the
    largest code, the examples' launcher: under torchrun (RANK and WORLD_SIZE set) this process is one rank; otherwise
    `num_ranks` fresh processes are spawned as spawn() does (fn at module level). Every rank releases FlatEP's memory
    (release_all) before it leaves the group."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            code = fn(dist.get_rank(), dist.get_world_size(), *args)
            dist.barrier()
        finally:
            release_all()
            dist.destroy_process_group()
        return code
    import torch.multiprocessing as mp

    codes = mp.get_context("spawn").Array("i", [0] * num_ranks)
    spawn(_store_code, num_ranks, fn, codes, *args)
    return max(codes[:])
