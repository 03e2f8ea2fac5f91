"""scripts/mutate.py on a throwaway package: an obvious mutant is killed, an equivalent one
survives, the report is deterministic and the package's source is left untouched."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "mutate.py"

MODULE = '''\
def clamp_add(a, b):
    """a + b, capped at 10."""
    total = a + b
    if total > 10:
        return 10
    return total
'''

# total > 10 -> total >= 10 is equivalent (at total == 10 both branches return 10);
# a + b -> a - b is not, and the first assertion catches it.
TESTS = '''\
from toypkg.mod import clamp_add


def test_clamp_add():
    assert clamp_add(2, 3) == 5
    assert clamp_add(8, 8) == 10
'''


def test_mutate_tool_kills_obvious_and_keeps_equivalent(tmp_path):
    pkg = tmp_path / "src" / "toypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(MODULE)
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_toy.py").write_text(TESTS)
    base = [sys.executable, str(SCRIPT), str(pkg / "mod.py"), "-f", "clamp_add"]
    sel = ["--", str(tests / "test_toy.py")]
    # deterministic listing: the same mutants in the same order, "toy.py:LINE #ID FUNC DESC: CODE"
    first = subprocess.run(base + ["--list"] + sel, capture_output=True, text=True, timeout=60, check=True).stdout
    second = subprocess.run(base + ["--list"] + sel, capture_output=True, text=True, timeout=60, check=True).stdout
    assert first == second
    ids = {}
    for line in first.splitlines():
        lineno, num, desc = re.match(r"^mod\.py:(\d+) #(\d+) clamp_add (.+?): ", line).groups()
        ids[(int(lineno), desc)] = int(num)
    assert {(3, "Add->Sub"), (4, "Gt->GtE"), (4, "Gt->Lt"), (5, "return None")} <= set(ids)
    # run three of them (the full list would cost a pytest run per mutant)
    chosen = [ids[(3, "Add->Sub")], ids[(4, "Gt->GtE")], ids[(4, "Gt->Lt")]]
    out = tmp_path / "report.json"
    cmd = base + ["--ids", ",".join(map(str, chosen)), "--json", str(out), "--preload", "pytest"] + sel
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[1/3]" in proc.stdout and "kill rate" in proc.stdout
    (target,) = json.loads(out.read_text())["targets"]
    status = {(m["line"], m["description"]): m["status"] for m in target["mutants"]}
    assert status == {(3, "Add->Sub"): "killed", (4, "Gt->GtE"): "survived", (4, "Gt->Lt"): "killed"}
    assert target["summary"] == dict(mutants=3, killed=2, survived=1, timeouts=0, kill_rate=round(2 / 3, 4))
    assert (pkg / "mod.py").read_text() == MODULE  # the real source is never modified


def test_functions_narrow_a_preset_to_the_entries_naming_them():
    """``--preset core --only plan.py -f step_rows`` lists step_rows' mutants alone (plan.py has
    five entries); a name no entry holds is refused with the ones it holds."""
    base = [sys.executable, str(SCRIPT), "--preset", "core", "--only", "plan.py"]
    listed = subprocess.run(base + ["-f", "step_rows", "--list"], capture_output=True, text=True, timeout=120,
                            check=True).stdout.splitlines()
    assert listed and all(re.match(r"^plan\.py:\d+ #\d+ step_rows ", line) for line in listed)
    bad = subprocess.run(base + ["-f", "nope", "--list"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "main_rows, path_rounds, scheduled_prefixes, split_plan, step_rows" in bad.stderr
