"""The code's size rule: no module over 400 lines and no function over 80 in kvdemo/, app.py and benchmarks/
(long modules and functions hide several concepts; cut them by concept, as the module map in CONTRIBUTING.md
does), and every module imports on its own (the arrows point one way: no cycle)."""

from __future__ import annotations

import ast
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


def sizes() -> dict[str, int]:
    """Lines per module (`path`) and per function or method (`path:name`), for every source under the rule."""
    out = {}
    for path in _sources():
        name = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        out[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{name}:{node.name}"
                out[key] = max(out.get(key, 0), node.end_lineno - node.lineno + 1)
    return out


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


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The kvdemo modules `path` imports at module level (imports inside functions are lazy on purpose);
    `from package import module` imports the module, not the package's `__init__`."""
    out = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvdemo"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvdemo"))
    return out


def test_imports_point_one_way():
    modules = {}
    for path in (ROOT / "kvdemo").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {
        name: {m for m in _imports(path, set(modules)) if m in modules and m != name} for name, path in modules.items()
    }
    graph["kvdemo"] = set()  # the package's __init__ re-exports; every module may import it

    def cycle(start: str, node: str, seen: tuple[str, ...]) -> tuple[str, ...] | None:
        for nxt in graph[node]:
            if nxt == start:
                return (*seen, nxt)
            if nxt not in seen and (found := cycle(start, nxt, (*seen, nxt))):
                return found
        return None

    cycles = [c for name in sorted(graph) if (c := cycle(name, name, (name,)))]
    assert not cycles, f"import cycles: {cycles[:3]}"


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
