"""Every `dsrl train` command the docs show parses: a stale or misspelt flag there fails here, not in a user's shell
(OpenRLHF PR #1275 is a month of such fixes). Commands whose --config is a file of the reader's own are checked for
their flags on top of configs/toy_cpu.yaml. The contributors' page's table of rooms holds the code's imports."""

import ast
import re
import shlex

import pytest

from dsrl.config import build_parser
from tests.conftest import ROOT

DOCS = ["README.md", "docs/tutorial.md"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md") if p.name != "tutorial.md"
)
"""The README and every page of the site (docs/tutorial.md among them): a command moved between pages still parses."""


def commands(text: str) -> list[str]:
    """The `dsrl train` argument lists of every bash block: continuation lines joined, comments dropped, and the
    block's own `NAME="..."` variables expanded."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        variables: dict[str, str] = {}
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"(^|\s+)#.*$", "", line).strip()  # a comment, or a line of one
            line = re.sub(r"\$(\w+)", lambda m, known=variables: known.get(m[1], m[0]), line)
            if m := re.fullmatch(r'(\w+)="(.*)"', line):
                variables[m[1]] = m[2]
                continue
            for part in line.split("&&"):
                words = shlex.split(part)
                if words[:2] == ["dsrl", "train"]:
                    found.append(words[2:])
                elif "--module" in words and "dsrl.train" in words:  # the deepspeed launcher
                    found.append(words[words.index("dsrl.train") + 1 :])
    return found


CASES = [(doc, args) for doc in DOCS for args in commands((ROOT / doc).read_text())]


def test_the_docs_show_commands():
    assert len(CASES) >= 15  # the extraction itself works
    assert {"README.md", "docs/tutorial.md", "docs/getting-started.md", "docs/gpus.md"} <= {doc for doc, _ in CASES}


@pytest.mark.parametrize("doc,args", CASES, ids=[f"{d}:{' '.join(a)[:60]}" for d, a in CASES])
def test_every_documented_command_parses(doc, args, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = [a for a in args if a not in ("--help", "--print_config")]
    if "--config" in args and not (ROOT / args[args.index("--config") + 1]).is_file():
        i = args.index("--config")
        args = args[:i] + args[i + 2 :]  # a file of the reader's own (run.yaml, sums.yaml)
    if "--config" not in args:
        args = ["--config", "configs/toy_cpu.yaml", *args]  # its flags, on top of a shipped config
    build_parser("dsrl train").parse_args(args)


def room(module: str) -> str:
    """`dsrl.zero.actor` -> `zero`, `dsrl.train` -> `train`: a package is one room, a top-level module another."""
    return module.split(".")[1]


def imported_rooms() -> dict[str, set[str]]:
    """Every room's imports of other rooms, module-level and inside functions (`from dsrl import moe` included)."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "dsrl").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        if rel.parts == ("dsrl", "__init__"):
            continue
        here = room(".".join(rel.parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"dsrl.{a.name}" for a in node.names] if node.module == "dsrl" else [node.module]
            else:
                continue  # dsrl's code imports by absolute name
            found.setdefault(here, set()).update(room(n) for n in names if n.startswith("dsrl.") and room(n) != here)
    return found


def test_the_contributors_page_names_every_rooms_imports():
    """docs/contributing.md's table: each room imports only rooms its row names, each of them a row above it."""
    rows = re.findall(r"^\| `([\w/]+)` \| .* \| (.*) \|$", (ROOT / "docs/contributing.md").read_text(), re.M)
    order = [name.rstrip("/") for name, _ in rows]
    allowed = {name.rstrip("/"): set(re.findall(r"`(\w+)`", cell)) for name, cell in rows}
    actual = imported_rooms()
    assert set(actual) <= set(order), f"rooms missing from docs/contributing.md: {set(actual) - set(order)}"
    for name in order:
        extra = actual.get(name, set()) - allowed[name]
        assert not extra, f"{name} imports {extra}: name it in its row of docs/contributing.md"
        above = set(order[: order.index(name)])
        assert allowed[name] <= above, f"{name}'s row names {allowed[name] - above}, not above it: an import back up"
