"""The artifact lifecycle on the real pipeline (tiny random verifier, real rclone S3 server, real dvc).

Scale A, push; scale-up B reuses A's shard; a storage change C re-extracts every shard;
`eagle3 gc` then removes exactly what only A and B referenced, and A comes back with `dvc pull`.
"""

import subprocess
import sys

import pytest
import yaml

from support.pipeline import LOCAL_SOURCE, add_dataset, write_local_prompts
from support.repo import run
from eagle3.config import compose_params
from eagle3.lifecycle.s3 import ServerHome, stop
from support.local_s3 import add_remote, cache_objects, file_hashes, free_port, local_s3, lock_objects  # noqa: F401

TARGET = "extract"  # the stages up to the hidden states, the artifact gc is about
SMALL = {"name": "small", "shards": ["000000-000006"], **LOCAL_SOURCE}
BIGGER = {"name": "bigger", "shards": ["000000-000006", "000006-000009"], **LOCAL_SOURCE}
FIXED = ["model=tiny-random", "generate.max_new_tokens=8"]


def use(repo, *overrides: str) -> None:
    """Recompose params.yaml (as `eagle3 params -S ...` does)."""
    compose_params([*FIXED, *overrides], conf_dir=repo / "conf", output=repo / "params.yaml")


def repro_and_commit(repo, tag: str) -> list[str]:
    """`dvc repro extract`, commit and tag; returns the stages that ran."""
    out = run(["dvc", "repro", TARGET], repo).stdout
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", tag], repo)
    run(["git", "tag", tag], repo)
    return [line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")]


@pytest.mark.slow
def test_push_invalidate_gc_and_restore(make_project, local_s3):
    repo = make_project(*FIXED[1:])
    for spec in (SMALL, BIGGER):
        add_dataset(repo, spec)
    write_local_prompts(repo)
    add_remote(repo)
    local_s3(repo)

    use(repo, "dataset=small")
    repro_and_commit(repo, "A")
    run(["dvc", "push"], repo)
    a_objects, a_files = lock_objects(repo), file_hashes(repo, "data", "models")
    a_shard = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["extract@000000-000006"]["outs"][0]["md5"]

    use(repo, "dataset=bigger")
    ran = repro_and_commit(repo, "B")
    assert "extract@000006-000009" in ran and not [s for s in ran if s.endswith("@000000-000006")], ran
    run(["dvc", "push"], repo)
    b_objects = lock_objects(repo)
    assert a_shard in b_objects  # scale-up: the first shard's hidden states stay referenced, not garbage

    use(repo, "dataset=bigger", "extract.dtype=float8_e4m3fn")  # other storage: new hidden states for every shard
    # (the tiny verifier's 4 layers allow only the taps [1, 2, 3])
    ran = repro_and_commit(repo, "C")
    assert sorted(ran) == ["extract@000000-000006", "extract@000006-000009", "params"], ran  # params: the check of any change
    run(["dvc", "push"], repo)
    c_objects = lock_objects(repo)

    before = cache_objects(repo)
    assert before == a_objects | b_objects | c_objects
    run(["eagle3", "gc"], repo)
    after = cache_objects(repo)
    assert after == c_objects and before - after == (a_objects | b_objects) - c_objects
    assert a_shard in before - after

    run(["git", "checkout", "-q", "A"], repo)
    run(["dvc", "pull", "--with-deps", TARGET], repo)
    assert "up to date" in run(["dvc", "status", TARGET], repo).stdout
    restored = file_hashes(repo, "data", "models")  # plus B's and C's second shard, untracked at A
    assert {path: restored.get(path) for path in a_files} == a_files


def test_gc_with_the_s3_server_down_is_one_line_and_deletes_nothing(tmp_path, local_s3):
    repo = tmp_path / "repo"
    repo.mkdir()
    run(["git", "init", "-q"], repo)
    run(["dvc", "init", "-q"], repo)
    (repo / "kept.txt").write_text("an artifact\n")
    run(["dvc", "add", "-q", "kept.txt"], repo)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "kept"], repo)
    add_remote(repo)
    port = local_s3(repo)
    stop(ServerHome(repo / ".eagle3" / "s3"))  # the server is down
    before = cache_objects(repo)
    result = subprocess.run([sys.executable, "-m", "eagle3.cli", "gc"], cwd=repo, capture_output=True, text=True)
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: remote 'local-s3' (http://127.0.0.1:{port}) cannot be asked for the kept "
                                    "objects (EndpointConnectionError: Could not connect to the endpoint URL")
    assert "no cached object was deleted, nothing was pushed; start the server (`eagle3 s3 serve --background`" in result.stderr
    assert cache_objects(repo) == before
    pushed = subprocess.run([sys.executable, "-m", "eagle3.cli", "push"], cwd=repo, capture_output=True, text=True)
    assert pushed.returncode == 1 and pushed.stderr.splitlines() == result.stderr.splitlines(), pushed.stderr


def test_ctrl_c_while_the_s3_server_starts_leaves_no_rclone_behind(tmp_path, monkeypatch, capsys):
    """rclone runs in a session of its own (Ctrl-C in the terminal does not reach it): interrupted before the server
    answered, `eagle3 s3 serve` stops it, says so in one line and exits 130. The Ctrl-C is raised where the command
    waits for the server (a real one cannot be timed to land there)."""
    from eagle3 import cli
    from eagle3.lifecycle import s3

    repo = tmp_path / "repo"
    repo.mkdir()
    run(["git", "init", "-q"], repo)
    run(["dvc", "init", "-q"], repo)
    add_remote(repo)
    started = []

    def interrupted(process, *args):
        started.append(process)
        raise KeyboardInterrupt

    monkeypatch.setattr(s3, "wait_ready", interrupted)
    monkeypatch.chdir(repo)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["s3", "serve", "--background", "--addr", f"127.0.0.1:{free_port()}"])
    assert stopped.value.code == 130
    assert capsys.readouterr().err.strip().splitlines() == ["eagle3 s3: interrupted (Ctrl-C)"]
    (process,) = started
    assert process.wait(timeout=10) is not None  # rclone was stopped
    assert not ServerHome(repo / ".eagle3" / "s3").state.exists()
