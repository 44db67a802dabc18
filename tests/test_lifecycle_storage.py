"""The local S3 server and `eagle3 gc` on a minimal pipeline of known sizes: real dvc, real rclone server.

The pipeline writes ``blobs/`` (a directory output of ``count`` random parts of ``kib`` KiB) and
``index.txt`` (a file output) from a seed, so a seed change orphans exactly 2 + count objects.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from support.local_s3 import (  # noqa: F401
    add_remote, cache_objects, cached_file, delete_remote_object, file_hashes, local_s3, lock_objects, manifest, put_remote_object)
from support.repo import git_dvc_repo, run

pytestmark = pytest.mark.slow  # real dvc pipelines

MAKE_BLOBS = """\
import random, sys
from pathlib import Path
seed, count, kib = map(int, sys.argv[1:4])
Path("blobs").mkdir()
for i in range(count):
    Path(f"blobs/part-{i:03d}.bin").write_bytes(random.Random(seed * 1000 + i).randbytes(kib << 10))
Path("index.txt").write_text(f"seed {seed}: {count} parts of {kib} KiB\\n")
"""
DVC_YAML = {"stages": {"blobs": {
    "cmd": "python make_blobs.py ${blobs.seed} ${blobs.count} ${blobs.kib}",
    "deps": ["make_blobs.py"], "params": ["blobs"], "outs": ["blobs", "index.txt"]}}}


def set_blobs(repo: Path, seed: int, count: int = 3, kib: int = 64) -> None:
    (repo / "params.yaml").write_text(yaml.safe_dump({"blobs": {"seed": seed, "count": count, "kib": kib}}))


def commit(repo: Path, message: str) -> None:
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", message], repo)


@pytest.fixture
def blob_repo(tmp_path: Path) -> Path:
    repo = git_dvc_repo(tmp_path / "blobs-project")
    run(["git", "config", "user.email", "test@eagle3"], repo)
    run(["git", "config", "user.name", "eagle3 test"], repo)
    (repo / ".dvc" / "config").write_text("[cache]\n    type = hardlink\n")
    add_remote(repo)
    (repo / "make_blobs.py").write_text(MAKE_BLOBS)
    (repo / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    set_blobs(repo, seed=1)
    commit(repo, "pipeline")
    return repo


def seed_1_pushed(repo: Path, local_s3) -> None:
    """The pipeline run at seed 1, committed and pushed to a new local server."""
    local_s3(repo)
    run(["dvc", "repro"], repo)
    commit(repo, "seed 1")
    run(["eagle3", "push"], repo)


def gc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return run(["eagle3", "gc", *args], repo, check=False)


def outs(repo: Path) -> dict[str, str]:
    """Output path -> object id, from the workspace's dvc.lock."""
    return {out["path"]: out["md5"] for out in yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["blobs"]["outs"]}


def test_gc_refuses_until_every_kept_object_is_in_the_remote(blob_repo, local_s3):
    repo = blob_repo
    port = local_s3(repo)
    run(["dvc", "repro"], repo)
    commit(repo, "seed 1")
    run(["git", "tag", "seed-1"], repo)
    run(["dvc", "push"], repo)
    first = lock_objects(repo)
    set_blobs(repo, seed=2)
    run(["dvc", "repro"], repo)
    commit(repo, "seed 2")
    second = lock_objects(repo)
    assert len(first) == len(second) == 5 and not first & second  # 3 parts + .dir + index.txt each

    before = cache_objects(repo)
    refused = gc(repo)
    assert refused.returncode != 0
    assert "refusing: 5 objects" in refused.stderr and "run `eagle3 push`" in refused.stderr
    assert "blobs/part-000.bin" in refused.stderr and "index.txt" in refused.stderr
    assert cache_objects(repo) == before  # nothing deleted

    run(["dvc", "push"], repo)
    passed = gc(repo)
    assert passed.returncode == 0, passed.stderr
    assert "all 10 objects" in passed.stdout
    assert cache_objects(repo) == second  # exactly the seed-1 objects went

    # A file gone from the remote while its directory's .dir is still there: `dvc status -c` and
    # `dvc push` trust the manifest; the check looks at every file and says how to repair.
    blobs = outs(repo)["blobs"]
    lost_file = manifest(repo, blobs)[0]
    delete_remote_object(repo, port, lost_file)
    refused = gc(repo)
    assert refused.returncode != 0 and lost_file in refused.stderr
    assert f"s3://eagle3/cache/files/md5/{blobs[:2]}/{blobs[2:]}" in refused.stderr
    delete_remote_object(repo, port, blobs)
    run(["dvc", "push"], repo)
    assert gc(repo, "--dry-run").returncode == 0

    # An object of a kept tag that is neither cached nor in the remote is reported, and gc goes on:
    # deleting local cache cannot make it worse. `--rev main` leaves the tag out.
    delete_remote_object(repo, port, sorted(o for o in first if not o.endswith(".dir"))[0])
    warned = gc(repo, "--dry-run")
    assert warned.returncode == 0 and "neither cached nor in remote" in warned.stderr and "seed-1" in warned.stderr
    assert "neither cached" not in gc(repo, "--dry-run", "--rev", "main").stderr


def test_gc_with_the_s3_server_down_after_a_gc_is_one_line(blob_repo, local_s3):
    """A kept tag's `.dir` manifest is only on the remote once gc removed it from the cache: reading it with the server
    down is one line, nothing deleted."""
    repo = blob_repo
    local_s3(repo)
    run(["dvc", "repro"], repo)
    commit(repo, "seed 1")
    run(["git", "tag", "seed-1"], repo)
    set_blobs(repo, seed=2)
    run(["dvc", "repro"], repo)
    commit(repo, "seed 2")
    run(["dvc", "push", "-T", "-a"], repo)
    assert gc(repo).returncode == 0
    run(["eagle3", "s3", "stop"], repo)
    before = cache_objects(repo)
    down = gc(repo)
    assert down.returncode == 1 and len(down.stderr.splitlines()) == 1, down.stderr
    assert "cannot be asked for the kept objects" in down.stderr and "no cached object was deleted" in down.stderr
    assert cache_objects(repo) == before


def test_gc_names_the_unpushed_experiments_whose_outputs_it_deletes(blob_repo, local_s3):
    """`eagle3 gc` keeps no experiment (documented): when it deletes the only copy of one's outputs, it says so."""
    repo = blob_repo
    seed_1_pushed(repo, local_s3)
    run(["dvc", "exp", "run", "-n", "seed-two", "-S", "blobs.seed=2"], repo)
    run(["git", "checkout", "--", "params.yaml", "dvc.lock"], repo)
    run(["dvc", "checkout", "--force"], repo)  # the workspace back at seed 1: the experiment's outputs are only cached
    line = ("the only copy of experiment seed-two's blobs, index.txt (never pushed; to keep it: "
            "`dvc exp branch seed-two <branch>`, `eagle3 push -a`, then `eagle3 gc`)")
    dry = gc(repo, "--dry-run")
    assert dry.returncode == 0 and f"would delete {line}" in dry.stdout.splitlines(), dry.stdout + dry.stderr
    done = gc(repo)
    assert done.returncode == 0 and f"deleting {line}" in done.stdout.splitlines(), done.stdout + done.stderr
    assert "experiment" not in gc(repo).stdout  # nothing of it left to delete


def test_gc_dry_run_says_what_it_would_remove_and_removes_nothing(blob_repo, local_s3):
    repo = blob_repo
    local_s3(repo)
    run(["dvc", "repro"], repo)
    commit(repo, "seed 1")
    first = lock_objects(repo)
    set_blobs(repo, seed=2)
    run(["dvc", "repro"], repo)
    commit(repo, "seed 2")  # seed 1 is no branch tip or tag any more: its 5 objects are what gc removes
    run(["dvc", "push"], repo)
    before = cache_objects(repo)

    dry = gc(repo, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert cache_objects(repo) == before
    output = dry.stdout + dry.stderr
    assert "Removing" not in output and "Removed" not in output
    listed = [line.split()[-1] for line in dry.stdout.splitlines() if line.startswith("  would remove ")]
    assert sorted(Path(path).parent.name + Path(path).name for path in listed) == sorted(first)
    assert dry.stdout.splitlines()[-1] == "dry run: nothing was removed; `eagle3 gc` would remove these 5 objects from the cache"
    assert "No unused" not in output
    assert gc(repo).returncode == 0 and cache_objects(repo) == before - first
    assert gc(repo, "--dry-run").stdout.splitlines()[-1] == (
        "dry run: nothing was removed; `eagle3 gc` would remove nothing (the workspace uses every cached object)")


def damage_in_place(part: Path) -> Path:
    """Truncate ``part`` through its hard link, as root does whatever the mode; returns its cache object (the same file)."""
    part.chmod(0o644)  # root needs no chmod; a user who has one damages the cache the same way
    os.truncate(part, part.stat().st_size // 3)
    return next(path for path in (part.parents[1] / ".dvc" / "cache" / "files" / "md5").glob("*/*") if path.samefile(part))


def remote_files(repo: Path) -> list[Path]:
    return [path for path in (repo / ".eagle3" / "s3" / "data").rglob("*") if path.is_file()]


def clone_and_pull(repo: Path, port: int, clone: Path) -> subprocess.CompletedProcess:
    run(["git", "clone", "-q", str(repo), str(clone)], repo)
    run(["eagle3", "s3", "serve", "--background", "--addr", f"127.0.0.1:{port}", "--dir", str(repo / ".eagle3" / "s3")], clone)
    return run(["dvc", "pull"], clone, check=False)


def test_a_part_damaged_through_its_hard_link_is_never_pushed_nor_pulled_back_as_good(blob_repo, local_s3, tmp_path):
    """A part truncated in the workspace is truncated in the hard-linked cache, under its good hash: `eagle3 push`
    refuses it before sending anything, naming the file, the object and the mend that works; after the mend a fresh
    clone pulls the good bytes. A damaged object that a plain `dvc push` sent is refused by the clone's pull (the
    remote's `verify`), not checked out as good."""
    repo = blob_repo
    port = local_s3(repo)
    run(["dvc", "repro"], repo)
    commit(repo, "seed 1")
    good = file_hashes(repo, "blobs")
    cached = damage_in_place(repo / "blobs" / "part-001.bin")
    object_path = cached.relative_to(repo)

    refused = run(["eagle3", "push"], repo, check=False)
    assert refused.returncode == 1, refused.stderr
    *listed, line = refused.stderr.splitlines()
    assert "blobs/part-001.bin" in listed[0] and "damaged in the cache" in listed[0], listed
    assert line.startswith("error: refusing to push: 1 cached objects no longer match their hash"), line
    mend = f"rm -f blobs/part-001.bin {object_path}"
    assert f"`{mend}`, then `dvc repro -f blobs`" in line and "as root a write ignores" in line, line
    assert remote_files(repo) == []  # nothing was sent

    run(mend.split(), repo)  # what the line says
    run(["dvc", "repro", "-f", "blobs"], repo)
    pushed = run(["eagle3", "push"], repo)
    assert "5 files pushed" in pushed.stdout, pushed.stdout
    clone = tmp_path / "clone"
    assert clone_and_pull(repo, port, clone).returncode == 0
    assert file_hashes(clone, "blobs") == good

    # The other mend, once a good copy is on the remote: remove both, pull.
    cached = damage_in_place(repo / "blobs" / "part-000.bin")
    run(["rm", "-f", "blobs/part-000.bin", str(cached.relative_to(repo))], repo)
    run(["dvc", "pull", "--force", "blobs"], repo)
    assert file_hashes(repo, "blobs") == good

    # A damaged object on the remote, however it got there (a plain `dvc push` sent one that DVC's state db vouched for):
    # the remote's `verify` makes the clone's pull hash what it fetched and refuse the damage.
    part = repo / "blobs" / "part-002.bin"
    put_remote_object(repo, port, next(oid for oid in manifest(repo, outs(repo)["blobs"]) if cached_file(repo, oid).samefile(part)),
                      part.read_bytes()[:1000])
    pulled = clone_and_pull(repo, port, tmp_path / "second-clone")
    assert pulled.returncode != 0
    assert not (tmp_path / "second-clone" / "blobs" / "part-002.bin").exists()


def wait_for_upload(data: Path, timeout: float = 30.0) -> None:
    """Return once rclone is midway through writing an object (a temp file holding > 4 MiB)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in data.rglob(".rclone_temp*"):
            try:
                if path.stat().st_size > 4 << 20:
                    return
            except FileNotFoundError:
                continue
        time.sleep(0.02)
    raise AssertionError("no upload seen in progress")


def test_interrupted_push_resumes_and_server_keeps_data_across_restarts(blob_repo, local_s3, tmp_path):
    repo = blob_repo
    set_blobs(repo, seed=7, count=2, kib=56 << 10)  # 2 x 56 MiB: above the 50 MiB checksum threshold
    run(["dvc", "repro"], repo)
    commit(repo, "big parts")
    home = repo / ".eagle3" / "s3"
    port = local_s3(repo)

    # One attempt per request: the client gives up in seconds instead of backing off for ~30 s.
    push = subprocess.Popen(["dvc", "push"], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, AWS_MAX_ATTEMPTS="1"))
    wait_for_upload(home / "data")
    os.kill(json.loads((home / "server.json").read_text())["pid"], signal.SIGKILL)
    output, _ = push.communicate(timeout=120)
    assert push.returncode != 0, output

    local_s3(repo, port=port)  # same data folder, same credentials
    run(["dvc", "push"], repo)
    assert "in sync" in run(["dvc", "status", "-c"], repo).stdout
    run(["eagle3", "s3", "stop"], repo)
    assert run(["eagle3", "s3", "status"], repo, check=False).returncode != 0
    local_s3(repo, port=port)
    assert "in sync" in run(["dvc", "status", "-c"], repo).stdout  # the restarted server kept everything

    # A fresh clone restores the bytes (pulls of > 50 MiB objects need the checksum settings).
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], tmp_path)
    run(["eagle3", "s3", "serve", "--background", "--addr", f"127.0.0.1:{port}", "--dir", str(home)], clone)
    run(["dvc", "pull"], clone)
    assert file_hashes(clone, "blobs") == file_hashes(repo, "blobs")
    assert "up to date" in run(["dvc", "status"], clone).stdout


@pytest.fixture
def fresh_repo(tmp_path: Path) -> Path:
    """A git + DVC repo with the project's default remote and nothing else."""
    repo = git_dvc_repo(tmp_path / "fresh")
    add_remote(repo)
    return repo


def test_status_checks_the_endpoint_and_key_dvc_signs_with(fresh_repo, local_s3):
    """`eagle3 s3 status` is ok only when the server accepts what .dvc/config.local gives DVC, not its own key alone."""
    from dvc.config import Config

    repo = fresh_repo
    port = local_s3(repo)
    run(["eagle3", "s3", "status"], repo)
    server_key = repo / ".eagle3" / "s3" / "credentials.json"
    for key, value, message in [
        ("secret_access_key", "not-the-secret", f"the server at http://127.0.0.1:{port} refuses the key of remote "
                                                f"'local-s3' that DVC signs with (the server's is in {server_key})"),
        ("endpointurl", "http://127.0.0.1:1", f"remote 'local-s3' points at http://127.0.0.1:1, the server listens at "
                                              f"http://127.0.0.1:{port}"),
    ]:
        with Config(dvc_dir=str(repo / ".dvc")).edit("local") as local:
            saved, local["remote"]["local-s3"][key] = local["remote"]["local-s3"][key], value
        refused = run(["eagle3", "s3", "status"], repo, check=False)
        assert refused.returncode != 0 and refused.stderr.splitlines() == [
            f"error: .dvc/config.local: {message}; run `eagle3 s3 serve --background --addr 127.0.0.1:{port}` to configure it again"]
        with Config(dvc_dir=str(repo / ".dvc")).edit("local") as local:
            local["remote"]["local-s3"][key] = saved
        run(["eagle3", "s3", "status"], repo)


def test_credentials_never_reach_git(fresh_repo, local_s3):
    repo = fresh_repo
    local_s3(repo, home=repo / "storage")  # even outside .eagle3/, the server folder ignores itself
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.email=t@e", "-c", "user.name=t", "commit", "-qm", "all"], repo)
    creds = json.loads((repo / "storage" / "credentials.json").read_text())
    local = (repo / ".dvc" / "config.local").read_text()
    assert creds["secret_access_key"] in local and creds["access_key_id"] in local
    tracked = run(["git", "ls-files"], repo).stdout.split()
    assert ".dvc/config" in tracked and not [p for p in tracked if p.startswith("storage") or p.endswith(".local")]
    for path in tracked:
        text = (repo / path).read_bytes()
        assert creds["secret_access_key"].encode() not in text and creds["access_key_id"].encode() not in text, path
    assert oct((repo / "storage" / "credentials.json").stat().st_mode & 0o777) == "0o600"
    assert oct((repo / ".dvc" / "config.local").stat().st_mode & 0o777) == "0o600"  # it holds the secret too


def test_gc_removes_what_killed_runs_left_beside_the_outputs(blob_repo, local_s3):
    from support.merge import plant_leftover

    repo = blob_repo
    seed_1_pushed(repo, local_s3)
    dead = plant_leftover(repo / "blobs")  # a kill -9 of the stage: its process is gone
    writing = repo / f".index.txt.tmp-{os.getpid()}-abc123"  # a live writer's (this test's pid)
    writing.mkdir()

    listed = gc(repo, "--dry-run")
    assert listed.returncode == 0, listed.stderr
    assert f"would remove {dead.name} (0.0 MB), left by a killed run" in listed.stdout and writing.name not in listed.stdout
    assert dead.exists()
    removed = gc(repo)
    assert removed.returncode == 0 and f"removing {dead.name}" in removed.stdout, removed.stderr
    assert not dead.exists() and writing.exists()
    assert "up to date" in run(["dvc", "status"], repo).stdout


FAKE_TRAIN = """\
import json, sys
from pathlib import Path
from eagle3.common import RUN_EXPORTED
run, checkpoints = sys.argv[1], Path(sys.argv[sys.argv.index("--checkpoints") + 1])
(checkpoints / run).mkdir(parents=True, exist_ok=True)
(checkpoints / run / "latest.pt").write_bytes(bytes(200_000))
Path("drafter").mkdir()
(Path("drafter") / "meta.json").write_text(json.dumps({"training": {"run": run}}))
(checkpoints / run / RUN_EXPORTED).write_text("drafter")
"""


def test_gc_removes_the_checkpoints_of_exported_runs_the_workspace_does_not_use(blob_repo, local_s3):
    """Training runs r1 and r2 exported (the workspace's export is r2's); r0 stopped before its export (resumable);
    r3 exported but held by a trainer (``dvc repro -f``): only r1's checkpoint folder goes, and r0 is listed as kept;
    ``--stopped-runs`` then removes r0 as well."""
    from eagle3.training.checkpoints import lock_run

    repo = blob_repo
    local_s3(repo)
    (repo / "train.py").write_text(FAKE_TRAIN)
    with (repo / ".gitignore").open("a") as ignore:
        ignore.write(".eagle3/\n")  # scratch, as in the project
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": {
        "cmd": "python train.py ${run} --checkpoints .eagle3/checkpoints/train", "deps": ["train.py"], "params": ["run"],
        "outs": ["drafter"]}}}))
    for run_id in ("r1", "r2"):
        (repo / "params.yaml").write_text(yaml.safe_dump({"run": run_id}))
        run(["dvc", "repro"], repo)
        commit(repo, run_id)
        run(["dvc", "push"], repo)
    runs = repo / ".eagle3" / "checkpoints" / "train"
    (runs / "r0").mkdir()
    (runs / "r3").mkdir()
    (runs / "r3" / "exported").write_text("drafter")
    trainer = lock_run(runs / "r3")  # as a trainer holds its run

    listed = gc(repo, "--dry-run")
    assert listed.returncode == 0, listed.stderr
    assert "would remove .eagle3/checkpoints/train/r1 (0.2 MB), an exported training run the workspace does not use" in listed.stdout
    assert not any(f"remove .eagle3/checkpoints/train/{name} " in listed.stdout for name in ("r0", "r2", "r3"))
    assert (runs / "r1").is_dir()
    kept = ("keeping .eagle3/checkpoints/train/r0 (0.0 MB), a training run stopped before its export: a `dvc repro` with "
            "the same params, data and code resumes it; `eagle3 gc --stopped-runs` removes it")
    assert kept in listed.stdout.splitlines()
    removed = gc(repo)
    assert removed.returncode == 0 and "removing .eagle3/checkpoints/train/r1" in removed.stdout, removed.stderr
    assert sorted(p.name for p in runs.iterdir()) == ["r0", "r2", "r3"]
    stopped = gc(repo, "--stopped-runs")
    assert stopped.returncode == 0, stopped.stderr
    assert "removing .eagle3/checkpoints/train/r0 (0.0 MB), a training run stopped before its export (--stopped-runs)" in stopped.stdout
    assert sorted(p.name for p in runs.iterdir()) == ["r2", "r3"]
    os.close(trainer)
    assert "up to date" in run(["dvc", "status"], repo).stdout
