"""The sandbox of model-written code (dapo_lightning/sandbox) against the hostile-code catalogue
of issue 56, through the real bwrap: each case returns within its deadline plus one second
with its failure recorded, leaves no process behind, changes no file outside its scratch, and
this process (the trainer's stand-in) goes on. Then its settings, its refusal where it cannot
run, and the explicit ``isolation: none``.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from dapo_lightning.checks import ConfigError
from dapo_lightning.cli.errors import run_reporting_errors
from dapo_lightning.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailableError,
    describe_exit,
)
from dapo_lightning.sandbox.command import UID_BASE, UID_SPAN
from dapo_lightning.sandbox.seccomp import seccomp_program
from tests._harness import needs_bwrap

pytestmark = needs_bwrap

#: The catalogue's limits: short, so the whole file stays fast.
LIMITS = SandboxConfig(
    timeout_s=3.0,
    memory_mb=256,
    scratch_mb=8,
    max_file_mb=4,
    max_processes=16,
    max_open_files=64,
    max_output_bytes=4096,
    pool_size=0,
)


#: The uids this file's sandboxes ran as (as root each interpreter gets its own): the leftover
#: checks look for these, not for the sandboxes another test file runs on the other xdist worker.
ISSUED_UIDS: set[int] = set()


@pytest.fixture(scope="module", autouse=True)
def _record_issued_uids():
    from dapo_lightning.sandbox import runner

    real = runner.sandbox_uid

    def issue() -> int:
        uid = real()
        ISSUED_UIDS.add(uid)
        return uid

    runner.sandbox_uid = issue
    yield
    runner.sandbox_uid = real


@pytest.fixture(scope="module")
def sandbox(_record_issued_uids):
    with Sandbox(LIMITS) as box:
        yield box


def sandbox_processes(since: float) -> list[psutil.Process]:
    """Processes started since ``since`` that are this file's sandboxes: descendants of this
    process, or processes of a uid one of them ran as (what a process that got out of the pid
    namespace would still have)."""
    found = {p.pid: p for p in new_children(since, recursive=True)}
    for p in psutil.process_iter(["uids", "create_time"]):
        uids = p.info["uids"]
        if uids and uids.real in ISSUED_UIDS:
            if p.info["create_time"] >= since - 1:
                found[p.pid] = p
    return [p for p in found.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def new_children(since: float, recursive: bool = False) -> list[psutil.Process]:
    """This process's children started since ``since`` (a reward worker or another file's warm
    pool, started before, is not this test's)."""
    children = psutil.Process().children(recursive=recursive)
    return [p for p in children if _started(p) >= since - 1]


def _started(process: psutil.Process) -> float:
    try:
        return process.create_time()
    except psutil.NoSuchProcess:
        return 0.0


def files_of_sandbox_uids() -> list[str]:
    """Files at the top of the host's /tmp, $HOME, /etc and the working folder owned by a uid
    this file's sandboxes ran as (what a write that got out would leave)."""
    found = []
    for folder in (Path("/tmp"), Path.home(), Path("/etc"), Path.cwd()):
        for path in folder.iterdir():
            try:
                uid = path.lstat().st_uid
            except OSError:
                continue
            if uid in ISSUED_UIDS:
                found.append(str(path))
    return found


def contained(sandbox: Sandbox, code: str) -> SandboxResult:
    """Run ``code`` and check the catalogue's invariants: back within ``timeout_s + 1``, no
    process left, no host file of a sandbox uid, and the sandbox still runs code afterwards
    (this process went on)."""
    since = time.time()
    start = time.monotonic()
    result = sandbox.run(code)
    wall = time.monotonic() - start
    assert wall <= sandbox.config.timeout_s + 1.0, (wall, result)
    assert result.status in ("ok", "error", "timeout")
    left = sandbox_processes(since)
    assert not left, [(p.pid, p.name(), p.uids()) for p in left]
    assert files_of_sandbox_uids() == []
    after = sandbox.run("print(6 * 7)")
    assert (after.status, after.stdout) == ("ok", "42\n")
    return result


# ----------------------------------------------------------------------------- the catalogue
def test_fork_bomb_stops_at_max_processes_and_the_call_ends_at_its_deadline(sandbox):
    counted = contained(
        sandbox,
        "import os, time\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "    except OSError as err:\n"
        "        print(n, err.errno)\n"
        "        break\n",
    )
    forked, code = map(int, counted.stdout.split())
    assert code == errno.EAGAIN
    assert forked == LIMITS.max_processes - 1  # the interpreter itself is the 16th
    assert counted.status == "ok"  # the sleeping children died with the namespace
    bomb = contained(
        sandbox, "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"
    )
    assert bomb.status == "timeout" and bomb.exit_code == -9


def test_memory_bomb_gets_memory_error(sandbox):
    result = contained(sandbox, "blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))")
    assert result.status == "error" and result.exit_code == 1
    assert "MemoryError" in result.stderr
    one = contained(sandbox, "x = bytearray(300 * 2**20)")  # over memory_mb at once
    assert "MemoryError" in one.stderr


def test_busy_loop_is_killed_at_the_deadline_and_at_its_cpu_limit():
    since = time.monotonic()
    with Sandbox(LIMITS) as box:
        result = contained(box, "while True: pass")
    assert result.status == "timeout" and result.exit_code == -9
    assert LIMITS.timeout_s <= result.wall_s <= LIMITS.timeout_s + 1
    assert "deadline of 3 s" in result.reason
    with Sandbox(SandboxConfig(timeout_s=4.0, cpu_s=1.0, pool_size=0)) as box:
        cpu = contained(box, "while True: pass")
    assert (cpu.status, cpu.exit_code) == ("error", -24)  # SIGXCPU after one CPU second
    assert cpu.reason == "killed by SIGXCPU (its CPU limit)"
    assert cpu.wall_s < 4.0  # before its wall deadline
    assert time.monotonic() - since < 10


def test_sleep_that_ignores_sigterm_is_killed(sandbox):
    result = contained(
        sandbox,
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('waiting', flush=True)\ntime.sleep(100)",
    )
    assert (result.status, result.stdout) == ("timeout", "waiting\n")


def test_double_fork_daemon_does_not_outlive_the_call(sandbox):
    """The daemon's parent exits at once (status ok); the daemon, in a new session, would sleep
    for a minute: it dies with the sandbox's pid namespace (``contained`` finds no process)."""
    result = contained(
        sandbox,
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "print('parent done')\n",
    )
    assert (result.status, result.stdout) == ("ok", "parent done\n")
    assert result.wall_s < 1.5


def test_100_mb_of_stdout_is_cut_to_max_output_bytes(sandbox):
    result = contained(
        sandbox, "import sys\nsys.stdout.write('x' * 10**8)\nprint('end', file=sys.stderr)"
    )
    assert result.status == "ok"
    assert result.stdout == "x" * LIMITS.max_output_bytes and result.stdout_truncated
    assert result.stderr == "end\n" and not result.stderr_truncated


def test_writes_outside_the_scratch_fail_and_change_no_host_file(sandbox, tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.csv").write_text("step,reward\n")
    name = f"dapo-sandbox-probe-{uuid.uuid4().hex[:8]}"
    home = Path.home()
    targets = [run_dir / "metrics.csv", run_dir / name, home / name, Path("/etc") / name]
    before = {p: (p.read_bytes() if p.exists() else None) for p in targets}
    code = "import errno, os\n" + "".join(
        f"try:\n    open({str(p)!r}, 'a').write('pwned')\n    print('wrote')\n"
        f"except OSError as err:\n    print(errno.errorcode[err.errno])\n"
        for p in targets
    )
    code += f"open('/tmp/{name}', 'w').write('scratch')\nprint(os.listdir('/tmp'))\n"
    result = contained(sandbox, code)
    lines = result.stdout.splitlines()
    # the run folder is not there; the home folder is the read-only root's; no /etc at all
    assert lines[:4] == ["ENOENT", "ENOENT", "EROFS", "ENOENT"], result
    assert lines[4] == repr([name])  # host /tmp is not the sandbox's /tmp
    assert {p: (p.read_bytes() if p.exists() else None) for p in targets} == before
    assert not (Path("/tmp") / name).exists()
    assert sorted(os.listdir(run_dir)) == ["metrics.csv"]


def test_reads_of_the_checkpoint_the_cache_and_the_trainers_environment_find_nothing(
    sandbox, tmp_path, monkeypatch
):
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    checkpoint.parent.mkdir()
    checkpoint.write_text("weights")
    cache = Path.home() / ".cache" / f"dapo-sandbox-secret-{uuid.uuid4().hex[:8]}"
    cache.parent.mkdir(exist_ok=True)
    cache.write_text("hf_cached_secret")
    token = "hf_" + uuid.uuid4().hex
    monkeypatch.setenv("HF_TOKEN", token)
    try:
        result = contained(
            sandbox,
            "import os\n"
            f"for p in ({str(checkpoint)!r}, {str(cache)!r}, {str(Path.home())!r}):\n"
            "    try:\n"
            "        print(open(p).read() if os.path.isfile(p) else os.listdir(p))\n"
            "    except OSError as err:\n"
            "        print(type(err).__name__)\n"
            "print(sorted(os.environ))\n"
            "seen = ''\n"
            "for pid in os.listdir('/proc'):\n"
            "    if pid.isdigit():\n"
            "        try:\n"
            "            seen += open(f'/proc/{pid}/environ').read()\n"
            "        except OSError:\n"
            "            pass\n"
            "print('HF_TOKEN' in seen, sorted(p for p in os.listdir('/proc') if p.isdigit()))\n",
        )
    finally:
        cache.unlink()
    assert token not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["FileNotFoundError", "FileNotFoundError"], result
    assert lines[2] in ("['.pyenv']", "FileNotFoundError", "PermissionError")  # only the bind
    assert lines[3] == "['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']"
    assert lines[4] == "False ['1', '2']"  # bwrap's init and the code: no other process


def test_a_socket_on_the_hosts_loopback_is_out_of_reach(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    result = contained(
        sandbox,
        "import socket\ns = socket.socket()\ns.settimeout(1)\n"
        f"try:\n    s.connect(('127.0.0.1', {port}))\n    print('connected')\n"
        "except OSError as err:\n    print(type(err).__name__)\n"
        "try:\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n    print('internet')\n"
        "except OSError as err:\n    print(type(err).__name__)\n",
    )
    listener.settimeout(0.2)  # a connection that got through would wait in the backlog
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    assert result.stdout.splitlines() == ["ConnectionRefusedError", "OSError"], result


def test_killing_the_parent_or_the_process_group_hurts_only_the_sandbox(sandbox):
    me = os.getpid()
    parent = contained(
        sandbox,
        "import errno, os\nprint(os.getppid())\n"
        "for target in (os.getppid(), -1):\n"
        "    try:\n        os.kill(target, 9)\n"
        "    except OSError as err:\n        print(errno.errorcode[err.errno])\n",
    )
    # getppid is the namespace's init (pid 1, root's: EPERM); kill(-1) signals every process
    # the code may signal but itself: there is none (ESRCH)
    assert parent.stdout.splitlines() == ["1", "EPERM", "ESRCH"]
    assert parent.status == "ok"
    group = contained(
        sandbox,
        "import errno, os\nprint(os.getpgrp())\ntry:\n    os.killpg(os.getpgrp(), 9)\n"
        "except OSError as err:\n    print(errno.errorcode[err.errno], flush=True)\n"
        "os.killpg(0, 9)\nprint('alive')",
    )
    # its group is init's (bwrap's --new-session), which it cannot signal; its own group (0)
    # holds only itself
    assert group.stdout.splitlines() == ["1", "ESRCH"]
    assert (group.status, group.exit_code, group.reason) == ("error", -9, "killed by SIGKILL")
    outside = contained(sandbox, f"import os\nos.kill({me}, 9)")
    assert "ProcessLookupError" in outside.stderr  # this process is not in its namespace
    assert os.getpid() == me


def test_filling_the_scratch_ends_in_no_space(sandbox):
    result = contained(
        sandbox,
        "import errno\nn = 0\nchunk = b'x' * 2**20\ntry:\n"
        "    for i in range(100):\n"
        "        with open(f'/tmp/fill{i}', 'wb') as f:\n"
        "            for _ in range(2):\n"
        "                f.write(chunk); f.flush(); n += len(chunk)\n"
        "except OSError as err:\n    print(errno.errorcode[err.errno], n // 2**20)\n",
    )
    name, written = result.stdout.split()
    assert name == "ENOSPC"
    assert LIMITS.scratch_mb - 2 <= int(written) <= LIMITS.scratch_mb


def test_a_file_over_max_file_mb_is_stopped(sandbox):
    result = contained(
        sandbox,
        "import signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "f = open('/tmp/big', 'wb')\ntry:\n    f.write(b'x' * 5 * 2**20); f.flush()\n"
        "except OSError as err:\n    print(err.errno)\n",
    )
    assert result.stdout.strip() == str(errno.EFBIG)


def test_opening_100000_files_stops_at_max_open_files(sandbox):
    result = contained(
        sandbox,
        "import errno\nfiles = []\ntry:\n"
        "    for i in range(100000):\n"
        "        files.append(open(f'/tmp/f{i}', 'w'))\n"
        "except OSError as err:\n    print(errno.errorcode[err.errno], len(files))\n",
    )
    name, opened = result.stdout.split()
    assert name == "EMFILE"
    assert LIMITS.max_open_files - 8 <= int(opened) < LIMITS.max_open_files


def test_a_segfault_through_ctypes_is_an_error_without_a_core_file(sandbox, tmp_path):
    result = contained(sandbox, "import ctypes\nctypes.string_at(0)")
    assert (result.status, result.exit_code) == ("error", -11)
    assert result.reason == "killed by SIGSEGV (a crash)"
    assert not [p for p in Path.cwd().iterdir() if p.name.startswith("core")]


def test_infinite_recursion_is_an_error(sandbox):
    result = contained(sandbox, "def f():\n    return f()\nf()")
    assert result.status == "error" and result.exit_code == 1
    assert result.stderr.rstrip().endswith("RecursionError: maximum recursion depth exceeded")
    deep = contained(
        sandbox,
        "import sys\nsys.setrecursionlimit(10**9)\nnested = []\n"
        "for _ in range(2 * 10**5):\n    nested = [nested]\nrepr(nested)",
    )  # repr recurses in C with the guard lifted: the C stack overflows
    assert (deep.status, deep.exit_code) == ("error", -11)


def test_thread_bomb_stops_at_max_processes_or_memory(sandbox):
    """Each thread reserves address space (its stack and a malloc arena, ~72 MiB): with the
    catalogue's 256 MiB the memory limit stops the bomb first, with 2 GiB the process limit."""
    code = (
        "import threading, time\nn = 0\ntry:\n"
        "    while True:\n"
        "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "        n += 1\n"
        "except RuntimeError as err:\n    print(n, err)\n"
    )
    few = contained(sandbox, code)
    assert 1 <= int(few.stdout.split()[0]) < LIMITS.max_processes - 1
    with Sandbox(SandboxConfig(memory_mb=2048, max_processes=16, pool_size=0)) as box:
        result = contained(box, code)
    assert result.stdout.split()[0] == "15"  # the interpreter's own thread is the 16th
    assert "can't start new thread" in result.stdout


def test_bash_through_subprocess_runs_inside_the_sandbox(sandbox):
    name = f"dapo-sandbox-bash-{uuid.uuid4().hex[:8]}"
    script = (
        "echo $(ls /); id -u; "
        f"echo x > /etc/{name} 2>/dev/null || echo no-etc; "
        f"echo x > /usr/{name} 2>/dev/null || echo no-usr; "
        "cat /root/.bashrc 2>/dev/null || echo no-bashrc; "
        "(exec 3<>/dev/tcp/127.0.0.1/22) 2>/dev/null || echo no-net"
    )
    result = contained(
        sandbox,
        "import subprocess\n"
        f"out = subprocess.run(['bash', '-c', {script!r}], capture_output=True, text=True)\n"
        "print(out.stdout, end='')\n",
    )
    lines = result.stdout.splitlines()
    assert set(lines[0].split()) <= {
        "bin",
        "dev",
        "lib",
        "lib64",
        "proc",
        "root",
        "sbin",
        "tmp",
        "usr",
    }
    uid = int(lines[1])
    assert uid != 0 and (os.geteuid() != 0 or UID_BASE <= uid < UID_BASE + UID_SPAN)
    assert lines[2:] == ["no-etc", "no-usr", "no-bashrc", "no-net"]
    assert not Path("/etc", name).exists() and not Path("/usr", name).exists()


@pytest.mark.skipif(seccomp_program() is None, reason="the seccomp filter is x86-64 only")
def test_a_namespace_or_a_mount_of_its_own_is_refused(sandbox):
    """An unprivileged user may make a user namespace and mount a tmpfs of any size in it,
    outside every limit: the seccomp filter refuses; forks, threads and clone3's fallback
    still work."""
    result = contained(
        sandbox,
        "import ctypes, errno, os, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def call(*args):\n"
        "    r = libc.syscall(*args)\n"
        "    print(errno.errorcode[ctypes.get_errno()] if r == -1 else r)\n"
        "call(272, 0x10000000 | 0x00020000)\n"  # unshare(CLONE_NEWUSER | CLONE_NEWNS)
        "call(165, b'none', b'/tmp', b'tmpfs', 0, None)\n"  # mount
        "call(56, 0x10000000 | 17, 0, 0, 0, 0)\n"  # clone(CLONE_NEWUSER | SIGCHLD)
        "call(435, 0, 0)\n"  # clone3
        "call(321, 0, 0, 0)\n"  # bpf
        "t = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
        "pid = os.fork()\nif pid == 0:\n    os._exit(3)\n"
        "print(os.waitpid(pid, 0)[1] >> 8)\n",
    )
    assert result.stdout.split() == ["EPERM", "EPERM", "EPERM", "ENOSYS", "EPERM", "thread", "3"]


def test_the_seccomp_program_is_x86_64_only_and_whole_instructions():
    program = seccomp_program("x86_64")
    assert program is not None and len(program) % 8 == 0
    code, jt, jf, k = struct.unpack("<HBBI", program[:8])
    assert (code, k) == (0x20, 4)  # it starts by loading the architecture
    assert seccomp_program("aarch64") is None


UNPRIVILEGED = """
import sys, types
package = types.ModuleType("dapo_lightning")  # the sandbox alone: no torch in this Python
package.__path__ = [sys.argv[1]]
sys.modules["dapo_lightning"] = package
from dapo_lightning.sandbox import Sandbox, SandboxConfig
import os
config = SandboxConfig(pool_size=0, timeout_s=3, max_processes=16, memory_mb=2048)
with Sandbox(config) as box:
    for code in sys.argv[2:]:
        result = box.run(code)
        print(result.status, result.stdout.strip())
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/python3").exists() or shutil.which("setpriv") is None,
    reason="needs root (to become another user), /usr/bin/python3 and setpriv",
)
def test_the_unprivileged_path_holds_for_another_user():
    """Run by an ordinary user (uid 65534 here, with the system Python: this project's
    interpreter lives under root's home), the sandbox takes bwrap's own user namespace: the
    code runs as that user, a fork bomb stops at the process limit (bwrap's init counts too),
    the network is its own."""
    codes = [
        "import os; print(os.getuid())",
        "import os, time\nn = 0\nwhile True:\n    try:\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
        "    except OSError:\n        print(n)\n        break",
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n"
        "except OSError as err:\n    print(type(err).__name__)",
        "import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000), errno.errorcode[ctypes.get_errno()])",
    ]
    since = time.time()
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
         "-c", UNPRIVILEGED, str(Path(__file__).resolve().parent.parent / "dapo_lightning"),
         *codes],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["ok 65534", "ok 14", "ok OSError", "ok -1 EPERM"]
    assert sandbox_processes(since) == []


# ----------------------------------------------------------------------------- the results
def test_a_trivial_call_is_ok_and_errors_are_described(sandbox):
    result = sandbox.run("print('hi')")
    assert (result.status, result.exit_code, result.stdout, result.stderr) == ("ok", 0, "hi\n", "")
    assert result.ok and not result.stdout_truncated and result.reason == ""
    failed = sandbox.run("raise SystemExit(3)")
    assert (failed.status, failed.exit_code, failed.reason) == ("error", 3, "exit status 3")
    assert describe_exit(None) == "did not start"
    assert describe_exit(-9) == "killed by SIGKILL"


def test_a_warm_pool_keeps_interpreters_ready_and_close_leaves_none():
    since = time.time()
    box = Sandbox(SandboxConfig(pool_size=2, timeout_s=2.0))
    try:
        waiting = new_children(since)
        assert len(waiting) == 2  # two bwraps waiting for code
        for _ in range(3):
            assert box.run("print(1)").stdout == "1\n"
        assert len(new_children(since)) == 2
        assert box.calls == 3
    finally:
        box.close()
    assert sandbox_processes(since) == []


def test_an_interpreter_that_died_waiting_is_replaced():
    since = time.time()
    with Sandbox(SandboxConfig(pool_size=1, timeout_s=2.0)) as box:
        waiting = new_children(since)
        assert len(waiting) == 1
        waiting[0].kill()  # bwrap of the waiting interpreter, killed from outside
        waiting[0].wait(2)
        result = box.run("print('fresh')")
    assert (result.status, result.stdout) == ("ok", "fresh\n")


def test_calls_from_threads_run_at_once():
    with Sandbox(SandboxConfig(pool_size=3, timeout_s=3.0)) as box:
        results: list[SandboxResult] = []
        start = time.monotonic()
        threads = [
            threading.Thread(
                target=lambda i=i: results.append(
                    box.run(f"import time; time.sleep(1); print({i})")
                )
            )
            for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - start
    assert sorted(r.stdout for r in results) == ["0\n", "1\n", "2\n"]
    assert wall < 2.5  # three one-second sleeps at once, not one after another


def test_warm_interpreters_outlive_the_thread_that_started_the_call():
    """bwrap's --die-with-parent follows the thread that started it: every sandbox is started
    on one long-lived thread, so interpreters made during calls from short-lived threads (a
    thread pool's, an episode's) are still alive for the next call."""

    def in_thread(fn):
        out = []
        thread = threading.Thread(target=lambda: out.append(fn()))
        thread.start()
        thread.join()
        return out[0]

    box = in_thread(lambda: Sandbox(SandboxConfig(pool_size=1, timeout_s=2.0)))
    try:
        results = [in_thread(lambda i=i: box.run(f"print({i})")) for i in range(3)]
        time.sleep(0.1)
        results.append(box.run("print(3)"))
    finally:
        box.close()
    assert [(r.status, r.stdout) for r in results] == [("ok", f"{i}\n") for i in range(4)]


def test_a_fork_of_this_process_does_not_hold_a_call_back():
    """A child forked while interpreters wait (a data loader's worker) holds copies of their
    stdin pipes: the code is sent with its length, so the call needs no end of file."""
    with Sandbox(SandboxConfig(pool_size=1, timeout_s=3.0)) as box:
        pid = os.fork()
        if pid == 0:  # the child only sleeps, holding the copies
            time.sleep(5)
            os._exit(0)
        try:
            result = box.run("print('done')")
        finally:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    assert (result.status, result.stdout) == ("ok", "done\n")
    assert result.wall_s < 1.5


def test_a_generation_of_episodes_calls_at_once_from_short_lived_threads():
    """32 calls at once, each from its own short-lived thread (as the episode runner steps a
    generation's episodes): every one runs its code, and nothing is left afterwards."""
    since = time.time()
    results: dict[int, SandboxResult] = {}
    with Sandbox(SandboxConfig(pool_size=2, timeout_s=20.0)) as box:
        threads = [
            threading.Thread(
                target=lambda i=i: results.__setitem__(i, box.run(f"print({i} * {i})"))
            )
            for i in range(32)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert {i: (r.status, r.stdout) for i, r in results.items()} == {
        i: ("ok", f"{i * i}\n") for i in range(32)
    }
    assert sandbox_processes(since) == []


# ----------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("timeout_s", 0, "sandbox.timeout_s must be > 0"),
        ("timeout_s", float("nan"), "sandbox.timeout_s=nan is not finite"),
        ("cpu_s", -1.0, "sandbox.cpu_s must be > 0 seconds or null"),
        ("memory_mb", 8, "sandbox.memory_mb must be an integer >= 64"),
        ("scratch_mb", 0, "sandbox.scratch_mb must be an integer >= 1"),
        ("max_processes", 1, "sandbox.max_processes must be an integer >= 2"),
        ("max_open_files", True, "sandbox.max_open_files must be an integer >= 16"),
        ("pool_size", -1, "sandbox.pool_size must be an integer >= 0"),
        ("isolation", "docker", "sandbox.isolation must be 'bwrap' or 'none'"),
        ("env", {"A=B": "x"}, "sandbox.env must map variable names to text"),
    ],
)
def test_bad_settings_name_the_field_and_the_fix(field, value, words):
    with pytest.raises(ConfigError) as err:
        SandboxConfig(**{field: value})
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_settings_defaults_and_the_cpu_limit():
    config = SandboxConfig()
    assert (config.timeout_s, config.memory_mb, config.isolation, config.pool_size) == (
        5.0, 512, "bwrap", 2,
    )  # fmt: skip
    assert config.cpu_limit_s == 6
    assert SandboxConfig(timeout_s=0.5).cpu_limit_s == 2
    assert SandboxConfig(cpu_s=2.5).cpu_limit_s == 3


def test_env_reaches_the_code_and_nothing_else(sandbox):
    with Sandbox(SandboxConfig(env={"TASK": "7"}, pool_size=0)) as box:
        result = box.run("import os\nprint(os.environ['TASK'], sorted(os.environ))")
    assert result.stdout == "7 ['HOME', 'LANG', 'PATH', 'PWD', 'TASK', 'TMPDIR']\n"


# ----------------------------------------------------------------------------- refusal
def test_no_bwrap_is_refused_at_start_with_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no bwrap on PATH
    config = SandboxConfig(timeout_s=1.25)  # settings no other test checked in this process
    with pytest.raises(SystemExit) as exit_info:
        run_reporting_errors(lambda: Sandbox(config))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("dapo-lightning: error: bubblewrap (bwrap) is not installed")
    assert "scripts/setup.sh" in err and "isolation: none" in err


def test_a_bwrap_that_cannot_make_namespaces_is_refused(tmp_path, monkeypatch):
    """A kernel without user namespaces cannot be made here (this machine has them), so a
    ``bwrap`` that answers as bwrap answers there stands in for it: the start check runs it
    and refuses, quoting it, with the fix."""
    fake = tmp_path / "bwrap"
    fake.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because "
        "the kernel does not allow non-privileged user namespaces.' >&2\nexit 1\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(SandboxUnavailableError) as err:
        Sandbox(SandboxConfig(timeout_s=1.5))
    message = str(err.value)
    assert "No permissions to creating new namespace" in message
    assert "user.max_user_namespaces" in message and "isolation: none" in message
    assert "\n" not in message


def test_isolation_none_warns_at_start_and_isolates_nothing(tmp_path, caplog):
    secret = tmp_path / "visible.txt"
    secret.write_text("host file")
    with caplog.at_level(logging.WARNING, logger="dapo_lightning.sandbox.runner"):
        box = Sandbox(SandboxConfig(isolation="none", pool_size=0, timeout_s=2.0))
    try:
        assert "NO isolation" in caplog.text
        result = box.run(f"print(open({str(secret)!r}).read())")
        assert result.stdout == "host file\n"  # the host's files: what 'none' means
        loop = box.run("while True: pass")
        assert loop.status == "timeout"  # the limits and the deadline still hold
    finally:
        box.close()


def test_the_child_runs_only_inside_an_interpreter_started_for_it():
    """Importing the child's module does nothing (it reads stdin only as __main__)."""
    import dapo_lightning.sandbox._child as child

    assert callable(child._main)
    assert sys.stdin is not None
