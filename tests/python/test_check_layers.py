"""scripts/check_layers.py passes on this tree and fails, one line per violation naming the file, the line and both
folders, on a tree with a forbidden include (docs/design.md §10).

Reproduce: /usr/bin/python3 -m pytest -q tests/python/test_check_layers.py
"""

import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "check_layers.py")

TABLE = """# Design

## 10. Layers

```layers
common:
ops:       common
host:      ops common
transport: common
```
"""


def check_layers(*args):
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_tree(tmp_path, table=TABLE):
    """A tree that follows TABLE: host includes ops and common, ops includes common, the public header everywhere."""
    write(tmp_path / "docs" / "design.md", table)
    write(tmp_path / "include" / "flatep" / "types.hpp", "#pragma once\n#include <cstdint>\n")
    write(tmp_path / "src" / "common" / "check.hpp", '#pragma once\n#include "flatep/types.hpp"\n')
    write(tmp_path / "src" / "ops" / "args.hpp", '#pragma once\n#include "common/check.hpp"\n')
    write(tmp_path / "src" / "host" / "op.hpp", '#pragma once\n#include "ops/args.hpp"\n')
    write(tmp_path / "src" / "host" / "op.cpp", '#include "host/op.hpp"\n\n#include "common/check.hpp"\n'
          '#include "op.hpp"\n#include <vector>\n')
    write(tmp_path / "src" / "transport" / "memory.hpp", '#pragma once\n#include "common/check.hpp"\n')
    return tmp_path


def test_real_tree_passes():
    rc, out, err = check_layers()
    assert rc == 0, out + err
    assert "follow the layers" in out, out


def test_fake_tree_passes(tmp_path):
    rc, out, err = check_layers("--root", str(fake_tree(tmp_path)))
    assert rc == 0, out + err
    assert "the includes of 6 files follow" in out, out


def test_forbidden_include_fails_naming_file_line_and_folders(tmp_path):
    root = fake_tree(tmp_path)
    # A .cuh under a subfolder, the include under an #if: the check reads the text, whatever a build compiles.
    write(root / "src" / "host" / "detail" / "twin.cuh",
          '#pragma once\n#include "ops/args.hpp"\n#if defined(X)\n#include "transport/memory.hpp"\n#endif\n')
    rc, out, err = check_layers("--root", str(root))
    assert rc == 1, out + err
    assert out.splitlines() == [
        'src/host/detail/twin.cuh:4: host may not include transport ("transport/memory.hpp"); host may include: '
        "ops common (docs/design.md §10)"
    ]
    assert "1 violation(s)" in err, err


def test_upward_include_of_a_header_only_folder_fails(tmp_path):
    root = fake_tree(tmp_path)
    # ops is headers only: no target of its own compiles this, host's (which may include host/) would.
    write(root / "src" / "ops" / "args.hpp", '#pragma once\n#include "common/check.hpp"\n#include "host/op.hpp"\n')
    rc, out, _ = check_layers("--root", str(root))
    assert rc == 1
    assert out.splitlines() == [
        'src/ops/args.hpp:3: ops may not include host ("host/op.hpp"); ops may include: common (docs/design.md §10)'
    ]


def test_include_climbing_with_dotdot_fails(tmp_path):
    root = fake_tree(tmp_path)
    write(root / "src" / "transport" / "memory.cpp", '#include "../host/op.hpp"\n')
    rc, out, _ = check_layers("--root", str(root))
    assert rc == 1
    assert out.startswith('src/transport/memory.cpp:1: includes "../host/op.hpp", which climbs out of its folder'), out


def test_commented_out_include_is_not_an_include(tmp_path):
    root = fake_tree(tmp_path)
    write(root / "src" / "transport" / "memory.cpp", '/* old:\n#include "host/op.hpp"\n*/\n// #include "host/op.hpp"\n')
    rc, out, err = check_layers("--root", str(root))
    assert rc == 0, out + err


def test_public_headers_may_include_no_folder(tmp_path):
    root = fake_tree(tmp_path)
    write(root / "include" / "flatep" / "api.hpp", '#pragma once\n#include "common/check.hpp"\n')
    rc, out, _ = check_layers("--root", str(root))
    assert rc == 1
    assert out.splitlines() == [
        'include/flatep/api.hpp:2: include/ may not include common ("common/check.hpp"); include/ may include: '
        "nothing (docs/design.md §10)"
    ]


def test_table_errors(tmp_path):
    # A folder without a line, a line without a folder, a name without a line.
    table = TABLE.replace("transport: common\n", "gpu: common\n").replace("host:      ops common", "host: ops common net")
    rc, out, _ = check_layers("--root", str(fake_tree(tmp_path, table)))
    assert rc == 1
    lines = out.splitlines()
    assert "src/transport: no line in the layers table of docs/design.md §10" in lines
    assert "layers table: gpu has a line but src/gpu does not exist" in lines
    assert "layers table: host names net, which has no line" in lines


def test_a_floor_below_that_is_not_an_arrow_is_refused(tmp_path):
    # host's line names ops only: its include of common, a floor below it that the build lets it see through ops,
    # is not an arrow of the picture.
    table = TABLE.replace("host:      ops common", "host:      ops")
    rc, out, _ = check_layers("--root", str(fake_tree(tmp_path, table)))
    assert rc == 1
    assert out.splitlines() == [
        'src/host/op.cpp:3: host may not include common ("common/check.hpp"); host may include: ops '
        "(docs/design.md §10)"
    ]


def test_an_arrow_no_file_uses_is_refused(tmp_path):
    # transport names ops, which none of its files includes: the picture would allow a dependency that does not exist.
    table = TABLE.replace("transport: common", "transport: ops common")
    rc, out, _ = check_layers("--root", str(fake_tree(tmp_path, table)))
    assert rc == 1
    assert out.splitlines() == [
        "layers table: transport names ops, but no file of src/transport includes src/ops: an arrow that does not "
        "exist (remove it from transport's line)"
    ]


def test_cycle_and_missing_block(tmp_path):
    table = TABLE.replace("common:\n", "common:    ops\n")
    rc, out, _ = check_layers("--root", str(fake_tree(tmp_path, table)))
    assert rc == 1
    assert "layers table: a cycle: common -> ops -> common" in out.splitlines(), out
    # Through three folders (and host's own arrow to common, a second cycle): each reported once.
    table = TABLE.replace("common:\n", "common:    host\n")
    rc, out, _ = check_layers("--root", str(fake_tree(tmp_path, table)))
    assert rc == 1
    assert [l for l in out.splitlines() if "cycle" in l] == [
        "layers table: a cycle: common -> host -> ops -> common",
        "layers table: a cycle: common -> host -> common",
    ], out
    write(tmp_path / "docs" / "design.md", "# Design\n")
    rc, out, _ = check_layers("--root", str(tmp_path))
    assert rc == 1
    assert out.strip().endswith("no ```layers block (section 10)"), out


def test_bindings_and_tools_include_only_the_public_headers_and_the_internal_api(tmp_path):
    root = fake_tree(tmp_path)
    write(root / "src" / "internal" / "api.hpp", '#pragma once\n#include "common/check.hpp"\n')
    write(root / "docs" / "design.md", TABLE.replace("transport: common\n", "transport: common\ninternal:  common\n"))
    write(root / "tools" / "json.hpp", "#pragma once\n")
    write(root / "tools" / "plan.cpp", '#include <vector>\n#include "flatep/types.hpp"\n#include "internal/api.hpp"\n'
          '#include "json.hpp"\n')
    write(root / "bindings" / "python" / "module.cpp", '#include <pybind11/pybind11.h>\n#include "internal/api.hpp"\n')
    rc, out, err = check_layers("--root", str(root))
    assert rc == 0, out + err
    # An internal header besides the internal API, and a file of another tree.
    write(root / "tools" / "demo.cpp", '#include "ops/args.hpp"\n#include "gpu_harness.hpp"\n')
    rc, out, _ = check_layers("--root", str(root))
    assert rc == 1
    assert out.splitlines() == [
        'tools/demo.cpp:1: tools/ may include only the public headers (flatep/...), the internal API '
        '("internal/api.hpp") and its own files, not "ops/args.hpp" (docs/design.md §10)',
        'tools/demo.cpp:2: tools/ may include only the public headers (flatep/...), the internal API '
        '("internal/api.hpp") and its own files, not "gpu_harness.hpp" (docs/design.md §10)',
    ]
