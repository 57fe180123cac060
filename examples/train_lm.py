#!/usr/bin/env python3
"""Trains a small decoder-only MoE language model with FlatEP (or the all-to-all baseline) on real text.

    /usr/bin/python3 examples/train_lm.py                                  # 2 processes on the CPU, tiny model
    /usr/bin/python3 examples/train_lm.py --virtual --ranks 4 --experts 16 # 4 virtual ranks in this process
    /usr/bin/python3 examples/train_lm.py --impl baseline                  # the same run through the all-to-all layer
    python3 examples/train_lm.py --device cuda --virtual --ranks 8 --blocks 8 --hidden 1024 --heads 16 \\
        --experts 64 --topk 4 --ffn 512 --seq-len 1024 --batch 4 --steps 300      # 8 virtual ranks on one GPU
    torchrun --nproc-per-node 4 examples/train_lm.py --device cuda         # launched by torchrun
    /usr/bin/python3 examples/train_lm.py --steps 20 --save ckpt --save-every 10
    /usr/bin/python3 examples/train_lm.py --steps 20 --resume ckpt          # continues from ckpt/latest, bitwise

Model (``MoETransformer``): byte tokens (vocab 256) -> embedding -> ``--blocks`` pre-norm blocks -> RMSNorm -> a
linear head, cross-entropy on the next byte. A block is h = h + Attention(RMSNorm(h)); h = h + FFN(RMSNorm(h)):
causal self-attention over ``--heads`` heads with rotary positions (torch's scaled_dot_product_attention where torch
has it, the same softmax(QK^T/sqrt(d))V by hand on torch 1.13); the FFN of every other block (blocks 1, 3, 5, ...) is
an MoE layer (flatep.nn.MoE, or flatep.baseline.AllToAllMoE with ``--impl baseline``: SwiGLU experts of size
``--ffn``, top-``--topk`` of ``--experts``, ``--shared-ffn`` a shared expert), the others a dense SwiGLU FFN of size
``--dense-ffn`` (default K*F: the MoE layer's active size). RMSNorm is written here (torch.nn.RMSNorm is torch >= 2.4).

Routing (``MoEFFN``): this script picks each token's experts itself, with the layer's router weight and
flatep.nn.route's arithmetic (fp32 logits x W^T, softmax, top-K), and passes them as ``topk_idx``, so both layers and
the routing trace see the same choice; the layer's weights stay the router's renormalised probabilities. No
load-balancing loss by default, so the router drifts into imbalance as routers do; ``--aux-loss c`` adds
c * E * sum_e f_e P_e (Switch Transformer's: f_e the fraction of this rank's entries on expert e, P_e the mean router
probability of e). Two options let the imbalance grow: ``--router-bias b`` adds b * z_e (z a fixed N(0, 1) draw per
layer and expert) to the logits when choosing (not to the weights), ramped in linearly over ``--router-bias-ramp``
steps; ``--router-temperature T`` divides the router's logits by T, implemented as the router weight W = V / T
(initialised at 1/T of the default) trained by AdamW at lr / T: Adam's update is invariant to the gradient's scale,
so this is softmax(x V^T / T) trained on V (up to Adam's eps); T < 1 sharpens the router.

Data: bytes of text. By default the source files of the running Python's standard library (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, leaving out site-packages / dist-packages, in sorted order of their relative
paths, concatenated): real text present on every machine without a network (its size depends on the Python:
13 MB for Debian's 3.11). ``--data PATH``: a file, or a folder's files matching ``--data-pattern`` (default *.py).
Each step every rank reads ``--batch`` windows of ``--seq-len`` + 1 bytes (inputs and next-byte targets) at offsets
drawn by splitmix64 from (seed, step, rank): the data position of a step is the step itself.

Ranks: processes (spawned, joined by gloo, or torchrun's), or ``--virtual`` ranks in this process
(flatep.virtual.run_threads; on a GPU every rank on its own CUDA stream). Non-expert parameters are data-parallel over
the EP group: each rank's loss (mean over its S = batch * seq_len tokens) is scaled by 1/R, their gradients are
summed over the ranks (one all-reduce of one flat fp32 buffer: the average of the ranks' gradients); the experts' come
back through the layer (FlatEP: replicas' gradients by reduce_grad). Gradients are clipped to ``--grad-clip`` in
global norm. bf16 compute with fp32 master weights: the non-expert parameters are fp32 and every matmul reads them as
bf16 (bf16 GEMMs on a GPU; on the CPU fp32 matmuls of the bf16 values rounded to bf16, as flatep.nn does), the
experts are bf16 with fp32 main_grad and masters (flatep.optim.MainGradOptimizer); AdamW with a linear warm-up and a
cosine decay to ``--min-lr-ratio`` of the peak.

Checkpoints (``--save DIR --save-every N``; always at the last step): DIR/step_NNNNNN/rank_R.pt per rank (the weights,
the experts' read from the pools, both optimizers' state with the fp32 masters, the step, torch's RNG states, the
data's size and CRC; torch.save pickles: resume only your own) and DIR/latest. ``--resume DIR`` (DIR or one of its
step folders) continues from there; the run is bitwise the uninterrupted one (losses and final weights;
tests/python/test_train_lm.py) wherever the kernels are deterministic (the CPU backend; on a GPU pass
``--deterministic``: torch's attention and index_add backward are not).
A checkpoint of one --impl resumes with the other (the layers' parameters have the same names).

Prints one line per step (loss, lr, gradient norm, the router's maxvio per MoE layer, rows per rank max/mean over
ranks and layers, time); ``--log FILE`` writes each step as a JSON line.
"""

import argparse
import json
import math
import os
import sys
import sysconfig
import time
import zlib

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))  # source checkout: python/ (the extension: PYTHONPATH)

from flatep import virtual  # noqa: E402  (before CUDA starts: flatep.virtual's settings)
import flatep  # noqa: E402
from flatep.baseline import AllToAllMoE, collectives  # noqa: E402
from flatep.baseline import backward as joint_backward  # noqa: E402
from flatep.nn import shared_expert_ffn  # noqa: E402
from flatep.optim import MainGradOptimizer  # noqa: E402
from flatep.testing import maxvio  # noqa: E402

BF16 = torch.bfloat16
VOCAB = 256
CHECKPOINT_FORMAT = "train_lm/1"
# The model's shape: a checkpoint resumes only into the same (and the same number of ranks).
SHAPE_KEYS = ("ranks", "blocks", "hidden", "heads", "ffn", "dense_ffn", "experts", "topk", "shared_ffn", "seq_len",
              "batch")


# ---- flags ----


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog="train_lm"):
    p = _Parser(prog=prog, description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--impl", choices=["flatep", "baseline"], default="flatep", help="the MoE layer: FlatEP or the all-to-all one")
    a("--ranks", type=int, default=2, help="EP ranks (processes to spawn, or virtual ranks); ignored under torchrun")
    a("--virtual", action="store_true", help="the ranks as threads of this process (flatep.virtual)")
    a("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: every rank on GPU rank %% device count")
    a("--steps", type=int, default=20)
    a("--blocks", type=int, default=4, help="transformer blocks (every other one MoE)")
    a("--hidden", type=int, default=64)
    a("--heads", type=int, default=4)
    a("--ffn", type=int, default=32, help="F of one expert")
    a("--dense-ffn", type=int, default=None, help="F of the dense blocks' FFN (default topk * ffn)")
    a("--experts", type=int, default=8)
    a("--topk", type=int, default=2)
    a("--shared-ffn", type=int, default=None, help="F of a shared expert in every MoE layer (default none)")
    a("--seq-len", type=int, default=32)
    a("--batch", type=int, default=2, help="sequences per rank per step (S = batch * seq_len tokens)")
    a("--lr", type=float, default=3e-3)
    a("--min-lr-ratio", type=float, default=0.1)
    a("--warmup", type=int, default=10, help="linear warm-up steps")
    a("--weight-decay", type=float, default=0.1)
    a("--grad-clip", type=float, default=1.0, help="global gradient norm clip (0: none)")
    a("--aux-loss", type=float, default=0.0, help="load-balancing loss coefficient (0: off, the default)")
    a("--router-temperature", type=float, default=1.0, help="router logits / T (T < 1: sharper)")
    a("--router-bias", type=float, default=0.0, help="scale of a fixed per-expert bias on the choice of experts")
    a("--router-bias-ramp", type=int, default=0, help="steps over which the bias grows linearly (0: full at once)")
    a("--align", type=int, default=flatep.nn.DEFAULT_ALIGN, help="FlatEP's row-group padding")
    a("--data", default=None, help="a text file or folder (default: the standard library's sources)")
    a("--data-pattern", default="*.py", help="file names read from a --data folder")
    a("--seed", type=int, default=0)
    a("--save", default=None, help="checkpoint folder")
    a("--save-every", type=int, default=0, help="steps between checkpoints (0: the last step only)")
    a("--resume", default=None, help="checkpoint folder (or one of its step_NNNNNN folders) to continue from")
    a("--log", default=None, help="a JSON line per step to this file")
    a("--deterministic", action="store_true", help="torch.use_deterministic_algorithms (GPU: bitwise resume)")
    return p


def check_args(args):
    """One-line ValueErrors for a configuration that cannot run (before anything is built)."""
    def need(cond, text):
        if not cond:
            raise ValueError(text)

    for name in ("ranks", "steps", "blocks", "hidden", "heads", "ffn", "experts", "topk", "seq_len", "batch"):
        need(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("dense_ffn", "shared_ffn"):
        value = getattr(args, name)
        need(value is None or value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")
    need(args.blocks >= 2, f"--blocks must be >= 2 (every other block is an MoE layer), got {args.blocks}")
    need(args.experts % args.ranks == 0, f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    need(args.topk <= args.experts, f"--topk {args.topk} must be at most --experts {args.experts}")
    need(args.hidden % 8 == 0, f"--hidden must be a multiple of 8 (FlatEP's rows), got {args.hidden}")
    need(args.hidden % args.heads == 0, f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    need((args.hidden // args.heads) % 2 == 0, f"--hidden / --heads must be even (rotary pairs), got "
                                               f"{args.hidden // args.heads}")
    need(args.seq_len >= 2, f"--seq-len must be >= 2, got {args.seq_len}")
    need(args.lr > 0 and math.isfinite(args.lr), f"--lr must be a positive number, got {args.lr}")
    need(0 <= args.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}")
    need(args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}")
    need(args.weight_decay >= 0, f"--weight-decay must be >= 0, got {args.weight_decay}")
    need(args.grad_clip >= 0, f"--grad-clip must be >= 0, got {args.grad_clip}")
    need(args.aux_loss >= 0, f"--aux-loss must be >= 0, got {args.aux_loss}")
    need(args.router_temperature > 0 and math.isfinite(args.router_temperature),
         f"--router-temperature must be a positive number, got {args.router_temperature}")
    need(math.isfinite(args.router_bias), f"--router-bias must be a finite number, got {args.router_bias}")
    need(args.router_bias_ramp >= 0, f"--router-bias-ramp must be >= 0, got {args.router_bias_ramp}")
    need(args.save_every >= 0, f"--save-every must be >= 0, got {args.save_every}")
    need(args.save_every == 0 or args.save, "--save-every needs --save DIR")
    need(args.data is None or os.path.exists(args.data), f"--data {args.data}: no such file or folder")
    need(args.resume is None or os.path.isdir(args.resume), f"--resume {args.resume}: no such folder")
    if args.device == "cuda" and not (torch.cuda.is_available() and flatep._C.has_cuda):
        why = "FlatEP was built without CUDA" if not flatep._C.has_cuda else "torch sees no CUDA device"
        raise ValueError(f"--device cuda is not available here ({why}); use --device cpu")
    if args.dense_ffn is None:
        args.dense_ffn = args.topk * args.ffn
    return args


def parse_args(argv=None, prog="train_lm"):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        return check_args(args)
    except ValueError as e:
        parser.error(str(e))


def shape_of(args, num_ranks):
    return {key: (num_ranks if key == "ranks" else getattr(args, key)) for key in SHAPE_KEYS}


# ---- data ----


def default_data_path():
    return sysconfig.get_paths()["stdlib"]


def corpus_files(path, pattern="*.py"):
    """The files read from `path`: [path] for a file; for a folder its files matching `pattern` (fnmatch, any depth),
    sorted by relative path, outside site-packages, dist-packages and __pycache__."""
    import fnmatch

    if os.path.isfile(path):
        return [path]
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        found += [os.path.relpath(os.path.join(dirpath, f), path) for f in filenames if fnmatch.fnmatch(f, pattern)]
    return [os.path.join(path, rel) for rel in sorted(found)]


class Corpus:
    """The training text as bytes (a CPU uint8 tensor), with its origin, size and CRC-32 (kept in checkpoints)."""

    def __init__(self, path=None, pattern="*.py"):
        self.path = path or default_data_path()
        files = corpus_files(self.path, pattern)
        chunks = []
        for name in files:
            with open(name, "rb") as f:
                chunks.append(f.read())
        raw = b"".join(chunks)
        self.num_files, self.num_bytes, self.crc32 = len(files), len(raw), zlib.crc32(raw)
        self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)

    def describe(self):
        return f"{self.num_bytes} bytes of {self.num_files} file(s) under {self.path}"


_MASK64 = (1 << 64) - 1


def splitmix64(x):
    """One step of splitmix64 (Steele, Lea, Flood 2014) on a 64-bit int: a fixed, version-independent mixer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def window_starts(seed, step, rank, count, limit):
    """`count` window offsets in [0, limit) for (seed, step, rank): splitmix64 of a key mixed from the three."""
    key = splitmix64(splitmix64(splitmix64(seed & _MASK64) ^ step) ^ rank)
    return [splitmix64((key + i) & _MASK64) % limit for i in range(count)]


def batch_of(corpus, args, step, rank):
    """(inputs, targets) [batch, seq_len] int64 (CPU) of `rank` at `step`: windows of seq_len + 1 bytes."""
    limit = corpus.num_bytes - args.seq_len
    if limit < 1:
        raise ValueError(f"the data has {corpus.num_bytes} bytes, fewer than --seq-len + 1 = {args.seq_len + 1}")
    starts = torch.tensor(window_starts(args.seed, step, rank, args.batch, limit), dtype=torch.int64)
    windows = corpus.data[starts.unsqueeze(1) + torch.arange(args.seq_len + 1)].long()
    return windows[:, :-1], windows[:, 1:]


# ---- the model ----


def _bf16_values(w):
    """w's values rounded to bf16, the gradient passed straight through to the fp32 master."""
    return w + (w.to(BF16).to(w.dtype) - w).detach()


def linear(x, w):
    """x @ w.T as bf16 compute: x bf16 values, w an fp32 master read as bf16; a bf16 GEMM on a GPU, an fp32 matmul of
    the bf16 values rounded to bf16 elsewhere (flatep.nn's convention)."""
    if x.is_cuda:
        return F.linear(x.to(BF16), w.to(BF16))
    return F.linear(x.float(), _bf16_values(w)).to(BF16)


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight in fp32, returned as bf16."""

    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(BF16)


def rotary_tables(seq_len, head_dim, device, base=10000.0):
    """cos, sin [seq_len, head_dim / 2] fp32 of rotary positions (angle t * base^(-2i/d))."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq_len, dtype=torch.float64).unsqueeze(1) * inv_freq
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rotary(x, cos, sin):
    """x [B, heads, T, d] rotated pairwise (first half with second half of d), in fp32, returned as bf16."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(BF16)


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d) + causal mask) v over [B, heads, T, d] bf16 -> bf16."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T = q.shape[-2]
    scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return (probs @ v.float()).to(BF16)


def _normal(generator, shape, std):
    return torch.randn(*shape, generator=generator) * std


class Attention(torch.nn.Module):
    def __init__(self, hidden, heads, generator, out_std):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Parameter(_normal(generator, (3 * hidden, hidden), hidden**-0.5))
        self.proj = torch.nn.Parameter(_normal(generator, (hidden, hidden), out_std))

    def forward(self, x, cos, sin):
        B, T, H = x.shape
        d = H // self.heads
        qkv = linear(x, self.qkv).view(B, T, 3, self.heads, d).permute(2, 0, 3, 1, 4)  # [3, B, heads, T, d]
        q, k = apply_rotary(qkv[0], cos, sin), apply_rotary(qkv[1], cos, sin)
        o = causal_attention(q, k, qkv[2].contiguous())
        return linear(o.transpose(1, 2).reshape(B, T, H), self.proj)


class DenseFFN(torch.nn.Module):
    """SwiGLU: w1 [H, 2F] = [gate | up], w2 [F, H] (flatep.nn.shared_expert_ffn's layout and arithmetic)."""

    def __init__(self, hidden, ffn, generator, out_std):
        super().__init__()
        self.w1 = torch.nn.Parameter(_normal(generator, (hidden, 2 * ffn), hidden**-0.5))
        self.w2 = torch.nn.Parameter(_normal(generator, (ffn, hidden), out_std))

    def forward(self, x):
        return shared_expert_ffn(x, self.w1, self.w2, "swiglu")


class MoEFFN(torch.nn.Module):
    """An MoE layer (flatep.nn.MoE or AllToAllMoE) with the routing chosen here (module docstring, "Routing")."""

    def __init__(self, moe, index, args):
        super().__init__()
        self.moe, self.index = moe, index
        self.aux_coef, self.bias_scale, self.bias_ramp = args.aux_loss, args.router_bias, args.router_bias_ramp
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + 7919 * (index + 1))
        self.register_buffer("bias_dir", torch.randn(moe.num_experts, generator=g).to(moe.device), persistent=False)
        self.last_idx = None

    def bias(self, step):
        ramp = 1.0 if self.bias_ramp == 0 else min(1.0, (step + 1) / self.bias_ramp)
        return self.bias_dir * (self.bias_scale * ramp)

    def forward(self, x, step):
        weight = self.moe.router.weight
        with torch.no_grad():  # flatep.nn.route's choice: softmax of fp32 logits, top-K
            logits = x.float() @ weight.float().t()
            scores = torch.softmax(logits if self.bias_scale == 0 else logits + self.bias(step), dim=-1)
            idx = scores.topk(self.moe.topk, dim=-1).indices
        self.last_idx = idx
        out = self.moe(x, idx)
        aux = None
        if self.aux_coef > 0:
            probs = torch.softmax(x.float() @ weight.float().t(), dim=-1)
            E = self.moe.num_experts
            ones = torch.ones(idx.numel(), device=idx.device)  # counts without bincount's host synchronisation
            fraction = torch.zeros(E, device=idx.device).index_add_(0, idx.reshape(-1), ones) / idx.numel()
            aux = self.aux_coef * E * (fraction * probs.mean(0)).sum()
        return out, aux


def make_moe(args, index, group, device):
    seed = args.seed * 1000 + index
    common = dict(group=group, num_tokens=args.batch * args.seq_len, seed=seed, device=device,
                  activation="swiglu", shared_ffn=args.shared_ffn)
    if args.impl == "baseline":
        return AllToAllMoE(args.hidden, args.ffn, args.experts, args.topk, **common)
    return flatep.nn.MoE(args.hidden, args.ffn, args.experts, args.topk, align=args.align, **common)


class Block(torch.nn.Module):
    def __init__(self, args, index, group, device, generator):
        super().__init__()
        out_std = (2 * args.blocks * args.hidden) ** -0.5  # residual branches scaled down with depth (GPT-2)
        self.norm1, self.norm2 = RMSNorm(args.hidden), RMSNorm(args.hidden)
        self.attn = Attention(args.hidden, args.heads, generator, out_std)
        self.is_moe = index % 2 == 1
        if self.is_moe:
            self.ffn = MoEFFN(make_moe(args, index, group, device), index, args)
        else:
            self.ffn = DenseFFN(args.hidden, args.dense_ffn, generator, out_std)

    def forward(self, h, cos, sin, step):
        B, T, H = h.shape
        h = h + self.attn(self.norm1(h), cos, sin).float()
        x = self.norm2(h).reshape(B * T, H)
        aux = None
        if self.is_moe:
            y, aux = self.ffn(x, step)
        else:
            y = self.ffn(x)
        return h + y.float().view(B, T, H), aux


class MoETransformer(torch.nn.Module):
    """The model (module docstring). forward(tokens [B, T], targets [B, T], step) -> (loss, cross-entropy), fp32
    scalars; loss adds the load-balancing term (if any). The residual stream is fp32."""

    def __init__(self, args, group, device):
        super().__init__()
        g = torch.Generator().manual_seed(args.seed)  # the non-expert weights: the same on every rank and --impl
        self.embed = torch.nn.Parameter(_normal(g, (VOCAB, args.hidden), 1.0))
        self.blocks = torch.nn.ModuleList(Block(args, i, group, device, g) for i in range(args.blocks))
        self.norm = RMSNorm(args.hidden)
        self.head = torch.nn.Parameter(_normal(g, (VOCAB, args.hidden), args.hidden**-0.5))
        self.to(device)  # the MoE layers' expert weights are the library's memory, already there
        self.cos, self.sin = rotary_tables(args.seq_len, args.hidden // args.heads, device)

    @property
    def moe_layers(self):
        return [b.ffn for b in self.blocks if b.is_moe]

    def forward(self, tokens, targets, step):
        h = self.embed.index_select(0, tokens.reshape(-1)).view(*tokens.shape, -1)
        aux_total = None
        for block in self.blocks:
            h, aux = block(h, self.cos, self.sin, step)
            if aux is not None:
                aux_total = aux if aux_total is None else aux_total + aux
        logits = linear(self.norm(h), self.head)
        ce = F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))
        return (ce if aux_total is None else ce + aux_total), ce


# ---- one rank ----


def lr_factor(step, args):
    """Linear warm-up over --warmup steps, then cosine decay to --min-lr-ratio at the last step."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    span = max(args.steps - args.warmup, 1)
    progress = min((step - args.warmup) / span, 1.0)
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class RankState:
    """One EP rank's model, optimizers and collectives; its step is forward(), backward(), finish()."""

    def __init__(self, args, rank, num_ranks, group, device, corpus):
        self.args, self.rank, self.num_ranks, self.device, self.corpus = args, rank, num_ranks, device, corpus
        self.coll = collectives(group)
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.model = MoETransformer(args, group, device)
        experts = [p for m in self.model.moe_layers for p in m.moe.expert_parameters()]
        expert_ids = {id(p) for p in experts}
        routers = [m.moe.router.weight for m in self.model.moe_layers]
        with torch.no_grad():  # --router-temperature: W = V / T (module docstring)
            for w in routers:
                w.div_(args.router_temperature)
        router_ids = {id(p) for p in routers}
        self.replicated = [p for p in self.model.parameters() if id(p) not in expert_ids]
        decay = [p for p in self.replicated if p.dim() >= 2 and id(p) not in router_ids]
        no_decay = [p for p in self.replicated if p.dim() < 2]
        betas = (0.9, 0.95)
        self.opt_experts = MainGradOptimizer(torch.optim.AdamW, experts, lr=args.lr, betas=betas,
                                             weight_decay=args.weight_decay)
        self.opt_dense = torch.optim.AdamW(
            [dict(params=decay), dict(params=no_decay, weight_decay=0.0),
             dict(params=routers, weight_decay=0.0, lr=args.lr / args.router_temperature)],
            lr=args.lr, betas=betas, weight_decay=args.weight_decay)
        for group_ in self._groups():
            group_["base_lr"] = group_["lr"]
        self.experts = experts
        self.loss = self.ce = self.grad_norm = None
        self.events = None

    def _groups(self):
        return list(self.opt_experts.optimizer.param_groups) + list(self.opt_dense.param_groups)

    def forward(self, step, timed=False):
        """Zeroes the gradients and runs the forward of `step`; returns this rank's loss (fp32 scalar)."""
        if timed and self.stream is not None:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record(self.stream)
        self.opt_experts.zero_grad()
        self.opt_dense.zero_grad(set_to_none=True)
        inputs, targets = batch_of(self.corpus, self.args, step, self.rank)
        self.loss, self.ce = self.model(inputs.to(self.device), targets.to(self.device), step)
        return self.loss

    def backward(self):
        self.loss.backward(torch.full_like(self.loss, 1.0 / self.num_ranks))

    def finish(self, step, ready=None):
        """The data-parallel all-reduce, the clip and the optimizer step (after backward; `ready`: an event the
        rank's stream waits for first, flatep.baseline.backward's)."""
        if ready is not None:
            self.stream.wait_event(ready)
        factor = lr_factor(step, self.args)
        for group_ in self._groups():
            group_["lr"] = group_["base_lr"] * factor
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.replicated]
        expert_sq = torch.zeros(1, dtype=torch.float32, device=self.device)
        for p in self.experts:
            expert_sq += p.main_grad.pow(2).sum()
        flat = torch.cat([g.reshape(-1) for g in grads] + [expert_sq])
        self.coll.all_reduce(flat)  # one all-reduce: the replicated gradients and the experts' squared norm
        at = 0
        for p in self.replicated:
            p.grad = flat[at:at + p.numel()].view_as(p)
            at += p.numel()
        self.grad_norm = (flat[:-1].pow(2).sum() + flat[-1]).sqrt()
        if self.args.grad_clip > 0:
            coef = (self.args.grad_clip / (self.grad_norm + 1e-6)).clamp(max=1.0)
            flat[:-1].mul_(coef)
            for p in self.experts:
                p.main_grad.mul_(coef)
        self.opt_experts.step()
        self.opt_dense.step()
        if self.events is not None:
            self.events[1].record(self.stream)

    def step_time_ms(self):
        """The step's time on this rank's stream (CUDA events; after a synchronisation), or None."""
        if self.events is None:
            return None
        return self.events[0].elapsed_time(self.events[1])

    def routing(self, record_tokens):
        """Per MoE layer: (counts [E] int64 of this rank's entries, the first record_tokens ids [T, K], the rows
        each rank computed this step [R] as the layer reports them) on the host."""
        out = []
        for m in self.model.moe_layers:
            idx = m.last_idx
            counts = torch.bincount(idx.reshape(-1), minlength=m.moe.num_experts).cpu()
            moe = m.moe
            loads = moe.last_loads if isinstance(moe, AllToAllMoE) else moe.last_plan.stats["loads"]
            out.append((counts, idx[:record_tokens].cpu(), list(loads)))
        return out

    # ---- checkpoints ----

    def state_dict(self, step):
        model = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"format": CHECKPOINT_FORMAT, "step": step, "shape": shape_of(self.args, self.num_ranks),
                "impl": self.args.impl, "seed": self.args.seed, "model": model,
                "opt_experts": self.opt_experts.state_dict(), "opt_dense": self.opt_dense.state_dict(), "rng": rng,
                "data": {"bytes": self.corpus.num_bytes, "crc32": self.corpus.crc32}}

    def load_state_dict(self, state, path):
        """Restores a checkpoint of this rank (checked against this run first: one-line ValueErrors)."""
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: not a train_lm checkpoint (format {state.get('format')!r})")
        mine = shape_of(self.args, self.num_ranks)
        for key in SHAPE_KEYS:
            if state["shape"].get(key) != mine[key]:
                raise ValueError(f"{path}: the checkpoint has {key}={state['shape'].get(key)}, this run {mine[key]}")
        if state["seed"] != self.args.seed:
            raise ValueError(f"{path}: the checkpoint has seed={state['seed']}, this run {self.args.seed}")
        data = {"bytes": self.corpus.num_bytes, "crc32": self.corpus.crc32}
        if state["data"] != data:
            raise ValueError(f"{path}: the checkpoint was trained on other data ({state['data']['bytes']} bytes, CRC "
                             f"{state['data']['crc32']:08x}; this run's {data['bytes']} bytes, CRC "
                             f"{data['crc32']:08x})")
        self.model.load_state_dict(state["model"])
        self.opt_experts.load_state_dict(state["opt_experts"])
        self.opt_dense.load_state_dict(state["opt_dense"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        return int(state["step"])


def checkpoint_dir(root, step):
    return os.path.join(root, f"step_{step:06d}")


def save_rank(state, root, step):
    """Writes rank's file of the checkpoint after `step` steps (atomically: a temporary file renamed)."""
    folder = checkpoint_dir(root, step)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank_{state.rank}.pt")
    torch.save(state.state_dict(step), path + ".tmp")
    os.replace(path + ".tmp", path)


def mark_latest(root, step):
    """Points root/latest at the checkpoint of `step` (after every rank wrote its file)."""
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(os.path.basename(checkpoint_dir(root, step)) + "\n")
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))


def resume_path(root, rank):
    """The file of `rank` in checkpoint folder `root` (root/latest's step, or root itself when it is a step
    folder)."""
    latest = os.path.join(root, "latest")
    folder = root
    if os.path.isfile(latest):
        with open(latest) as f:
            folder = os.path.join(root, f.read().strip())
    path = os.path.join(folder, f"rank_{rank}.pt")
    if not os.path.isfile(path):
        raise ValueError(f"--resume {root}: no checkpoint of rank {rank} ({path} is missing)")
    return path


def load_rank(state, root):
    path = resume_path(root, state.rank)
    # A checkpoint is a pickle this script wrote (load only your own): weights_only=False, since torch 1.13's
    # weights-only unpickler refuses the optimizer state's floats (torch >= 2.6 would default to True).
    return state.load_state_dict(torch.load(path, map_location=state.device, weights_only=False), path)


def should_save(args, step_done):
    return bool(args.save) and (step_done == args.steps or (args.save_every and step_done % args.save_every == 0))


# ---- steps, either driver ----


class StepRecord:
    """What one step did, on the host: loss (the mean over ranks of the rank losses), cross-entropy, lr, gradient
    norm, per MoE layer the counts [R, E], recorded ids (list of R [T, K]) and rows per rank, per-rank step times (ms,
    CUDA events; None on the CPU) and the wall time (ms)."""

    def __init__(self, step, losses, ces, lr, grad_norm, routing, rank_ms, wall_ms):
        R = len(losses)
        self.step, self.lr, self.grad_norm = step, lr, grad_norm
        self.rank_losses = losses
        self.loss = sum(losses) / R
        self.ce = sum(ces) / R
        self.counts = [torch.stack([routing[r][l][0] for r in range(R)]) for l in range(len(routing[0]))]
        self.ids = [[routing[r][l][1] for r in range(R)] for l in range(len(routing[0]))]
        self.loads = [routing[0][l][2] for l in range(len(routing[0]))]
        self.maxvio = [maxvio(c) for c in self.counts]
        self.rank_ms, self.wall_ms = rank_ms, wall_ms
        self.memory = None  # filled by a caller that samples memory

    def line(self, args):
        rows = [v for loads in self.loads for v in loads]
        ms = max(self.rank_ms) if self.rank_ms and None not in self.rank_ms else self.wall_ms
        tokens = len(self.rank_losses) * args.batch * args.seq_len
        return (f"step {self.step + 1:4d}/{args.steps}  loss {self.loss:.4f}  lr {self.lr:.2e}  grad "
                f"{self.grad_norm:.3f}  maxvio [{' '.join(f'{m:.2f}' for m in self.maxvio)}]  rows max/mean "
                f"{max(rows)}/{sum(rows) / len(rows):.0f}  {ms:.0f} ms  {tokens / ms * 1e3:.0f} tok/s")

    def json(self):
        return {"step": self.step, "loss": self.loss, "ce": self.ce, "lr": self.lr, "grad_norm": self.grad_norm,
                "maxvio": self.maxvio, "loads": self.loads, "rank_ms": self.rank_ms, "wall_ms": self.wall_ms,
                "rank_losses": self.rank_losses}


def virtual_step(states, step, record_tokens=0, timed=False, after_forward=None):
    """One step of every virtual rank (forward and finish on the ranks' threads; backward there for FlatEP, one call
    on rank 0's thread for the baseline: flatep.baseline.backward). after_forward(): called once every rank's forward
    is enqueued (a memory sample). Returns a StepRecord."""
    R = len(states)
    t0 = time.perf_counter()
    losses = virtual.run_threads(R, lambda r: states[r].forward(step, timed))
    if after_forward is not None:
        after_forward()
    ready = None
    if states[0].args.impl == "baseline":
        ready = virtual.run_threads(R, lambda r: joint_backward(losses, 1.0 / R) if r == 0 else None)[0]
    else:
        virtual.run_threads(R, lambda r: states[r].backward())
    virtual.run_threads(R, lambda r: states[r].finish(step, ready if r else None))

    def host(r):
        st = states[r]
        if st.stream is not None:
            st.stream.synchronize()
        return (float(st.loss), float(st.ce), float(st.grad_norm), st.routing(record_tokens), st.step_time_ms())

    done = virtual.run_threads(R, host)
    wall_ms = (time.perf_counter() - t0) * 1e3
    lr = states[0].args.lr * lr_factor(step, states[0].args)
    return StepRecord(step, [d[0] for d in done], [d[1] for d in done], lr, done[0][2], [d[3] for d in done],
                      [d[4] for d in done], wall_ms)


def process_step(state, step, record_tokens=0, timed=False):
    """One step of this process's rank; every rank gets the StepRecord (its routing all-gathered)."""
    t0 = time.perf_counter()
    state.forward(step, timed)
    state.backward()
    state.finish(step)
    if state.stream is not None:
        state.stream.synchronize()
    mine = (float(state.loss), float(state.ce), float(state.grad_norm), state.routing(record_tokens),
            state.step_time_ms())
    wall_ms = (time.perf_counter() - t0) * 1e3
    done = state.coll.all_gather_object(mine)
    lr = state.args.lr * lr_factor(step, state.args)
    return StepRecord(step, [d[0] for d in done], [d[1] for d in done], lr, done[0][2], [d[3] for d in done],
                      [d[4] for d in done], wall_ms)


def _log(args, record, log_file):
    print(record.line(args), flush=True)
    if log_file is not None:
        log_file.write(json.dumps(record.json()) + "\n")
        log_file.flush()


def banner(args, num_ranks, corpus, mode):
    S = args.batch * args.seq_len
    return (f"train_lm: impl={args.impl} R={num_ranks} ({mode}) device={args.device} blocks={args.blocks} "
            f"(MoE: {args.blocks // 2}) H={args.hidden} heads={args.heads} E={args.experts} K={args.topk} "
            f"F={args.ffn} dense F={args.dense_ffn} shared={args.shared_ffn} S={S} per rank ({args.batch} x "
            f"{args.seq_len}); data: {corpus.describe()}")


def make_virtual(args, corpus, num_ranks=None):
    """R virtual ranks (one CUDA stream each on a GPU, made current once on the rank's thread) and their
    RankStates."""
    R = num_ranks or args.ranks
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    ranks = virtual.virtual_ranks(R, device)
    if device.type == "cuda":
        virtual.run_threads(R, lambda r: torch.cuda.set_stream(torch.cuda.Stream(device)))
    return virtual.run_threads(R, lambda r: RankState(args, r, R, ranks[r], device, corpus))


def train_virtual(args, corpus):
    states = make_virtual(args, corpus)
    R = len(states)
    print(banner(args, R, corpus, "virtual ranks"), flush=True)
    start = 0
    if args.resume:
        start = virtual.run_threads(R, lambda r: load_rank(states[r], args.resume))[0]
    log_file = open(args.log, "a") if args.log else None
    try:
        for step in range(start, args.steps):
            _log(args, virtual_step(states, step), log_file)
            if should_save(args, step + 1):
                virtual.run_threads(R, lambda r: save_rank(states[r], args.save, step + 1))
                mark_latest(args.save, step + 1)
    finally:
        if log_file is not None:
            log_file.close()
    return 0


def train_process(rank, num_ranks, args, corpus=None):
    """The body of one process (flatep.testing.launch: spawned or torchrun)."""
    device = torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    corpus = corpus or Corpus(args.data, args.data_pattern)
    state = RankState(args, rank, num_ranks, None, device, corpus)
    if rank == 0:
        print(banner(args, num_ranks, corpus, "processes"), flush=True)
    start = load_rank(state, args.resume) if args.resume else 0
    log_file = open(args.log, "a") if args.log and rank == 0 else None
    try:
        for step in range(start, args.steps):
            record = process_step(state, step)
            if rank == 0:
                _log(args, record, log_file)
            if should_save(args, step + 1):
                save_rank(state, args.save, step + 1)
                state.coll.barrier()
                if rank == 0:
                    mark_latest(args.save, step + 1)
    finally:
        if log_file is not None:
            log_file.close()
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        corpus = Corpus(args.data, args.data_pattern)
        if corpus.num_bytes <= args.seq_len:
            raise ValueError(f"the data has {corpus.num_bytes} bytes, fewer than --seq-len + 1 = {args.seq_len + 1}")
    except (OSError, ValueError) as e:
        sys.exit(f"train_lm: error: {e}")
    if args.virtual:
        return train_virtual(args, corpus)
    return flatep.testing.launch(train_process, args.ranks, args)


if __name__ == "__main__":
    sys.exit(main())
