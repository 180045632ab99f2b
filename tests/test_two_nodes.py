"""Two accelerate machines on this host (bench/two_nodes.py): data_prep with an engine per node and train,
each uninterrupted and with node 1 killed mid-way then both rerun - the cache and the head equal to the
uninterrupted run's, nothing of either node left running, the surviving node stopped with one line."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.slow  # ~5 min on a 2-core CPU: six two-node launches, three of them with vLLM engines
def test_two_nodes_lose_one_and_resume_to_the_same_cache_and_head(tmp_path, subprocess_env):
    out = tmp_path / "two_nodes"
    done = subprocess.run([sys.executable, "-m", "bench.two_nodes", "--out", str(out)], cwd=REPO,
                          env=subprocess_env, capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["cache_equal_to_uninterrupted"] and report["head_equal_to_uninterrupted"]
    runs = {r["name"]: r for r in report["runs"]}
    assert all(not r["outlived"] for r in runs.values())
    for killed in ("prep-killed", "train-killed"):
        assert runs[killed]["exit_codes"] == [1, -9]  # node 0 stopped on its own; node 1 was killed
        log = (out / "logs" / f"{killed}-node0.log").read_text()
        assert "another process of this distributed job stopped (Connection " in log  # closed or reset
    assert any("resumed from" in line for line in report["resumed"])
