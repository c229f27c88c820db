"""The import rules of the package (docs/architecture.md): data flows one way.

front door (``vitlab.cli``: the dispatcher and one thin file per command) -> tools (``experiments``,
``analysis``, ``bench``) -> tasks (``tasks.segmentation``, ``tasks.points``, ``tasks.lm``) -> the training
engine (``engine``) -> distillation (``distill``) -> the package's public front (``vitlab/__init__``) ->
services (``interop``, ``checkpoint``, ``measure``) -> core (models -> layers -> mixers; data, ops) ->
foundation (``common``). A module imports only from its own unit or a lower rank; commands never import each
other, nor do tools or tasks; services may use each other, one way; within the core a unit imports only lower
ranks (``vitlab.data`` and ``vitlab.ops`` share the lowest and never import each other); nothing but the two
``__main__`` modules imports the dispatcher; no two modules import each other, directly or in a circle. Imports
inside functions count: they are the same dependency, only deferred; so do string references to a module
(``"vitlab.x.y:function"``, ``importlib.import_module("vitlab.x")``), which import it at run time.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

DISPATCHER = "vitlab.cli"
MAINS = ("vitlab.__main__", "vitlab.cli.__main__")
# (unit, rank): a module belongs to the longest unit that holds it; higher ranks may import lower ones; units of
# one rank never import each other, except the services and the foundation (one way: no cycles)
RANKS: dict[str, float] = {
    "vitlab.__main__": 7,
    "vitlab.cli": 6,
    "vitlab.experiments": 5,
    "vitlab.analysis": 5,
    "vitlab.bench": 5,
    "vitlab.tasks": 4,
    "vitlab.tasks.segmentation": 4,
    "vitlab.tasks.points": 4,
    "vitlab.tasks.lm": 4,
    "vitlab.engine": 3,
    "vitlab.distill": 2.8,
    "vitlab": 2.5,  # the package itself: `import vitlab` gives the public API (create_model with weights, ...)
    "vitlab.interop": 2,
    "vitlab.checkpoint": 2,
    "vitlab.measure": 2,
    "vitlab.models": 1.3,
    "vitlab.layers": 1.2,
    "vitlab.mixers": 1.1,
    "vitlab.ops": 1,
    "vitlab.data": 1,
    "vitlab.common": 0,
}
SHARED_RANKS = (2, 0)  # services, foundation: their units may use each other one way
CORE = ("vitlab.models", "vitlab.layers", "vitlab.mixers", "vitlab.ops", "vitlab.data")
SERVICES = tuple(u for u, r in RANKS.items() if r == 2)
# the table of the old import paths names their new modules for users who still import them; vitlab itself
# never imports through it
OLD_PATHS_TABLE = "vitlab.common.deprecated"
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
        name: imports_of(name, path.read_text(), set(mods), path.name == "__init__.py")
        if name != OLD_PATHS_TABLE
        else set()
        for name, path in mods.items()
    }


def owner(name: str, group) -> str | None:
    """The longest entry of ``group`` that is ``name`` or a package holding it."""
    hits = [g for g in group if name == g or name.startswith(g + ".")]
    return max(hits, key=len) if hits else None


def layer(name: str) -> tuple[float, str]:
    """(rank, unit) of a module: a command is a unit of its own; a foundation module too."""
    group = owner(name, RANKS)
    if group is None:
        raise ValueError(f"{name} is in no unit of RANKS")
    unit = name if group in (DISPATCHER, "vitlab.common") else group  # each command, each foundation module
    return RANKS[group], unit


def edge_violation(name: str, dep: str) -> str | None:
    """Why the import ``name -> dep`` breaks the layering, or None."""
    if dep == DISPATCHER and name not in MAINS:
        return f"{name} -> {dep}: only the __main__ modules import the dispatcher"
    (rank, unit), (dep_rank, dep_unit) = layer(name), layer(dep)
    if dep_rank > rank:
        return f"{name} -> {dep}: imports a higher layer ({dep_unit} above {unit})"
    if rank == 6:  # the dispatcher imports the commands; a command imports no other command
        if name in MAINS:
            return None
        if dep_rank == 6 and name != DISPATCHER and dep_unit != unit:
            return f"{name} -> {dep}: commands never import each other"
        return None
    if dep_rank == rank and dep_unit != unit and rank not in SHARED_RANKS and unit != "vitlab.tasks":
        kind = "core units of one rank" if unit in CORE else "units of one rank"
        return f"{name} -> {dep}: {kind} never import each other"
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
        assert layer(name)  # raises ValueError for a module outside the table


def test_the_package_keeps_its_layering():
    bad = violations(graph())
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_checker_rejects_each_kind_of_violation():
    """``violations`` fed synthetic graphs: each rule must be able to fail, and a clean graph passes."""
    clean = {
        "vitlab.__main__": {"vitlab.cli"},
        "vitlab.cli": {"vitlab.common.extras", "vitlab.cli.train"},
        "vitlab.cli.train": {"vitlab.engine.arguments"},
        "vitlab.cli.study": {"vitlab.experiments.reproduce"},
        "vitlab.experiments.reproduce": {"vitlab.experiments.runner", "vitlab.tasks.segmentation"},
        "vitlab.tasks.segmentation.task": {"vitlab.engine.tasks", "vitlab.engine.dense"},
        "vitlab.engine.arguments": {"vitlab.engine.loop", "vitlab.interop.pretrained", "vitlab.common.report"},
        "vitlab.engine.loop": {"vitlab.models.vit", "vitlab.data.loader", "vitlab.distill.loss"},
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
        "imports a higher layer (vitlab.tasks.points above vitlab.engine)": {
            "vitlab.engine.setup": {"vitlab.tasks.points.task"}
        },
        "core units of one rank": {"vitlab.data.loader": {"vitlab.ops.linear"}},
        "units of one rank never import each other": {"vitlab.bench.models": {"vitlab.experiments.runner"}},
        "never import each other": {"vitlab.tasks.points.task": {"vitlab.tasks.segmentation.task"}},
        "commands never import each other": {"vitlab.cli.seg": {"vitlab.cli.train"}},
        "only the __main__ modules import the dispatcher": {"vitlab.engine.arguments": {"vitlab.cli"}},
        "cycle": {"vitlab.layers.block": {"vitlab.layers.mlp"}, "vitlab.layers.mlp": {"vitlab.layers.block"}},
        "imports a higher layer (vitlab.experiments above vitlab.measure)": {
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
        if name == OLD_PATHS_TABLE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.match(node.value):
                target = node.value.partition(":")[0]
                assert target not in mods or target == name or target in g[name], (name, target)


def test_the_ranks_stand_in_order():
    assert layer("vitlab.cli.study")[0] > layer("vitlab.experiments.reproduce")[0] > layer("vitlab.tasks.lm")[0]
    assert layer("vitlab.tasks.segmentation.task")[0] > layer("vitlab.engine.loop")[0] > layer("vitlab.distill")[0]
    assert layer("vitlab.distill.teacher")[0] > layer("vitlab")[0] > layer("vitlab.interop.pretrained")[0]
    assert layer("vitlab.measure.maps")[0] == layer("vitlab.checkpoint.load")[0] > layer("vitlab.models.vit")[0]
    assert layer("vitlab.mixers.aft")[0] < layer("vitlab.layers.block")[0] < layer("vitlab.models.vit")[0]
    assert layer("vitlab.common.io") == (0, "vitlab.common.io")
    assert layer("vitlab.cli.seg")[1] != layer("vitlab.cli.train")[1]  # each command its own unit


def test_every_command_is_one_file_of_the_front_door():
    """Each ``vitlab`` subcommand is the file ``vitlab/cli/<command>.py`` (its flags, then calls into the
    library), and the command files are exactly the commands."""
    from vitlab.cli import COMMANDS

    mods = modules()
    for command, (module, _) in COMMANDS.items():
        assert module == "vitlab.cli." + command.replace("-", "_"), (command, module)
        assert module in mods, f"{command}: {module} is not a module of the package"
    files = {m for m in mods if m.startswith("vitlab.cli.") and m != "vitlab.cli.__main__"}
    assert files == {m for m, _ in COMMANDS.values()}


def test_no_module_says_nothing_or_the_same_thing_twice():
    """No ``*_more``, ``*_cli`` or ``catalog`` modules; nothing at the top level beside the packages but
    ``__init__`` and ``__main__``."""
    pkg = SRC / "vitlab"
    stems = [p.stem for p in pkg.rglob("*.py")]
    assert not [s for s in stems if s.endswith(("_more", "_cli")) or s == "catalog"]
    top = sorted(p.name for p in pkg.glob("*.py"))
    assert top == ["__init__.py", "__main__.py"], top


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
    """Services may use each other, one way: a package-level loop (checkpoint <-> interop) would make a save or
    a load cross between them back and forth."""
    edges = _package_edges(SERVICES)
    loops = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    assert not loops, "service packages that import each other: " + "; ".join(loops)


def test_the_checkpoint_package_stands_below_interop_and_above_distributed():
    """interop reads files through the checkpoint package (its one safe loader), never the other way;
    the checkpoint package's sharded checkpoints use distributed's process group, never the other way."""
    edges = _package_edges((*SERVICES, "vitlab.common.distributed"))
    assert ("vitlab.interop", "vitlab.checkpoint") in edges
    assert ("vitlab.checkpoint", "vitlab.interop") not in edges
    assert ("vitlab.common.distributed", "vitlab.checkpoint") not in edges


def test_a_save_goes_down_the_checkpoint_package_one_way():
    """Inside the package: load -> sharded -> safeload -> format, each importing only lower ones (a training
    run's checkpoint, above them, is the engine's: vitlab.engine.checkpointing)."""
    order = ["format", "safeload", "sharded", "load"]
    g = graph()
    bad = []
    for i, mod in enumerate(order):
        for dep in g[f"vitlab.checkpoint.{mod}"]:
            if dep.startswith("vitlab.checkpoint.") and order.index(dep.rpartition(".")[2]) >= i:
                bad.append(f"vitlab.checkpoint.{mod} -> {dep}")
    assert not bad, "\n".join(bad)


def test_the_kernel_layer_names_all_its_modules():
    """ops/__init__'s docstring is the map of the kernel layer: every module of it is named there."""
    init = (SRC / "vitlab" / "ops" / "__init__.py").read_text()
    missing = [p.stem for p in (SRC / "vitlab" / "ops").glob("*.py") if p.stem != "__init__"
               and f":mod:`.{p.stem}`" not in init]  # fmt: skip
    assert not missing, missing
