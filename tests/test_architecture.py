"""The import rules of the package (README "Development"): data flows one way.

front door (``cli``) -> tools -> the package's public front (``vitlab/__init__``) -> services -> core
(models -> layers -> mixers; data) -> foundation. A module
imports only from its own tool or package, or from a lower layer; tools never import each other (services
may use each other); nothing but ``vitlab.__main__`` imports the front door; no two modules import each other, directly or in a circle. Imports
inside functions count: they are the same dependency, only deferred.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

FRONT = ("vitlab.cli", "vitlab.__main__")
TOOLS = (
    "vitlab.train",
    "vitlab.bench",
    "vitlab.analysis",
    "vitlab.lm",
    "vitlab.export",
    "vitlab.catalog",
    "vitlab.convert.cli",
    "vitlab.integrations",
    "vitlab.data.cli",
)
# the package itself: `import vitlab` gives the public API (create_model with weights, from_pretrained, ...)
PUBLIC = "vitlab"
SERVICES = (
    "vitlab.checkpoint",
    "vitlab.convert",
    "vitlab.measure",
    "vitlab.optim",
    "vitlab.rundir",
    "vitlab.pretrained",
    "vitlab.distributed",
    "vitlab.tracking",
)
# the core, lowest first: a module may import lower ranks and its own unit; the kernel layer (ops) and the data
# path share the lowest rank and never import each other
CORE = {"vitlab.ops": 0, "vitlab.data": 0, "vitlab.mixers": 1, "vitlab.layers": 2, "vitlab.models": 3}
FOUNDATION = ("vitlab.io", "vitlab.runtime", "vitlab.registry", "vitlab.options", "vitlab.extras", "vitlab.device")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / "vitlab").rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every vitlab module ``name`` imports (``from pkg import submodule`` names the submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "vitlab")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "vitlab":
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & known
            found.update(subs or {target})
    return {m for m in found if m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def owner(name: str, group: tuple[str, ...]) -> str | None:
    """The longest entry of ``group`` that is ``name`` or a package holding it."""
    hits = [g for g in group if name == g or name.startswith(g + ".")]
    return max(hits, key=len) if hits else None


def layer(name: str) -> tuple[int, str]:
    """(rank, unit): higher ranks may import lower ones; within a rank only the same unit."""
    if owner(name, FRONT):
        return 5, "front door"
    if tool := owner(name, TOOLS):
        return 4, tool
    if name == PUBLIC:
        return 3.5, PUBLIC
    if service := owner(name, SERVICES):
        return 3, service
    if found := owner(name, FOUNDATION):
        return 0, found
    core = max((c for c in CORE if name == c or name.startswith(c + ".")), key=len)
    return 1 + CORE[core] / 10, core


def test_every_module_has_a_layer():
    for name in modules():
        assert layer(name)  # raises ValueError (max of nothing) for a module outside the table


def test_imports_go_down_and_tools_never_import_each_other():
    bad = []
    for name, deps in graph().items():
        rank, unit = layer(name)
        for dep in deps:
            dep_rank, dep_unit = layer(dep)
            if dep_rank > rank or (dep_rank == rank and dep_unit != unit and rank >= 4):
                bad.append(f"{name} -> {dep}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_nothing_inside_the_package_imports_the_front_door():
    bad = [f"{n} -> vitlab.cli" for n, deps in graph().items() if "vitlab.cli" in deps and n != "vitlab.__main__"]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    g = graph()
    # a package importing its own submodules to re-export them is not a cycle; a submodule importing its
    # package's re-exports back would be
    edges = {n: {d for d in deps if not (d.startswith(n + "."))} for n, deps in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_violations():
    # the rules above must be able to fail: a tool importing another tool, and a service importing a tool
    assert layer("vitlab.bench.models")[0] == layer("vitlab.train.compare")[0] == 4
    assert layer("vitlab.bench.models")[1] != layer("vitlab.train.compare")[1]
    assert layer("vitlab.measure.flops")[0] < layer("vitlab.bench.models")[0]
    assert layer("vitlab.convert.cli")[0] > layer("vitlab.convert.load")[0]
    assert layer("vitlab.mixers.aft")[0] < layer("vitlab.layers.block")[0] < layer("vitlab.models.vit")[0]
    # the public front sits above the services it re-exports and below the tools
    assert layer("vitlab.pretrained")[0] < layer("vitlab")[0] < layer("vitlab.export")[0]
    assert layer("vitlab.models.folder")[0] < layer("vitlab.pretrained")[0]


def test_every_command_is_a_tool():
    """Each ``vitlab`` subcommand runs a module of the tools layer (``study`` lives with compare in vitlab.train,
    whose training and table code it reuses)."""
    from vitlab.cli import COMMANDS

    mods = modules()
    for command, (module, _) in COMMANDS.items():
        assert module in mods, f"{command}: {module} is not a module of the package"
        assert layer(module)[0] == 4, f"{command}: {module} is not in the tools layer"
    assert COMMANDS["study"][0] == "vitlab.train.study" and layer("vitlab.train.study")[1] == "vitlab.train"
    assert layer("vitlab.measure.maps")[0] == 3  # the attention-map measures are a service (analysis and study)


def _package_edges(units: tuple[str, ...]) -> set[tuple[str, str]]:
    """(importer, imported) between the units of ``units`` (a module counts as its unit; a tool inside one,
    such as ``vitlab.convert.cli``, does not), imports in functions included."""

    def unit(name: str) -> str | None:
        return None if owner(name, TOOLS) else owner(name, units)

    edges = set()
    for name, deps in graph().items():
        for dep in deps:
            a, b = unit(name), unit(dep)
            if a and b and a != b:
                edges.add((a, b))
    return edges


def test_no_two_services_import_each_other():
    """Services may use each other, one way: a package-level loop (checkpoint <-> convert, checkpoint <->
    distributed) would make a save or a load cross between them back and forth."""
    edges = _package_edges(SERVICES)
    loops = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    assert not loops, "service packages that import each other: " + "; ".join(loops)


def test_the_checkpoint_package_stands_below_convert_and_above_distributed():
    """convert reads files through the checkpoint package (its one safe loader), never the other way;
    the checkpoint package's sharded checkpoints use distributed's process group, never the other way."""
    edges = _package_edges(SERVICES)
    assert ("vitlab.convert", "vitlab.checkpoint") in edges
    assert ("vitlab.checkpoint", "vitlab.convert") not in edges
    assert ("vitlab.distributed", "vitlab.checkpoint") not in edges
    bad = [f"{n} -> {d}" for n, deps in graph().items() if n.startswith("vitlab.checkpoint") for d in deps
           if owner(d, TOOLS) or d.startswith("vitlab.convert")]  # fmt: skip
    assert not bad, "\n".join(bad)


def test_a_save_goes_down_the_checkpoint_package_one_way():
    """Inside the package: run -> load -> sharded -> safeload -> format, each importing only lower ones."""
    order = ["format", "safeload", "sharded", "load", "run"]
    g = graph()
    bad = []
    for i, mod in enumerate(order):
        for dep in g[f"vitlab.checkpoint.{mod}"]:
            if dep.startswith("vitlab.checkpoint.") and order.index(dep.rpartition(".")[2]) >= i:
                bad.append(f"vitlab.checkpoint.{mod} -> {dep}")
    assert not bad, "\n".join(bad)
