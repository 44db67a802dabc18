"""train's command under real `dvc repro`: a stopped training run ends in one line, not torchrun's report, whether it
ran in the command's own process (one process) or under torchrun (two, eagle3.launch)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from support.processes import stage_processes
from support.repo import run
from support.train import copy_data, stage_args, stage_params, tiny_data  # noqa: F401 (fixture)

LAYOUT = ["--nnodes", "1", "--rdzv-endpoint", "localhost:0"]  # dvc.yaml's, with --nproc-per-node

FAILED = r"ERROR: failed to reproduce 'train': .* exited with (130|-2)"
GONE = r"eagle3: process \d+ that launched this stage is gone; stopping \(pid \d+\)"
LOG_RECORD = re.compile(r"\d\d:\d\d:\d\d [A-Z]+ [\w.]+: ")  # runner.setup_logging's format
STOPS = {  # (training processes, how the stop is signalled) -> what the processes say as they stop (stop_lines)
    # `kill` of dvc alone: one process is killed with its parent, the kernel's guard, where DVC's shell (bash, the
    # user's $SHELL) execs it (nothing to say), and stops in the watcher's line where the shell (dash, /bin/sh when
    # $SHELL is unset, as in CI) stays and is orphaned; two, torchrun's workers: the first to see DVC gone stops in
    # one line, and the other either says the same (its watcher or its failed collective came first) or is stopped
    # without a word by torchrun's agent, which terminates a failed worker's peers (CI saw both)
    (1, "SIGTERM to dvc"): (lambda pid: os.kill(pid, signal.SIGTERM), [], [GONE]),
    (2, "SIGTERM to dvc"): (lambda pid: os.kill(pid, signal.SIGTERM), [GONE] * 2, [GONE]),
    # SIGINT to dvc's process group: one process runs in the command's, which stops as any stage does; two run under
    # torchrun's agent, which stops them. DVC reports 130 where its shell (bash) execs the command, -2 where the
    # shell (dash, CI's /bin/sh) stays and is stopped by the same Ctrl-C.
    (1, "Ctrl-C"): (lambda pid: os.killpg(pid, signal.SIGINT), [r"eagle3: interrupted; stopping \(pid \d+\)", FAILED]),
    (2, "Ctrl-C"): (lambda pid: os.killpg(pid, signal.SIGINT), [r"eagle3.launch: stopped by SIGINT; workers stopped", FAILED]),
}  # each: how to stop, then the tails that may follow (one per shell where they differ)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
@pytest.mark.parametrize("procs,stop", list(STOPS), ids=[f"{procs} process(es), {stop}" for procs, stop in STOPS])
def test_a_stopped_train_ends_in_one_line(tiny_data, tiny_verifier_dir, tmp_path, procs, stop):  # noqa: F811
    send, *tails = STOPS[procs, stop]
    repo = copy_data(tiny_data, tmp_path / "repo")
    params = stage_params(repo / "p.yaml", max_steps=1000, checkpoint_every=1000, val_every=1000, batch_tokens=128 * procs)
    command = " ".join([sys.executable, "-m", "eagle3.train", *stage_args(repo, tiny_verifier_dir, "run", params), "--threads", "1",
                        *LAYOUT, "--nproc-per-node", str(procs)])
    (repo / "dvc.yaml").write_text(f"stages:\n  train:\n    cmd: {command}\n")
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "test@eagle3"], ["git", "config", "user.name", "eagle3 test"],
                ["dvc", "init", "-q"], ["git", "add", "dvc.yaml"], ["git", "commit", "-qam", "train"]):
        run(cmd, repo)  # dvclive needs a commit
    dvc = subprocess.Popen(["dvc", "repro"], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (repo / "run" / "live" / "plots").is_dir():  # training has started
        assert dvc.poll() is None and time.monotonic() < deadline, dvc.stdout.read()[-3000:]
        time.sleep(0.2)
    send(dvc.pid)
    output = dvc.communicate(timeout=60)[0]  # until every process of the stage has closed its output
    assert not stage_processes(repo, "train")
    tail = stop_lines(output)
    assert any(len(tail) == len(expected) and all(map(re.fullmatch, expected, tail)) for expected in tails), output[-3000:]


def stop_lines(output: str) -> list[str]:
    """The lines of a stage's output after training's first log record that are not log records: what its processes
    said as they stopped. Why not the lines after its last record: with two processes, one can say its line while the
    other still writes the train lines it had queued (a sync writes many at once)."""
    lines = output.splitlines()
    first_log = min(i for i, line in enumerate(lines) if LOG_RECORD.match(line))
    return [line for line in lines[first_log:] if line.strip() and not LOG_RECORD.match(line)]
