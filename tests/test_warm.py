"""``eagle3.warm``: per-shard stage commands served by one warm server's imports, each in a process of its own,
with the client's streams, folder, environment and exit status; a killed client stops its shard; under real
``dvc repro`` warm shards write the bytes cold processes write."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from support.pipeline import FAST, LOCAL_SOURCE, add_dataset, overrides, write_local_prompts
from support.repo import run

# A stage stand-in: says who it is and where it runs, then sleeps (``sleep``) or exits with its first argument.
STAND_IN = """
import os, sys, time
print("job", os.getpid(), os.getppid(), os.environ.get("MARK"), os.getcwd(), sys.argv[1:], flush=True)
print("on stderr", file=sys.stderr, flush=True)
if "sleep" in sys.argv:
    time.sleep(120)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    return tmp_path


def warm(folder, *args: str, seconds: str = "20", mark: str = "a", **popen) -> subprocess.Popen:
    env = {**os.environ, "EAGLE3_WARM_SECONDS": seconds, "MARK": mark}
    return subprocess.Popen([sys.executable, "-m", "eagle3.warm", "-m", "stand_in", *args], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def job(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=120)
    _, pid, parent, mark, cwd, args = out.split(" ", 5)
    return {"pid": int(pid), "server": int(parent), "mark": mark, "cwd": cwd, "args": args.strip(), "err": err,
            "status": process.returncode, "client": process.pid}


def gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_shards_share_one_server_in_processes_of_their_own(folder):
    first, second = job(warm(folder, "0")), job(warm(folder, "4", "x"))
    assert (first["status"], second["status"]) == (0, 4)  # the client exits with its shard's status
    assert first["server"] == second["server"] != first["client"]  # forked from one server
    assert len({first["pid"], second["pid"], first["server"]}) == 3
    assert second["args"] == "['4', 'x']" and second["cwd"] == str(folder) and second["mark"] == "a"
    assert second["err"] == "on stderr\n"  # the shard writes to the client's own streams
    other = job(warm(folder, "0", mark="b"))  # another environment imports differently: another server
    assert other["server"] != first["server"] and other["mark"] == "b"


def test_no_server_when_warm_seconds_is_0(folder):
    cold = job(warm(folder, "5", seconds="0"))
    assert cold["status"] == 5 and cold["pid"] == cold["client"]  # exec'd in the client's own process
    assert not (folder / ".eagle3").exists()


def test_a_server_leaves_once_idle(folder):
    served = job(warm(folder, "0", seconds="1"))
    assert gone(served["server"], timeout=15)


def test_a_server_leaves_once_a_command_fails(folder):
    """A failed stage ends its `dvc repro` (a refused `dvc exp run -S`, a layout this machine lacks): no command of that
    run is coming, so the server does not wait its idle time for one."""
    served = job(warm(folder, "2", seconds="600"))
    assert served["status"] == 2 and served["server"] != served["client"]
    left = gone(served["server"], timeout=15)
    if not left:
        os.kill(served["server"], signal.SIGTERM)
    assert left


def test_a_killed_client_stops_its_shard(folder):
    client = warm(folder, "0", "sleep", start_new_session=True)
    line = client.stdout.readline().split()
    shard, server = int(line[1]), int(line[2])
    client.send_signal(signal.SIGKILL)
    client.wait()
    assert gone(shard, timeout=15)  # interrupted when the connection closed
    os.kill(server, signal.SIGTERM)


SQUATTER = """
import os, socket, sys, time
from eagle3.warm import address, server_key
where = address(server_key())  # the address a client here would use, taken before any server of ours
os.setuid(65534)  # by another user (nobody)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(where)
listener.listen(8)
print("bound", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="takes root to be another user")
def test_another_users_listener_gets_no_request(folder):
    """The request carries the environment (credentials too): only our own user's server may have it."""
    env = {**os.environ, "EAGLE3_WARM_SECONDS": "20", "MARK": "a"}
    squatter = subprocess.Popen([sys.executable, "-c", SQUATTER], cwd=folder, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline() == "bound\n"
        cold = job(warm(folder, "6"))
        assert cold["status"] == 6 and cold["pid"] == cold["client"]  # ran in the client's own process
        assert "another user's process holds" in cold["err"]
    finally:
        squatter.kill()


CUDA_STAND_IN = """
import sys, torch
print("job", torch.ones(4, device="cuda").sum().item(), torch.cuda.get_device_name(), flush=True)
sys.exit(0)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_forked_process_starts_cuda(tmp_path):
    """The server imported the stages (transformers asks whether CUDA is there) and never started CUDA itself."""
    (tmp_path / "stand_in.py").write_text(CUDA_STAND_IN)
    for _ in range(2):  # the second through the same server
        out, err = warm(tmp_path).communicate(timeout=300)
        assert out.startswith("job 4.0"), err


@pytest.mark.slow
def test_warm_stages_write_what_cold_processes_write(make_project):
    """The warm server is plumbing (no stage's dep, docs/layout.md): through it generate and extract write the bytes of
    cold processes, train the same drafter and evaluate the same τ."""
    repo = make_project(*FAST[1:])
    add_dataset(repo, {"name": "two", "shards": ["000000-000006", "000006-000010"], **LOCAL_SOURCE})
    write_local_prompts(repo)
    run(["eagle3", "params", *overrides(*FAST, "dataset=two", "evaluate=tau",
                                        "layout.warm_seconds=30", "layout.compile_ahead=true")], repo)
    stages = [f"{stage}@{shard}" for stage in ("generate", "extract") for shard in ("000000-000006", "000006-000010")]
    run(["dvc", "repro", *stages], repo)
    logs = list((repo / ".eagle3" / "warm").glob("*.log"))
    assert len(logs) == 1 and logs[0].read_text().count("ready") == 1, [log.read_text() for log in logs]
    # The first extract command started the compile ahead of train's step, once, which found nothing to compile on the CPU.
    ahead, deadline = repo / ".eagle3" / "compile-ahead" / "log", time.monotonic() + 60
    while "compiles no step ahead" not in (ahead.read_text() if ahead.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ahead.read_text().count("params.yaml: train compiles no step ahead on this layout") == 1, ahead.read_text()
    warm_outputs = outputs(repo)

    second = [stage for stage in stages if stage.endswith("000006-000010")]  # served warm, as the first shard was
    cold = run(["dvc", "repro", "-f", "-s", *second], repo, env={**os.environ, "EAGLE3_WARM_SECONDS": "0"})
    assert cold.stdout.count("Running stage") == 2
    assert outputs(repo) == warm_outputs

    run(["dvc", "repro"], repo)  # merge, then train and evaluate through a warm server
    warm_drafter = drafter_and_tau(repo)
    shutil.rmtree(repo / ".eagle3" / "checkpoints")  # else the cold train resumes the finished run and trains nothing
    cold = run(["dvc", "repro", "-f", "-s", "train", "evaluate"], repo, env={**os.environ, "EAGLE3_WARM_SECONDS": "0"})
    assert cold.stdout.count("Running stage") == 2
    assert drafter_and_tau(repo) == warm_drafter


def outputs(repo) -> dict[str, str]:
    """The md5 of each generate and extract output, as dvc.lock records it."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    return {out["path"]: out["md5"] for name, body in lock.items() if name.startswith(("generate@", "extract@"))
            for out in body["outs"]}


def drafter_and_tau(repo) -> tuple[str, dict]:
    """The md5 of train's drafter (dvc.lock) and evaluate's τ of every set and method (its timings differ run to run)."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    drafter = next(out["md5"] for out in lock["train"]["outs"] if out["path"] == "models/drafter")
    metrics = json.loads((repo / "dvclive" / "evaluate" / "metrics.json").read_text())
    tau = {name: {method: values["tau"] for method, values in [("chain", values), *values.items()] if isinstance(values, dict)
                  and "tau" in values} for name, values in metrics.items() if isinstance(values, dict)}
    return drafter, tau
