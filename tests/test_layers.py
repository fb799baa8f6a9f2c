"""Every module imports only its own package and lower layers (ragkv/layers.py): the house imports downward."""

import ast
from pathlib import Path

import ragkv
from ragkv.layers import ENGINE_LAYERS, ENGINE_RANK, LAYERS, RANK, allowed, engine_allowed, engine_part, layer_of

ROOT = Path(ragkv.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every ragkv import in the file, function-level ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            if node.module == "ragkv":  # `from ragkv import cli` imports the subpackage
                out += [(node.lineno, f"ragkv.{a.name}") for a in node.names]
    return [(line, m) for line, m in out if m == "ragkv" or m.startswith("ragkv.")]


def test_every_package_has_a_layer():
    names = {p.name if p.is_dir() else p.stem for p in ROOT.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    assert names <= set(RANK), f"packages without a layer in ragkv/layers.py: {sorted(names - set(RANK))}"
    assert len(RANK) == sum(len(layer) for layer in LAYERS), "a package is listed on two layers"


def test_no_module_imports_a_higher_layer_or_a_sibling():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        for line, imported in _imports(path):
            if imported != "ragkv" and not allowed(module, imported):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} ({layer_of(module)}) imports {imported} "
                           f"({layer_of(imported)})")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_the_check_catches_an_upward_import():
    assert not allowed("ragkv.store.disk", "ragkv.engine.engine")
    assert not allowed("ragkv.serve.app", "ragkv.train.loop")       # siblings on one layer
    assert allowed("ragkv.cli.ask", "ragkv.engine.engine") and allowed("ragkv.engine.fusion.context", "ragkv.engine.fusion.ape")


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or
                                         isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (imports for annotations only, never executed: they
    make no import circle; they still may not import upward, which the check above sees)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo += [child for child in ast.iter_child_nodes(node) if not _type_checking_block(child)]


def _module_graph() -> dict[str, set[str]]:
    """module -> the ragkv modules it imports (function-level imports included: a circle through one is still a
    circle in the design). `from ragkv.x import y` counts as importing ragkv.x.y when that is a module."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in modules:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                deps |= subs or {node.module}
        graph[name] = deps - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm; the package's import depth
    is far below Python's recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert not _cycles(_module_graph()), "import circles:\n" + "\n".join(" <-> ".join(c) for c in
                                                                          _cycles(_module_graph()))


def test_the_circle_check_catches_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not _cycles({"a": {"b"}, "b": set()})


def test_the_engine_sub_packages_import_down_a_request_path():
    """ragkv/layers.py ENGINE_LAYERS: measure < request, kv < blocks < fusion < decode, recompute < modes <
    options < engine; imports for annotations only (under TYPE_CHECKING) are exempt."""
    engine = ROOT / "engine"
    parts = {p.name if p.is_dir() else p.stem for p in engine.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert parts == set(ENGINE_RANK), f"engine parts without a layer: {sorted(parts ^ set(ENGINE_RANK))}"
    assert len(ENGINE_RANK) == sum(len(layer) for layer in ENGINE_LAYERS)
    bad = []
    for path in sorted(engine.rglob("*.py")):
        module = _module_name(path)
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            bad += [f"{path.relative_to(ROOT.parent)}:{node.lineno} ({engine_part(module)}) imports {m}"
                    for m in names if m.startswith("ragkv.engine.") and not engine_allowed(module, m)]
    assert not bad, "upward or sideways imports inside the engine:\n" + "\n".join(bad)
    assert not engine_allowed("ragkv.engine.kv.state", "ragkv.engine.fusion.layout")
    assert not engine_allowed("ragkv.engine.decode.generate", "ragkv.engine.recompute.base")  # siblings


def test_modules_fit_in_a_head_and_the_cli_is_thin():
    """No module over 500 lines; no cli module over 300 and no cli function over 80 (flags -> configs only)."""
    import ast

    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"modules over 500 lines: {long}"
    cli = ROOT / "cli"
    fat = {p.name: n for p in cli.glob("*.py") if (n := len(p.read_text().splitlines())) > 300}
    assert not fat, f"cli modules over 300 lines: {fat}"
    big = [f"{p.name}:{f.name} ({f.end_lineno - f.lineno + 1})" for p in cli.glob("*.py")
           for f in ast.walk(ast.parse(p.read_text())) if isinstance(f, ast.FunctionDef)
           and f.end_lineno - f.lineno + 1 > 80]
    assert not big, f"cli functions over 80 lines: {big}"
