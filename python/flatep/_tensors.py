"""Tensor plumbing: argument checks with one-line ValueErrors, and tensors over memory the C++ runtime owns."""

import ctypes
import math

import torch


INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_TIMEOUT_S = 86400.0  # one day: flatep::env::kMaxTimeoutSeconds


def number_text(value):
    """A number as the user gave it, for messages: the shortest round-trip form (0.1234567, not :g's 0.123457), without
    a trailing ".0" (2, 0.5)."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def check_int(op, name, value, accepted, low=-INT32_MAX - 1, high=INT32_MAX):
    """`value` when it is an int (not a bool) in [low, high], the range of the C++ parameter it is passed as (int32 by
    default): the C++ checks then give their own one-line messages for values inside it. Otherwise a one-line
    ValueError naming `op`, `name` and the value, with `accepted` (e.g. "in [1, 4096]") saying what the argument
    takes, instead of pybind11's multi-line TypeError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{op}: {name} must be an int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{op}: {name} must be {accepted}, got {value}")
    return value


def check_timeout(op, timeout_s):
    """`timeout_s` as a float, or None (the default: FLATEP_TIMEOUT_S); a one-line ValueError unless it is a finite
    number of seconds in (0, 86400]. NaN and infinity are errors, never "no timeout"."""
    if timeout_s is None:
        return None
    valid = not isinstance(timeout_s, bool) and isinstance(timeout_s, (int, float))
    if not valid or not 0 < timeout_s <= MAX_TIMEOUT_S:  # NaN fails the comparison
        raise ValueError(
            f"{op}: timeout_s must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}] or None, got {timeout_s!r}"
        )
    return float(timeout_s)


def cache_key(*values):
    """A key of a process-wide object cache (flatep.buffer.shared_buffer, flatep.pools.shared_pools) over constructor
    arguments: each value with its type, so that a value the constructor refuses never finds the object built from one
    equal to it (True == 1 and 8.0 == 8 in a dict): the call reaches the constructor, which raises its one-line error.
    Spellings the constructor takes as the same value (documented identities) are made one before they get here."""
    return tuple((type(v), v) for v in values)


def shape_text(shape):
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_tensor(op, name, value, dtypes, shape, device, shape_names=None):
    """Raises ValueError naming `op` and `name` unless `value` is a tensor of one of `dtypes`, of `shape` (None in a
    dimension: any size; checked by the caller) on `device`. Returns it contiguous. Every op of a step calls it for
    each tensor argument, so the accepted case builds no text and creates no device object."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    value_device = value.device
    if value_device != device and (value_device.type != device.type or device.type == "cuda"):
        raise ValueError(
            f"{op}: {name} is on {value_device}, but this object runs on {device} "
            + ("(the CPU backend: host memory); pass CPU tensors" if device.type == "cpu" else "")
        )
    if value.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{op}: {name} must be {allowed}, got {str(value.dtype).replace('torch.', '')}")
    got = value.shape  # a torch.Size: equal to a tuple of the same sizes (the common case, no None in shape)
    if got != shape and (len(got) != len(shape) or any(e is not None and e != d for e, d in zip(shape, got))):
        expected = shape_names if shape_names is not None else shape_text(shape)
        raise ValueError(f"{op}: {name} must have shape {expected}, got {shape_text(got)}")
    return value if value.is_contiguous() else value.contiguous()


def address(tensor):
    """Data pointer of a tensor as the int the binding takes; 0 for None."""
    return 0 if tensor is None else tensor.data_ptr()


_ELEMENT_BYTES = {torch.bfloat16: 2, torch.float32: 4, torch.int32: 4, torch.int16: 2, torch.uint8: 1}
_STORAGE_DTYPE = {torch.bfloat16: torch.int16}  # dtypes neither torch.frombuffer nor the array interface takes
if hasattr(torch, "float8_e4m3fn"):  # torch >= 2.1: e4m3 weights as their own dtype (bytes underneath)
    _ELEMENT_BYTES[torch.float8_e4m3fn] = 1
    _STORAGE_DTYPE[torch.float8_e4m3fn] = torch.uint8


class _CudaArray:
    """__cuda_array_interface__ over a device pointer (int16 for bf16: the interface has no bf16 typestr)."""

    def __init__(self, ptr, shape, typestr):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False), "version": 2}


def tensor_at(ptr, shape, dtype, device=torch.device("cpu"), owner=None):
    """A tensor of `shape` and `dtype` over `ptr` (memory owned by the C++ runtime; no copy). `owner` is kept
    referenced by the tensor object; views derived from the tensor do not keep it, so keep the owner alive."""
    numel = math.prod(shape)
    nbytes = numel * _ELEMENT_BYTES[dtype]
    storage_dtype = _STORAGE_DTYPE.get(dtype, dtype)
    if device.type == "cpu":
        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
        tensor = torch.frombuffer(raw, dtype=storage_dtype, count=numel)
    else:
        typestr = {torch.int16: "<i2", torch.float32: "<f4", torch.int32: "<i4", torch.uint8: "|u1"}[storage_dtype]
        tensor = torch.as_tensor(_CudaArray(ptr, (numel,), typestr), device=device)
    tensor = tensor.view(dtype).view(shape)
    if owner is not None:
        tensor._flatep_owner = owner
    return tensor
