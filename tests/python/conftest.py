"""Makes `import flatep` work from a source checkout when it is not importable yet: python/ (the package) and
<build>/python (the compiled extension; FLATEP_BUILD_DIR, default `build`) go on sys.path. Spawned test processes
inherit sys.path."""

import importlib.util
import os
import sys

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
