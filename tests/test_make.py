"""`make smoke`: the four stages as a user runs them on the smoke target, ending in vLLM served (~4 min)."""

import json
import shutil
import subprocess

import pytest

from tests.helpers import REPO


@pytest.mark.slow
def test_make_smoke_runs_every_stage_and_export_verifies(tmp_path):
    pytest.importorskip("vllm")
    if shutil.which("make") is None:
        pytest.skip("no make")
    run_dir = tmp_path / "smoke"
    result = subprocess.run(
        ["make", "smoke", f"RUN_DIR={run_dir}"], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    verification = json.loads((run_dir / "export" / "verification.json").read_text())
    assert verification["parity"]["passed"] and not verification["collapsed"]
    assert (run_dir / "eval" / "report.md").exists()
