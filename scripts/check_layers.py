#!/usr/bin/env python3
"""Checks every #include of src/ (and include/) against the layer table of docs/design.md §10, and the table against
the includes; and that bindings/, tools/ and benchmarks/ include only the public headers, the one internal API
header (src/internal/api.hpp) and their own files.

The table is the ```layers block of docs/design.md: one line per folder of src/, then the folders its files include
besides their own and the public headers (include/flatep/): exactly the arrows of the picture. An include of a folder
not on the line is a violation, and so is a folder on the line that no file of the folder includes (an arrow that does
not exist). CMakeLists.txt builds the same table into the links of the targets (a target sees every floor below it);
this check also sees what the build cannot: an include of a floor below that is not an arrow, headers compiled only by
the targets of floors above their own (src/ops is headers only), includes that climb out of their folder with "..",
and code under an #if the current build does not compile.

Prints one line per violation ("file:line: ...") and exits 1 when there is any; exits 0 otherwise.

  scripts/check_layers.py                 the tree this script is in
  scripts/check_layers.py --root DIR      another tree (DIR/src, DIR/include, DIR/docs/design.md)
"""

import argparse
import os
import re
import sys

EXTENSIONS = (".cpp", ".hpp", ".cu", ".cuh")
PUBLIC = "flatep"  # include/flatep/: every folder may include it
# The folders outside src/ held to the public headers, the one internal API header and their own files.
OUTSIDE = ("bindings", "tools", "benchmarks")
INTERNAL_API = "internal/api.hpp"
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.MULTILINE)
BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)


def read_table(design_path):
    """The layers block as {folder: [folders it may include]}, in the order written; raises ValueError when absent."""
    with open(design_path, encoding="utf-8") as f:
        text = f.read()
    match = re.search(r"^```layers\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    if match is None:
        raise ValueError(f"{design_path}: no ```layers block (section 10)")
    table = {}
    for number, line in enumerate(match.group(1).splitlines(), 1):
        if not line.strip():
            continue
        m = re.fullmatch(r"([a-z_]+):((?:\s+[a-z_]+)*)\s*", line)
        if m is None:
            raise ValueError(f"{design_path}: layers line {number} is not 'folder: folder...': {line!r}")
        if m.group(1) in table:
            raise ValueError(f"{design_path}: layers line {number}: {m.group(1)} has a line already")
        table[m.group(1)] = m.group(2).split()
    return table


def table_errors(table):
    """What makes the table unusable by the build: unknown names, a folder naming itself, a cycle of arrows."""
    errors = []
    for folder, below in table.items():
        for name in below:
            if name not in table:
                errors.append(f"layers table: {folder} names {name}, which has no line")
            elif name == folder:
                errors.append(f"layers table: {folder} names itself (a cycle)")
    # A cycle through several folders: depth-first, each cycle reported once from its first folder in the table.
    state = {}  # folder -> "open" while on the path, "done" after

    def visit(folder, path):
        state[folder] = "open"
        for name in table.get(folder, []):
            if name == folder or name not in table:
                continue
            if state.get(name) == "open":
                cycle = path[path.index(name):] + [name]
                errors.append(f"layers table: a cycle: {' -> '.join(cycle)}")
            elif name not in state:
                visit(name, path + [name])
        state[folder] = "done"

    for folder in table:
        if folder not in state:
            visit(folder, [folder])
    return errors


def source_files(top):
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(EXTENSIONS):
                yield os.path.join(dirpath, name)


def includes(path):
    """(line number, delimiter, name) of each #include in the file, block comments skipped."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    # Blank block comments out, keeping their newlines so line numbers stay right.
    text = BLOCK_COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    for m in INCLUDE.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)


def includes_within(root, path, out):
    """(line number, delimiter, name) of each #include of the file except those that climb out of their folder with
    "..", which go into `out` as violations."""
    rel = os.path.relpath(path, root)
    for line, delimiter, name in includes(path):
        if ".." in name.split("/"):
            out.append(f"{rel}:{line}: includes \"{name}\", which climbs out of its folder with '..' (the build "
                       f"cannot see it): write it from the folder, as \"<folder>/...\"")
            continue
        yield line, delimiter, name


def check_file(root, path, owner, allowed, folders, used=None):
    """Violations of one file of folder `owner` (None: include/, which may include only the public headers). The
    folders it includes go into `used` (a set), when given."""
    rel = os.path.relpath(path, root)
    src = os.path.join(root, "src")
    what = owner if owner is not None else "include/"
    may = " ".join(allowed) if allowed else "nothing"
    out = []
    for line, delimiter, name in includes_within(root, path, out):
        parts = name.split("/")
        target = None
        if delimiter == '"' and os.path.isfile(os.path.join(os.path.dirname(path), name)):
            # The compiler looks beside the including file first: the include stays in the file's own folder.
            resolved = os.path.relpath(os.path.join(os.path.dirname(path), name), src)
            target = resolved.split(os.sep)[0]
        elif parts[0] in folders:
            target = parts[0]
        if target is None or target == owner:
            continue  # the public headers, the own folder, or a system / third-party header
        if used is not None:
            used.add(target)
        if target not in allowed:
            out.append(f"{rel}:{line}: {what} may not include {target} (\"{name}\"); {what} may include: {may} "
                       f"(docs/design.md §10)")
    return out


def check_outside(root, path, top):
    """Violations of one file under the folder `top` outside src/ (OUTSIDE): a quoted include must be a public header,
    the internal API header, or a file of its own tree (beside it, or from `top`); angle brackets are system and
    third-party headers."""
    rel = os.path.relpath(path, root)
    out = []
    for line, delimiter, name in includes_within(root, path, out):
        if delimiter == "<" or name.split("/")[0] == PUBLIC or name == INTERNAL_API:
            continue
        if os.path.isfile(os.path.join(os.path.dirname(path), name)) or os.path.isfile(os.path.join(root, top, name)):
            continue  # its own tree
        out.append(f"{rel}:{line}: {top}/ may include only the public headers (flatep/...), the internal API "
                   f"(\"{INTERNAL_API}\") and its own files, not \"{name}\" (docs/design.md §10)")
    return out


def check(root, design):
    try:
        table = read_table(design)
    except (OSError, ValueError) as e:
        return [str(e)], 0
    violations = table_errors(table)
    src = os.path.join(root, "src")
    present = sorted(d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d)))
    violations += [f"src/{d}: no line in the layers table of docs/design.md §10" for d in present if d not in table]
    violations += [f"layers table: {d} has a line but src/{d} does not exist" for d in table if d not in present]
    num_files = 0
    for folder in present:
        used = set()
        for path in source_files(os.path.join(src, folder)):
            num_files += 1
            violations += check_file(root, path, folder, table.get(folder, []), table, used)
        for name in table.get(folder, []):
            if name in table and name != folder and name not in used:
                violations.append(f"layers table: {folder} names {name}, but no file of src/{folder} includes "
                                  f"src/{name}: an arrow that does not exist (remove it from {folder}'s line)")
    public = os.path.join(root, "include")
    if os.path.isdir(public):
        for path in source_files(public):
            num_files += 1
            violations += check_file(root, path, None, [], table)
    for top in OUTSIDE:
        if os.path.isdir(os.path.join(root, top)):
            for path in source_files(os.path.join(root, top)):
                num_files += 1
                violations += check_outside(root, path, top)
    return violations, num_files


def main(argv=None):
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=here, help="the tree to check (default: this script's)")
    parser.add_argument("--design", help="the file holding the layers block (default: ROOT/docs/design.md)")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.root)
    violations, num_files = check(root, args.design or os.path.join(root, "docs", "design.md"))
    for v in violations:
        print(v)
    if violations:
        print(f"check_layers: {len(violations)} violation(s) of the layers of docs/design.md §10", file=sys.stderr)
        return 1
    print(f"check_layers: the includes of {num_files} files follow the layers of docs/design.md §10")
    return 0


if __name__ == "__main__":
    sys.exit(main())
