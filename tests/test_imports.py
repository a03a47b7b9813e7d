"""No circle of imports between the project's own modules. An import inside a function hides a circle
from Python (it runs later, once both modules are loaded) but not from a reader, who must then know
which module loads first: so every import counts here, at the top level and inside functions."""
import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def project_files():
    """The project's Python files, by their path in the repository (hidden folders skipped: .venv, .git)."""
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(folder, name).relative_to(REPO)


def module_file(name, bases):
    """The project's file that the dotted module `name` is, looked for in `bases` in turn (a script's own
    folder comes first on its sys.path, then the repository); None if it is not one of the project's."""
    for base in bases:
        path = REPO / base / Path(*name.split("."))
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate.relative_to(REPO)
    return None


def imported_files(path):
    """The project's files that `path` imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse((REPO / path).read_text(), str(path))):
        bases = (path.parent, Path("."))
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: named from the repository, through the package of `path` and up
                package = path.parents[node.level - 1].parts
                names, bases = [".".join([*package, *filter(None, [node.module])])], [Path(".")]
            else:
                names = [node.module]
            names += [f"{names[0]}.{alias.name}" for alias in node.names]  # `from harness import launch`
        else:
            continue
        for name in names:
            parts = name.split(".")
            for n in range(1, len(parts) + 1):  # `import a.b` loads a, then a.b
                target = module_file(".".join(parts[:n]), bases)
                if target is not None and target != path:
                    found.add(target)
    return found


def import_graph():
    return {str(path): sorted(str(p) for p in imported_files(path)) for path in project_files()}


def circles(graph):
    """Each circle of `graph` found by a depth-first walk, as the list of its files, the first one again
    at its end."""
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_graph_reads_imports_inside_functions_and_from_a_package():
    graph = import_graph()
    assert "common/stop.py" in graph["harness/procs.py"]  # at the top level
    assert "tiers/replica.py" in graph["tiers/snapshot.py"]  # inside a function
    assert "harness/launch.py" in graph["tests/conftest.py"]  # `from harness import launch`
    assert "tests/conftest.py" in graph["tests/test_ddp.py"]  # a test's folder is on its sys.path
    assert "fsdp/checkpoint.py" in graph["fsdp/train.py"]  # a folder without __init__.py
    assert circles({"a": ["b"], "b": ["c"], "c": ["a"]}) == [["a", "b", "c", "a"]]


def test_no_circle_of_imports():
    found = circles(import_graph())
    assert not found, "circles of imports: " + "; ".join(" -> ".join(circle) for circle in found)
