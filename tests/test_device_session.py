"""benchmarks/device_session.sh, the one script device calls run: every stage it can run is one it accepts and
documents. Session 32 lost a device call to a stage (`k3-launches`) whose clause existed but which the script's
check of its arguments refused as unknown."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_session.sh"


def _sections() -> tuple[set[str], set[str], set[str]]:
    text = SCRIPT.read_text()
    first, second = [m.start() for m in re.finditer(r"^  case \$stage in$", text, re.M)][:2]
    accepted = set()
    for line in text[first:text.index("  esac", first)].splitlines()[1:]:
        labels = line.strip().split(")")[0]
        if not labels.startswith("*"):
            accepted |= set(labels.split("|"))
    runs = set()
    for m in re.finditer(r"^    ([a-z0-9|-]+)\)", text[second:], re.M):
        runs |= set(m.group(1).split("|"))
    documented = set(re.findall(r"^#   ([a-z0-9-]+)(?: \(|\s{2,})", text, re.M))
    return accepted, runs, documented


def test_every_stage_with_a_clause_is_accepted_and_documented() -> None:
    accepted, runs, documented = _sections()
    assert "k3-launches" in runs and "spec-b1" in runs
    assert runs <= accepted, sorted(runs - accepted)
    assert accepted <= runs, sorted(accepted - runs)  # nothing accepted that would run nothing
    assert runs <= documented, sorted(runs - documented)


def test_an_unknown_stage_is_refused_before_anything_runs(tmp_path) -> None:
    proc = subprocess.run(["bash", str(SCRIPT), "decode", "no-such-stage"], capture_output=True, text=True,
                          cwd=tmp_path, env={"OUT": str(tmp_path / "out"), "PATH": "/usr/bin:/bin"}, timeout=30)
    assert proc.returncode == 2 and "unknown stage: no-such-stage" in proc.stderr
    assert not (tmp_path / "out").exists()
