"""``eagle3 push``: ``dvc push``, once every object it would send matches its hash.

    eagle3 push [-r REMOTE] [-a] [-T] [-A]

Why: the cache is hard-linked into the workspace, and a write as root ignores the read-only mode DVC
gives cached files, so a part damaged in place in the workspace (truncated, overwritten) is damaged
in ``.dvc/cache`` too, under the hash of its good bytes. ``dvc push`` sends it as it is; the remote
then serves the damage to every clone under the good hash, and ``dvc status`` there says up to date.
This command asks the remote which objects of the revisions it pushes are missing (as ``eagle3 gc``
does: every file of every directory output), hashes each of those in the cache, and refuses, naming
each damaged object, its workspace file and the mend, before anything is sent; then it runs
``dvc push`` with the same revisions.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import TYPE_CHECKING

from eagle3.common import UserError
from eagle3.lifecycle.objects import Ref, cache_odb, check, describe, quiet_dvc

if TYPE_CHECKING:
    from dvc.repo import Repo


def damaged(repo: Repo, refs: list[Ref]) -> list[Ref]:
    """The refs whose cached object's bytes no longer hash to its name (hashed afresh: DVC's state db could vouch
    for a file whose inode, size and mtime a careful write kept)."""
    from dvc_data.hashfile.hash import hash_file

    bad = []
    for ref in refs:
        odb = cache_odb(repo, ref.oid)
        _, actual = hash_file(odb.oid_to_path(ref.oid.value), odb.fs, ref.oid.name)
        if actual.value.split(".")[0] != ref.oid.value.split(".")[0]:
            bad.append(ref)
    return bad


def mend(repo: Repo, bad: list[Ref]) -> str:
    """The commands that mend the damaged objects of ``bad``: remove them (each workspace file too, where it is the
    same hard-linked file), then have their stages write them again or pull a copy pushed before the damage."""
    odb = cache_odb(repo, bad[0].oid)
    objects = [os.path.relpath(odb.oid_to_path(ref.oid.value), repo.root_dir) for ref in bad]
    files = [ref.path for ref in bad if os.path.isfile(os.path.join(repo.root_dir, ref.path))]
    stages = sorted({ref.stage for ref in bad})
    return (f"`rm -f {' '.join(files + objects)}`, then `dvc repro -f {' '.join(stages)}` "
            f"(or `dvc pull --force {' '.join(sorted({ref.path for ref in bad}))}` of a copy pushed before the damage)")


def refuse_damaged(repo: Repo, bad: list[Ref]) -> None:
    print("\n".join(describe(bad, "damaged in the cache")), file=sys.stderr)
    raise UserError(f"refusing to push: {len(bad)} cached objects no longer match their hash (written in place through "
                    "the workspace's hard link: as root a write ignores the cache's read-only mode); nothing was pushed; "
                    f"mend them with {mend(repo, bad)}, then `eagle3 push` again")


def push_flags(args: argparse.Namespace) -> list[str]:
    return ([*(["-r", args.remote] if args.remote else []), *(["-a"] if args.all_branches else []),
             *(["-T"] if args.all_tags else []), *(["-A"] if args.all_commits else [])])


def run_push(args: argparse.Namespace) -> None:
    from dvc.repo import Repo

    quiet_dvc()
    scope = dict(all_branches=args.all_branches, all_tags=args.all_tags, all_commits=args.all_commits)
    with Repo() as repo:
        verdict = check(repo, scope, args.remote)
        bad = damaged(repo, verdict.unpushed)
        if bad:
            refuse_damaged(repo, bad)
        print(f"the {len(verdict.unpushed)} cached objects missing from the remote match their hashes; "
              f"running `{' '.join(['dvc', 'push', *push_flags(args)])}`", flush=True)
    done = subprocess.run(["dvc", "push", *push_flags(args)])
    if done.returncode != 0:
        raise SystemExit(done.returncode)  # DVC said why


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("push", help="`dvc push`, once every object it sends matches its hash")
    parser.add_argument("-r", "--remote", help="remote to push to (default: core.remote)")
    parser.add_argument("-a", "--all-branches", action="store_true", help="push every branch tip's objects too")
    parser.add_argument("-T", "--all-tags", action="store_true", help="push every tag's objects too")
    parser.add_argument("-A", "--all-commits", action="store_true", help="push every commit's objects too")
    parser.set_defaults(func=run_push)
