"""The package's shape: the public API resolves (the flat paths of 0.2.0 are gone), models and
data know nothing of MPI, planning and the commands built on it load no torch, every
import points down the layers (options, planning, mpi, training, parameter_server,
tools), and no module imports, even inside a function, a module that imports it back (a
cycle that a local import only hides)."""
import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dbs_mpi


def loaded_by_each(modules) -> dict[str, set[str]]:
    """{module: what importing dbs_mpi.<module> loaded that was not loaded yet}, importing
    `modules` in turn in one fresh interpreter (one start, not one each: most load torch).
    A module that loads something forbidden is named, unless one before it already
    loaded it, and then that one is named: a test per module still fails for any."""
    code = textwrap.dedent(f"""
        import importlib, json, sys
        loaded = {{}}
        for name in {list(modules)!r}:
            before = set(sys.modules)
            importlib.import_module("dbs_mpi." + name)
            loaded[name] = sorted(set(sys.modules) - before)
        print(json.dumps(loaded))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return {name: set(found) for name, found in json.loads(out.stdout).items()}


LIBRARY = ["parameter_server", "training.balancer", "training.optimizer", "planning.sharding",
           "training.evaluation", "training.checkpoint", "training.results", "tools.plugins"]


@pytest.fixture(scope="module")
def loaded_by_library_modules():
    return loaded_by_each(LIBRARY)


@pytest.mark.parametrize("module", LIBRARY)
def test_library_modules_do_not_import_the_command_line(module, loaded_by_library_modules):
    loaded = loaded_by_library_modules[module]
    assert not loaded & {"dbs_mpi.tools.train", "dbs_mpi.tools.cli"}, loaded


NO_MPI = ["tools.models", "tools.data", "training.batches", "planning.allocation", "planning.dynamic",
          "planning.sharding", "planning.heterogeneity", "tools.config", "options", "mpi", "training", "tools",
          "tools.bench_tracking", "mpi.startup",                   # startup: it must run before MPI_Init
          "training.results", "tools.analysis", "tools.machine",  # see LAZY
          "parameter_server.groups", "parameter_server.work"]     # the simulator's Cursor and group rule


@pytest.fixture(scope="module")
def loaded_by_pure_modules():
    return loaded_by_each(NO_MPI)


@pytest.mark.parametrize("module", NO_MPI, ids=lambda m: "mpi-package" if m == "mpi" else m)
def test_models_data_and_pure_functions_do_not_import_mpi(module, loaded_by_pure_modules):
    assert "mpi4py.MPI" not in loaded_by_pure_modules[module]


# Planning, and what `dbs-mpi simulate`, `data` and `close` run, answer without torch
# (~1.4 s of CPU to import): the simulator's module, its dataset sizes, result files.
# Bottom up, so that the first module to load torch is the one named.
NO_TORCH = ["planning.allocation", "planning.dynamic", "planning.sharding", "planning.heterogeneity",
            "training.results", "tools.machine", "tools.data", "parameter_server.groups", "parameter_server.work",
            "tools.simulator"]


@pytest.fixture(scope="module")
def loaded_by_torch_free_modules():
    return loaded_by_each(NO_TORCH)


@pytest.mark.parametrize("module", NO_TORCH)
def test_planning_and_the_simulator_do_not_import_torch(module, loaded_by_torch_free_modules):
    assert "torch" not in loaded_by_torch_free_modules[module]


def test_the_command_line_loads_nothing_heavy_before_the_start_up_watchdog_forks():
    """`dbs-mpi` forks its start-up watchdog first thing: a child forked after numpy
    (OpenBLAS's threads), torch or MPI have loaded inherits their state."""
    code = "import sys, dbs_mpi.tools.cli; print(sorted({'numpy', 'torch', 'mpi4py'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_every_public_name_resolves():
    for name in dbs_mpi.__all__:
        assert getattr(dbs_mpi, name) is not None, name
    with pytest.raises(AttributeError):
        dbs_mpi.no_such_name


PACKAGE = Path(dbs_mpi.__file__).parent


def package_imports(inside_functions_only: bool = False) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, at the top or inside a function alike
    (or only those imported inside a function)."""
    names = {p.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", "."): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        here = name.split(".")[:-1]                # the package a relative import starts from
        found, tree = set(), ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if inside_functions_only and id(node) in top:
                continue
            if isinstance(node, ast.ImportFrom) and node.level:
                base = here[:len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
                candidates = [".".join(base)] + [".".join(base + [a.name]) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dbs_mpi"):
                rest = node.module.split(".")[1:]
                candidates = [".".join(rest)] + [".".join(rest + [a.name]) for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("dbs_mpi.")]
            else:
                continue
            candidates = [c if c in names else f"{c}.__init__" for c in candidates]   # a package: its __init__
            found |= {c for c in candidates if c in names and c != name}
        graph[name] = found
    return graph


def cycle_through(graph, start):
    """A path start -> ... -> start, or None."""
    todo, seen = [(start, [start])], set()
    while todo:
        node, path = todo.pop()
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                todo.append((nxt, path + [nxt]))
    return None


def test_no_module_imports_itself_back():
    graph = package_imports()
    assert graph["training.optimizer"] >= {"training.exchange", "mpi.comm"} and "tools.train" in graph["tools.cli"], \
        "the import graph is misread"
    assert "parameter_server.__init__" in graph["tools.train"] and "mpi.comm" in graph["parameter_server.server"], \
        "imports of and within a subpackage are misread"
    cycles = [" -> ".join(c) for c in (cycle_through(graph, m) for m in sorted(graph)) if c]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_a_cycle_is_found():
    assert cycle_through({"a": {"b"}, "b": {"c"}, "c": {"a"}}, "a") == ["a", "b", "c", "a"]
    assert cycle_through({"a": {"b"}, "b": {"c"}, "c": set()}, "a") is None


def test_names_that_moved_are_the_same_objects_where_they_were_documented():
    from dbs_mpi.mpi import process_group
    from dbs_mpi.training import ddp
    assert dbs_mpi.init_process_group is ddp.init_process_group is process_group.init_process_group
    assert ddp.destroy_process_group is process_group.destroy_process_group



# The layers, bottom up: a module imports only from its own layer or the ones below.
# The package's own __init__ (the public API) and __main__ sit above them all: nothing
# imports from them (the version and the cores at import are in about.py).
LAYERS = ["about", "options", "planning", "mpi", "training", "parameter_server", "tools", "__init__", "__main__"]


def layer_of(module: str) -> str:
    return module.split(".")[0]


def test_every_module_is_in_a_layer_and_imports_only_downwards():
    graph = package_imports()
    assert {layer_of(m) for m in graph} <= set(LAYERS), \
        f"modules outside the layers: {sorted(m for m in graph if layer_of(m) not in LAYERS)}"
    upward = [f"{m} -> {t}" for m, targets in sorted(graph.items()) for t in sorted(targets)
              if LAYERS.index(layer_of(t)) > LAYERS.index(layer_of(m))]
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_an_upward_import_is_found():
    assert LAYERS.index(layer_of("tools.data")) > LAYERS.index(layer_of("training.balancer"))
    assert layer_of("parameter_server.server") == "parameter_server" and layer_of("options") == "options"


@pytest.mark.parametrize("old", ["comm", "results", "analysis", "allocation"])
def test_the_flat_paths_of_0_2_0_are_gone_without_an_import_hook(old):
    """0.3.0 dropped them (CHANGELOG.md): an old path fails at once, and nothing sits on
    sys.meta_path."""
    code = (f"import sys, dbs_mpi; hooks = [f for f in sys.meta_path if getattr(f, '__module__', '').startswith('dbs_mpi')]\n"
            f"try:\n    import dbs_mpi.{old}\nexcept ModuleNotFoundError as e:\n    print(hooks, e.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == f"[] dbs_mpi.{old}"


# The only modules that import package modules inside functions, and why: to keep a
# dependency away from whoever does not need it, never to hide a cycle.
LAZY = {
    "__init__": "the public API loads on first use: `import dbs_mpi` starts no MPI and loads no torch",
    "tools.cli": "the start-up watchdog forks before MPI and torch load; a command loads only what it runs",
    "training.results": "readers of result files (the analysis, the notebooks) need neither MPI nor torch",
    "tools.machine": "the simulator's machine constants need neither torch nor MPI; measuring them does",
    "tools.data": "`dbs-mpi data` and the simulator (the datasets' sizes) need no torch; loading a dataset does",
    "tools.simulator.calibration": "a simulation needs no torch; `simulate calibrate` runs the engine (tools.train)",
    "parameter_server.__init__": "the simulator reads the Cursor and the group rule; the server's modules load torch",
}


def test_imports_inside_functions_are_only_where_a_reason_is_given():
    local = {module for module, imported in package_imports(inside_functions_only=True).items() if imported}
    assert local <= set(LAZY), f"imports inside functions in {sorted(local - set(LAZY))}: move them to the top"


# Classes over ~150 lines and functions over ~60 cannot be read in one sitting (lines of
# code: docstrings count, blank lines and comments do not). None is over today.
CLASS_LINES, FUNCTION_LINES = 150, 60


def long_definitions(class_lines: int = CLASS_LINES, function_lines: int = FUNCTION_LINES) -> dict[str, int]:
    """{module.Class[.method] or module.function: lines of code} of every class and function
    of the package over its limit."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        module = path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", ".")
        todo = [(node, module) for node in ast.parse("\n".join(lines)).body]
        while todo:
            node, prefix = todo.pop()
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            name = f"{prefix}.{node.name}"
            code = sum(1 for line in lines[node.lineno - 1:node.end_lineno]
                       if line.strip() and not line.strip().startswith("#"))
            if code > (class_lines if isinstance(node, ast.ClassDef) else function_lines):
                found[name] = code
            todo += [(child, name) for child in node.body]
    return found


def test_no_class_or_function_is_longer_than_one_sitting():
    shorter_limits = long_definitions(class_lines=100, function_lines=30)
    assert shorter_limits.get("parameter_server.server.Server", 0) > 100 and \
        any(name.count(".") >= 3 for name in shorter_limits), f"the lengths are misread: {shorter_limits}"
    found = long_definitions()
    assert not found, f"too long to read in one sitting (split along a seam): {found}"
