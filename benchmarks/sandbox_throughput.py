"""What a sandboxed call costs: latency of a trivial program, cold and warm, and calls per
second of the sandbox and of the ``python`` tool (issue 56: at most 30 ms a call, at least 40
tool calls per second on 2 cores).

Rows (each through the real bwrap sandbox unless said):

* ``plain python``: ``subprocess.run([python, -I, -S, -c, "pass"])`` without any sandbox, the
  floor a fresh interpreter costs;
* ``sandbox cold``: ``Sandbox(pool_size=0)``: bwrap and the interpreter start in the call;
* ``sandbox warm``: ``Sandbox(pool_size=2)``: the call takes an interpreter started ahead
  (a replacement starts in the call);
* ``sandbox warm xT``: T threads calling at once for ``--seconds`` (pool size T);
* ``python tool xT``: T threads, each an episode of the ``python`` environment answering a
  tool-call turn (``print(23 * 47 * 56)``): parse, sandbox, observation;
* ``code_tests x2``: the ``code_tests`` reward scoring batches of 8 right solutions against 3
  tests (2 at once: ``sandbox.pool_size``); its times are per response.

The program is ``pass`` (``print(...)`` for the tool). Median and 90th percentile of the
per-call wall time; calls/s is calls / elapsed wall time. Writes ``docs/img/sandbox_throughput.png``
(``benchmarks/out/sandbox_throughput_quick.png`` with ``--quick``).

Usage::

    .venv/bin/python -m benchmarks.sandbox_throughput            # ~40 s
    .venv/bin/python -m benchmarks.sandbox_throughput --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks._common import REPO_ROOT, out_dir, print_table
from dapo_lightning.envs.python_tool import PythonToolEnvironment
from dapo_lightning.rewards.code_tests import CodeTestsReward
from dapo_lightning.sandbox import Sandbox, SandboxConfig
from dapo_lightning.sandbox.command import interpreter

TESTS = json.dumps(["assert f(2) == 4", "assert f(0) == 0", "assert f(-3) == -6"])
TOOL_TURN = (
    '<tool_call>{"name": "python", "arguments": {"code": "print(23 * 47 * 56)"}}</tool_call>'
)


def serial(call: Callable[[], object], n: int) -> tuple[list[float], float]:
    """Per-call wall seconds of ``n`` calls one after another, and the calls per second."""
    times = []
    start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times, n / (time.perf_counter() - start)


def concurrent(make: Callable[[], Callable[[], object]], threads: int, seconds: float):
    """Per-call wall seconds and calls per second of ``threads`` threads calling for
    ``seconds`` (each thread's call from ``make()``)."""
    times: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def work() -> None:
        call = make()
        mine = []
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            call()
            mine.append(time.perf_counter() - t0)
        with lock:
            times.extend(mine)

    start = time.perf_counter()
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return times, len(times) / (time.perf_counter() - start)


def machine() -> str:
    """The CPU model, its AVX-512/AMX flags and the cores this process may use."""
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if "Model name" in ln), "?"
    )
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if "Flags" in ln), [])
    wide = [f for f in flags if f.startswith(("avx512f", "avx512_bf16", "amx"))]
    return f"{model}, {len(os.sched_getaffinity(0))} cores, flags {' '.join(wide) or 'no avx512'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few calls (smoke test)")
    parser.add_argument("--seconds", type=float, default=8.0, help="per concurrent row")
    args = parser.parse_args(argv)
    n, seconds = (10, 1.0) if args.quick else (100, args.seconds)
    python = interpreter()[0]
    rows: list[tuple[str, int, list[float], float]] = []

    plain = [
        "plain python",
        1,
        *serial(lambda: subprocess.run([python, "-I", "-S", "-c", "pass"]), n),
    ]
    rows.append(plain)  # type: ignore[arg-type]
    with Sandbox(SandboxConfig(pool_size=0)) as cold:
        rows.append(("sandbox cold", 1, *serial(lambda: cold.run("pass"), n)))
    with Sandbox(SandboxConfig(pool_size=2)) as warm:
        warm.run("pass")
        rows.append(("sandbox warm", 1, *serial(lambda: warm.run("pass"), n)))
    for threads in (2, 4):
        with Sandbox(SandboxConfig(pool_size=threads)) as box:
            rows.append(
                (
                    f"sandbox warm x{threads}",
                    threads,
                    *concurrent(lambda b=box: lambda: b.run("pass"), threads, seconds),
                )
            )

    def episode() -> Callable[[], object]:
        env = PythonToolEnvironment(sandbox={"pool_size": 2})
        env.reset(None)  # type: ignore[arg-type]
        return lambda: env.step(TOOL_TURN)

    reward = CodeTestsReward(sandbox={"pool_size": 2})
    batch = 8
    solutions, tests = ["def f(x):\n    return 2 * x"] * batch, [TESTS] * batch
    assert all(r.acc for r in reward(solutions, tests))
    times, rate = serial(lambda: reward(solutions, tests), max(2, n // batch))
    per_response = [t / batch for t in times for _ in range(batch)]
    rows.append(("code_tests x2", 2, per_response, rate * batch))

    check = episode()()
    assert check.observation == "60536", check  # type: ignore[attr-defined]
    rows.append(("python tool x2", 2, *concurrent(episode, 2, seconds)))

    table = [
        (name, threads, len(times), 1e3 * statistics.median(times),
         1e3 * statistics.quantiles(times, n=10)[-1], rate)
        for name, threads, times, rate in rows
    ]  # fmt: skip
    where = machine()
    print_table(
        "Sandboxed calls of a trivial program",
        ["method", "threads", "calls", "median ms", "p90 ms", "calls/s"],
        table,
        caption=where,
    )
    png = (
        (out_dir() / "sandbox_throughput_quick.png")
        if args.quick
        else (REPO_ROOT / "docs" / "img" / "sandbox_throughput.png")
    )
    plot(png, table, where)
    (out_dir() / "sandbox_throughput.json").write_text(
        json.dumps({"machine": where, "rows": table}, indent=1)
    )
    print(f"wrote {png}")
    return 0


def plot(path: Path, table: list[tuple], where: str) -> None:
    """Median latency and calls/s per method, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row[0] for row in table]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.barh(names, [row[3] for row in table], color="tab:blue")
    left.axvline(30, color="tab:red", ls="--", label="30 ms goal")
    left.set_xlabel("median wall ms per call")
    left.legend()
    right.barh(names, [row[5] for row in table], color="tab:green")
    right.axvline(40, color="tab:red", ls="--", label="40 calls/s goal")
    right.set_xlabel("calls per second")
    right.legend()
    right.set_yticklabels([])
    fig.suptitle(f"Sandboxed calls of a trivial program ({where})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
