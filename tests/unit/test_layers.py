"""The engine's layers (docs/architecture.md) as a checked rule: every import inside
``hpdcp_runner.dcp`` points to the same layer or a lower one, the import graph has no cycles, the
engine never imports Hydra/OmegaConf, and its public surface is exactly the documented one."""

from __future__ import annotations

import ast
import os

import hpdcp_runner.dcp as dcp

ROOT = os.path.dirname(dcp.__file__)
# lower number = lower layer; a module may import its own layer and those below
LAYERS = {"core": 0, "format": 1, "planning": 2, "storage": 3, "comm": 4, "api": 5, "protocol": 5, "background": 5, "node_tier": 5, "node_moves": 5,
          "state_dict": 5, "offline": 6, "__init__": 7, "tools": 7}
FORBIDDEN = ("hydra", "omegaconf")


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel] = os.path.join(dirpath, f)
    return out


def _layer(mod: str) -> int:
    return LAYERS[mod.split(".")[0]]


def _imports(mod: str, path: str) -> list[tuple[str, int]]:
    """(absolute target, line) of every import in the module, at any depth (function-level too)."""
    pkg = mod.split(".")[:-1] if not mod.endswith("__init__") else mod.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                target = ".".join(["hpdcp_runner", "dcp", *base, *([node.module] if node.module else [])])
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                names = [node.module]
            out += [(n, node.lineno) for n in names]
    return out


def _engine_target(name: str, modules: dict[str, str]) -> str | None:
    if not name.startswith("hpdcp_runner.dcp"):
        return None
    rest = name[len("hpdcp_runner.dcp"):].lstrip(".")
    while rest and rest not in modules and f"{rest}.__init__" not in modules:
        rest = rest.rpartition(".")[0]
    if not rest:
        return "__init__"
    return rest if rest in modules else f"{rest}.__init__"


def test_imports_point_down_the_layers_and_never_to_hydra():
    modules = _modules()
    problems = []
    for mod, path in sorted(modules.items()):
        for name, line in _imports(mod, path):
            if name.split(".")[0] in FORBIDDEN:
                problems.append(f"{mod}:{line} imports {name} (the engine never imports Hydra/OmegaConf)")
            target = _engine_target(name, modules)
            if target is not None and target != mod and _layer(target) > _layer(mod):
                problems.append(f"{mod}:{line} imports {target}, a higher layer")
    assert not problems, "\n".join(problems)


def test_the_engine_import_graph_has_no_cycles():
    modules = _modules()
    graph = {m: sorted({t for n, _ in _imports(m, p) if (t := _engine_target(n, modules)) and t != m
                        and not t.endswith("__init__")}) for m, p in modules.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in graph.get(m, ()):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]) if t in stack else f"{m} -> {t}")
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_the_runner_uses_only_the_engines_public_surface():
    """hpdcp_runner.dcp (the API) and hpdcp_runner.dcp.tools (helpers), never a layer module."""
    runner = os.path.dirname(ROOT)
    problems = []
    for dirpath, _, files in os.walk(runner):
        if dirpath.startswith(ROOT):
            continue
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            pkg = os.path.relpath(dirpath, os.path.dirname(runner)).split(os.sep)
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    base = pkg[:len(pkg) - node.level + 1] if node.level else []
                    name = ".".join([*base, node.module]) if node.level else node.module
                    if name.startswith("hpdcp_runner.dcp.") and name != "hpdcp_runner.dcp.tools":
                        problems.append(f"{os.path.relpath(path, runner)}:{node.lineno} imports {name}")
    assert not problems, "\n".join(problems)


def test_public_surface_is_the_documented_one():
    assert sorted(dcp.__all__) == sorted([
        "save", "load", "read_metadata", "async_save", "AsyncSaveResponse", "wait_for_async_saves",
        "release_staging_buffers", "start_async_persist", "PersistProcessError", "copy_checkpoint",
        "Drainer", "get_optim_state_dict", "set_optim_state_dict", "get_model_state_dict",
        "set_model_state_dict", "BroadcastOptions", "release_broadcast_groups", "MinimumRankLoadPlanner",
        "LOAD_PLANNERS", "LoadResult", "Metadata", "SavePlanner", "LoadPlanner", "StandardSavePlanner",
        "MinimumRankSavePlanner", "StandardLoadPlanner", "StorageWriter", "StorageReader", "FileSystemWriter",
        "FileSystemReader", "HfReader", "TorchDcpReader", "open_reader", "open_writer", "ObjectStoreReader",
        "ObjectStoreWriter", "rename_keys", "FlatShard", "FusedShard", "LocalShard", "ShardPieces",
        "SAVE_PLANNERS", "HpdcpError", "ConfigError", "CheckpointNotFoundError", "CheckpointExistsError",
        "CommitDurabilityError", "CheckpointChangedError", "MetadataError", "CorruptCheckpointError",
        "StateDictError", "InsufficientMemoryError", "KeyMismatchError", "ShapeMismatchError", "CoverageError", "PickleNotAllowedError",
        "StorageAccessError", "ReplicaMismatchError", "DistributedError", "CollectiveTimeoutError", "PeerLostError"])
    for name in dcp.__all__:
        assert hasattr(dcp, name), name


_RUNNER = os.path.dirname(os.path.dirname(dcp.__file__))
_SCHEME_NAMES = {"is_uri", "is_remote", "scheme_of", "kind_of", "KINDS", "check_uri"}


def _python_files(root: str):
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


def _outside_storage():
    """(path, parsed module) of every module of the package outside dcp/storage/."""
    storage = os.path.join(_RUNNER, "dcp", "storage")
    for path in _python_files(_RUNNER):
        if not path.startswith(storage + os.sep):
            yield path, ast.parse(open(path).read())


def test_only_storage_looks_at_a_uris_scheme():
    """One seam: outside dcp/storage/, a path reaches a store through location.locate; nothing
    else names the scheme functions or the store registry."""
    found = []
    for path, tree in _outside_storage():
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else \
                [node.attr] if isinstance(node, ast.Attribute) else [node.id] if isinstance(node, ast.Name) else []
            found += [f"{os.path.relpath(path, _RUNNER)}:{node.lineno} {n}" for n in names if n in _SCHEME_NAMES]
    assert not found, found


def test_the_tools_and_the_runner_ask_the_location_instead_of_branching():
    """Outside dcp/storage/, no local-or-remote predicate (is_local, is_remote, is_uri), no
    ``.local_path``, and no isinstance or ``type(...) is`` test of a class the storage layer
    defines: what differs between storages is a method or a capability of the location, the
    writer or the output (docs/architecture.md, the storage seam)."""
    found = []
    for path, tree in _outside_storage():
        classes = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                   and ".storage" in f".{n.module}" for a in n.names if a.name[:1].isupper()}
        where = lambda n: f"{os.path.relpath(path, _RUNNER)}:{n.lineno}"  # noqa: E731
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in ("is_local", "is_remote", "is_uri"):
                found.append(f"{where(node)} {node.id}")
            elif isinstance(node, ast.Attribute) and node.attr in ("local_path", "is_local", "is_remote", "is_uri"):
                found.append(f"{where(node)} .{node.attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                    and len(node.args) == 2:
                named = [e.id for e in (node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]])
                         if isinstance(e, ast.Name)]
                found += [f"{where(node)} isinstance(..., {c})" for c in named if c in classes]
            elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                found += [f"{where(node)} type(...) is {c.id}" for c in node.comparators
                          if isinstance(c, ast.Name) and c.id in classes]
    assert not found, found


def test_no_module_is_over_800_lines():
    long = [f"{os.path.relpath(p, _RUNNER)}: {n}" for p in _python_files(_RUNNER)
            if (n := sum(1 for _ in open(p))) > 800]
    assert not long, long


def test_no_function_is_over_80_lines():
    long = []
    for path in _python_files(_RUNNER):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{os.path.relpath(path, _RUNNER)}:{node.lineno} {node.name}")
    assert not long, long


def test_no_class_has_over_25_methods():
    """A class past 25 methods holds more than one job (the reader's copying, a store prefix's
    fetching ahead were cut out along their seams)."""
    big = []
    for path in _python_files(_RUNNER):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for f in node.body)
                if n > 25:
                    big.append(f"{os.path.relpath(path, _RUNNER)}:{node.lineno} {node.name} ({n} methods)")
    assert not big, big


def test_layouts_does_not_import_the_config():
    """config.py imports layouts.py (validation); the reverse would be a cycle."""
    tree = ast.parse(open(os.path.join(_RUNNER, "layouts.py")).read())
    mods = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "config" not in mods and not any(m and m.endswith(".config") for m in mods), mods


def test_readers_take_their_storage_by_composition():
    """One reader over any storage's files: no store's reader is built on another store's, and
    the storage layer makes no class inside a function or an instance past its __init__."""
    from hpdcp_runner.dcp.storage.checkpoint_files import CheckpointFiles
    from hpdcp_runner.dcp.storage.reader import CheckpointReader

    per_store = (dcp.FileSystemReader, dcp.ObjectStoreReader)
    for cls in per_store + (dcp.HfReader, dcp.TorchDcpReader):
        assert issubclass(cls, CheckpointReader), cls
        assert not [b for b in cls.__mro__[1:] if b in per_store], (cls, cls.__mro__)
        assert not issubclass(cls, CheckpointFiles)
    found = []
    for path in _python_files(os.path.join(_RUNNER, "dcp", "storage")):
        tree = ast.parse(open(path).read())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{os.path.basename(path)}:{n.lineno} class {n.name}" for n in ast.walk(fn)
                          if isinstance(n, ast.ClassDef)]
            if isinstance(fn, ast.Attribute) and fn.attr == "__new__":
                found.append(f"{os.path.basename(path)}:{fn.lineno} __new__")
    assert not found, found
