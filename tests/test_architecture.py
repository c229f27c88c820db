"""The import rules of the package (README "Development"): data flows one way.

front door (``cli``) -> tools -> the package's public front (``vitlab/__init__``) -> services -> core
(models -> layers -> mixers; data, ops) -> foundation. A module imports only from its own tool or package, or
from a lower layer; tools never import each other (services may use each other, one way); within the core a
unit imports only lower ranks (``vitlab.data`` and ``vitlab.ops`` share the lowest and never import each
other); nothing but ``vitlab.__main__`` imports the front door; no two modules import each other, directly or
in a circle. Imports inside functions count: they are the same dependency, only deferred; so do string
references to a module (``"vitlab.x.y:function"``, ``importlib.import_module("vitlab.x")``), which import it
at run time.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

FRONT = ("vitlab.cli", "vitlab.__main__")
TOOLS = (
    "vitlab.engine",
    "vitlab.bench",
    "vitlab.analysis",
    "vitlab.tasks.lm",
    "vitlab.interop.export",
    "vitlab.cli.models",
    "vitlab.cli.convert",
    "vitlab.interop",
    "vitlab.cli.data",
)
# the package itself: `import vitlab` gives the public API (create_model with weights, from_pretrained, ...)
PUBLIC = "vitlab"
SERVICES = (
    "vitlab.checkpoint",
    "vitlab.interop",
    "vitlab.measure",
    "vitlab.engine.optim",
    "vitlab.common.report",
    "vitlab.common.rundir",
    "vitlab.interop.pretrained",
    "vitlab.common.distributed",
    "vitlab.engine.tracking",
    "vitlab.tasks.segmentation",
    "vitlab.tasks.points",
)
# the core, lowest first: a module may import lower ranks and its own unit; the kernel layer (ops) and the data
# path share the lowest rank and never import each other
CORE = {"vitlab.ops": 0, "vitlab.data": 0, "vitlab.mixers": 1, "vitlab.layers": 2, "vitlab.models": 3}
FOUNDATION = (
    "vitlab.common.io",
    "vitlab.common.runtime",
    "vitlab.common.registry",
    "vitlab.common.options",
    "vitlab.common.extras",
    "vitlab.common.device",
)
# a string that names a module, alone or with an attribute: "vitlab.experiments.runner:train_case"
MODULE_STRING = re.compile(r"^vitlab(\.\w+)+(:\w+)?$")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / "vitlab").rglob("*.py"))}


def imports_of(name: str, source: str, known: set[str], is_package: bool = False) -> set[str]:
    """Every vitlab module the module ``name`` (its text ``source``) imports: ``from pkg import submodule``
    names the submodule; a string naming a known module (``"vitlab.x.y"``, ``"vitlab.x.y:attr"``) counts."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source, name)):
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
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.match(node.value):
            target = node.value.partition(":")[0]
            if target in known:  # prose such as "vitlab.data.open_source" names a function, not a module
                found.add(target)
    return {m for m in found if m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {
        name: imports_of(name, path.read_text(), set(mods), path.name == "__init__.py") for name, path in mods.items()
    }


def owner(name: str, group: tuple[str, ...]) -> str | None:
    """The longest entry of ``group`` that is ``name`` or a package holding it."""
    hits = [g for g in group if name == g or name.startswith(g + ".")]
    return max(hits, key=len) if hits else None


def layer(name: str) -> tuple[float, str]:
    """(rank, unit): higher ranks may import lower ones; within a rank only the same unit, except that
    services (3) and the foundation (0) may use each other (one way: no cycles)."""
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


def is_core(unit: str) -> bool:
    return unit in CORE


def edge_violation(name: str, dep: str) -> str | None:
    """Why the import ``name -> dep`` breaks the layering, or None."""
    if dep == "vitlab.cli" and name != "vitlab.__main__":
        return f"{name} -> {dep}: only vitlab.__main__ imports the front door"
    (rank, unit), (dep_rank, dep_unit) = layer(name), layer(dep)
    if dep_rank > rank:
        return f"{name} -> {dep}: imports a higher layer ({dep_unit} above {unit})"
    if dep_rank == rank and dep_unit != unit and rank == 4:
        return f"{name} -> {dep}: tools never import each other"
    if dep_rank == rank and dep_unit != unit and is_core(unit):
        return f"{name} -> {dep}: core units of one rank never import each other"
    return None


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or in a circle (Tarjan's strongly connected
    components). A package importing its own submodules to re-export them is not a cycle; a submodule
    importing its package's re-exports back would be."""
    edges = {n: {d for d in deps if not d.startswith(n + ".")} for n, deps in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def violations(g: dict[str, set[str]]) -> list[str]:
    """Every break of the rules in the module docstring, one line each, in ``g`` (module -> what it imports)."""
    bad = [why for name, deps in g.items() for dep in deps if (why := edge_violation(name, dep))]
    bad += ["cycle: " + " <-> ".join(c) for c in cycles(g)]
    return sorted(bad)


def test_every_module_has_a_layer():
    for name in modules():
        assert layer(name)  # raises ValueError (max of nothing) for a module outside the table


def test_the_package_keeps_its_layering():
    bad = violations(graph())
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_checker_rejects_each_kind_of_violation():
    """``violations`` fed synthetic graphs: each rule must be able to fail, and a clean graph passes."""
    clean = {
        "vitlab.__main__": {"vitlab.cli"},
        "vitlab.cli": {"vitlab.common.extras"},
        "vitlab.engine.arguments": {"vitlab.engine.loop", "vitlab.interop.pretrained", "vitlab.common.report"},
        "vitlab.engine.loop": {"vitlab.models.vit", "vitlab.data.loader"},
        "vitlab.interop.pretrained": {"vitlab.checkpoint.load", "vitlab.models.registry"},
        "vitlab.checkpoint.load": {"vitlab.models.registry", "vitlab.common.io"},
        "vitlab.models.vit": {"vitlab.layers.block", "vitlab.mixers.attention", "vitlab.ops.linear"},
        "vitlab.layers.block": {"vitlab.mixers.attention"},
        "vitlab.mixers.attention": {"vitlab.ops.linear", "vitlab.common.registry"},
        "vitlab.data.loader": {"vitlab.data.spec", "vitlab.common.io"},
    }
    assert violations(clean) == []
    cases = {
        "imports a higher layer": {"vitlab.mixers.aft": {"vitlab.layers.block"}},
        "core units of one rank": {"vitlab.data.loader": {"vitlab.ops.linear"}},
        "tools never import each other": {"vitlab.bench.models": {"vitlab.experiments.runner"}},
        "only vitlab.__main__ imports the front door": {"vitlab.engine.arguments": {"vitlab.cli"}},
        "cycle": {"vitlab.layers.block": {"vitlab.layers.mlp"}, "vitlab.layers.mlp": {"vitlab.layers.block"}},
        "imports a higher layer (vitlab.engine above vitlab.measure)": {
            "vitlab.measure.process": imports_of(
                "vitlab.measure.process",
                'TARGET = "vitlab.experiments.runner:train_case"',
                {"vitlab.experiments.runner"},
            )
        },
    }
    for kind, g in cases.items():
        found = violations({**clean, **g})
        assert len(found) >= 1 and all(kind in line for line in found), (kind, found)


def test_string_references_to_modules_are_imports():
    """A module named in a string is imported at run time (``importlib``, a case target): the graph lists it."""
    mods = modules()
    g = graph()
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.match(node.value):
                target = node.value.partition(":")[0]
                assert target not in mods or target == name or target in g[name], (name, target)


def test_the_checker_sees_violations():
    # the rules above must be able to fail: a tool importing another tool, and a service importing a tool
    assert layer("vitlab.bench.models")[0] == layer("vitlab.experiments.runner")[0] == 4
    assert layer("vitlab.bench.models")[1] != layer("vitlab.experiments.runner")[1]
    assert layer("vitlab.measure.flops")[0] < layer("vitlab.bench.models")[0]
    assert layer("vitlab.cli.convert")[0] > layer("vitlab.interop.convert")[0]
    assert layer("vitlab.cli.data")[0] > layer("vitlab.data.spec")[0]
    assert layer("vitlab.mixers.aft")[0] < layer("vitlab.layers.block")[0] < layer("vitlab.models.vit")[0]
    # the public front sits above the services it re-exports and below the tools
    assert layer("vitlab.interop.pretrained")[0] < layer("vitlab")[0] < layer("vitlab.interop.export")[0]
    assert layer("vitlab.models.folder")[0] < layer("vitlab.interop.pretrained")[0]


def test_every_command_is_a_tool():
    """Each ``vitlab`` subcommand runs a module of the tools layer (``study`` lives with compare in vitlab.engine,
    whose training and table code it reuses)."""
    from vitlab.cli import COMMANDS

    mods = modules()
    for command, (module, _) in COMMANDS.items():
        assert module in mods, f"{command}: {module} is not a module of the package"
        assert layer(module)[0] == 4, f"{command}: {module} is not in the tools layer"
    assert (
        COMMANDS["study"][0] == "vitlab.experiments.reproduce"
        and layer("vitlab.experiments.reproduce")[1] == "vitlab.engine"
    )
    assert layer("vitlab.measure.maps")[0] == 3  # the attention-map measures are a service (analysis and study)


def _package_edges(units: tuple[str, ...]) -> set[tuple[str, str]]:
    """(importer, imported) between the units of ``units`` (a module counts as its unit), imports in functions
    included."""

    def unit(name: str) -> str | None:
        return owner(name, units)

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
    assert ("vitlab.interop", "vitlab.checkpoint") in edges
    assert ("vitlab.checkpoint", "vitlab.interop") not in edges
    assert ("vitlab.common.distributed", "vitlab.checkpoint") not in edges
    bad = [f"{n} -> {d}" for n, deps in graph().items() if n.startswith("vitlab.checkpoint") for d in deps
           if owner(d, TOOLS) or d.startswith("vitlab.interop")]  # fmt: skip
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
