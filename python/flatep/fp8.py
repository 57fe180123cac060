"""FP8 token rows (docs/design.md §6, "FP8 rows"): the library's quantisation rule in torch, bitwise equal to the C++
rule that ``Buffer.dispatch(..., fp8=True)`` applies inside its kernels (tests/python/test_fp8.py compares the bits).

    q, scales = flatep.fp8.quantize(x)                  # x [..., H] bf16, H % 128 == 0 -> q [..., H] e4m3,
                                                        # scales [..., H/128] fp32 (one per 128 channels)
    x_approx = flatep.fp8.dequantize(q, scales)         # [..., H] fp32: e4m3 value * its block's scale

The rule, per block of 128 channels of a row: amax = the largest |x| over the block's finite values (NaN and +-Inf are
left out); scale = amax / 448 in fp32 (ue8m0=True: the smallest power of two with 448 * scale >= amax), 1 when amax
is 0; q = e4m3(x * inverse) with inverse = 448 / amax (ue8m0: 1 / scale; 1 when amax is 0), one fp32 division per
block and one fp32 multiplication per value (x / scale instead in a block whose inverse overflows fp32: amax below
about 1.3e-36), then round to nearest even onto e4m3 ("fn": no infinities), with |x * inverse| >= 448 (Inf
included) saturating to +-448 and NaN giving 0x7f.

e4m3 tensors are ``torch.float8_e4m3fn`` where torch has it (2.1 and later) and ``torch.uint8`` holding the same bytes
otherwise (torch 1.13); both are accepted wherever e4m3 rows go in. Everything here is integer arithmetic on the bits
plus IEEE fp32 divisions and multiplications of tensors (never by a Python scalar: torch may turn a scalar division
into a multiplication by the reciprocal), so CPU and CUDA tensors give the same bits.
"""

import torch

BLOCK = 128
E4M3_MAX = 448.0
#: torch's e4m3 dtype, or None on a torch without one (use uint8 there).
E4M3_DTYPE = getattr(torch, "float8_e4m3fn", None)
#: dtypes accepted for e4m3 bytes.
E4M3_DTYPES = (torch.uint8,) if E4M3_DTYPE is None else (torch.uint8, E4M3_DTYPE)


def as_e4m3(q):
    """`q` (uint8 bytes) as torch's e4m3 dtype where torch has one; unchanged otherwise."""
    return q if E4M3_DTYPE is None or q.dtype == E4M3_DTYPE else q.view(E4M3_DTYPE)


def as_bytes(q):
    """e4m3 rows as uint8 bytes (a view, no copy)."""
    return q if q.dtype == torch.uint8 else q.view(torch.uint8)


def _check_rows(op, name, value, dtypes, what):
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{op}: {name} must be {allowed}, got {str(value.dtype).replace('torch.', '')}")
    if value.dim() < 1 or value.shape[-1] == 0 or value.shape[-1] % BLOCK != 0:
        last = value.shape[-1] if value.dim() >= 1 else "none (a 0-d tensor)"
        raise ValueError(f"{op}: {name}'s last dimension ({what}) must be a positive multiple of {BLOCK}, got {last}")
    return value.contiguous()


def _int32_const(value, like):
    return torch.full_like(like, value, dtype=torch.int32)


def _block_scales(amax_bits, ue8m0):
    """fp32 scales of blocks whose amax is given as bf16 magnitude bits (int32)."""
    word = amax_bits << 16  # amax as fp32 bits
    if not ue8m0:
        amax = word.view(torch.float32)
        scale = amax / torch.full_like(amax, E4M3_MAX)
    else:
        exponent_field = word >> 23
        fraction = word & 0x7FFFFF
        # A subnormal amax: normalise it. Its fraction (< 2^23) converts to fp32 exactly, whose exponent is the
        # position of the leading one.
        lead = (fraction.to(torch.float32).view(torch.int32) >> 23) - 127
        shift = (23 - lead).clamp(0, 31)
        subnormal = exponent_field == 0
        fraction = torch.where(subnormal, (fraction << shift) & 0x7FFFFF, fraction)
        exponent = torch.where(subnormal, -126 - shift, exponent_field - 127)
        e = exponent - 8 + (fraction > 0x600000).to(torch.int32)  # 448 = 1.75 * 2^8
        normal_bits = (e + 127).clamp(0, 254) << 23
        subnormal_bits = _int32_const(1, e) << (e + 149).clamp(0, 30)
        scale = torch.where(e >= -126, normal_bits, subnormal_bits).view(torch.float32)
    return torch.where(amax_bits == 0, torch.ones_like(scale), scale)


def _block_inverses(amax_bits, scales, ue8m0):
    """The multipliers of the blocks' values: 448 / amax (1 / scale with ue8m0), 1 where amax is 0; one IEEE fp32
    division of tensors each."""
    if ue8m0:
        inverse = torch.ones_like(scales) / scales
    else:
        amax = (amax_bits << 16).view(torch.float32)
        inverse = torch.full_like(amax, E4M3_MAX) / amax
    return torch.where(amax_bits == 0, torch.ones_like(inverse), inverse)


def _float_to_e4m3(v):
    """fp32 tensor -> e4m3 bytes (int32 in [0, 255]): round to nearest even, saturating, NaN -> 0x7f."""
    word = v.contiguous().view(torch.int32)
    sign = (word >> 24) & 0x80
    magnitude = word & 0x7FFFFFFF
    exponent = magnitude >> 23
    fraction = magnitude & 0x7FFFFF
    normal = exponent >= 121  # >= 2^-6
    q_normal = ((exponent - 120).clamp(min=0) << 3) | (fraction >> 20)
    significand = torch.where(exponent == 0, fraction, fraction | 0x800000)
    shift = torch.where(exponent == 0, _int32_const(140, exponent), 141 - exponent).clamp(1, 25)
    q_sub = significand >> shift
    rest_sub = significand & ((_int32_const(1, shift) << shift) - 1)
    half_sub = _int32_const(1, shift) << (shift - 1)
    q = torch.where(normal, q_normal, q_sub)
    rest = torch.where(normal, fraction & 0xFFFFF, rest_sub)
    half = torch.where(normal, _int32_const(0x80000, q), half_sub)
    q = q + ((rest > half) | ((rest == half) & ((q & 1) == 1))).to(torch.int32)
    q = torch.where(magnitude >= 0x43E00000, _int32_const(0x7E, q), q)  # |v| >= 448, Inf included
    q = sign | q
    return torch.where(magnitude > 0x7F800000, _int32_const(0x7F, q), q)  # NaN, either sign


def quantize(x, ue8m0=False):
    """Quantises bf16 rows by the library's rule (module docstring).

    Args:
        x (torch.Tensor): [..., H] bfloat16, H a positive multiple of 128 (CPU or CUDA).
        ue8m0 (bool): power-of-two scales (UE8M0-representable) instead of amax / 448.
    Returns:
        (q, scales): q [..., H] e4m3 (float8_e4m3fn, or uint8 where torch has no float8), scales [..., H/128] fp32.
    """
    x = _check_rows("quantize", "x", x, (torch.bfloat16,), "H")
    if not isinstance(ue8m0, bool):
        raise ValueError(f"quantize: ue8m0 must be a bool, got {ue8m0!r}")
    blocks = x.shape[:-1] + (x.shape[-1] // BLOCK, BLOCK)
    magnitude = (x.view(torch.int16).to(torch.int32) & 0x7FFF).view(blocks)
    amax_bits = magnitude.masked_fill(magnitude >= 0x7F80, 0).max(dim=-1).values  # NaN and Inf left out
    scales = _block_scales(amax_bits, ue8m0)
    inverses = _block_inverses(amax_bits, scales, ue8m0)
    xf = x.to(torch.float32).view(blocks)
    finite = ((inverses.view(torch.int32) & 0x7F800000) != 0x7F800000).unsqueeze(-1).expand(blocks)
    by_inverse = xf * inverses.unsqueeze(-1).expand(blocks)
    by_scale = xf / scales.unsqueeze(-1).expand(blocks)  # only where the inverse overflows (amax < ~1.3e-36)
    values = torch.where(finite, by_inverse, by_scale)
    q = _float_to_e4m3(values).to(torch.uint8).view(x.shape)
    return as_e4m3(q), scales


def _e4m3_table(device):
    values = []
    for code in range(256):
        e, m = (code >> 3) & 0xF, code & 7
        if e == 0xF and m == 7:
            values.append(float("nan"))
            continue
        magnitude = m * 2.0**-9 if e == 0 else (8 + m) * 2.0 ** (e - 10)
        values.append(-magnitude if code & 0x80 else magnitude)
    return torch.tensor(values, dtype=torch.float32, device=device)


def dequantize(q, scales, dtype=torch.float32):
    """e4m3 rows back to real values: e4m3 value * its block's scale, in fp32.

    Args:
        q (torch.Tensor): [..., H] e4m3 (float8_e4m3fn or uint8 bytes), H a positive multiple of 128.
        scales (torch.Tensor): [..., H/128] fp32.
        dtype: of the result (the product is rounded once from fp32).
    Returns:
        [..., H] tensor of `dtype`.
    """
    q = _check_rows("dequantize", "q", q, E4M3_DTYPES, "H")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        got = str(scales.dtype).replace("torch.", "") if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise ValueError(f"dequantize: scales must be a float32 tensor, got {got}")
    blocks = q.shape[:-1] + (q.shape[-1] // BLOCK, BLOCK)
    if tuple(scales.shape) != blocks[:-1]:
        want = "[" + ", ".join(str(d) for d in blocks[:-1]) + "]"
        raise ValueError(f"dequantize: scales must have shape {want}, got [{', '.join(str(d) for d in scales.shape)}]")
    values = _e4m3_table(q.device)[as_bytes(q).long()].view(blocks)
    return (values * scales.contiguous().unsqueeze(-1).expand(blocks)).view(q.shape).to(dtype)
