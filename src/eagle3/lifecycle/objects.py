"""The objects that revisions reference and whether the remote holds them: what ``eagle3 gc`` checks before it deletes
and ``eagle3 push`` before it sends.

Every cached output of each revision, a directory output expanded to its ``.dir`` manifest and every file in it,
asked of the remote afresh (not DVC's remote index: ``dvc push`` and ``dvc status -c`` take a ``.dir`` manifest on the
remote as proof that all its files are there). A remote that cannot be asked is one line, nothing deleted or sent.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eagle3.common import UserError

if TYPE_CHECKING:
    from dvc.repo import Repo
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.tree import Tree

SHOWN = 20  # missing objects listed by name; the rest are counted


@dataclass(frozen=True)
class Ref:
    """One object a kept revision needs: where it appears and which remote ``dvc push`` sends it to."""

    rev: str  # "workspace", branch/tag names joined by ",", or the revision as given
    path: str  # the output, or a file inside a directory output
    oid: HashInfo
    remote: str | None  # the output's own remote, None for the default
    stage: str  # the stage that writes the output (``extract@000000-000032``)
    manifest: HashInfo | None = None  # for a file inside a directory output: that directory's .dir


@dataclass
class Verdict:
    unpushed: list[Ref]  # in the local cache only: `dvc gc -w` could delete the last copy
    lost: list[Ref]  # neither cached nor in the remote: nothing here can bring them back
    unlisted: list[Ref]  # directory manifests nowhere to be read: their files cannot be enumerated
    checked: int  # distinct objects asked for
    kept: set[str]  # the object ids of the kept revisions: what `dvc gc -w` keeps once they are all pushed


def load_manifest(repo: Repo, oid: HashInfo, remote: str | None) -> Tree | None:
    """A directory output's ``.dir`` manifest, from the cache, else from ``remote``; None where neither holds it."""
    from dvc_data.hashfile.tree import Tree
    from dvc_objects.errors import ObjectFormatError

    try:
        return Tree.load(cache_odb(repo, oid), oid)
    except (FileNotFoundError, ObjectFormatError):
        pass
    try:
        return Tree.load(remote_odb(repo, oid, remote), oid)
    except (FileNotFoundError, ObjectFormatError):
        return None
    except Exception as err:  # transport and auth errors, as in `absent`
        raise UserError(unreachable(repo, remote, err)) from None


def revisions(repo: Repo, scope: dict) -> Iterator[str]:
    """``repo.brancher`` (which switches ``repo`` to each revision in turn), with bad names as UserError."""
    from dvc.scm import RevError

    try:
        yield from repo.brancher(**scope)
    except RevError as err:
        raise UserError(f"--rev: {err}") from None


def kept_refs(repo: Repo, scope: dict, remote: str | None) -> Iterator[tuple[Ref, bool]]:
    """``(ref, listed)`` for every cached output of the revisions of ``scope`` (``repo.brancher``'s arguments);
    directory outputs are expanded.

    ``listed`` is False for a ``.dir`` manifest that neither the cache nor the remote holds.
    """
    manifests: dict[str, Tree | None] = {}
    for rev in revisions(repo, scope):
        for out in repo.index.outs:
            if not out.use_cache or out.hash_info is None or not out.hash_info.value or out.stage.is_repo_import:
                continue
            ref = Ref(rev=rev, path=str(out), oid=out.hash_info, remote=out.remote, stage=out.stage.addressing)
            if not out.hash_info.isdir:
                yield ref, True
                continue
            if out.hash_info.value not in manifests:
                manifests[out.hash_info.value] = load_manifest(repo, out.hash_info, out.remote or remote)
            tree = manifests[out.hash_info.value]
            yield ref, tree is not None
            for key, _, oid in tree or ():
                yield Ref(rev=rev, path="/".join([str(out), *key]), oid=oid, remote=out.remote, stage=out.stage.addressing,
                          manifest=out.hash_info), True


def cache_odb(repo: Repo, oid: HashInfo):
    """The local cache store for ``oid``'s kind of hash (DVC 3 md5, or DVC 2's md5-dos2unix)."""
    from dvc.cachemgr import LEGACY_HASH_NAMES

    return repo.cache.legacy if oid.name in LEGACY_HASH_NAMES else repo.cache.local


def remote_odb(repo: Repo, oid: HashInfo, remote: str | None):
    """The object store of ``remote`` (None: the default remote) for ``oid``'s kind of hash."""
    from dvc.exceptions import DvcException

    try:
        return repo.cloud.get_remote_odb(remote, "gc", hash_name=oid.name)
    except DvcException as err:
        raise UserError(f".dvc/config: {err}") from None


def check(repo: Repo, scope: dict, remote: str | None) -> Verdict:
    """Ask the remote for every object the revisions of ``scope`` reference (no remote index: a fresh listing)."""
    first: dict[tuple[str | None, str], Ref] = {}
    unlisted: list[Ref] = []
    for ref, listed in kept_refs(repo, scope, remote):
        first.setdefault((ref.remote or remote, ref.oid.value), ref)
        if not listed:
            unlisted.append(ref)
    verdict = Verdict(unpushed=[], lost=[], unlisted=unlisted, checked=len(first), kept={oid for _, oid in first})
    for ref in missing_from_remote(repo, list(first.values()), remote):
        (verdict.unpushed if cache_odb(repo, ref.oid).exists(ref.oid.value) else verdict.lost).append(ref)
    return verdict


def missing_from_remote(repo: Repo, refs: list[Ref], remote: str | None) -> list[Ref]:
    """The refs whose object is not in their remote (the output's own, else ``remote``)."""
    targets = {ref.remote or remote for ref in refs}
    return [missing for target in targets
            for missing in absent(repo, [ref for ref in refs if (ref.remote or remote) == target], target)]


def absent(repo: Repo, refs: list[Ref], remote: str | None) -> list[Ref]:
    """The refs whose object the remote does not hold."""
    missing = []
    for name in {ref.oid.name for ref in refs}:
        group = [ref for ref in refs if ref.oid.name == name]
        odb = remote_odb(repo, group[0].oid, remote)
        try:
            present = set(odb.oids_exist([ref.oid.value for ref in group]))
        except Exception as err:  # transport and auth errors come in many types (aiohttp, botocore, s3fs, ...)
            raise UserError(unreachable(repo, remote, err)) from None
        missing += [ref for ref in group if ref.oid.value not in present]
    return missing


def unreachable(repo: Repo, remote: str | None, err: Exception) -> str:
    """One line: which remote could not be asked, why, and what to do."""
    name = remote or repo.config["core"].get("remote")
    settings = repo.config["remote"].get(name, {})
    where = settings.get("endpointurl") or settings.get("url")
    reason = (str(err).strip().splitlines() or [""])[0]
    return (f"remote {name!r} ({where}) cannot be asked for the kept objects ({type(err).__name__}: {reason}); "
            "no cached object was deleted, nothing was pushed; start the server (`eagle3 s3 serve --background` for the local "
            "one) or fix the remote's settings, then run the command again")


def describe(refs: list[Ref], why: str) -> list[str]:
    lines = [f"  {ref.rev:<20} {ref.path}  ({ref.oid.value}, {why})" for ref in refs[:SHOWN]]
    if len(refs) > SHOWN:
        lines.append(f"  ... and {len(refs) - SHOWN} more")
    return lines


def quiet_dvc() -> None:
    """DVC's log lines once, as DVC prints them, without the S3 client's chatter."""
    for name in ("dvc", "dvc_objects", "dvc_data"):  # DVC's own console handlers print these once already
        logging.getLogger(name).propagate = False
    logging.getLogger("aiobotocore").setLevel(logging.WARNING)  # "Found credentials in ..." on every run
