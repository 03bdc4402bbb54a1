"""The structure the code keeps: each part of runner/ imports only itself and the parts below it, no module comes
back to itself through its imports, and outside runner/strategies/ no code names a strategy's class (it asks the
strategy, runner/strategies/strategy_protocol.py). Imports are read from the source, type-only and function-local
ones too."""

import ast
from pathlib import Path

import runner
from runner.strategies import STRATEGIES

PACKAGE = Path(runner.__file__).resolve().parent
# The parts of runner/, from the bottom: each may import its own modules and those of the parts below it.
LAYERS = [
    {"errors", "distributed", "library_noise", "compat", "framework_imports"},
    {"files"},
    {"config"},
    {"components"},
    {"data"},
    {"parallel"},
    {"memory"},
    {"planning"},
    {"strategies"},
    {"processes"},
    {"engine"},
    {"generation"},
    {"tasks", "tools"},
    {"cli"},
    {"__main__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported(path: Path) -> set[str]:
    """The runner's modules that a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("runner"):
            for alias in node.names:  # `from runner.config import data` imports the module runner.config.data
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("runner"))
    return found


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def layer(module: str) -> int:
    return next(i for i, parts in enumerate(LAYERS) if part(module) in parts)


def test_every_module_belongs_to_a_part():
    assert all(layer(module) >= 0 for module in MODULES if module != "runner")


def test_each_part_imports_only_itself_and_the_parts_below_it():
    wrong = [
        f"{module} imports {target}"
        for module, path in MODULES.items()
        if module != "runner"
        for target in imported(path)
        if layer(target) > layer(module) or (layer(target) == layer(module) and part(target) != part(module))
    ]
    assert wrong == []


def test_no_module_comes_back_to_itself_through_its_imports():
    graph = {module: imported(path) for module, path in MODULES.items()}
    circles = []

    def visit(module: str, trail: list[str]) -> None:
        for target in graph.get(module, ()):
            if target in trail:
                circles.append(" -> ".join(trail[trail.index(target) :] + [target]))
            elif target not in done:
                visit(target, trail + [target])
        done.add(module)

    done: set[str] = set()
    for module in graph:
        if module not in done:
            visit(module, [module])
    assert circles == []


def test_only_the_strategy_backends_name_a_strategy_class():
    classes = {strategy.__name__ for strategy in STRATEGIES.values()}
    named = [
        f"{module}: {name}"
        for module, path in MODULES.items()
        if part(module) != "strategies"
        for node in ast.walk(ast.parse(path.read_text()))
        for name in [getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None)]
        if name in classes
    ]
    assert named == []


def test_every_package_of_the_code_ships():
    """An installed runner (pip install ., not -e) holds every package: pyproject.toml lists them one by one."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {module_name(path) for path in PACKAGE.rglob("__init__.py")}
    assert packages - listed == set()


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60  # its docstring and decorators included


def test_no_module_and_no_function_outgrows_its_size():
    too_long = []
    for module, path in MODULES.items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{module}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
                if node.end_lineno - first + 1 > MAX_FUNCTION_LINES:
                    too_long.append(f"{module}.{node.name}: {node.end_lineno - first + 1} lines")
    assert too_long == []


# What a schema module may import when it is imported: no engine (torch, transformers, ...) and nothing that talks
# to the network; what runs at run time lives in runner/components/ and the stages' packages.
SCHEMA_IMPORTS_REFUSED = {
    "torch",
    "transformers",
    "datasets",
    "peft",
    "torchao",
    "deepspeed",
    "wandb",
    "mlflow",
    "tensorboard",
    "urllib",
    "socket",
    "http",
    "requests",
    "huggingface_hub",
    "netrc",
}


def test_config_holds_schemas_and_checks_only():
    engines = []
    for module, path in MODULES.items():
        if part(module) != "config":
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level: what importing the schema costs
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            engines += [f"{module} imports {name}" for name in names if name.split(".")[0] in SCHEMA_IMPORTS_REFUSED]
        for node in ast.walk(tree):  # inside functions too: a schema asks no service
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                engines += [
                    f"{module} imports {name} to talk to a service"
                    for name in names
                    if name.split(".")[0] in {"urllib", "socket", "http", "requests", "netrc"}
                ]
    assert engines == []


def test_no_two_modules_share_a_name():
    """A name says which module is meant: `inference.py` is never two files."""
    by_name: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(module)
    assert {name: modules for name, modules in by_name.items() if len(modules) > 1} == {}


def test_the_layout_is_worked_out_in_one_place():
    """The job's parallel dimensions come from RunSpec.layout (runner/config/spec.py), which the prepared job holds;
    no other code asks a strategy for them again."""
    asked = [
        f"{module}:{node.lineno}"
        for module, path in MODULES.items()
        if module != "runner.config.spec"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dims"
    ]
    assert asked == []
