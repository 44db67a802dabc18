"""Storage benchmark: DVC push/pull through the local S3 server vs a plain copy; DVC overhead at 100 shards.

    python benchmarks/storage_throughput.py [--shards 4] [--shard-mib 256] [--stages 100] [--repeats 3]
    python benchmarks/storage_throughput.py --smoke      # one 1 MiB shard, 2 stages, once: seconds (tests run it)

Part 1 writes ``--shards`` random files of ``--shard-mib`` MiB (incompressible, like hidden-state
safetensors parts) as one directory output in a temporary git+DVC repo, starts ``eagle3 s3 serve``
on a free loopback port, and times ``dvc push`` (each repeat to a fresh remote prefix), ``dvc pull``
(each repeat after emptying the cache and the workspace copy) and ``shutil.copyfile`` of the same
bytes. Part 2 generates a ``foreach`` of ``--stages`` trivial stages, runs it once, then times
``dvc status`` and a no-op ``dvc repro``. Prints medians; everything happens under a temp folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

MIB = 1 << 20


def sh(cmd: list[str], cwd: Path) -> None:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stdout}{result.stderr}")


def timed(cmd: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    sh(cmd, cwd)
    return time.perf_counter() - start


def new_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    sh(["git", "init", "-q"], path)
    sh(["dvc", "init", "-q"], path)
    sh(["dvc", "config", "cache.type", "hardlink"], path)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_remote_prefix(repo: Path, prefix: str) -> None:
    """Point the remote at a fresh prefix of the bucket (like ``dvc remote modify --local ... url``)."""
    from dvc.config import Config

    with Config(dvc_dir=str(repo / ".dvc")).edit("local") as conf:
        conf["remote"]["bench"]["url"] = f"s3://eagle3/{prefix}"


def write_shards(folder: Path, count: int, mib: int) -> None:
    folder.mkdir(parents=True)
    for i in range(count):
        with (folder / f"part-{i:03d}.safetensors").open("wb") as handle:
            for _ in range(mib):
                handle.write(os.urandom(MIB))


def throughput(root: Path, args: argparse.Namespace) -> dict[str, float]:
    """Median MB/s of dvc push, dvc pull and a plain copy of the same shard files."""
    repo = new_repo(root / "throughput")
    addr = f"127.0.0.1:{free_port()}"
    sh(["dvc", "remote", "add", "-d", "bench", "s3://eagle3/cache"], repo)
    sh(["dvc", "remote", "modify", "bench", "endpointurl", f"http://{addr}"], repo)
    sh(["eagle3", "s3", "serve", "--background", "--addr", addr], repo)
    try:
        write_shards(repo / "shards", args.shards, args.shard_mib)
        sh(["dvc", "add", "-q", "shards"], repo)
        total_mb = args.shards * args.shard_mib * MIB / 1e6
        copies, pushes, pulls = [], [], []
        for rep in range(args.repeats):
            target = root / f"copy-{rep}"
            target.mkdir()
            start = time.perf_counter()
            for part in sorted((repo / "shards").iterdir()):
                shutil.copyfile(part, target / part.name)
            copies.append(time.perf_counter() - start)
            shutil.rmtree(target)
            set_remote_prefix(repo, f"push-{rep}")
            pushes.append(timed(["dvc", "push", "-q"], repo))
        for _ in range(args.repeats):
            shutil.rmtree(repo / ".dvc" / "cache")
            shutil.rmtree(repo / "shards")
            pulls.append(timed(["dvc", "pull", "-q"], repo))
    finally:
        sh(["eagle3", "s3", "stop"], repo)
    return {name: total_mb / statistics.median(times) for name, times in
            [("copy", copies), ("push", pushes), ("pull", pulls)]}


def stage_overhead(root: Path, args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of `dvc status` and a no-op `dvc repro` with ``args.stages`` foreach stages."""
    repo = new_repo(root / "stages")
    items = [f"{i:06d}" for i in range(args.stages)]
    (repo / "params.yaml").write_text(yaml.safe_dump({"shards": items}))
    stage = {"foreach": "${shards}", "do": {"cmd": "echo ${item} > out/${item}.txt", "outs": ["out/${item}.txt"]}}
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"shard": stage}}))
    (repo / "out").mkdir()
    first = timed(["dvc", "repro", "-q"], repo)
    status = [timed(["dvc", "status", "-q"], repo) for _ in range(args.repeats)]
    noop = [timed(["dvc", "repro", "-q"], repo) for _ in range(args.repeats)]
    return {"first repro": first, "status": statistics.median(status), "no-op repro": statistics.median(noop)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mib", type=int, default=256)
    parser.add_argument("--stages", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", help="parent of the temporary folder (default: system temp)")
    parser.add_argument("--smoke", action="store_true", help="--shards 1 --shard-mib 1 --stages 2 --repeats 1")
    args = parser.parse_args()
    if args.smoke:
        args.shards, args.shard_mib, args.stages, args.repeats = 1, 1, 2, 1
    with tempfile.TemporaryDirectory(prefix="eagle3-storage-bench-", dir=args.workdir) as tmp:
        root = Path(tmp)
        rates = throughput(root, args)
        print(f"{args.shards} x {args.shard_mib} MiB shards, median of {args.repeats} "
              f"(load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs):")
        for name, rate in rates.items():
            print(f"  {name:<5} {rate:8.1f} MB/s")
        overhead = stage_overhead(root, args)
        print(f"{args.stages} foreach stages, median of {args.repeats}:")
        for name, seconds in overhead.items():
            print(f"  {name:<12} {seconds:7.2f} s")


if __name__ == "__main__":
    main()
