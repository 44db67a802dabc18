"""Stages without a process start each: ``python -m eagle3.extract ARGS`` hands itself to a warm server (``eagle3.runner``).

Every ``generate@<shard>`` and ``extract@<shard>`` is its own command, and so its own process, and so are
``train`` and ``evaluate`` (``SERVED``): on a GPU host importing
torch and transformers took 7.7 of the ~10 s before a shard's first batch (docs/data.md, "What a shard costs"),
paid again by every one. Here such a command is a small client (no
torch): it hands its arguments, environment, working folder and standard streams to a *warm server* that has
imported the stage modules once, and the server forks a fresh process for it, which runs ``-m MODULE`` as
Python would (``runpy``), writing straight to the client's streams, while the client waits and exits with its
status. DVC still runs one command per stage with its own deps and outputs; only the imports are shared. The
server never touches the GPU (a forked CUDA context would be unusable): each process starts CUDA and loads the
verifier itself, so its outputs are those of a cold process (tested: the same bytes).

    layout.warm_seconds: 600    # conf/layout/gpu*.yaml: the server lives 600 s past its last stage; 0 (cpu): no server
                                # (past a failed stage it leaves at once: DVC stops its run there)
    EAGLE3_WARM_SECONDS=0       # overrides the params (0: every command starts its own process, as before)

A server serves only clients that would have imported exactly what it did: the same Python, search path,
installed packages, eagle3 sources, environment (DVC's per-stage ``DVC_STAGE`` aside) and working folder
(``server_key``). A client that finds none starts one (detached, its log in ``.eagle3/warm/``), and runs its
command cold if it fails to start. A killed client (``kill`` of ``dvc repro``, Ctrl-C) stops its command's process:
that process interrupts itself when the client's connection closes, and outputs are written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import yaml

from eagle3.common import params_argument
from eagle3.launch import LAUNCHER_GONE, exit_with_launcher

WARM_ENV = "EAGLE3_WARM_SECONDS"
VOLATILE_ENV = ("DVC_STAGE", "_", "OLDPWD", "SHLVL")  # differ between stage commands or shells; no import reads them
SERVED = ("eagle3.generate", "eagle3.extract", "eagle3.evaluate", "eagle3.train")  # the stages a warm server runs
PRELOAD = (*SERVED, "eagle3.backends.local", "safetensors.torch",
           "torch.distributed.run", "torch._inductor.compile_fx")  # the last two: eagle3.launch's, train's torch.compile
SERVER_START_S = 300  # the longest a client waits for a server's imports (a loaded 2-core machine took 9 s)
INTERRUPT_GRACE_S = 10  # a process whose client is gone gets this long to stop by KeyboardInterrupt, then is killed
FORKED = False  # True in a process a server forked for a command: the command runs here, not handed over again


# --- the client (a stage's command) -------------------------------------------------------------------------------


def warm_seconds(args: list[str]) -> float:
    """How long a server should wait for more commands: $EAGLE3_WARM_SECONDS, else the params' ``layout.warm_seconds``
    (the file of the stage's ``--params``, params.yaml by default); 0 when neither says (the stage then reads and
    refuses its params itself)."""
    if os.environ.get(WARM_ENV):
        return float(os.environ[WARM_ENV])
    path = params_argument(args) or "params.yaml"
    try:
        return float(((yaml.safe_load(Path(path).read_text()) or {}).get("layout") or {}).get("warm_seconds") or 0)
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        return 0.0


def server_key() -> str:
    """What a server's imports depend on, hashed: a client uses a server only where it would import the same."""
    package = Path(__file__).parent
    sources = sorted((str(p.relative_to(package)), p.stat().st_size, p.stat().st_mtime_ns) for p in package.rglob("*.py"))
    here = os.getcwd()  # where the stages write: its listing changes, the packages do not live there
    entries = [os.path.abspath(entry) for entry in sys.path]  # "" (python -c) is the folder too
    paths = [(entry, os.stat(entry).st_mtime_ns if os.path.isdir(entry) and entry != here else None) for entry in entries]
    env = sorted((k, v) for k, v in os.environ.items() if k not in VOLATILE_ENV)
    facts = [sys.executable, os.getuid(), os.getcwd(), paths, sources, env]
    return hashlib.sha256(json.dumps(facts, default=str).encode()).hexdigest()[:24]


def address(key: str) -> str:
    return f"\0eagle3-warm-{key}"  # Linux's abstract namespace: no file to clean up, no path-length limit


def start_server(key: str, idle: float) -> None:
    import subprocess

    folder = Path(".eagle3") / "warm"
    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "DVC_STAGE"}  # it serves every stage
    env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # imports asking "is CUDA there?" must not start CUDA before a fork
    with open(folder / f"{key}.log", "ab") as log:
        subprocess.Popen([sys.executable, "-m", "eagle3.warm", "--serve", key, str(idle)], env=env, stdin=subprocess.DEVNULL,
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (Linux's SO_PEERCRED: pid, uid, gid)."""
    return int.from_bytes(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)[4:8], sys.byteorder)


def connect(key: str, idle: float) -> socket.socket | None:
    """A connection to this key's server, started if there is none; None when none could start, or when another
    user's process holds the address (the request carries this environment: it goes to our own user's server only)."""
    started, deadline = False, time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(address(key))
            if peer_uid(sock) == os.getuid():
                return sock
            sock.close()
            print("eagle3.warm: another user's process holds this command's warm-server address; running it here",
                  file=sys.stderr)
            return None
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
        if not started:
            start_server(key, idle)
            started = True
        time.sleep(0.05)
    return None


def run_on_server(sock: socket.socket, module: str, args: list[str]) -> int | None:
    """Hand the command to the server; its exit status, or None when the server went before starting it."""
    request = {"module": module, "args": args, "cwd": os.getcwd(), "env": dict(os.environ)}
    try:
        socket.send_fds(sock, [json.dumps(request).encode()], [open_or_null(fd) for fd in (0, 1, 2)])
        first = sock.recv(256).decode()
    except OSError:  # the server left (its idle time ran out) before taking the request
        return None
    if not first.startswith("started "):
        return None
    try:
        last = sock.recv(256).decode()
    except OSError:
        last = ""
    if not last.startswith("exit "):
        print(f"eagle3.warm: the warm server of this command's process {first.split()[1]} is gone; run the stage again "
              f"(its log: .eagle3/warm/)", file=sys.stderr)
        return 1
    return int(last.split()[1])


def open_or_null(fd: int) -> int:
    """``fd`` if this process has it open, else the null device (a stage run with a closed stdin)."""
    try:
        os.fstat(fd)
        return fd
    except OSError:
        return os.open(os.devnull, os.O_RDWR)


def hand_over(module: str, args: list[str]) -> None:
    """Run ``-m module args`` through a warm server and exit with its status; return when none took it (the command
    then runs in this process)."""
    idle = warm_seconds(args)
    sock = connect(server_key(), idle) if idle > 0 and sys.platform == "linux" else None
    if sock is None:
        return
    exit_with_launcher()  # a killed dvc takes this client, and so the command's process, with it
    try:
        status = run_on_server(sock, module, args)
    except KeyboardInterrupt:  # the command's process sees the connection close and interrupts itself
        sys.exit(130)
    if status is None:
        print(f"eagle3.warm: no warm server took the command (its log: .eagle3/warm/); running {module} here", file=sys.stderr)
        return
    sys.exit(status)


def client(module: str, args: list[str]) -> None:
    """``python -m eagle3.warm -m module args``: through a warm server, or in this process (exec: the same pid)."""
    hand_over(module, args)
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


# --- the server ----------------------------------------------------------------------------------------------------


def serve(key: str, idle: float) -> None:
    """Bind the key's address (a second server of the key leaves), import the stage modules, then fork a process per
    command until ``idle`` seconds pass with none running (or the working folder is gone)."""
    import select

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(address(key))
    except OSError:
        return
    listener.listen(64)  # clients queue here during the imports below
    preload()
    print(f"eagle3.warm: server {os.getpid()} ready", flush=True)
    running: dict[int, socket.socket | None] = {}  # None: a compile ahead, no client's
    last, folder, ahead = time.monotonic(), os.getcwd(), False
    failed = False  # the last command failed: DVC stops its run there, so no command of that run is coming
    while running or (time.monotonic() - last < (0 if failed else idle) and os.path.isdir(folder)):
        ready, _, _ = select.select([listener], [], [], 0.2)
        if ready:
            conn, _ = listener.accept()
            request = fork_command(conn, listener, running)
            failed = failed and request is None
            if request is not None and request["module"] == "eagle3.extract" and not ahead:
                ahead = True  # once a server (one folder): a later server's finds its work done, or running
                compile_ahead(request, listener, running)
        for pid, status in reaped(running):
            conn = running.pop(pid)
            if conn is not None:
                failed = status != 0
                with conn:
                    try:
                        conn.send(f"exit {status}".encode())
                    except OSError:  # the client is gone (its command's process saw it and stopped)
                        pass
            last = time.monotonic()


def preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import transformers

    transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM  # noqa: B018 (lazy imports)


def reaped(running: dict[int, socket.socket]) -> list[tuple[int, int]]:
    """(pid, exit status) of each finished command's process (killed by a signal: 128 + signal, as a shell says)."""
    done = []
    for pid in list(running):
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            done.append((pid, os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)))
    return done


def fork_command(conn: socket.socket, listener: socket.socket, running: dict) -> dict | None:
    """Fork the process of one client's command, noted in ``running``; its request (None: not our user's client, or a
    broken request)."""
    uid = peer_uid(conn)
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(data)
    except (OSError, ValueError):
        conn.close()
        return None
    if uid != os.getuid() or len(fds) != 3:
        conn.close()
        return None
    pid = fork_process(conn, request, fds, listener)
    running[pid] = conn
    conn.send(f"started {pid}".encode())
    return request


def fork_process(conn: socket.socket | None, request: dict, fds: list[int], listener: socket.socket) -> int:
    """Fork a process that runs ``request`` (``run_command``) on the streams ``fds`` (closed here); its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        run_command(conn, request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    return pid


def compile_ahead(extract: dict, listener: socket.socket, running: dict) -> None:
    """Beside an ``extract`` command, train's compiled step built ahead (``eagle3.training.ahead``, which decides from
    the params whether train compiles at all), for the same verifier and params, in the command's folder and
    environment; what it prints goes to ``.eagle3/compile-ahead/log``. Why here: the server lives from the first stage
    to the last, and extract's GPU work leaves the host's cores free for a compile."""
    args = [extract["args"][0], "--params", params_argument(extract["args"]) or "params.yaml"]
    log = Path(extract["cwd"]) / ".eagle3" / "compile-ahead" / "log"
    log.parent.mkdir(parents=True, exist_ok=True)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    streams = [os.open(os.devnull, os.O_RDONLY), out, os.dup(out)]
    running[fork_process(None, {**extract, "module": "eagle3.training.ahead", "args": args}, streams, listener)] = None


def run_command(conn: socket.socket | None, request: dict, fds: list[int]) -> None:
    """In the forked process: become the client's process (streams, folder, environment, argv) and run its module
    (``conn`` None: a process of the server's own, no client to watch)."""
    import atexit
    import runpy
    import signal
    import threading
    import traceback
    import warnings

    global FORKED
    FORKED = True
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["args"]]
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where the server was started with it ignored (&)
    if conn is not None:  # a client's command
        threading.Thread(target=stop_when_client_goes, args=(conn,), daemon=True).start()
    # runpy's note that the module was imported before (by preload) is no news here: it runs afresh as __main__
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    status = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as done:  # as the interpreter reads it: None is 0, a message is printed and is 1
        if done.code is None or isinstance(done.code, int):
            status = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 (what the interpreter prints for an uncaught error, then its status)
        traceback.print_exc()
        status = 1
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])  # the watcher must not interrupt the exit itself
    atexit._run_exitfuncs()  # what the interpreter runs at exit (os._exit below runs nothing)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def stop_when_client_goes(conn: socket.socket) -> None:
    """The client sends nothing after its request: its connection closing means it is gone (killed, or Ctrl-C).
    The process stops as a cold one would (KeyboardInterrupt: atomic outputs cleaned up), else is killed."""
    import signal

    try:
        while conn.recv(1):
            pass
    except OSError:  # reset: gone as well
        pass
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(INTERRUPT_GRACE_S)
    os._exit(LAUNCHER_GONE)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--serve"]:
        serve(argv[1], float(argv[2]))
    elif len(argv) >= 2 and argv[0] == "-m":
        client(argv[1], argv[2:])
    else:
        sys.exit("usage: python -m eagle3.warm -m MODULE [ARGS ...]  (the stage command MODULE runs through a warm server)")


if __name__ == "__main__":
    import eagle3.warm  # run as the module the stages' runner imports, so that it sees FORKED (not this __main__ copy's)

    eagle3.warm.main(sys.argv[1:])
