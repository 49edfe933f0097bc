"""Every tool on CPU: each tools/*.py and tools/peers/*.py module imports and answers --help, so a rename in dsrl
that a benchmark or a GPU script depends on fails here, not at the next GPU run."""

import json
import subprocess
import sys

from tests.conftest import ROOT

IN_VERL = {"tools/peers/verl_agent.py", "tools/peers/verl_sampler.py"}
"""Classes that verl's own processes load by path (they subclass verl's). verl is not installed here:
tests/test_peers.py checks them against stand-ins."""
TOOLS = sorted(
    str(p.relative_to(ROOT)) for p in [*ROOT.glob("tools/*.py"), *ROOT.glob("tools/peers/*.py")]
    if str(p.relative_to(ROOT)) not in IN_VERL
)  # fmt: skip
IMPORTED_ONLY = {"tools/peers/verl_reward.py": "a reward function that verl loads by path: no command line"}

# One interpreter runs them all, one after the other, as `python TOOL --help` would (its folder first on sys.path):
# torch and DeepSpeed are imported once, not once per tool.
RUN = """
import contextlib, io, json, os, runpy, sys
outcomes = {}
for path in sys.argv[1:]:
    sys.argv, sys.path[0] = [path, "--help"], os.path.dirname(os.path.abspath(path))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(path, run_name="__main__")
        code = None
    except SystemExit as e:
        code = e.code
    outcomes[path] = [code, printed.getvalue()]
print(json.dumps(outcomes))
"""


def test_every_tool_imports_and_answers_help():
    out = subprocess.run([sys.executable, "-c", RUN, *TOOLS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    outcomes = json.loads(out.stdout.splitlines()[-1])
    assert sorted(outcomes) == TOOLS
    for tool, (code, printed) in outcomes.items():
        if tool in IMPORTED_ONLY:
            assert code is None, tool
        else:
            assert code == 0 and "usage:" in printed, f"{tool}: exit {code}, printed {printed[:300]!r}"
