"""The package's shape: no import cycles between its modules, no test infrastructure in it.

Static checks over the source (no import, no processes): an import inside a function counts as
much as one at the top, since it ties the two modules together all the same.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "torchdist_ext"


def _modules():
    """{dotted name: path} of every Python module of the package, plus the extension ``_C``."""
    mods = {f"{PKG}._C": None}
    for folder, _, files in os.walk(os.path.join(ROOT, PKG)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mods[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return mods


def import_graph():
    """{module: set of package modules it imports}, from every import statement in its source."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        graph[name] = set()
        if path is None:
            continue
        here = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in mods:
                        target = target.rsplit(".", 1)[0] if "." in target else ""
                    if target:
                        graph[name].add(target)
            elif isinstance(node, ast.ImportFrom):
                base = here
                for _ in range(max(node.level - 1, 0)):
                    base = base.rsplit(".", 1)[0]
                target = (base + ("." + node.module if node.module else "")) if node.level else (node.module or "")
                if not target.startswith(PKG):
                    continue
                for alias in node.names:  # `from .pkg import sub` imports the submodule
                    sub = f"{target}.{alias.name}"
                    graph[name].add(sub if sub in mods else target)
        graph[name].discard(name)
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    detail = "\n".join(f"{c}: " + "; ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c) for c in found)
    assert not found, ("import cycles in the package (move what both sides need into a module that imports "
                       f"neither):\n{detail}")


def test_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_test_infrastructure_in_the_package():
    """Test hosts (root, network namespaces) live in tests/, not in what pip installs."""
    names = set(_modules())
    assert not {n for n in names if "testhosts" in n or n.split(".")[-1].startswith("test")}, sorted(names)
    assert os.path.isfile(os.path.join(ROOT, "tests", "_testhosts.py"))
