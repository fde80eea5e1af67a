"""The house's rules: no module over 400 lines of code and no function over 80 in kvdemo/, app.py and benchmarks/
(long modules and functions hide several concepts; cut them by concept; docstrings, comments and blank lines do not
count, so nothing is trimmed of its explanation to fit); imports point down the package order of
docs/DESIGN.md, read from every import (inside functions and under `if TYPE_CHECKING:` too), with no cycle; and
every name is imported from the one module that defines it.

Cost: 10 s in a pytest-xdist worker on 2 cores (2026-12-04): it parses every module of kvdemo/, tests/ and the
notebooks."""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE_LINES = 400
FUNCTION_LINES = 80

LEFT_OVER: dict[str, int] = {
    # what is still over the limit, with its size today: it may shrink, never grow
}


def _sources() -> list[Path]:
    paths = sorted((ROOT / "kvdemo").rglob("*.py")) + [ROOT / "app.py"] + sorted((ROOT / "benchmarks").rglob("*.py"))
    return [p for p in paths if "__pycache__" not in p.parts]


def code_lines(text: str) -> set[int]:
    """The numbers of the lines of `text` that hold code: not blank, not only a comment, not in a docstring (a
    string standing alone as a statement: a module's, class's or function's docstring, or an attribute's after
    its assignment)."""
    tree = ast.parse(text)
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docs.update(range(node.lineno, node.end_lineno + 1))
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    skipped |= {tokenize.ENCODING, tokenize.ENDMARKER}
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in skipped:
            code.update(range(token.start[0], token.end[0] + 1))
    return code - docs


def sizes() -> dict[str, int]:
    """Lines of code (`code_lines`) per module (`path`) and per function or method (`path:name`), for every source
    under the rule."""
    out = {}
    for path in _sources():
        name = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        code = code_lines(text)
        out[name] = len(code)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{name}:{node.name}"
                lines = len(code & set(range(node.lineno, node.end_lineno + 1)))
                out[key] = max(out.get(key, 0), lines)
    return out


def test_code_lines_leave_out_docstrings_comments_and_blank_lines():
    text = 'X = 1\n"""X\'s docstring,\non two lines."""\n\n\n'
    text += 'def f(a):\n    """Doc."""\n    # a comment\n    return (a +\n        1)  # tail\n'
    assert code_lines(text) == {1, 6, 9, 10}


def test_no_module_or_function_over_the_limit():
    over = {}
    for key, lines in sizes().items():
        limit = FUNCTION_LINES if ":" in key else MODULE_LINES
        if lines > max(limit, LEFT_OVER.get(key, 0)):
            over[key] = lines
    assert not over, f"over {MODULE_LINES} lines a module or {FUNCTION_LINES} a function: {over}"


def test_the_left_over_list_is_current():
    found = sizes()
    stale = {k: found.get(k) for k in LEFT_OVER if found.get(k, 0) <= (FUNCTION_LINES if ":" in k else MODULE_LINES)}
    assert not stale, f"these are within the limit now; drop them from LEFT_OVER: {stale}"


PACKAGE_ORDER: tuple[tuple[str, ...], ...] = (
    ("app", "kvdemo.__main__"),
    ("kvdemo.ui", "kvdemo.cli"),
    ("kvdemo.serve",),
    ("kvdemo.compare", "kvdemo.needle"),
    ("kvdemo.evals",),
    ("kvdemo.charts",),
    ("kvdemo.qa",),
    ("kvdemo.cache",),
    ("kvdemo.checks", "kvdemo.paths", "kvdemo.quiet"),
)
"""docs/DESIGN.md, "The package order": a module may import its own package and the packages on the floors below
its own, never one beside it or above. `kvdemo` (the public face, `kvdemo/__init__.py`) is read from outside only."""


def _modules() -> dict[str, Path]:
    """Every module of the package and app.py, by dotted name (a package by its name, from its `__init__.py`)."""
    modules = {"app": ROOT / "app.py"}
    for path in (ROOT / "kvdemo").rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[int, str, tuple[str, ...]]]:
    """Every kvdemo import of `path`, wherever it stands (module level, inside a function, under
    `if TYPE_CHECKING:`): (line, the module imported, the names taken). `from package import module` imports the
    module, not the package's face."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == "kvdemo"
        ):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.append((node.lineno, sub, ()) if sub in modules else (node.lineno, node.module, (alias.name,)))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, ()) for a in node.names if a.name.split(".")[0] == "kvdemo"]
    return out


def _floor(module: str) -> int:
    """The floor of `module` in `PACKAGE_ORDER` (0 = the top)."""
    for floor, packages in enumerate(PACKAGE_ORDER):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return floor
    raise AssertionError(f"{module} is on no floor of PACKAGE_ORDER: add its package there and to docs/DESIGN.md")


def _package(module: str) -> str:
    return next(p for packages in PACKAGE_ORDER for p in packages if module == p or module.startswith(p + "."))


def test_imports_point_down_the_package_order():
    modules = _modules()
    wrong = []
    for name, path in sorted(modules.items()):
        if name == "kvdemo":
            continue  # the public face hands names on to the outside
        for line, target, _ in _imports(path, modules):
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if target == "kvdemo":
                wrong.append(f"{where} (the public face; import the module that defines the name)")
            elif _package(target) != _package(name) and _floor(target) <= _floor(name):
                wrong.append(f"{where} (floor {_floor(target)} from floor {_floor(name)})")
    assert not wrong, "imports that do not point down the package order:\n" + "\n".join(wrong)


CACHE_ROOMS: tuple[tuple[str, ...], ...] = (
    ("kvdemo.cache.state",),
    ("kvdemo.cache.catalogue", "kvdemo.cache.warmup"),
    ("kvdemo.cache.spec",),
    ("kvdemo.cache.registry",),
    ("kvdemo.cache.formats",),
    ("kvdemo.cache.layers",),
    (
        "kvdemo.cache.backend",
        "kvdemo.cache.deploy",
        "kvdemo.cache.layouts",
        "kvdemo.cache.options",
        "kvdemo.cache.model",
    ),
    ("kvdemo.cache.layer_plan", "kvdemo.cache.policies", "kvdemo.cache.read"),
)
"""docs/DESIGN.md, "The rooms of kvdemo.cache": a module of `kvdemo.cache` may import the rooms on its own floor and on
the floors below, never one above. A format's card and what a model config says share a floor (a card's rules take a
model's geometry; a spec's checks on a model read the card's rules, named for the type checker only); the decode
kernel (`read`) imports no other room."""


def _cache_floor(module: str) -> int | None:
    """The floor of a `kvdemo.cache` module in `CACHE_ROOMS`, None for the package's face."""
    for floor, rooms in enumerate(CACHE_ROOMS):
        if any(module == room or module.startswith(room + ".") for room in rooms):
            return floor
    if module == "kvdemo.cache":
        return None
    raise AssertionError(f"{module} is in no room of CACHE_ROOMS: add it there and to docs/DESIGN.md")


def test_the_cache_rooms_import_down_their_order():
    modules = _modules()
    wrong = []
    for name, path in sorted(modules.items()):
        if not name.startswith("kvdemo.cache.") or (here := _cache_floor(name)) is None:
            continue
        for line, target, _ in _imports(path, modules):
            there = _cache_floor(target) if target.startswith("kvdemo.cache.") else None
            if there is not None and there < here:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} (floor {there} from floor {here})")
    assert not wrong, "imports that point up the rooms of kvdemo.cache:\n" + "\n".join(wrong)


def test_each_package_map_names_its_modules():
    """Each package of kvdemo says in its `__init__` docstring what each of its modules and folders holds: every one
    is named there (`name`); the format folders are listed by the registry's `FORMATS` instead, each folder there
    once, so that adding a format is its folder and that one line (a format folder's own modules are its card's)."""
    from kvdemo.cache.registry import FORMATS

    formats = ROOT / "kvdemo" / "cache" / "formats"
    unnamed = []
    for init in sorted((ROOT / "kvdemo").rglob("__init__.py")):
        if init.parent.parent == formats:
            continue
        named = set(re.findall(r"`(\w+)", ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""))
        parts = [p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"]
        if init.parent != formats:
            parts += [d.name for d in init.parent.iterdir() if (d / "__init__.py").is_file()]
        unnamed += [f"{init.parent.relative_to(ROOT)}/{part}" for part in sorted(parts) if part not in named]
    assert not unnamed, f"modules their package's map does not name: {unnamed}"
    folders = sorted(d.name for d in formats.iterdir() if (d / "__init__.py").is_file())
    assert folders == sorted(FORMATS) and len(set(FORMATS)) == len(FORMATS), f"folders {folders}, FORMATS {FORMATS}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle of `graph` (module -> the modules it imports), as the modules along it back to the first, or
    None: a depth-first search that marks each module done once (linear in the imports; following every simple path
    instead took 28 s once the server's door joined the graph)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done (no cycle through it)
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_imports_point_one_way():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    modules = _modules()
    graph = {
        name: {t for _, t, _ in _imports(path, modules) if t in modules and t != name} for name, path in modules.items()
    }
    graph["kvdemo"] = set()  # the public face is imported by no module of the package (the test above)
    cycle = find_cycle(graph)
    assert cycle is None, f"an import cycle: {' -> '.join(cycle or [])}"


def _defined(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments; also inside a top-level
    `if`, such as `if TYPE_CHECKING:` and its `else`, or a top-level `try`, such as an optional import's), not those it
    imports."""
    names = set()
    nodes = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If):
            nodes += node.body + node.orelse
        elif isinstance(node, ast.Try):
            nodes += node.body + [n for h in node.handlers for n in h.body] + node.orelse + node.finalbody
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _python_of_the_tree() -> list[tuple[Path, str]]:
    """Every Python source of the project (kvdemo, app.py, tests, benchmarks, scripts) and the notebooks' code."""
    out = []
    for folder in ("kvdemo", "tests", "benchmarks", "scripts"):
        out += [(p, p.read_text(encoding="utf-8")) for p in sorted((ROOT / folder).rglob("*.py"))]
    out.append((ROOT / "app.py", (ROOT / "app.py").read_text(encoding="utf-8")))
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        out.append((notebook, "\n".join(line for line in code.splitlines() if not line.lstrip().startswith("%"))))
    return out


def test_every_name_has_one_home():
    """No re-export shims: `from kvdemo.x.y import name` takes `name` from the module that defines it, everywhere
    (kvdemo, tests, benchmarks, scripts, notebooks). Only a package's face (`__init__.py`) hands names on, and the
    modules of kvdemo import from modules, not from faces."""
    modules = _modules()
    faces = {name for name, path in modules.items() if path.name == "__init__.py"}
    wrong = []
    for path, code in _python_of_the_tree():
        inside = path.is_relative_to(ROOT / "kvdemo")
        tree_path = path.with_suffix(".py").relative_to(ROOT)
        for node in ast.walk(ast.parse(code)):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvdemo")):
                continue
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    continue  # a module
                where = f"{tree_path}:{node.lineno}: {node.module}.{alias.name}"
                if node.module in faces:
                    if inside and path.name != "__init__.py":
                        wrong.append(f"{where} (inside kvdemo, import from the module that defines it)")
                elif node.module not in modules:
                    wrong.append(f"{where} (no such module)")
                elif alias.name not in _defined(modules[node.module]):
                    wrong.append(f"{where} (not defined there: import it from its own module)")
    assert not wrong, "imports of a name from where it is not defined:\n" + "\n".join(wrong)


def test_no_merge_conflict_markers_are_left():
    """A merge's unresolved hunk (`<<<<<<<`, `=======`, `>>>>>>>` at a line's start) in any text file of the project:
    Python fails to import one, but a README, a Makefile or a notebook would carry it silently."""
    kinds = {".py", ".md", ".ipynb", ".txt", ".toml", ".cfg", ".yml", ".yaml", ".sh", ""}
    skip = {".git", ".venv", "artifacts", "node_modules", "__pycache__"}
    markers = ("<<<<<<< ", ">>>>>>> ", "=======\n")
    found = []
    for path in ROOT.rglob("*"):
        if skip & set(path.relative_to(ROOT).parts) or not path.is_file() or path.suffix not in kinds:
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        found += [f"{path.relative_to(ROOT)}:{i}" for i, line in enumerate(lines, 1) if line.startswith(markers)]
    assert not found, f"merge conflict markers left in: {found[:10]}"


def test_every_invariant_cited_is_in_the_design():
    """Every "invariant N" or "invariants N-M" in the code and the docs is one of docs/DESIGN.md's numbered
    invariants, and every citation of the design names the file in the tree (docs/DESIGN.md)."""
    design = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    section = design.split("## The invariants", 1)[1].split("\n## ", 1)[0]
    numbers = {int(n) for n in re.findall(r"^(\d+)\. \*\*", section, flags=re.M)}
    assert numbers == set(range(1, len(numbers) + 1)) and len(numbers) >= 6
    texts = [(p, p.read_text(encoding="utf-8")) for p in _cited_files()]
    cited, unnamed = set(), []
    for path, text in texts:
        for first, last in re.findall(r"\binvariants? (\d+)(?:-(\d+))?", text):
            cited.update(range(int(first), int(last or first) + 1))
        unnamed += [f"{path.relative_to(ROOT)}: {m}" for m in re.findall(r"(?<![/\w])DESIGN(?:\.md)?[ ,]", text)]
    assert cited and cited <= numbers, f"cited but not in docs/DESIGN.md: {sorted(cited - numbers)}"
    assert not unnamed, f"cite the design as docs/DESIGN.md: {unnamed}"


def _cited_files() -> list[Path]:
    """The files that may cite the design: the code, the tests, the benchmarks, the docs."""
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "app.py"]
    for folder, pattern in (("kvdemo", "*.py"), ("tests", "*.py"), ("benchmarks", "*.py"), ("docs", "*.md")):
        files += sorted((ROOT / folder).rglob(pattern))
    return [f for f in files if f.exists() and f.name != "DESIGN.md"]
