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
          "planning.noise_scale", "planning.goodput",
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


def module_file(package: Path, parts: list[str]) -> Path | None:
    """The file of module <parts> of the package at `package` (a package: its __init__.py), or None."""
    path = package.joinpath(*parts)
    return next((c for c in [path / "__init__.py"] + ([path.with_suffix(".py")] if parts else []) if c.is_file()), None)


def top_level_names(path: Path) -> set[str] | None:
    """The names a module binds at its top (in if/try blocks too), read without importing
    it; None for a module whose __getattr__ makes any name possible."""
    todo, names = list(ast.parse(path.read_text()).body), set()
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            todo += [n for h in getattr(node, "handlers", []) for n in h.body]
    return None if "__getattr__" in names else names


def unresolved_relative_imports(package: Path = PACKAGE) -> list[str]:
    """Every `from .x import y` of the package, at the top or inside a function alike,
    that names no module of the package, or a name that module (or package) neither
    defines nor has as a submodule: 'module:line: from .x import y (why)'. Read from the
    source, so that nothing is imported (a function-level import fails only when its
    function runs)."""
    wrong = []
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).with_suffix("").as_posix().replace("/", ".")
        here = name.split(".")[:-1]                # the package a relative import starts from
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            said = f"{name}:{node.lineno}: from {'.' * node.level}{node.module or ''} import " + \
                ", ".join(a.name for a in node.names)
            if node.level - 1 > len(here):
                wrong.append(f"{said} (above the package)")
                continue
            base = here[:len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
            target = module_file(package, base)
            if target is None:
                wrong.append(f"{said} (no module dbs_mpi.{'.'.join(base)})")
                continue
            defined = top_level_names(target)
            for alias in node.names:
                submodule = target.name == "__init__.py" and module_file(package, base + [alias.name])
                if alias.name == "*" or defined is None or alias.name in defined or submodule:
                    continue
                wrong.append(f"{said} (dbs_mpi.{'.'.join(base)} has no {alias.name})")
    return wrong


def test_every_relative_import_resolves_even_inside_a_function():
    """An import inside a function body runs only when the function does: a module that
    moved leaves it pointing nowhere while every other test passes (`simulate calibrate`
    imported `.train` from simulator/ after the engine had moved to tools/train.py)."""
    wrong = unresolved_relative_imports()
    assert not wrong, "relative imports that resolve to nothing:\n" + "\n".join(wrong)


def test_an_unresolved_relative_import_is_found(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "engine.py").write_text("def train():\n    pass\n")
    (tmp_path / "sub" / "__init__.py").write_text("")
    (tmp_path / "sub" / "calibration.py").write_text(
        "from ..engine import train\nfrom . import calibration\n\n"
        "def measure():\n    from .engine import train\n    from ..engine import evaluate\n")
    wrong = unresolved_relative_imports(tmp_path)
    assert [w.split(" (")[1] for w in wrong] == ["no module dbs_mpi.sub.engine)",
                                                 "dbs_mpi.engine has no evaluate)"], wrong


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
    assert graph["training.optimizer"] >= {"training.exchange", "mpi.collectives"} and "tools.train" in graph["tools.cli"], \
        "the import graph is misread"
    assert "parameter_server.__init__" in graph["tools.train"] and "mpi.waits" in graph["parameter_server.server"], \
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
    "tools.experiments": "listing a grid loads no numpy or h5py; running one reads result files and checkpoints",
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
