"""FlatEP: expert-parallel dispatch/combine with redundant experts, so every rank receives the same number of rows.

The package wraps the torch-free C++ runtime (``flatep._C``, built by CMake with ``-DFLATEP_BUILD_PYTHON=ON`` or by
``pip install .``). Main entry points:

* :class:`flatep.Buffer` -- per-layer communication object: ``plan``, ``dispatch``, ``combine`` (autograd-aware).
* :class:`flatep.ExpertPools` / :class:`flatep.ExpertLayer` -- expert weights with slot/reduce pools,
  ``prefetch`` and ``reduce_grad``; compute views are torch tensors over the C++ memory.
* :class:`flatep.nn.MoE` -- a complete MoE layer (router, experts on ExpertPools, grouped GEMM, combine).
* :class:`flatep.optim.MainGradOptimizer` -- fp32 master weights for the experts' bf16 parameters and main_grad.
* :mod:`flatep.testing` -- routing generator, ``maxvio`` and a dense single-process MoE reference.
"""

import pkgutil as _pkgutil

# The compiled extension may live in a separate directory (a CMake build: <build>/python/flatep/_C*.so) while this
# source package lives in python/flatep: join every `flatep` directory on sys.path into one package.
__path__ = _pkgutil.extend_path(__path__, __name__)

try:
    from . import _C  # noqa: E402
except ImportError as _error:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "flatep: the compiled extension flatep._C was not found or failed to load "
        f"({_error}). Build it with `cmake -S . -B build -DFLATEP_BUILD_PYTHON=ON && cmake --build build "
        "--target flatep_python` and put build/python on PYTHONPATH, or run `pip install .`."
    ) from _error

from .buffer import Buffer, Plan  # noqa: E402
from .pools import ExpertLayer, ExpertPools  # noqa: E402
from . import nn, optim, testing  # noqa: E402

__all__ = ["Buffer", "Plan", "ExpertPools", "ExpertLayer", "nn", "optim", "testing"]
__version__ = "0.1.0"
