"""Teachers that cannot run code: ``.pt2`` programs and TorchScript files are checked before anything in them runs.

A ``torch.export`` archive is read as a zip and its JSON checked *before* torch's deserialiser sees it, because
that deserialiser evaluates strings the file carries: symbolic-shape expressions go through ``sympy.sympify``
(``eval``), guard code is ``exec``-ed when the module is built, node targets are resolved by ``getattr`` on
``torch``/``operator``/``math``, pickled weights, constants and sample inputs are unpickled with
``weights_only=False`` (or as a fallback), and compiled (AOTInductor) members are loaded as shared libraries.
The check (:func:`read_export`):

- members: only the layout ``torch.export.save`` writes for one plain program (:data:`EXPORT_MEMBERS`): no
  compiled code, no pickled custom objects, no legacy pickled weights;
- every node target and operator argument is on the operator allowlist (:func:`check_target`): the ``aten``
  and ``prims`` namespaces except the operators of :data:`REFUSED_OPS` (files, printing, foreign memory,
  global random state, remote calls), a vetted few higher-order operators (none that loops: :data:`LOOP_OPS`),
  the symbolic-integer arithmetic torch itself emits (:data:`SYMBOLIC_OPS`), and vitlab's own operators
  (:data:`PACKAGE_OPS`); no other namespace, and no Python callable;
- every name is a plain dotted identifier, every shape expression is integer arithmetic over size symbols
  (:func:`check_expression`), every guard a comparison of input sizes (:func:`check_guard`), and the input and
  output tree specs name only tuples, lists and dicts;
- weights and constants are raw tensor bytes (no pickle); the sample inputs, the one pickle in the archive,
  must load with ``weights_only=True``.

Only then is a *copy* deserialised, rebuilt from the bytes that were checked (the file is read once): free-text
metadata (stack traces, module paths, custom metadata) and the sample inputs are left out of it, so nothing of
them reaches torch. The loaded graph is checked again, node by node, against the same allowlist.

A TorchScript file (:func:`read_torchscript`) is refused before ``torch.jit.load`` when its code defines
``__setstate__`` (the one method loading runs) or its pickles name C++ custom classes; after loading, the
inlined graph of ``forward`` (the functions it calls included) is checked against the allowlist
(:data:`SCRIPT_PRIMS` for TorchScript's own instructions; no ``prim::Loop`` but a ``for`` over a tensor's
dimensions, :func:`bounded_loop`) before it ever runs, and the teacher calls ``forward`` itself, not the module
(no hooks).

No loop whose end the file decides passes (a ``while``, a ``for`` over any count but a tensor's number of
dimensions, a loop within a loop), because it could run forever inside torch's C++, where Python cannot
interrupt it; what is left could still be slow, so :mod:`.teacher` also bounds the time of a teacher's first
call.

Every refusal, and every file that is not what it says, is one :class:`TeacherError` line.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import logging
import math
import operator
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..checkpoint.safeload import one_line, pickle_imports


class TeacherError(ValueError):
    """A teacher file refused or unreadable: one line naming the file and the reason."""


# ------------------------------------------------------------------------------------- the allowlist (data)
def _words(text: str) -> frozenset[str]:
    """A table of names written as one string of words."""
    return frozenset(text.split())


#: operator namespaces whose operators compute on tensors (minus :data:`REFUSED_OPS`)
OP_NAMESPACES = ("aten", "prims")
#: operators of those namespaces that reach outside the tensors they are given: never in a teacher
REFUSED_OPS = {
    "from_file": "opens, and with shared=True creates, a file",
    "save": "writes a file",
    "load": "reads a file",
    "_print": "prints from inside the program",
    "set_": "points a tensor at memory it was not given",
    "manual_seed": "changes the process's random state",
    "seed": "changes the process's random state",
    "to_here": "makes a remote call",
    "wait": "waits on a remote call",
    "local_value": "reads a remote value",
    "owner": "reads a remote value",
    "owner_name": "reads a remote value",
    "is_owner": "reads a remote value",
    "confirmed_by_owner": "reads a remote value",
}
#: vitlab's own registered operators (:mod:`vitlab.ops.onednn`: oneDNN's linear product), which a vitlab model
#: exported with the fast paths on calls; defined by this package, not by the file
PACKAGE_OPS = {"vitlab": frozenset({"onednn_linear", "onednn_linear_grad_input", "onednn_linear_grad_weight"})}
#: higher-order operators a teacher may use: they only run subgraphs of the program itself, each a bounded
#: number of times (a branch, or once per row of a tensor)
HIGHER_ORDER_OPS = frozenset({"cond", "map_impl", "wrap_with_set_grad_enabled", "wrap_with_autocast"})
#: higher-order operators that repeat a subgraph until a condition of the program says stop: a file could make
#: that never happen, and a loop inside torch's C++ cannot be interrupted (a denial of service, not a teacher)
LOOP_OPS = frozenset({"while_loop", "while_loop_stack_output", "scan"})
LOOP_FIX = "a teacher's forward must not loop (trace or export the model so that its loops are unrolled)"
#: a ``for`` over a tensor's dimensions may count a few more or fewer (``range(len(size) - 2)``)
MAX_LOOP_OFFSET = 64
#: how deep the trip count of such a loop is traced back to the shapes it counts
MAX_SHAPE_DEPTH = 8
#: Python callables torch.export records for symbolic-integer arithmetic (its serialiser's own list)
SYMBOLIC_OPS: tuple[Callable, ...] = (
    *(getattr(operator, n) for n in _words("eq ne le ge lt gt neg pos mul add sub floordiv mod pow truediv and_ or_")),
    *(getattr(operator, n) for n in ("lshift", "rshift", "getitem")),
    math.trunc, math.ceil, math.floor,
    torch.sym_not, torch.sym_int, torch.sym_float, torch.sym_ite, torch.sym_max, torch.sym_min, torch.sym_sqrt,
)  # fmt: skip
SYMBOLIC_NAMES = {f"{f.__module__}.{f.__name__}": f for f in SYMBOLIC_OPS}
#: TorchScript's own instructions (``prim::``) a teacher's forward may use: data movement and branches.
#: Not here: PythonOp (a Python callback), Print, CallFunction/CallMethod left after inlining (interfaces),
#: CreateObject/SetAttr (script objects and module state), Enter/Exit (context managers), rpc_*, and Loop (a
#: ``for`` or ``while`` of scripted code: its trip count and condition are values the file chooses, so it may
#: never end, inside C++ where nothing interrupts it), but for a ``for`` over a tensor's dimensions
#: (:func:`bounded_loop`).
SCRIPT_PRIMS = _words(
    "Constant ListConstruct ListUnpack TupleConstruct TupleUnpack TupleIndex TupleSlice DictConstruct GetAttr If "
    "NumToTensor device dtype layout is_cuda is_cpu is_mkldnn is_quantized is_sparse is_nested RaiseException "
    "Uninitialized unchecked_cast unchecked_unwrap_optional isinstance min max abs data requires_grad shape "
    "ConstantChunk BroadcastSizes ListIndex StringIndex EnumName EnumValue tolist AutogradAdd rangelist index "
    "itemsize nbytes type"
)
#: the members of a ``torch.export.save`` archive of one program (below its root folder); anything else, such
#: as compiled AOTInductor libraries, pickled custom objects or legacy pickled weights, is refused
EXPORT_MEMBERS = re.compile(
    r"archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id|models/model\.json"
    r"|data/weights/(weight_\d+|model_weights_config\.json)|data/constants/(tensor_\d+|model_constants_config\.json)"
    r"|data/sample_inputs/model\.pt"
)
#: names in a program (nodes, parameters, symbols, dialects): dotted identifiers, nothing a code generator or
#: an expression parser could read as code
NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*", re.ASCII)
#: the words of a shape expression besides size symbols: torch writes them with ``sympy.srepr`` (``Symbol('s0',
#: positive=True, integer=True)``, ``Add(...)``, ``Integer(2)``): sympy's expression classes, the sympy functions
#: torch's deserialiser knows, and the symbols' assumptions
EXPRESSION_WORDS = _words(
    "FloorDiv ModularIndexing Where PythonMod Mod CleanDiv CeilToInt FloorToInt CeilDiv LShift RShift PowByNatural "
    "FloatPow FloatTrueDiv IntTrueDiv IsNonOverlappingAndDenseIndicator TruncToFloat TruncToInt RoundToInt "
    "RoundDecimal ToFloat Identity Max Min Eq Ne Lt Le Gt Ge And Or Not Abs floor ceiling Symbol Dummy Integer "
    "Rational Float Add Mul Pow Equality Unequality StrictLessThan LessThan StrictGreaterThan GreaterThan "
    "BooleanTrue BooleanFalse Infinity NegativeInfinity oo zoo nan true false True False precision positive "
    "negative nonnegative nonpositive integer real finite infinite zero nonzero even odd rational commutative"
)
_SYMBOL = re.compile(r"[a-z]{1,4}\d+", re.ASCII)  # torch's size symbols: s0, u3, zuf1, ...
#: a quoted word in an expression: a symbol's name, or a Float's digits
_QUOTED = re.compile(r"'([a-z]{1,4}\d+|-?\d+(\.\d*)?(e[-+]?\d+)?)'", re.ASCII)
_EXPRESSION_TOKEN = re.compile(
    r"\s+|\d+\.\d*(e-?\d+)?|\d+|[A-Za-z_]\w*|'[^']*'|\*\*|//|[<>=!]=|[-+*/%(),<>&|~=]", re.ASCII
)
#: tree-spec node types a teacher's inputs and outputs may have
TREE_TYPES = frozenset({None, "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict"})
#: JSON keys whose strings are free text passed on as values (never parsed as code or names)
FREE_TEXT = frozenset({"as_string", "as_strings", "torch_version"})
#: JSON keys left out of the copy torch deserialises: free text no teacher needs
DROPPED = ("metadata",)
MAX_EXPRESSION = 2000
MAX_TEACHER_BYTES = 32 * 2**30  # far above any teacher (RegNetY-16GF: 0.3 GB); a device or sparse file stops here
MAX_UNPACK_RATIO = 64  # torch stores members uncompressed: a member inflating more than this is a zip bomb


def refuse(path: Path, why: str) -> TeacherError:
    """The one line refusing ``path`` for the reason ``why``."""
    return TeacherError(
        f"refusing teacher {path}: {one_line(why, 200)}; vitlab loads teachers that only compute on tensors"
    )


# ------------------------------------------------------------------------------------- the checks
def check_target(name: str) -> str | None:
    """Why the operator named ``name`` (as torch.export serialises it) is refused, or None when allowed."""
    if name in SYMBOLIC_NAMES:
        return None
    m = re.fullmatch(r"torch\.ops\.(\w+)\.(\w+)(?:\.(\w+))?", name, re.ASCII)
    if m is None:
        return f"it calls {name!r}, which is not a tensor operator"
    namespace, op = m[1], m[2]
    if namespace == "higher_order":
        if op in LOOP_OPS:
            return f"it runs the loop {op!r}, which may never end; {LOOP_FIX}"
        return None if op in HIGHER_ORDER_OPS else f"it calls the higher-order operator {op!r}"
    if namespace in PACKAGE_OPS:
        return None if op in PACKAGE_OPS[namespace] else f"it calls {name!r}, which {namespace} does not define"
    if namespace not in OP_NAMESPACES:
        return f"it calls {name!r}, an operator of the custom namespace {namespace!r}"
    if op in REFUSED_OPS:
        return f"it calls {namespace}::{op}, which {REFUSED_OPS[op]}"
    return None


def check_expression(text: str) -> str | None:
    """Why the shape expression ``text`` (which torch reads with ``sympy.sympify``, an ``eval``) is refused."""
    if len(text) > MAX_EXPRESSION:
        return "a shape expression is too long"
    pos = 0
    while pos < len(text):
        m = _EXPRESSION_TOKEN.match(text, pos)
        if m is None:
            return f"the shape expression {text!r} is not integer arithmetic"
        word = m[0]
        if word[0] == "'" and not _QUOTED.fullmatch(word):
            return f"the shape expression {text!r} quotes {word}"
        if (word[0].isalpha() or word[0] == "_") and not (word in EXPRESSION_WORDS or _SYMBOL.fullmatch(word)):
            return f"the shape expression {text!r} names {word!r}"
        pos = m.end()
    return None


_GUARD_NODES = (ast.Expression, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Subscript,
                ast.Call, ast.Attribute, ast.Name, ast.Load, ast.cmpop, ast.boolop, ast.operator, ast.unaryop)  # fmt: skip


def check_guard(code: str) -> str | None:
    """Why the guard ``code`` (Python that torch ``exec``-s when it builds the module) is refused: allowed are
    comparisons and arithmetic of integers and of ``L['input'].size()[i]``-like reads of the inputs' shapes."""
    try:
        tree = ast.parse(code, mode="eval")
    except (SyntaxError, ValueError):
        return f"its guard {code!r} is not Python"
    for node in ast.walk(tree):
        bad = not isinstance(node, _GUARD_NODES)
        bad |= isinstance(node, ast.Name) and node.id != "L"
        bad |= isinstance(node, ast.Attribute) and node.attr not in ("size", "stride", "storage_offset", "dim")
        bad |= isinstance(node, ast.Call) and bool(
            node.args or node.keywords or not isinstance(node.func, ast.Attribute)
        )
        # strings only as input names: torch pastes the guard's text into a string literal of the code it exec-s
        bad |= isinstance(node, ast.Constant) and not (
            isinstance(node.value, int) or (isinstance(node.value, str) and NAME.fullmatch(node.value))
        )
        if bad:
            return f"its guard {code!r} is more than a check of input sizes"
    return None


def check_tree_spec(text: str) -> str | None:
    """Why an input or output tree spec (JSON) is refused: only tuples, lists, dicts and leaves."""
    try:
        spec = json.loads(text)
    except (TypeError, ValueError):
        return "an input or output spec is not JSON"
    for key, value in walk(spec):
        if key == "type" and value not in TREE_TYPES:
            return f"its inputs or outputs are of type {value!r}"
    return None


def walk(obj: Any, key: str | None = None) -> Iterator[tuple[str | None, Any]]:
    """Every (key, value) pair of a JSON document, depth first, dict keys reported as (None, key)."""
    yield key, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield None, k
            yield from walk(v, k)
    elif isinstance(obj, list):
        for v in obj:
            yield from walk(v, key)


def check_value(key: str | None, value: Any) -> str | None:
    """Why one value of the program's JSON is refused (its key says what it is)."""
    if not isinstance(value, str):
        return "it carries a custom object" if key in ("as_custom_obj", "custom_obj", "class_fqn") else None
    if key in ("target", "as_operator"):
        return check_target(value)
    if key == "expr_str":
        return check_expression(value)
    if key in ("in_spec", "out_spec"):
        return check_tree_spec(value)
    if key == "guards_code":
        return check_guard(value)
    if key in FREE_TEXT or value == "" or NAME.fullmatch(value):
        return None
    return f"it names {value!r}, which is not a plain identifier"


def check_program(model: Any) -> str | None:
    """Why the program's JSON (``models/model.json``, metadata already dropped) is refused, or None."""
    if not isinstance(model, dict) or not isinstance(model.get("graph_module"), dict):
        return "models/model.json is not a torch.export program"
    if model["graph_module"].get("graph", {}).get("custom_obj_values"):
        return "it carries custom (C++/Python) objects"
    for key, value in walk(model):
        why = check_value(key, value)
        if why:
            return why
    return None


def check_payload_config(config: Any, prefix: str, stored: dict[str, bytes] | None = None) -> str | None:
    """Why a weights or constants config is refused: every entry must be raw tensor bytes (no pickle), and
    (``stored``: the members by file name) hold at least the bytes its shape, strides and dtype address."""
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        return "its weights or constants table is not valid"
    for fqn, meta in entries.items():
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False or not meta.get("tensor_meta"):
            return f"{fqn!r} is stored as a pickle, not as tensor bytes"
        if not re.fullmatch(prefix + r"\d+", str(meta.get("path_name", ""))):
            return f"{fqn!r} is stored as {meta.get('path_name')!r}, not as a tensor"
        need = _tensor_bytes(meta["tensor_meta"])
        have = len(stored.get(meta["path_name"], b"")) if stored is not None else None
        if need is not None and have is not None and have < need:
            return f"{fqn!r} holds {have} bytes where its shape and dtype need {need} (damaged or edited weights)"
    return None


def _tensor_bytes(meta: Any) -> int | None:
    """The bytes a serialised tensor's storage must hold (None: sizes not plain integers, or an unknown dtype)."""
    try:
        from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE as dtypes

        sizes = [int(s["as_int"]) for s in meta["sizes"]]
        strides = [int(s["as_int"]) for s in meta["strides"]]
        offset = int(meta.get("storage_offset", {}).get("as_int", 0))
        item = dtypes[meta["dtype"]].itemsize
    except (ImportError, KeyError, TypeError, ValueError, AttributeError):
        return None
    if any(s == 0 for s in sizes):
        return 0
    return (offset + sum((n - 1) * st for n, st in zip(sizes, strides)) + 1) * item


def read_bounded(path: Path) -> bytes:
    """The bytes of a teacher file, at most :data:`MAX_TEACHER_BYTES` (a larger file is one line, unread)."""
    size = path.stat().st_size
    if size > MAX_TEACHER_BYTES:
        raise TeacherError(f"cannot read teacher {path}: {size / 2**30:.1f} GiB is more than any teacher "
                           f"({MAX_TEACHER_BYTES / 2**30:.0f} GiB at most)")  # fmt: skip
    return path.read_bytes()


def check_unpacked_sizes(path: Path, z: zipfile.ZipFile) -> None:
    """Refuse an archive whose members would inflate past :data:`MAX_TEACHER_BYTES` or :data:`MAX_UNPACK_RATIO`
    times their stored size, before any is read (the declared sizes bound what zipfile inflates)."""
    infos = z.infolist()
    total = sum(i.file_size for i in infos)
    bomb = next((i for i in infos if i.file_size > MAX_UNPACK_RATIO * max(i.compress_size, 1024)), None)
    if total > MAX_TEACHER_BYTES or bomb is not None:
        raise refuse(path, f"its members would unpack to {total / 2**20:.0f} MiB"
                           + (f" ({bomb.filename} {bomb.file_size // max(bomb.compress_size, 1)}x its size)" if bomb else ""))  # fmt: skip


# ------------------------------------------------------------------------------------- .pt2 programs
def _members(path: Path, data: bytes) -> dict[str, bytes]:
    """The archive's members by their name below its one root folder (a zip that is not a torch.export archive of
    one plain program: one line)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            check_unpacked_sizes(path, z)
            entries = {info.filename: z.read(info) for info in z.infolist() if not info.is_dir()}
    except TeacherError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, NotImplementedError) as e:
        raise TeacherError(
            f"cannot read teacher {path}: not a torch.export program (not a complete zip archive: {one_line(str(e), 80)}); "
            "pass a file written by torch.export.save"
        ) from None
    roots = {name.split("/", 1)[0] for name in entries}
    members = {name.split("/", 1)[1]: blob for name, blob in entries.items() if "/" in name}
    if len(roots) != 1 or len(members) != len(entries) or "models/model.json" not in members:
        what = "another zip"
        if any(n.endswith("data.pkl") for n in entries):
            script = any("/code/" in n for n in entries)
            what = "a TorchScript file: give it a .pt name" if script else "a torch.save file: a checkpoint?"
        raise TeacherError(
            f"cannot read teacher {path}: not a torch.export program ({what}); a .pt2 teacher is a file "
            "written by torch.export.save"
        )
    foreign = sorted(name for name in members if not EXPORT_MEMBERS.fullmatch(name))
    if foreign:
        raise refuse(path, f"the archive holds {foreign[0]!r}, which is not part of a plain exported program")
    return members


def _json(path: Path, members: dict[str, bytes], name: str) -> Any:
    """The JSON member ``name`` (missing or invalid: one line)."""
    try:
        return json.loads(members[name].decode("utf-8"))
    except KeyError:
        raise TeacherError(f"cannot read teacher {path}: {name} is missing; re-export the program") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise TeacherError(f"cannot read teacher {path}: {name} is not valid JSON ({one_line(str(e), 80)})") from None


def _check_sample_inputs(path: Path, blob: bytes) -> None:
    """The sample inputs (the archive's one pickle) must hold tensors and plain values only; torch would
    otherwise retry them with ``weights_only=False``. They are checked, then left out of what torch reads."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as e:
        imported = next((g for g in pickle_imports(_first_pickle(blob)) if not g.startswith("torch.")), None)
        why = f"a pickle importing {imported}" if imported else one_line(str(e).split("\n")[0], 80)
        raise refuse(path, f"its sample inputs are not plain tensors ({why})") from None


def _first_pickle(blob: bytes) -> bytes:
    """The data.pkl inside a torch.save zip, or the blob itself (only to name what a pickle imports)."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    except Exception:
        return blob


def checked_export_archive(path: Path, data: bytes) -> bytes:
    """The archive ``data`` checked (module docstring), as the bytes of the copy torch may deserialise: the
    program's metadata dropped, the sample inputs emptied, every other member as it was."""
    members = _members(path, data)
    if members.get("archive_format", b"").strip() != b"pt2" or members.get("archive_version", b"").strip() != b"0":
        raise TeacherError(f"cannot read teacher {path}: not a pt2 archive of version 0 (re-export it with this torch)")
    model = _json(path, members, "models/model.json")
    try:
        _drop_metadata(model)
        why = check_program(model)
    except RecursionError:  # JSON nested deeper than any program is
        why = "models/model.json is nested too deeply"
    for name, prefix in (("data/weights/model_weights_config.json", "weight_"),
                         ("data/constants/model_constants_config.json", "tensor_")):  # fmt: skip
        folder = name.rsplit("/", 1)[0] + "/"
        stored = {k[len(folder) :]: v for k, v in members.items() if k.startswith(folder)}
        why = why or check_payload_config(_json(path, members, name), prefix, stored)
    if why:
        raise refuse(path, why)
    if "data/sample_inputs/model.pt" in members:
        _check_sample_inputs(path, members["data/sample_inputs/model.pt"])
    members["models/model.json"] = json.dumps(model).encode()
    members["data/sample_inputs/model.pt"] = b""  # torch then keeps no example inputs: nothing is unpickled
    return _write_archive(members)


def _drop_metadata(model: Any) -> None:
    """Leave out free text torch would read (stack traces, module paths and types, custom metadata)."""
    for _, value in walk(model):
        if isinstance(value, dict):
            for dropped in DROPPED:
                if dropped in value and isinstance(value[dropped], dict):
                    value[dropped] = {}


def _write_archive(members: dict[str, bytes]) -> bytes:
    """A pt2 archive of ``members``, written by torch's own archive writer (its reader expects its layout)."""
    from torch.export.pt2_archive._package import PT2ArchiveWriter

    buffer = io.BytesIO()
    with PT2ArchiveWriter(buffer) as writer:
        for name, blob in members.items():
            if not name.startswith(".data/") and not writer.has_record(name):  # records the writer writes itself
                writer.write_bytes(name, blob)
    return buffer.getvalue()


def _serialised_name(target: Any) -> str:
    """How torch.export names a call target (an operator overload, a higher-order operator, a function)."""
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"torch.ops.higher_order.{target.name()}"
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__name__', '?')}"


def _call_targets(node: torch.fx.Node) -> list[Any]:
    """What a graph node calls: its target, and any operator or function passed to it as an argument."""
    found = [node.target] if node.op == "call_function" else []
    torch.fx.node.map_aggregate((node.args, node.kwargs), lambda a: found.append(a) if callable(a) else None)
    return found


def check_loaded_graph(module: nn.Module) -> str | None:
    """Why a deserialised program is refused (the check after loading): every call is an allowed operator."""
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        for node in getattr(graph, "nodes", ()):
            if node.op in ("call_module", "call_method"):
                return f"it calls {node.op} {node.target!r}"
            for target in _call_targets(node):
                if target in SYMBOLIC_OPS:
                    continue
                why = check_target(_serialised_name(target))
                if why:
                    return why
    return None


@contextlib.contextmanager
def no_pickled_code(path: Path) -> Iterator[None]:
    """While ``torch.export.load`` reads ``path``: tensors with ``weights_only=True``, other pickles refused.

    The second wall behind the archive check (which leaves nothing pickled but tensors' own records): the archive
    reader unpickles custom objects with ``pickle.loads`` or torch's own object loader, depending on the torch
    release; both are replaced for the duration of the load (the stdlib function itself, not a name inside
    torch's private modules, which differ between releases)."""
    real_load, real_obj, real_loads = torch.load, torch._C._pickle_load_obj, pickle.loads

    def weights_only_load(*args, **kwargs):
        kwargs["weights_only"] = True
        return real_load(*args, **kwargs)

    def refuse_pickle(*args, **kwargs):
        raise refuse(path, "the program carries pickled Python objects")

    torch.load, torch._C._pickle_load_obj, pickle.loads = weights_only_load, refuse_pickle, refuse_pickle
    try:
        yield
    finally:
        torch.load, torch._C._pickle_load_obj, pickle.loads = real_load, real_obj, real_loads


#: torch loggers that report a failed load with its traceback (the failure becomes one line instead)
QUIET_LOGGERS = ("torch.export", "torch.export.pt2_archive._package", "torch._export.serde.serialize",
                 "torch.export.exported_program", "torch.fx.experimental.symbolic_shapes")  # fmt: skip


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """Silence :data:`QUIET_LOGGERS` and warnings while torch reads a teacher."""
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    before = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, was in zip(loggers, before):
            lg.disabled = was


def read_export(path: Path) -> tuple[Any, nn.Module]:
    """The ``ExportedProgram`` in ``path``, deserialised from a checked copy (module docstring), and its module."""
    from ..ops import onednn  # noqa: F401 -- registers PACKAGE_OPS, which torch resolves by name

    archive = checked_export_archive(path, read_bounded(path))  # read once: what is loaded is what was checked
    try:
        with no_pickled_code(path), quiet_torch_logs():
            program = torch.export.load(io.BytesIO(archive))
            why = check_loaded_graph(program.graph_module)
            module = None if why else program.module()
    except TeacherError:
        raise
    except Exception as e:  # the structure passed the checks but torch cannot build it: a damaged file
        raise TeacherError(
            f"cannot read teacher {path}: torch.export cannot load it ({type(e).__name__}: "
            f"{one_line(str(e).split(chr(10))[0], 100)}); re-export it with this torch"
        ) from None
    if why:
        raise refuse(path, why)
    return program, module


# ------------------------------------------------------------------------------------- TorchScript
def _check_script_archive(path: Path, data: bytes) -> None:
    """Before ``torch.jit.load``: no ``__setstate__`` in the code (loading runs it) and no C++ custom classes in
    the pickles (their own ``__setstate__`` runs)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            check_unpacked_sizes(path, z)
            # every entry, duplicates included: the C++ reader may take another of two same-named ones
            entries = [(i.filename, z.read(i)) for i in z.infolist() if i.filename.endswith((".py", ".pkl"))]
    except TeacherError:
        raise
    except Exception as e:
        raise TeacherError(
            f"cannot read teacher {path}: a damaged TorchScript archive ({one_line(str(e), 80)})"
        ) from None
    for name, blob in entries:
        if name.endswith(".py") and b"__setstate__" in blob:
            raise refuse(path, f"its code defines __setstate__ ({name}), which runs while the file loads")
        if name.endswith(".pkl"):
            custom = next((g for g in pickle_imports(blob) if g.startswith("__torch__.torch.classes.")), None)
            if custom:
                raise refuse(path, f"it holds an object of the C++ class {custom}")


def _constant(value: Any) -> Any:
    """The value of a TorchScript constant (None for anything computed)."""
    if value.node().kind() != "prim::Constant":
        return None
    try:
        return value.toIValue()
    except RuntimeError:
        return None


def _counts_dimensions(value: Any, depth: int = 0) -> bool:
    """Whether a TorchScript integer is a tensor's number of dimensions, or the length of a list of shapes (see
    :func:`_shape_list`), give or take a small constant: what a ``for`` over a shape counts to."""
    node, inputs = value.node(), list(value.node().inputs())
    if depth > MAX_SHAPE_DEPTH:
        return False
    if node.kind() == "aten::dim":
        return True
    if node.kind() == "aten::len":
        return _shape_list(inputs[0], depth + 1)
    if node.kind() in ("aten::add", "aten::sub") and len(inputs) == 2:
        offset = _constant(inputs[1])
        return (
            isinstance(offset, int)
            and not isinstance(offset, bool)
            and abs(offset) <= MAX_LOOP_OFFSET
            and _counts_dimensions(inputs[0], depth + 1)
        )
    return False


def _shape_list(value: Any, depth: int) -> bool:
    """Whether a TorchScript list is a tensor's shape, a copy or slice of one, a list written out in the code, or
    two such lists joined: as long as a tensor has dimensions, or the code has items (never a repeated list)."""
    node, inputs = value.node(), list(value.node().inputs())
    if depth > MAX_SHAPE_DEPTH:
        return False
    if node.kind() == "aten::size":
        return len(inputs) == 1
    if node.kind() == "prim::ListConstruct":
        return True
    if node.kind() in ("aten::list", "aten::slice") and inputs:
        return _shape_list(inputs[0], depth + 1)
    if node.kind() == "aten::add" and len(inputs) == 2:
        return all(_shape_list(v, depth + 1) for v in inputs)
    return False


def bounded_loop(node: Any) -> bool:
    """Whether a ``prim::Loop`` is a ``for`` over the dimensions of a tensor: no condition of its own (constant
    true, before and after each turn) and a trip count that :func:`_counts_dimensions` bounds. TorchScript's
    own library code has such loops (BatchNorm's batch-size check, the sizes of an interpolation), so a scripted
    CNN keeps them; they end after at most as many turns as a tensor has dimensions."""
    trips, condition = list(node.inputs())[:2]
    body = next(iter(node.blocks()))
    again = next(iter(body.outputs()))
    return _constant(condition) is True and _constant(again) is True and _counts_dimensions(trips)


def check_script_graph(graph: Any, in_loop: bool = False) -> str | None:
    """Why a TorchScript graph is refused: an instruction outside ``aten`` (minus :data:`REFUSED_OPS`) and
    :data:`SCRIPT_PRIMS`, or a loop but a :func:`bounded_loop` (not within another loop), in any block (the graph
    given is the inlined one: called functions included)."""
    for node in graph.nodes():
        namespace, _, op = node.kind().partition("::")
        loop = node.kind() == "prim::Loop"
        if loop and (in_loop or not bounded_loop(node)):
            return f"its forward has a loop (prim::Loop) that may never end; {LOOP_FIX}"
        if namespace == "prim" and op not in SCRIPT_PRIMS and not loop:
            return f"its forward runs prim::{op}, which is not a tensor operation"
        if namespace not in ("prim", "aten"):
            return f"its forward calls {node.kind()}, an operator outside aten"
        if namespace == "aten" and op in REFUSED_OPS:
            return f"its forward calls aten::{op}, which {REFUSED_OPS[op]}"
        for block in node.blocks():
            why = check_script_graph(block, in_loop or loop)
            if why:
                return why
    return None


class ScriptTeacher(nn.Module):
    """A checked TorchScript module, called through its ``forward`` (the graph that was checked): calling the
    module itself would also run forward hooks compiled into it."""

    def __init__(self, script: nn.Module) -> None:
        super().__init__()
        self.script = script

    def forward(self, x: Tensor) -> Any:
        return self.script.forward(x)


def read_torchscript(path: Path) -> ScriptTeacher:
    """The TorchScript module in ``path``, loaded after the archive check, its forward checked before it runs."""
    data = read_bounded(path)
    _check_script_archive(path, data)
    try:
        with quiet_torch_logs():
            script = torch.jit.load(io.BytesIO(data), map_location="cpu")
            graph = script.forward.inlined_graph
    except Exception as e:
        raise TeacherError(
            f"cannot read teacher {path}: TorchScript cannot load it ({type(e).__name__}: "
            f"{one_line(str(e).split(chr(10))[0], 100)})"
        ) from None
    why = check_script_graph(graph)
    if why:
        raise refuse(path, why)
    return ScriptTeacher(script.eval())
