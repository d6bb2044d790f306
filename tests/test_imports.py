"""No import circle in the repository: every import, at the top of a file or inside a function
(the lazy ones included), between the repository's own Python files.

An import names a file of the repository the way Python finds it for that file: a script's own
folder first (bench/'s and tests/helpers/' modules import their neighbours by bare name), then the
repository root (a top-level module, or a package such as records/ or data/ by its dotted path).
Imports of anything else (the standard library, torch, triton) are not edges."""
import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIPPED_DIRS = {".git", "__pycache__", "logs", "node_modules"}


def repository_files():
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".")]
        for name in files:
            if name.endswith(".py"):
                yield Path(root, name)


def module_path(dotted, base):
    """The file `dotted` names when looked up from the folder `base`, or None."""
    path = base.joinpath(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate.resolve()
    return None


def imported_names(tree, file):
    """Every dotted name an import in `tree` may load: `import a.b` loads a and a.b; `from a import
    b` loads a and, where b is a module, a.b; relative imports resolve against the file's package."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                yield from (".".join(parts[:i]) for i in range(1, len(parts) + 1))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = file.parent
                for _ in range(node.level - 1):
                    package = package.parent
                base = ".".join(package.relative_to(REPO).parts)
                module = ".".join(p for p in (base, node.module or "") if p)
            else:
                module = node.module
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def import_graph():
    graph = {}
    for file in repository_files():
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        edges = set()
        for dotted in imported_names(tree, file):
            target = module_path(dotted, file.parent) or module_path(dotted, REPO)
            if target is not None and target != file.resolve():
                edges.add(target)
        graph[file.resolve()] = edges
    return graph


def circles(graph):
    """The strongly connected components with more than one file (Tarjan's algorithm)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(str(p.relative_to(REPO)) for p in component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def test_the_finder_sees_a_lazy_circle(tmp_path):
    """Two files that import each other, one of them inside a function, make one circle; a third
    that only imports them is outside it."""
    a, b, c = (REPO / "a_.py", REPO / "b_.py", REPO / "c_.py")
    trees = {a: "import b_\n", b: "def f():\n    from a_ import g\n", c: "import a_, b_\n"}
    graph = {f: {f.parent / f"{d}.py" for d in imported_names(ast.parse(text), f)} for f, text in trees.items()}
    assert circles(graph) == [["a_.py", "b_.py"]]


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50 and any(graph.values())
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)
