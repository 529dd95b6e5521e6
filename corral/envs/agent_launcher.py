"""The sandbox side of a black-box agent run (see :mod:`corral.envs.agent_bridge`).

Standard library only: this file is copied into every sandbox beside the runner. Started as
``python3 -m corral.envs.agent_launcher`` (``PYTHONPATH`` the payload, ``CORRAL_MODEL_JAIL``
the backend's jail) in the task's workspace, which becomes the agent's working folder.

The protocol is one compact JSON object per line, ``t`` naming the frame; bytes are base64
(``b``), at most :data:`CHUNK` bytes a frame. Down (env server -> here): first ``launch``
(``argv``, ``env``, ``files``, ``path_dirs``, ``kill_grace_s``, ``forward``: how many bytes
of each stream to send up whole), then ``data``/``eof``/``close`` (``abort``: reset it) for a
connection ``id``, ``term`` (SIGTERM to the agent's process group; everything it started is
SIGKILLed ``kill_grace_s`` later) and ``kill`` (SIGKILL everything now). Up: ``listening``
(``port``), ``started`` (``pid``), ``open``/``data``/``eof``/``close`` per connection,
``out``/``err`` (the agent's streams, their first ``forward`` bytes), then ``tail`` per stream
(``s``, its last :data:`TAIL` bytes ``b``, its size ``n``) and ``exit`` (``code`` or
``signal``). ``error`` (``message``) when the launch fails before the agent starts; the
launcher then exits.

What it does: :func:`harden` (as the env runner: non-dumpable, protocol streams off fds 0/1);
become a child subreaper (so whatever the agent leaves, even in a session of its own, stays
this process's descendant and can be found and killed); listen on ``127.0.0.1:0``; put the
listener's origin in place of :data:`GATEWAY_PLACEHOLDER` in argv, env values and file
contents; start ``jail + [python3, -I, -c, SETUP]`` in a process group of its own (in this
process's session), the setup reading the files and the agent's environment from its stdin as
the model's user, then exec'ing the agent. Of the agent's connections at most
:data:`MAX_CONNECTIONS` are served at once; one more, or one whose threads cannot be started
(the sandbox's pids limit), is reset at once: the agent sees a failure, never a hang. A link
found in place of :data:`AGENT_ROOT` (set up or removed) is removed, never followed. When the
agent exits (or is killed), every process left below this one is killed, the agent's folders
are removed (:func:`remove_agent_root`), the pipes are drained (at most :data:`DRAIN_S`),
``tail`` and ``exit`` go up, and the launcher ends. Signals go straight to the agent's
processes where this process may send them (bwrap: one uid; local as root) and otherwise
through the jail (docker: the agent's uid is not this one's), as a tiny killer run as the
model's user.

On ``local`` the agent's folders (:data:`AGENT_ROOT`) are the host's ``/tmp/corral-agent``:
one agent at a time per host there (a stale one is removed by the next setup); and a launcher
killed outright (not by the env server's frames) leaves what the agent started running: only
the agent's own process dies with it (a parent-death signal). bwrap's launcher is its
namespace's pid 1, so everything dies with it; docker's spawn kill ends the launcher's
session, the agent's process group included, but not processes in sessions of their own
(those end with the container).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import json
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import IO, Any

from corral.envs.model_actions import model_argv
from corral.envs.runner import private_streams

# The protocol module's constants, repeated: this file cannot import pydantic's protocol module.
GATEWAY_PLACEHOLDER = "@@CORRAL_GATEWAY@@"
AGENT_ROOT = "/tmp/corral-agent"
AGENT_HOME = f"{AGENT_ROOT}/home"
AGENT_TMP = f"{AGENT_ROOT}/tmp"
AGENT_DIR = f"{AGENT_ROOT}/agent"
BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
CHUNK = 65536
TAIL = 4000
DRAIN_S = 2.0  # after the agent is gone, how long its pipes may stay open (held by escapees)
KILL_ROUNDS_S = 5.0  # how long the kill loop keeps finding new processes below this one
LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset
PR_SET_CHILD_SUBREAPER = 36
# The agent's connections open at once: each costs two threads here, and a sandbox's pids limit
# (bwrap's and docker's default 256) counts threads; past it a connection is reset at once.
MAX_CONNECTIONS = 64
# accept() errors that pass (out of fds or memory for a moment): the loop waits and goes on.
TRANSIENT_ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

# Runs as the model's user through the jail (python3 -I: no PYTHONPATH, no user site): reads
# {"env", "argv", "files"} from stdin, makes the agent's folders, writes the files (the
# agent_dir area read-only), points fd 0 at /dev/null and becomes the agent. Exit 126 when the
# files cannot be written, 127 when the agent cannot be exec'd, a message on stderr.
REMOVE = r"""
import os, shutil, sys


def remove(root):
    if not os.path.lexists(root):
        return
    if os.path.islink(root) or not os.path.isdir(root):
        os.unlink(root)  # a link planted in its place is removed, never followed
        return
    for top, dirs, _ in os.walk(root):
        for d in dirs:
            if not os.path.islink(os.path.join(top, d)):
                os.chmod(os.path.join(top, d), 0o700)
    os.chmod(root, 0o700)
    shutil.rmtree(root)
"""
SETUP = (
    REMOVE
    + r"""
import base64, ctypes, json, signal
ROOT, AREAS = sys.argv[1], {"home": sys.argv[2], "agent_dir": sys.argv[4]}
# Die with the parent, the launcher or the jail's process (PR_SET_PDEATHSIG, kept across the
# exec below): a launcher killed outright does not leave the agent's own process running.
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
spec = json.loads(sys.stdin.buffer.read())
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
try:
    remove(ROOT)  # a stale one (the local backend's host /tmp)
    os.mkdir(ROOT, 0o700)
    for folder in sys.argv[2:5]:
        os.mkdir(folder, 0o700)
    for f in spec["files"]:
        path = os.path.join(AREAS[f["area"]], f["path"])
        os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
        ro = f["area"] == "agent_dir"
        mode = (0o555 if f["x"] else 0o444) if ro else (0o700 if f["x"] else 0o600)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(base64.b64decode(f["b"]))
        os.chmod(path, mode)
    for top, dirs, _ in os.walk(AREAS["agent_dir"], topdown=False):
        for d in dirs:
            os.chmod(os.path.join(top, d), 0o555)
    os.chmod(AREAS["agent_dir"], 0o555)
except OSError as exc:
    print(f"corral agent setup: cannot write the agent's files: {exc}", file=sys.stderr)
    sys.exit(126)
try:
    os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
except OSError as exc:
    print(f"corral agent setup: cannot run {spec['argv'][0]!r}: {exc}", file=sys.stderr)
    sys.exit(127)
"""
)
# Runs as the model's user: sends signal argv[1] to the pids (negative: groups) after it.
KILLER = r"""
import os, sys
for target in sys.argv[2:]:
    try:
        os.kill(int(target), int(sys.argv[1]))
    except OSError:
        pass
"""


def harden() -> tuple[IO[bytes], IO[bytes]]:
    """As :func:`corral.envs.runner.harden` (:func:`~corral.envs.runner.private_streams`:
    non-dumpable, the protocol on private close-on-exec copies of fds 0/1), and a child
    subreaper. ``OSError`` when either cannot be set."""
    down, up = private_streams()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER, 1) failed: {os.strerror(err)}")
    return down, up


def substitute(text: str, origin: str) -> str:
    return text.replace(GATEWAY_PLACEHOLDER, origin)


def descendants(root: int) -> list[tuple[int, str, int]]:
    """``(pid, state, ppid)`` of every process below ``root`` (from ``/proc``)."""
    children: dict[int, list[tuple[int, str, int]]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        ppid = int(fields[1])
        children.setdefault(ppid, []).append((int(name), fields[0].decode(), ppid))
    found: list[tuple[int, str, int]] = []
    todo = [root]
    while todo:
        for entry in children.get(todo.pop(), []):
            found.append(entry)
            todo.append(entry[0])
    return found


def remove_agent_root() -> None:
    """Remove :data:`AGENT_ROOT` (its configs hold the session's key), best effort, as the
    model's user through the jail: the folder is the model's, and a privileged launcher
    (local as root) must not walk paths the agent could have swapped for links."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            model_argv([sys.executable, "-I", "-c", REMOVE + "remove(sys.argv[1])", AGENT_ROOT]),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={"PATH": BASE_PATH},
            timeout=10,
            check=False,
        )


class Launcher:
    """One agent run: the frames up, the connections, the agent's process."""

    def __init__(self, up: IO[bytes]) -> None:
        self._up = up
        self._send_lock = threading.Lock()
        self._kill_lock = threading.Lock()
        self._conns: dict[int, Connection] = {}
        self._agent: subprocess.Popen[bytes] | None = None
        self._killed_at: float | None = None
        self._grace_s = 5.0

    # -- frames up ---------------------------------------------------------------------------

    def send(self, frame: dict[str, Any]) -> None:
        """One frame up. The env server gone (a broken pipe): kill everything, exit."""
        line = json.dumps(frame, separators=(",", ":")).encode() + b"\n"
        try:
            with self._send_lock:
                self._up.write(line)
                self._up.flush()
        except OSError:
            self.kill_tree()
            os._exit(1)

    def send_bytes(self, kind: str, data: bytes, **fields: Any) -> None:
        self.send({"t": kind, **fields, "b": base64.b64encode(data).decode()})

    # -- signals ------------------------------------------------------------------------------

    def signal(self, sig: int, targets: list[int]) -> None:
        """Send ``sig`` to ``targets`` (pids; negative: process groups): directly where this
        process may, else as the model's user through the jail (best effort, never raises)."""
        denied = []
        for target in targets:
            try:
                os.kill(target, sig)
            except PermissionError:
                denied.append(str(target))
            except OSError:
                pass  # gone already
        if denied:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(
                    model_argv([sys.executable, "-I", "-c", KILLER, str(int(sig)), *denied]),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env={"PATH": BASE_PATH},
                    timeout=10,
                    check=False,
                )

    def kill_tree(self) -> None:
        """SIGKILL every process below this one until none is left (at most
        :data:`KILL_ROUNDS_S`), reaping the orphans that became this process's children but
        never the agent's own process (its waiter reaps it)."""
        agent = self._agent.pid if self._agent is not None else -1
        with self._kill_lock:
            deadline = time.monotonic() + KILL_ROUNDS_S
            while time.monotonic() < deadline:
                procs = descendants(os.getpid())
                live = [pid for pid, state, _ in procs if state not in ("Z", "X")]
                for pid, state, ppid in procs:
                    if state == "Z" and ppid == os.getpid() and pid != agent:
                        with contextlib.suppress(ChildProcessError):
                            os.waitpid(pid, os.WNOHANG)
                if not live:
                    return
                self.signal(signal.SIGKILL, live)
                time.sleep(0.02)

    def term(self) -> None:
        """SIGTERM the agent's process group; SIGKILL everything the launch's ``kill_grace_s``
        later."""
        if self._agent is None or self._killed_at is not None:
            return
        self._killed_at = time.monotonic()
        self.signal(signal.SIGTERM, [-self._agent.pid])
        timer = threading.Timer(self._grace_s, self.kill_tree)
        timer.daemon = True
        timer.start()

    # -- the run ------------------------------------------------------------------------------

    def start(self, launch: dict[str, Any], listener: socket.socket) -> None:
        """Start the agent (module docstring); ``started`` up. Raises ``OSError``/``ValueError``
        when it cannot be started."""
        origin = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self._grace_s = float(launch.get("kill_grace_s", 5.0))
        env = {str(k): substitute(str(v), origin) for k, v in launch["env"].items()}
        path_dirs = [str(d) for d in launch.get("path_dirs", [])]
        env |= {
            "HOME": AGENT_HOME,
            "TMPDIR": AGENT_TMP,
            "CORRAL_AGENT_DIR": AGENT_DIR,
            "PATH": ":".join([*path_dirs, BASE_PATH]),
        }
        files = []
        for f in launch["files"]:
            data = base64.b64decode(f["b"]).replace(GATEWAY_PLACEHOLDER.encode(), origin.encode())
            path = str(f["path"])
            if path.startswith("/") or ".." in path.split("/") or f["area"] not in AREAS:
                raise ValueError(f"refused file {f['area']}:{path!r}")
            files.append({**f, "b": base64.b64encode(data).decode()})
        setup = {
            "argv": [substitute(str(a), origin) for a in launch["argv"]],
            "env": env,
            "files": files,
        }
        folders = [AGENT_ROOT, AGENT_HOME, AGENT_TMP, AGENT_DIR]
        argv = model_argv([sys.executable, "-I", "-c", SETUP, *folders])
        self._agent = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": BASE_PATH, "LANG": "C.UTF-8"},
            # Its own process group (``term`` reaches all of it), in this process's session:
            # a backend that kills spawn's session (docker) kills the agent's group with it.
            process_group=0,
        )
        self.send({"t": "started", "pid": self._agent.pid})
        spec = json.dumps(setup).encode()
        _thread(self._feed, self._agent.stdin, spec)
        forward = launch.get("forward", {})
        readers = [
            _thread(self._stream, "out", self._agent.stdout, int(forward.get("out", 0))),
            _thread(self._stream, "err", self._agent.stderr, int(forward.get("err", 0))),
        ]
        _thread(self._serve, listener)
        _thread(self._wait, readers)

    @staticmethod
    def _feed(pipe: IO[bytes], data: bytes) -> None:
        try:
            pipe.write(data)
            pipe.close()
        except OSError:
            pass  # the setup died: its exit says why

    def _stream(self, kind: str, pipe: IO[bytes], forward: int) -> None:
        """Forward the first ``forward`` bytes of the stream, keep its tail, send ``tail``."""
        sent = total = 0
        tail = bytearray()
        fd = pipe.fileno()
        while chunk := os.read(fd, CHUNK):
            total += len(chunk)
            if sent < forward:
                part = chunk[: forward - sent]
                sent += len(part)
                self.send_bytes(kind, part)
            tail += chunk
            del tail[:-TAIL]
        self.send_bytes("tail", bytes(tail), s=kind, n=total)

    def _wait(self, readers: list[threading.Thread]) -> None:
        """Wait for the agent, kill what it left, drain, report ``exit``, end the process."""
        assert self._agent is not None
        _, status = os.waitpid(self._agent.pid, 0)
        self._agent.returncode = os.waitstatus_to_exitcode(status)
        self.kill_tree()
        remove_agent_root()
        deadline = time.monotonic() + DRAIN_S
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        if os.WIFSIGNALED(status):
            self.send({"t": "exit", "code": None, "signal": os.WTERMSIG(status)})
        else:
            self.send({"t": "exit", "code": os.WEXITSTATUS(status), "signal": None})
        os._exit(0)

    def _serve(self, listener: socket.socket) -> None:
        """Accept the agent's connections; each one becomes ``open`` + data frames. At most
        :data:`MAX_CONNECTIONS` at once: one more is reset at once, as is one whose threads
        cannot be started (the sandbox's pids limit): the agent sees its connection fail,
        never hang. Should accepting itself fail for good, the listener is closed, so the
        agent's next connections are refused rather than left waiting in its backlog."""
        next_id = 0
        try:
            while True:
                try:
                    sock, _ = listener.accept()
                except OSError as exc:
                    if exc.errno not in TRANSIENT_ACCEPT_ERRORS:
                        raise
                    time.sleep(0.05)  # out of fds or memory for a moment: try again
                    continue
                if len(self._conns) >= MAX_CONNECTIONS:
                    _reset(sock)
                    continue
                next_id += 1
                conn = Connection(next_id, sock, self)
                self._conns[next_id] = conn
                self.send({"t": "open", "id": next_id})
                if not conn.start():
                    self._conns.pop(next_id, None)
                    self.send({"t": "close", "id": next_id})
        except Exception:  # whatever broke the loop: fail closed (docstring)
            traceback.print_exc()
            with contextlib.suppress(OSError):
                listener.close()

    def handle(self, frame: dict[str, Any]) -> None:
        """One frame down (after ``launch``); unknown connection ids are ignored (closed)."""
        kind = frame.get("t")
        if kind == "term":
            self.term()
        elif kind == "kill":
            self.kill_tree()
        elif kind in ("data", "eof", "close"):
            conn = self._conns.get(int(frame["id"]))
            if conn is None:
                return
            if kind == "data":
                conn.outbox.put(base64.b64decode(frame["b"]))
            elif kind == "eof":
                conn.outbox.put(EOF)
            else:
                self._conns.pop(conn.id, None)
                conn.outbox.put(ABORT if frame.get("abort") else CLOSE)


AREAS = ("home", "agent_dir")


class Mark:
    """What a connection's outbox holds besides bytes: an end of the agent-bound stream."""


EOF, CLOSE, ABORT = Mark(), Mark(), Mark()


class Connection:
    """One TCP connection of the agent to the listener: a reader thread sends its bytes up,
    a writer thread writes what comes down (so a slow agent never blocks the frames)."""

    def __init__(self, cid: int, sock: socket.socket, launcher: Launcher) -> None:
        self.id = cid
        self.sock = sock
        self.launcher = launcher
        self.outbox: queue.SimpleQueue[bytes | Mark] = queue.SimpleQueue()

    def start(self) -> bool:
        """Start its two threads; False (the connection reset, no thread left) when they
        cannot be started. The writer goes first: until something is queued it never touches
        the socket, so an ``ABORT`` queued for it is the whole cleanup."""
        try:
            _thread(self._write)
        except RuntimeError:  # "can't start new thread": the sandbox's pids limit
            _reset(self.sock)
            return False
        try:
            _thread(self._read)
        except RuntimeError:
            self.outbox.put(ABORT)
            return False
        return True

    def _read(self) -> None:
        try:
            while chunk := self.sock.recv(CHUNK):
                self.launcher.send_bytes("data", chunk, id=self.id)
        except OSError:
            self.launcher.send({"t": "close", "id": self.id})
            return
        self.launcher.send({"t": "eof", "id": self.id})

    def _write(self) -> None:
        item: bytes | Mark = ABORT
        try:
            while True:
                item = self.outbox.get()
                if isinstance(item, bytes):
                    self.sock.sendall(item)
                elif item is EOF:
                    self.sock.shutdown(socket.SHUT_WR)
                else:
                    break
        except OSError:
            item = ABORT
        with contextlib.suppress(OSError):
            if item is ABORT:  # a reset, so the agent sees the connection fail, not end
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
            self.sock.shutdown(socket.SHUT_RD)  # wakes the reader
        self.sock.close()


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (the agent sees its connection fail, not end)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
    sock.close()


def _thread(target: Callable[..., None], *args: Any) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def main() -> int:
    down, up = harden()
    launcher = Launcher(up)
    try:
        launch = json.loads(down.readline())
        if launch.get("t") != "launch":
            raise ValueError(f"the first frame is {launch.get('t')!r}, not 'launch'")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        launcher.send({"t": "listening", "port": listener.getsockname()[1]})
        launcher.start(launch, listener)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        # RuntimeError: a thread that cannot be started (the sandbox's pids limit).
        launcher.kill_tree()
        launcher.send({"t": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    try:
        for line in down:
            launcher.handle(json.loads(line))
    except Exception:  # a frame this launcher cannot read: say so on stderr, end the run
        traceback.print_exc()
    # The env server closed the stream (it is gone or done) or broke it: nothing outlives it.
    launcher.kill_tree()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
