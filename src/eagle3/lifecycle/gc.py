"""``eagle3 gc``: reclaim cache disk with ``dvc gc -w``, but only once every kept revision is in the remote.

    eagle3 gc [--rev REV ...] [--all-commits] [--remote NAME] [--dry-run] [--stopped-runs]

``dvc gc -w`` deletes every cached object the workspace does not reference, including the only
copy of an old run's hidden states if nobody pushed them. This command first lists every object
that the kept revisions reference (default: the workspace, every branch tip and every tag;
``--rev`` restricts to given revisions or ``A..B`` ranges, ``--all-commits`` takes every commit),
directory outputs expanded to their ``.dir`` manifest and every file in it, and asks the remote
for each one. It refuses, listing what is missing and the ``eagle3 push`` that verifies and uploads it, unless
all are there; then it runs DVC's own ``gc --workspace --force``, holding the repo lock from
the check to the deletion. It never deletes anything from the remote (no ``--cloud``).

First it removes what killed stages left beside their outputs (``atomic_dir``'s temporaries
``.<output>.tmp-<pid>-*`` whose process is gone: partial hidden-state parts, gigabytes at scale),
which no hash includes, so neither ``dvc status`` nor ``dvc gc`` ever sees them; and the checkpoint folders of
training runs that ended and were exported (``train --checkpoints``: weights, optimizer state and the best weights,
gigabytes a run at 8B), but the one whose export the workspace holds and any a trainer has locked. A run stopped
before its export is kept, since a ``dvc repro`` with the same params, data and code resumes it, and listed with its
size; ``--stopped-runs`` removes such runs too (a rerun of their params then trains from its first step).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.common import RUN_EXPORTED, UserError, stale_tmp, try_lock_run
from eagle3.lifecycle.objects import (
    Ref, Verdict, cache_odb, check, describe, kept_refs, missing_from_remote, quiet_dvc, remote_odb)

if TYPE_CHECKING:
    from dvc.repo import Repo

# DVC's loggers of a gc run: in a dry run they still say "Removing <path>" and "Removed N objects".
GC_LOGGERS = ("dvc_data.hashfile.gc", "dvc.repo.gc")


def expand_ranges(repo: Repo, revs: Iterable[str]) -> list[str]:
    """Revisions as given, with each ``A..B`` replaced by the commits of ``git rev-list A..B``."""
    expanded = []
    for rev in revs:
        if ".." not in rev:
            expanded.append(rev)
            continue
        result = subprocess.run(["git", "rev-list", rev], cwd=repo.scm.root_dir, capture_output=True, text=True)
        if result.returncode != 0 or not result.stdout.split():
            reason = (result.stderr.strip().splitlines() or ["no commits"])[0]
            raise UserError(f"--rev {rev}: not a git range with commits ({reason})")
        expanded.extend(result.stdout.split())
    return expanded


def kept_scope(revs: list[str], all_commits: bool) -> dict:
    """``repo.brancher``'s arguments for the revisions gc keeps: ``revs``, else every branch tip and tag (every commit)."""
    return dict(revs=revs) if revs else dict(all_branches=True, all_tags=True, all_commits=all_commits)


def experiments(repo: Repo) -> list[tuple[str, str]]:
    """``(name, commit)`` of each experiment (``refs/exps/<2 hex>/<38 hex>/<name>``; not DVC's queue and run refs)."""
    listed = subprocess.run(["git", "for-each-ref", "--format=%(objectname) %(refname)", "refs/exps"],
                            cwd=repo.scm.root_dir, capture_output=True, text=True).stdout.split("\n")
    found = []
    for commit, ref in (line.split() for line in listed if line.strip()):
        parts = ref.split("/")
        if len(parts) == 5 and len(parts[2]) == 2:
            found.append((parts[4], commit))
    return found


def unpushed_experiments(repo: Repo, kept: set[str], remote: str | None) -> list[tuple[str, list[str]]]:
    """``(experiment, outputs)`` for each experiment whose outputs `dvc gc -w` takes the only copy of: objects in this
    cache that no kept revision references and the remote lacks (``eagle3 gc`` keeps no experiment)."""
    found = []
    for name, commit in experiments(repo):
        refs = {ref.oid.value: ref for ref, _ in kept_refs(repo, dict(revs=[commit], workspace=False), remote)
                if ref.oid.value not in kept and cache_odb(repo, ref.oid).exists(ref.oid.value)}
        lost = [ref.path for ref in missing_from_remote(repo, list(refs.values()), remote)]
        outputs = sorted({ref.path for ref in refs.values() if ref.manifest is None})
        gone = [out for out in outputs if any(path == out or path.startswith(out + "/") for path in lost)]
        if gone:
            found.append((name, gone))
    return found


def say_unpushed_experiments(repo: Repo, kept: set[str], remote: str | None, dry_run: bool) -> None:
    """One line for each experiment whose outputs (its drafter, ...) lose their only copy here."""
    for name, outputs in unpushed_experiments(repo, kept, remote):
        print(f"{'would delete' if dry_run else 'deleting'} the only copy of experiment {name}'s {', '.join(outputs)} "
              f"(never pushed; to keep it: `dvc exp branch {name} <branch>`, `eagle3 push -a`, then `eagle3 gc`)", flush=True)


def push_command(repo: Repo, refs: list[Ref], remote: str | None) -> str:
    """The ``eagle3 push`` covering the revisions of ``refs``: plain for the workspace, -a/-T for tips, -A else."""
    names = {name for ref in refs if ref.rev != "workspace" for name in ref.rev.split(",")}
    branches, tags = set(repo.scm.list_branches()), set(repo.scm.list_tags())
    if names - branches - tags:
        flags = ["-A"]
    else:
        flags = (["-a"] if names & branches else []) + (["-T"] if names & tags else [])
    return " ".join(["eagle3", "push", *(["-r", remote] if remote else []), *flags])


def refusal(repo: Repo, verdict: Verdict, remote: str | None) -> str | None:
    """Print what is missing; return the one-line reason to refuse, or None when ``dvc gc -w`` is safe."""
    name = remote or repo.config["core"].get("remote")
    if verdict.lost:
        print(f"warning: {len(verdict.lost)} objects of kept revisions are neither cached nor in remote {name!r} "
              "(already unrecoverable here; gc does not change that):", file=sys.stderr)
        print("\n".join(describe(verdict.lost, "lost")), file=sys.stderr)
    if verdict.unlisted:
        print("\n".join(describe(verdict.unlisted, "manifest missing")), file=sys.stderr)
        return (f"{len(verdict.unlisted)} directory manifests of kept revisions are neither cached nor in remote "
                f"{name!r}, so `dvc gc` cannot tell which of their files to keep; rebuild them (`dvc repro` at that "
                "revision) or leave that revision out with --rev")
    if not verdict.unpushed:
        return None
    print("\n".join(describe(verdict.unpushed, "only in the local cache")), file=sys.stderr)
    fix = push_command(repo, verdict.unpushed, remote)
    missing = {ref.oid.value for ref in verdict.unpushed}
    # `dvc push` takes a .dir manifest on the remote as proof that all its files are there too.
    trusted = {ref.manifest.value: ref.manifest for ref in verdict.unpushed
               if ref.manifest is not None and ref.manifest.value not in missing}
    if trusted:
        odb = remote_odb(repo, next(iter(trusted.values())), remote)
        urls = " ".join(odb.fs.unstrip_protocol(odb.oid_to_path(value)) for value in sorted(trusted))
        fix = f"{fix}` after deleting their directory manifests from the remote (`dvc push` trusts them): `{urls}"
    return f"refusing: {len(verdict.unpushed)} objects of kept revisions are not in remote {name!r}; run `{fix}`, then `eagle3 gc` again"


class DryRunLines(logging.Filter):
    """Drops DVC's gc lines, keeping the paths of its "Removing <path>" ones (in a dry run, nothing is)."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Removing %s":
            self.paths.append(str(record.args[0]))
        return False


@contextmanager
def would_remove() -> Iterator[list[str]]:
    """The cache paths that the ``repo.gc(dry=True)`` inside would remove, DVC's own lines silenced."""
    lines = DryRunLines()
    for name in GC_LOGGERS:
        logging.getLogger(name).addFilter(lines)
    try:
        yield lines.paths
    finally:
        for name in GC_LOGGERS:
            logging.getLogger(name).removeFilter(lines)


def dry_run(repo: Repo) -> None:
    """Print what ``dvc gc --workspace --force`` would remove, in words that say nothing was."""
    with would_remove() as paths:
        repo.gc(workspace=True, force=True, dry=True)
    for path in paths:
        print(f"  would remove {os.path.relpath(path, repo.root_dir)}")
    print(f"dry run: nothing was removed; `eagle3 gc` would remove these {len(paths)} objects from the cache"
          if paths else "dry run: nothing was removed; `eagle3 gc` would remove nothing (the workspace uses every cached object)")


def stale_temporaries(repo: Repo) -> list[Path]:
    """The temporaries of killed runs in the folders of the workspace's outputs (of any shard, listed or not)."""
    folders = sorted({Path(out.fs_path).parent for out in repo.index.outs})
    return [tmp for folder in folders if folder.is_dir() for tmp in stale_tmp(folder)]


def remove_temporaries(repo: Repo, dry_run: bool) -> None:
    """Remove (``dry_run``: only list) the stale temporaries, one line each with its size."""
    for tmp in stale_temporaries(repo):
        remove_folder(repo, tmp, "left by a killed run (its process is gone)", dry_run)


def folder_size(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.rglob("*") if file.is_file())


def remove_folder(repo: Repo, folder: Path, why: str, dry_run: bool) -> None:
    print(f"{'would remove' if dry_run else 'removing'} {folder.relative_to(repo.root_dir)} ({folder_size(folder) / 1e6:.1f} MB), {why}")
    if not dry_run:
        shutil.rmtree(folder)


def training_runs(repo: Repo) -> Iterator[tuple[Path, set[str]]]:
    """Each checkpoints folder a stage names (``--checkpoints DIR`` in its command) with the runs the workspace's
    exports come from (``training.run`` in the ``meta.json`` of the stage's outputs)."""
    for stage in repo.index.stages:
        args = shlex.split(" ".join(stage.cmd) if isinstance(stage.cmd, list) else stage.cmd or "")
        if "--checkpoints" in args[:-1]:
            exports = [Path(out.fs_path) / "meta.json" for out in stage.outs]
            used = {json.loads(meta.read_text()).get("training", {}).get("run") for meta in exports if meta.is_file()}
            yield Path(stage.wdir) / args[args.index("--checkpoints") + 1], used


def remove_training_runs(repo: Repo, dry_run: bool, stopped: bool) -> None:
    """Remove (``dry_run``: only list) the checkpoint folders of exported training runs the workspace does not use, and
    with ``stopped`` those of runs stopped before their export too; without it, say which stopped runs are kept and how
    large they are (a run killed and never resumed, its params since changed, stays until a user asks). Each run is
    locked while it goes (``try_lock_run``, as a trainer locks its run): one that a trainer holds is left alone."""
    for checkpoints, used in training_runs(repo):
        for run_dir in sorted(folder for folder in checkpoints.glob("*") if folder.is_dir() and folder.name not in used):
            exported = (run_dir / RUN_EXPORTED).is_file()
            fd = try_lock_run(run_dir)
            if fd is None:
                continue  # a trainer runs it (`dvc repro`, or `-f` of an exported run)
            try:
                if exported:
                    remove_folder(repo, run_dir, "an exported training run the workspace does not use", dry_run)
                elif stopped:
                    remove_folder(repo, run_dir, "a training run stopped before its export (--stopped-runs)", dry_run)
                else:
                    print(f"keeping {run_dir.relative_to(repo.root_dir)} ({folder_size(run_dir) / 1e6:.1f} MB), a training "
                          f"run stopped before its export: a `dvc repro` with the same params, data and code resumes it; "
                          f"`eagle3 gc --stopped-runs` removes it")
            finally:
                os.close(fd)


def run_gc(args: argparse.Namespace) -> None:
    from dvc.repo import Repo, lock_repo

    quiet_dvc()
    with Repo() as repo, lock_repo(repo):  # held from the check to the deletion: no dvc command in between
        remove_temporaries(repo, args.dry_run)
        remove_training_runs(repo, args.dry_run, args.stopped_runs)
        verdict = check(repo, kept_scope(expand_ranges(repo, args.rev), args.all_commits), args.remote)
        problem = refusal(repo, verdict, args.remote)
        if problem:
            raise UserError(problem)
        print(f"all {verdict.checked} objects of the kept revisions are in the remote; "
              f"{'listing what' if args.dry_run else 'running'} `dvc gc --workspace --force`"
              f"{' would remove' if args.dry_run else ''}", flush=True)
        say_unpushed_experiments(repo, verdict.kept, args.remote, args.dry_run)
        if args.dry_run:
            dry_run(repo)
        else:
            repo.gc(workspace=True, force=True)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("gc", help="`dvc gc -w`, only once every kept revision is in the remote")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--rev", nargs="+", default=[], help="keep only these revisions or A..B ranges "
                       "(default: all branches and tags); the workspace is always kept")
    scope.add_argument("--all-commits", action="store_true", help="keep every commit")
    parser.add_argument("--remote", help="remote to check (default: core.remote)")
    parser.add_argument("--dry-run", action="store_true", help="check, then list what `dvc gc -w` would remove, the "
                        "temporaries of killed runs and the checkpoints of exported training runs (removing nothing)")
    parser.add_argument("--stopped-runs", action="store_true", help="also remove the checkpoints of training runs stopped "
                        "before their export (kept by default: a `dvc repro` with the same params, data and code resumes them)")
    parser.set_defaults(func=run_gc)
