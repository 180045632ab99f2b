"""The GPU check (bench/gpu_check.py) kept runnable on the machine it is for: its imports with only that
machine's distributions visible (the image's, tests/gpu_image_packages.txt, and the wheels carried to it,
tests/gpu_wheels.txt), so that a new module-level import of a package that machine lacks fails here, not in
the first minutes of a lent GPU; its CPU mode end to end (slow); its bookkeeping (a JSON after every step,
unique step names, budgets that skip and say so)."""

import json
import os
import re
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

from tests.helpers import REPO


def distribution_names(path: Path) -> set[str]:
    """The normalised distribution names a package list file holds (comments and pins dropped)."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(normalise(re.split(r"[=<>~!\[ ]", line)[0]))
    return names


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def gpu_machine_view(directory: Path, allowed: set[str]) -> set[str]:
    """A directory of links to the top-level modules (and metadata) of this venv's distributions that are in
    `allowed`: what `python -S` sees with PYTHONPATH=<directory> is what the GPU machine has (its versions
    aside). The distributions linked."""
    site = Path(sysconfig.get_paths()["purelib"])
    directory.mkdir()
    linked = set()
    for dist in metadata.distributions(path=[str(site)]):
        name = normalise(dist.metadata["Name"])
        if name not in allowed or not dist.files:
            continue
        linked.add(name)
        for top in {f.parts[0] for f in dist.files if f.parts and f.parts[0] not in ("..", "__pycache__")}:
            if top.endswith(".pth") or not (site / top).exists() or (directory / top).exists():
                continue  # a shared namespace directory (google, nvidia) is linked once, whole
            (directory / top).symlink_to(site / top)
    return linked


def test_the_gpu_checks_imports_need_only_what_the_gpu_machine_has(tmp_path):
    """The check's first step, run with only the image's distributions and the carried wheels visible: every
    module a later section needs imports, and the versions are printed."""
    allowed = distribution_names(REPO / "tests" / "gpu_image_packages.txt")
    allowed |= distribution_names(REPO / "tests" / "gpu_wheels.txt")
    linked = gpu_machine_view(tmp_path / "site", allowed)
    assert {"torch", "transformers", "hydra-core", "datasets", "deepspeed", "speculators"} <= linked
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}"}
    done = subprocess.run(
        [sys.executable, "-S", "-m", "bench.gpu_check", "--cpu", "--sections", "imports", "--out", str(tmp_path / "out")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    step = result["steps"][0]
    assert (step["step"], step["ok"]) == ("imports", True)
    assert {"torch", "transformers", "hydra-core", "datasets", "deepspeed", "speculators"} <= set(
        result["versions"]
    )


@pytest.mark.slow  # ~14 s; the restricted view itself runs by default (the test above)
def test_a_module_the_gpu_machine_lacks_fails_the_imports_step_naming_it(tmp_path):
    """The same view without DeepSpeed: the imports step fails in seconds naming the distribution, and the
    sections that need it are skipped with the reason; the others still run (here: none asked)."""
    allowed = distribution_names(REPO / "tests" / "gpu_image_packages.txt")
    allowed |= distribution_names(REPO / "tests" / "gpu_wheels.txt")
    gpu_machine_view(tmp_path / "site", allowed - {"deepspeed"})
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}"}
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-S", "-m", "bench.gpu_check", "--cpu", "--sections", "imports", "zero2", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    assert "No module named 'deepspeed'" in done.stdout
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["steps"][0]["ok"] is False
    assert result["sections"]["zero2"]["status"].startswith("skipped: needs deepspeed")
    assert "deepspeed" in (out / "gpu_check.log").read_text()


# Slow (3 min of subprocess start-ups): each stage it runs has its own default test; this checks the wiring.
@pytest.mark.slow
def test_the_gpu_check_runs_in_its_cpu_mode(tmp_path):
    """The check's own script at tiny shapes: every section passes, each step named once, the benchmark
    reports each head kind's step time, tokens/s and peak memory beside the model's prediction, and ours
    beside speculators' trainer at K=3, as it trains and with the levers on."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--cpu", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["finished"]
    assert {s["section"] for s in result["steps"]} == {"imports", "peer", "memory", "pipeline", "zero2"}
    assert all(s["ok"] for s in result["steps"])
    names = [s["step"] for s in result["steps"]]
    assert len(names) == len(set(names))
    kinds = [(m["setting"], m["online"]) for m in result["memory"]]
    # every kind and lever but FlexAttention's (no backward on a CPU)
    assert kinds == [("eagle3", False), ("eagle3-compiled", False), ("eagle3-packed", False), ("peagle", False),
                     ("dflash", False), ("eagle3-unfused", False), ("eagle3-online", True)]  # fmt: skip
    assert all("split" in m and m["flops_per_token"]["model"] > 0 for m in result["memory"][:6])  # profiled
    for m in result["memory"]:
        assert m["step_s"] > 0 and m["tokens_per_s"] > 0 and m["peak_over_setup_gb"] > 0
        assert 0.3 < m["predicted_over_setup_gb"] / m["peak_over_setup_gb"] < 3  # tiny: fixed costs dominate
    peers = [(r["trainer"], r["ttt_steps"], r["setting"]) for r in result["peer"]["results"]]
    assert peers == [("ours", 3, "default"), ("speculators", 3, "default"), ("ours", 3, "train.compile=true"),
                     ("ours", 7, "train.compile=true")]  # fmt: skip
    assert [(r["ttt_steps"], r["setting"]) for r in result["peer"]["ratios"]] == [
        (3, "default"),
        (3, "train.compile=true"),
    ]
    assert result["sections"]["golden"]["status"].startswith("skipped")  # the suite runs them on a CPU
