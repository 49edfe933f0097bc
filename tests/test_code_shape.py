"""The code's shape, kept: short functions, and the layering the design asks for (STYLE.md, DESIGN.md)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXEMPT = {("dsrl/config.py", "validate")}  # one check per line, reported together: long by nature


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_no_function_over_60_lines():
    long = []
    for path in sorted((ROOT / "dsrl").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (rel, node.name) not in EXEMPT:
                if node.end_lineno - node.lineno + 1 > 60:
                    long.append(f"{rel}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def test_the_math_does_not_import_the_http_layer():
    """The trainer's side (dsrl/zero) works on samples, never on servers; the embedded engine stands alone
    beside the weight update's transports rather than on them."""
    for path in (ROOT / "dsrl/zero").rglob("*.py"):
        assert not {m for m in imports(path) if m.startswith("dsrl.serving")}, path
    assert not {m for m in imports(ROOT / "dsrl/serving/embedded.py") if m.startswith("dsrl.sync")}
