"""Two nodes on one machine: data_prep and train launched as two accelerate machines (`--num_machines 2`,
machine ranks 0 and 1, 127.0.0.1; gloo on CPU, the backend the stages name there), one process per node with
its own vLLM engine, both writing one run directory - first uninterrupted, then with node 1 killed mid-way
(SIGKILL to its launcher's whole process group, as a lost machine) and both rerun. It reports what the
surviving node did and how long it took to stop, whether any process of either node outlived it, and whether
the rerun's outputs equal the uninterrupted run's: the regenerated chunks and cache shards byte for byte, the
trained head's tensors exactly.

    python -m bench.two_nodes --out runs/two_nodes     (~5 min on a 2-core CPU: the smoke target)

The smoke target regenerates its answers (experiment=smoke_regen) in chunks of 16 conversations, two per node,
the hidden states captured by each node's engine in the same pass (capture.engine=vllm); node 1 is killed
when its first chunk is written. Training checkpoints every 10 steps; node 1 is killed after the first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREP = ["experiment=smoke_regen", "cache.num_threads=1", "regen.batch_size=16", "capture.engine=vllm"]
TRAIN = ["experiment=smoke_regen", "train.save_every=10"]


def node(
    rank: int, port: int, script: str, run_dir: Path, overrides: list[str], log: Path
) -> subprocess.Popen:
    """One machine of two: `accelerate launch` with machine rank `rank`, in a process group of its own."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
        "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
        "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
        script, f"run_dir={run_dir}", *overrides,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process now running."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def tree(root: int, table: dict[int, tuple[int, str]]) -> dict[int, str]:
    """`root` and its descendants (pid -> start time). torchrun starts each rank in a session of its own
    (and the ranks their vLLM engines), so a machine's processes are its launcher's tree, not one group."""
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in table:
            found[pid] = table[pid][1]
            frontier += [child for child, (parent, _) in table.items() if parent == pid]
    return found


def alive(seen: dict[int, str]) -> list[str]:
    """Those of `seen` still running (the same start time: not a reused pid), as "pid: command line"."""
    table, out = processes(), []
    for pid, started in seen.items():
        if table.get(pid, (0, None))[1] == started:
            try:
                line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            out.append(f"{pid}: {line[:160]}")
    return out


def pair(name: str, script: str, run_dir: Path, overrides: list[str], port: int, logs: Path, kill_when=None,
         timeout_s: float = 900) -> dict:  # fmt: skip
    """Both nodes to the end, or node 1 - its launcher, ranks and engines - killed once `kill_when()`
    holds: exit codes, seconds, and what of either node outlived its end."""
    started = time.monotonic()
    nodes = [node(r, port, script, run_dir, overrides, logs / f"{name}-node{r}.log") for r in (0, 1)]
    seen: list[dict[int, str]] = [{}, {}]  # every process each node ran (sampled while it runs)

    def sample():
        table = processes()
        for i, n in enumerate(nodes):
            seen[i].update(tree(n.pid, table))

    result: dict = {"name": name}
    try:
        while kill_when is not None and not kill_when():
            sample()
            if any(n.poll() is not None for n in nodes):
                raise RuntimeError(f"{name}: a node ended before the moment to kill ({logs})")
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"{name}: no moment to kill node 1 within {timeout_s:.0f} s ({logs})")
            time.sleep(0.2)
        if kill_when is not None:
            sample()
            for pid in seen[1]:  # the machine is lost: every process of it at once
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            result["killed_node_1_at_s"] = round(time.monotonic() - started, 1)
            result["node_1_processes_killed"] = len(seen[1])
        while any(n.poll() is None for n in nodes):
            sample()
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"{name}: still running after {timeout_s:.0f} s ({logs})")
            time.sleep(0.5)
        result["exit_codes"] = [n.returncode for n in nodes]
        result["seconds"] = round(time.monotonic() - started, 1)
        time.sleep(5)  # what a dying process leaves behind has had time to go
        result["outlived"] = alive(seen[0]) + alive(seen[1])
    finally:
        for line in alive(seen[0]) + alive(seen[1]):  # never leave an engine behind, whatever the outcome
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
    return result


def cache_files(run_dir: Path) -> dict[str, bytes]:
    cache = run_dir / "cache"
    names = sorted((cache / "regenerated").glob("chunk-*.json")) + sorted(cache.glob("*/*.safetensors"))
    return {str(p.relative_to(cache)): p.read_bytes() for p in names + [cache / "vocab.safetensors"]}


def head_tensors(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "draft_head" / "model.safetensors")


def rank_lines(logs: Path, name: str, words: str) -> list[str]:
    return [line.strip() for r in (0, 1) for line in (logs / f"{name}-node{r}.log").read_text().splitlines()
            if words in line]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/two_nodes"))
    parser.add_argument("--port", type=int, default=29610, help="the first rendezvous port (one per launch)")
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"--out {args.out} exists: name a new directory, or move it away yourself")
    logs = args.out / "logs"
    logs.mkdir(parents=True)
    clean, killed = (args.out / "clean").resolve(), (args.out / "killed").resolve()
    port = iter(range(args.port, args.port + 100))
    runs = []

    def run(*a, **k):
        result = pair(*a, logs=logs, port=next(port), **k)
        runs.append(result)
        print(json.dumps(result), flush=True)
        return result

    run("prep-clean", "data_prep/main.py", clean, PREP)
    first_of_node_1 = killed / "cache" / "regenerated" / "chunk-00001-of-00004.json"
    run("prep-killed", "data_prep/main.py", killed, PREP, kill_when=first_of_node_1.exists)
    run("prep-rerun", "data_prep/main.py", killed, PREP)
    same_cache = cache_files(killed) == cache_files(clean)
    reused = rank_lines(logs, "prep-rerun", "reusing")

    run("train-clean", "train/main.py", clean, TRAIN)
    run(
        "train-killed",
        "train/main.py",
        killed,
        TRAIN,
        kill_when=lambda: any((killed / "ckpt").glob("step-*")),
    )
    run("train-rerun", "train/main.py", killed, [*TRAIN, "train.resume=auto"])
    a, b = head_tensors(clean), head_tensors(killed)
    same_head = a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    resumed = rank_lines(logs, "train-rerun", "resum")

    report = {
        "runs": runs,
        "cache_equal_to_uninterrupted": same_cache,
        "chunks_reused_on_rerun": reused,
        "head_equal_to_uninterrupted": same_head,
        "resumed": resumed[:4],
        "machine": f"{os.cpu_count()} cores",
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    ok = same_cache and same_head and all(not r["outlived"] for r in runs)
    ok = ok and all(r["exit_codes"] == [0, 0] for r in runs if "killed_node_1_at_s" not in r)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
