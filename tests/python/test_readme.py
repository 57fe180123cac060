"""README.md cannot rot: every Python and C++ block in it is either run here or is an excerpt of a file that a test
runs, the quick start runs and prints what the README shows, and the README names only what exists.

A code block is tested by the HTML comment on the line before its opening fence:

    <!-- test: run -->                           (Python) extracted and run; `; prints TEXT` also checks its output
    <!-- test: excerpt of PATH -->               the block's lines, verbatim, in PATH; lines `...` (Python) or
                                                 `// ...` (C++), with or without a comment after them, skip lines
    <!-- test: output of examples/quickstart.py -->   the quick start's output, its error figures masked

A Python or C++ block without one of these fails test_every_code_block_is_tested. examples/quickstart.py runs in
test_quickstart (and on a GPU with --device cuda: pytest -m cuda); examples/cpp/quickstart.cpp is CTest's
example.cpp_quickstart; the install commands are tests/python/test_install_venv.py's.

Reproduce: PYTHONPATH=python:build/python /usr/bin/python3 -m pytest -q tests/python/test_readme.py
"""

import glob
import os
import re
import subprocess
import sys

import pytest

import flatep
import mp_cases

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
README = os.path.join(ROOT, "README.md")
CUDA_SKIP = mp_cases.cuda_unavailable_reason()
# The docs the README links to and that link back into the tree (design.md and adding.md are checked by their owner).
LINKED_DOCS = ["README.md", "docs/performance.md", "docs/api.md", "docs/errors.md", "docs/testing.md",
               "docs/eplb.md", "benchmarks/results/LOG.md"]
MAX_LINES = 260  # a newcomer's five minutes (about 250 lines); the figures are in docs/performance.md


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def blocks():
    """[(line number, language, text, marker)] of README.md's fenced code blocks; marker: the `test:` comment on the
    line before the fence, or None."""
    lines = read("README.md").split("\n")
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        prev = lines[i - 1].strip() if i > 0 else ""
        marker = re.match(r"^<!-- test: (.*?) -->$", prev)
        found.append((i + 1, m.group(1), "\n".join(lines[i + 1 : end]), marker.group(1) if marker else None))
        i = end + 1
    return found


def env_with_flatep():
    """This process's environment, with the directories it imports flatep from on PYTHONPATH."""
    paths = [os.path.dirname(p) for p in flatep.__path__] + [os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))


def section(title):
    """The README's `## title` section (up to the next `## `)."""
    text = read("README.md")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_every_code_block_is_tested():
    untested = [f"README.md:{line} ({lang})" for line, lang, _, marker in blocks()
                if lang in ("python", "cpp") and not (marker and re.match(r"^(run\b|excerpt of \S+$)", marker))]
    assert not untested, f"code blocks with no `<!-- test: run -->` or `<!-- test: excerpt of PATH -->`: {untested}"


def excerpt_pieces(text):
    """The runs of lines between skip lines (`...` or `// ...`, optionally with a comment after)."""
    pieces, piece = [], []
    for line in text.split("\n"):
        if re.match(r"^\s*(//\s*)?\.\.\.(\s|$)", line):
            pieces.append(piece)
            piece = []
        else:
            piece.append(line)
    return [p for p in pieces + [piece] if p]


def find_lines(lines, piece, start):
    for i in range(start, len(lines) - len(piece) + 1):
        if lines[i : i + len(piece)] == piece:
            return i
    return -1


@pytest.mark.parametrize("block", [b for b in blocks() if b[3] and b[3].startswith("excerpt of ")],
                         ids=lambda b: f"line{b[0]}")
def test_excerpt_is_in_its_file(block):
    line, _, text, marker = block
    path = marker[len("excerpt of "):]
    lines, at = read(path).split("\n"), 0
    for piece in excerpt_pieces(text):
        found = find_lines(lines, piece, at)
        assert found >= 0, (f"README.md:{line}: these lines are not (or no longer, or not in this order) in {path}:\n"
                            + "\n".join(piece))
        at = found + len(piece)


@pytest.mark.parametrize("block", [b for b in blocks() if b[3] and b[3].startswith("run")], ids=lambda b: f"line{b[0]}")
def test_run_block_runs(block, tmp_path):
    line, lang, text, marker = block
    assert lang == "python", f"README.md:{line}: only Python blocks are run, got {lang!r}"
    script = tmp_path / "readme_block.py"
    script.write_text(text + "\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env_with_flatep(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"README.md:{line} failed:\n{proc.stdout}\n{proc.stderr}"
    prints = re.match(r"^run; prints (.*)$", marker)
    if prints:
        assert proc.stdout.strip() == prints.group(1), f"README.md:{line} printed {proc.stdout!r}"


def masked(text):
    return re.sub(r"\d\.\de[-+]\d\d", "<error>", text).strip()


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                        pytest.mark.skipif(CUDA_SKIP is not None, reason=f"cuda: {CUDA_SKIP}")])],
)
def test_quickstart(device):
    readme = read("README.md")
    for command in ("examples/quickstart.py", "examples/quickstart.py --device cuda"):
        assert command in readme, f"README.md no longer shows `{command}`"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py"), "--device", device],
                          env=env_with_flatep(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.strip().split("\n")
    assert out[-1].startswith("quickstart: OK"), proc.stdout
    for level in ("flatep.Buffer ", "flatep.ExpertPools ", "flatep.nn.MoE "):
        assert sum(l.startswith(level) for l in out) == 1, proc.stdout
    # exact mode: each of the two ranks computes S*K = 128 rows
    assert "rows per rank [128, 128] " in proc.stdout, proc.stdout
    if device == "cpu":
        shown = [text for _, _, text, marker in blocks() if marker == "output of examples/quickstart.py"]
        assert len(shown) == 1, "README.md shows the quick start's output once, marked `output of ...`"
        assert masked(shown[0]) == masked(proc.stdout), f"README.md shows:\n{shown[0]}\nthe quick start prints:\n" \
                                                        f"{proc.stdout}"


def test_quickstart_fails_when_a_check_fails(tmp_path):
    # The checks are real: the quick start with reduce_grad left out (replicas' gradients never reach their owners)
    # prints MISMATCH and exits 1.
    source = read("examples/quickstart.py")
    assert source.count("    pools.reduce_grad(plan, layer)") == 1
    broken = tmp_path / "quickstart.py"
    broken.write_text(source.replace("    pools.reduce_grad(plan, layer)", "    pass")
                      .replace('os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")',
                               repr(os.path.join(ROOT, "python"))))
    proc = subprocess.run([sys.executable, str(broken)], env=env_with_flatep(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "flatep.ExpertPools" in proc.stdout and "MISMATCH" in proc.stdout, proc.stdout


def public_cpp_names():
    text = "\n".join(read(os.path.relpath(p, ROOT)) for p in glob.glob(os.path.join(ROOT, "include", "flatep", "*.hpp")))
    text = re.sub(r"//[^\n]*", "", text)  # declarations, not the comments that mention other names
    names = set(re.findall(r"\b(?:class|struct|enum class|using)\s+(\w+)\s*[:{=]", text))
    names |= set(re.findall(r"\b(\w+)\s*\(", text))  # functions and methods
    names |= set(re.findall(r"\b(k[A-Z]\w*)\b", text))  # constants and enumerators
    return names


def test_cpp_section_names_only_the_public_api():
    public = public_cpp_names()
    text = section("Three levels of use")
    cpp = text[text.index("### C++") :]
    named = set(re.findall(r"flatep::(\w+)", read("README.md")))
    prose = re.sub(r"```.*?```", "", cpp, flags=re.S)
    named |= {n for n in re.findall(r"`(\w+)`", prose)}
    missing = sorted(n for n in named if n not in public)
    assert not missing, f"README.md names C++ API that include/flatep/ does not declare: {missing}"
    for internal in ("LocalHostWorld", "LocalDeviceGroup"):
        assert internal not in read("README.md"), f"{internal} is a test harness, not public API"


def test_cpp_example_uses_only_public_headers():
    includes = re.findall(r'^#include\s+[<"]([^>"]+)[>"]', read("examples/cpp/quickstart.cpp"), re.M)
    ours = [i for i in includes if "/" in i or i.endswith(".hpp")]
    assert ours and all(i.startswith("flatep/") and os.path.exists(os.path.join(ROOT, "include", i)) for i in ours), \
        ours
    cmake = read("examples/cpp/CMakeLists.txt")
    assert "add_test(NAME example.cpp_quickstart " in cmake and "add_subdirectory(examples/cpp)" in read("CMakeLists.txt")


def test_no_commit_hash_or_session_label():
    hits = [(n + 1, l) for n, l in enumerate(read("README.md").split("\n"))
            if re.search(r"\b[0-9a-f]{7,40}\b|session [0-9]", l)]
    assert not hits, f"commit hashes and session labels belong in benchmarks/results/LOG.md, not README.md: {hits}"


def test_readme_is_short():
    n = read("README.md").count("\n")
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): move details to docs/"


def env_vars_read():
    """Every FLATEP_* variable the library, its Python package and the user-facing scripts read."""
    found = set()
    for path in glob.glob(os.path.join(ROOT, "src", "**", "*.*"), recursive=True):
        with open(path, errors="replace") as f:
            found |= set(re.findall(r'(?:\bget|\bgetenv)\(\s*"(FLATEP_\w+)"', f.read()))
    for path in glob.glob(os.path.join(ROOT, "python", "flatep", "**", "*.py"), recursive=True) + \
            [os.path.join(ROOT, "setup.py")]:
        with open(path) as f:
            found |= set(re.findall(r'environ(?:\.get\(|\[)\s*["\'](FLATEP_\w+)["\']', f.read()))
    for script in ("setup.sh", "run_tests.sh", "run_demo.sh"):
        found |= set(re.findall(r"\$\{(FLATEP_\w+)", read(os.path.join("scripts", script))))
    return found


def test_every_environment_variable_is_listed():
    read_by_code = env_vars_read()
    assert {"FLATEP_TIMEOUT_S", "FLATEP_DEBUG", "FLATEP_SPAWN_TIMEOUT_S", "FLATEP_BUILD_DIR"} <= read_by_code
    listed = set(re.findall(r"`(FLATEP_\w+)`", section("Environment variables")))
    missing = sorted(v for v in read_by_code if v not in listed)
    assert not missing, f"variables the code reads that README.md's Environment variables does not list: {missing}"
    stale = sorted(v for v in listed if v not in read_by_code)
    assert not stale, f"README.md lists variables no code reads: {stale}"


@pytest.mark.parametrize("doc", LINKED_DOCS)
def test_relative_links_resolve(doc):
    base = os.path.dirname(os.path.join(ROOT, doc))
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", read(doc)):
        path = target.split("#")[0]
        if not path or re.match(r"^[a-z]+://", path):
            continue
        if not os.path.exists(os.path.normpath(os.path.join(base, path))):
            broken.append(target)
    assert not broken, f"{doc} links to files that do not exist: {broken}"


def test_every_results_row_links_its_csv_and_every_table_names_its_command():
    text = section("Results")
    rows = [l for l in text.split("\n") if l.startswith("|") and not l.startswith("|---")]
    data = [l for l in rows if not re.match(r"^\|\s*(maxvio|op|shape)", l)]
    assert len(data) >= 10, data
    for row in data:
        csvs = re.findall(r"\]\((benchmarks/results/[^)]+\.csv)\)", row)
        assert csvs, f"a results row without its CSV: {row}"
    tables = text.split("\n\n|")
    for caption in tables[:-1]:
        last = caption.strip().split("\n\n")[-1]
        assert re.search(r"`[^`]*benchmarks/[^`]*`", last), f"a results table without its command: {last}"


def test_license():
    assert read("LICENSE").startswith("MIT License\n\nCopyright (c) 2026 the FlatEP authors\n")
    assert 'license = {text = "MIT"}' in read("pyproject.toml")
    assert 'license="MIT"' in read("setup.py")
    assert "MIT, copyright the FlatEP authors" in read("README.md")
