"""Helpers of the lifecycle tests: a real `eagle3 s3` server per temp repo, cache listings, file hashes."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from eagle3.common import sha256_file
from eagle3.lifecycle.s3 import ServerHome, load_credentials, s3_client, stop
from support.repo import run


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def local_s3():
    """``serve(repo, port=None, home=None) -> port``: `eagle3 s3 serve --background` in ``repo``; stopped at teardown."""
    homes: list[ServerHome] = []

    def serve(repo: Path, port: int | None = None, home: Path | None = None) -> int:
        port = port or free_port()
        home = home or repo / ".eagle3" / "s3"
        run(["eagle3", "s3", "serve", "--background", "--addr", f"127.0.0.1:{port}", "--dir", str(home)], repo)
        homes.append(ServerHome(home))
        return port

    yield serve
    for home in homes:
        stop(home)


def add_remote(repo: Path) -> None:
    """The project's default remote, as committed in .dvc/config (through DVC's config API: dvc calls are slow)."""
    from dvc.config import Config

    with Config(dvc_dir=str(repo / ".dvc")).edit("repo") as conf:
        conf["core"]["remote"] = "local-s3"
        conf["remote"]["local-s3"] = {"url": "s3://eagle3/cache", "endpointurl": "http://127.0.0.1:9000", "verify": True}


def cache_objects(repo: Path) -> set[str]:
    """Object ids in the repo's DVC cache (``.dir`` manifests included)."""
    root = repo / ".dvc" / "cache" / "files" / "md5"
    return {path.parent.name + path.name for path in root.glob("*/*")} if root.is_dir() else set()


def file_hashes(repo: Path, *folders: str) -> dict[str, str]:
    """sha256 of every file under ``folders`` (relative paths as keys)."""
    return {str(path.relative_to(repo)): sha256_file(path)
            for folder in folders for path in sorted((repo / folder).rglob("*")) if path.is_file()}


def remote_client(repo: Path, port: int):
    """An S3 client of the repo's server (changes go through the S3 API: rclone's VFS must see them)."""
    return s3_client(f"http://127.0.0.1:{port}", load_credentials(ServerHome(repo / ".eagle3" / "s3")))


def remote_key(oid: str) -> str:
    return f"cache/files/md5/{oid[:2]}/{oid[2:]}"


def delete_remote_object(repo: Path, port: int, oid: str) -> None:
    """Remove one object from the server."""
    remote_client(repo, port).delete_object(Bucket="eagle3", Key=remote_key(oid))


def put_remote_object(repo: Path, port: int, oid: str, data: bytes) -> None:
    """Store ``data`` on the server as object ``oid`` (damage: bytes that are not what the name says)."""
    remote_client(repo, port).put_object(Bucket="eagle3", Key=remote_key(oid), Body=data)


def cached_file(repo: Path, oid: str) -> Path:
    return repo / ".dvc" / "cache" / "files" / "md5" / oid[:2] / oid[2:]


def manifest(repo: Path, oid: str) -> list[str]:
    """The file object ids listed by a cached ``.dir`` manifest."""
    entries = json.loads(cached_file(repo, oid).read_text())
    return [entry["md5"] for entry in entries]


def lock_objects(repo: Path) -> set[str]:
    """Object ids the workspace's cached outputs reference, directories expanded from their manifests."""
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc_repo:
        ids = {out.hash_info.value for out in dvc_repo.index.outs if out.use_cache and out.hash_info}
    return ids | {oid for dir_id in ids if dir_id.endswith(".dir") for oid in manifest(repo, dir_id)}
