"""Makes `import flatep` work from a source checkout when it is not importable yet: python/ (the package) and
<build>/python (the compiled extension; FLATEP_BUILD_DIR, default `build`) go on sys.path. Spawned test processes
inherit sys.path (and the environment set below)."""

import importlib.util
import os
import sys

import pytest

try:  # Debian's python3-hypothesis (scripts/setup.sh); a machine without it (the device machine) skips test_prop_*.py
    from hypothesis import settings
except ImportError:
    settings = None
if settings is not None:
    # The property tests (test_prop_*.py): the same examples on every run (a failure reproduces with the command in
    # the test file's docstring), no example database written into the tree, no per-example deadline (2 shared
    # cores); each test sets its own max_examples.
    settings.register_profile("flatep", derandomize=True, database=None, deadline=None)
    settings.load_profile("flatep")

# Read when the CUDA driver starts, which a test module's import may do (torch.cuda.is_available()): set here, before
# any of them, so that virtual ranks' streams never share a hardware queue (flatep.virtual's docstring says why).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
# Tests that drive virtual ranks in this process are not a user's environment: load CUDA modules eagerly, so that the
# first launch of a torch kernel between two ranks' ops cannot wait for a rank spinning on its peer (issue 46; seen
# on the H200 as the first serving test of a pytest process timing out). The tests of a user's environment
# (test_gpu_virtual.py, test_gpu_robustness.py) run children with the variable removed or set explicitly.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

if importlib.util.find_spec("flatep") is None:
    build = os.environ.get("FLATEP_BUILD_DIR", "build")
    for path in (os.path.join(ROOT, build, "python"), os.path.join(ROOT, "python")):
        if os.path.isdir(path) and path not in sys.path:
            sys.path.insert(0, path)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA GPU and FlatEP built with CUDA (skipped with the reason elsewhere); -m cuda "
        "selects only these"
    )


@pytest.fixture
def fresh_caches():
    """The process's shared Buffers, pools and transports dropped before and after the test (flatep.testing
    .release_all): a test that counts on what is cached, or leaves objects behind, starts from empty caches."""
    from flatep import testing

    testing.release_all()
    yield
    testing.release_all()
