"""Every `dsrl train` command the docs show parses: a stale or misspelt flag there fails here, not in a user's shell
(OpenRLHF PR #1275 is a month of such fixes). Commands whose --config is a file of the reader's own are checked for
their flags on top of configs/toy_cpu.yaml."""

import re
import shlex

import pytest

from dsrl.config import build_parser
from tests.conftest import ROOT

DOCS = ["README.md", "docs/tutorial.md"]


def commands(text: str) -> list[str]:
    """The `dsrl train` argument lists of every bash block: continuation lines joined, comments dropped, and the
    block's own `NAME="..."` variables expanded."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        variables: dict[str, str] = {}
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
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
