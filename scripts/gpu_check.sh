#!/usr/bin/env bash
# GPU check: the CUDA tests (pytest -m gpu) with the machine's own Python, numbers in one JSON.
#
#   bash scripts/gpu_check.sh                 # on a GPU machine (or here: no CUDA -> all skipped)
#   bash scripts/gpu_check.sh --require-cuda  # the same, but exit 3 when there is no CUDA
#   bash scripts/gpu_check.sh --env-only      # environment + import checks only, no pytest
#   bash scripts/gpu_check.sh --summary FILE  # print the summary of a gpu_check.json
#   bash scripts/gpu_check.sh --prepare-wheels  # here, with network: pytest wheels that travel
#
# The project is NOT installed: the repository root goes on PYTHONPATH, and a generated
# sitecustomize.py (in a temporary folder, first on PYTHONPATH) adds a meta-path finder that maps
# the packages setup.cfg's [options] package_dir puts elsewhere (callbacks/ ->
# dapo_lightning.callbacks), as setuptools' editable finder does. No pip, no setuptools, no
# network: it works with any python3 that has torch, lightning and transformers. (A plain
# symlink farm would not do: `python -m pytest` puts the repository root first on sys.path, so
# the real dapo_lightning/ wins and has no callbacks/ in it.) An existing sitecustomize further
# down sys.path is still run.
#
# pytest: used from the machine if it has it; otherwise from wheels in build/gpu_wheels/ (made
# here by --prepare-wheels; pass carry=["build/gpu_wheels"] to the device run), unpacked into the
# temporary folder. Only files that use the gpu marker are collected (grep "mark.gpu"), so test
# modules needing packages the GPU machine lacks (jsonargparse, math-verify, ...) cannot fail
# the collection.
#
# Writes to $OUT (default build/gpu_check_out/): gpu_check.json (env, tests' numbers, pytest
# outcome), gpu_pytest.txt (pytest output), gpu_pytest.xml (JUnit).
#
# Exit status: 0 every gpu test passed or skipped (no CUDA: all skipped, "NO CUDA" printed);
# 1 a test failed or errored; 2 set-up failed (no Python with torch, import failure, no pytest);
# 3 --require-cuda without CUDA; 124 the pytest run hit its timeout (GPU_CHECK_TIMEOUT, 420 s).
#
# Environment: OUT, GPU_CHECK_PYTHON (default python3, else .venv/bin/python), GPU_CHECK_TIMEOUT,
# GPU_CHECK_WHEELS (default build/gpu_wheels), GPU_CHECK_FORCE_WHEELS=1 (use the wheels' pytest
# even where one is installed, e.g. a too old one), DAPO_GPU_CHECK_HIDE (comma-separated modules to
# hide: simulates a machine without them; used by tests/test_gpu.py).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

MODE=run
REQUIRE_CUDA=0
SUMMARY_FILE=
while [ $# -gt 0 ]; do
    case "$1" in
        --require-cuda) REQUIRE_CUDA=1 ;;
        --env-only) MODE=env ;;
        --prepare-wheels) MODE=wheels ;;
        --summary)
            MODE=summary
            SUMMARY_FILE=${2:?--summary needs a gpu_check.json path}
            shift
            ;;
        -h | --help)
            sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "gpu_check: unknown argument $1 (see --help)" >&2
            exit 2
            ;;
    esac
    shift
done

OUT=${OUT:-$REPO/build/gpu_check_out}
JSON=$OUT/gpu_check.json
WHEELS=${GPU_CHECK_WHEELS:-$REPO/build/gpu_wheels}
TIMEOUT=${GPU_CHECK_TIMEOUT:-420}
export TOKENIZERS_PARALLELISM=false

# ---------------------------------------------------------------- python with torch
pick_python() {
    local candidate
    for candidate in ${GPU_CHECK_PYTHON:-} python3 "$REPO/.venv/bin/python"; do
        if [ -n "$candidate" ] && "$candidate" -c "import torch" >/dev/null 2>&1; then
            PY=$candidate
            return 0
        fi
    done
    return 1
}

summary() {
    "${PY:-${GPU_CHECK_PYTHON:-python3}}" - "$1" <<'PYEOF'
import json
import sys

data = json.load(open(sys.argv[1]))
env, tests, run = data.get("env", {}), data.get("tests", {}), data.get("pytest", {})


def num(value, fmt):
    return "-" if value is None else format(value, fmt)


print("==================== GPU check summary ====================")
print(f"status: {data.get('status', '?')}")
device = env.get("device_name") or "no CUDA device"
print(
    f"device: {device} | torch {env.get('torch')} (CUDA {env.get('torch_cuda')}) | lightning "
    f"{env.get('lightning')} | transformers {env.get('transformers')} | python {env.get('python')}"
)
if env.get("missing_optional"):
    print("missing optional: " + ", ".join(env["missing_optional"]))
if run:
    print(
        f"pytest: {run.get('passed', 0)} passed, {run.get('failed', 0)} failed, "
        f"{run.get('errors', 0)} errors, {run.get('skipped', 0)} skipped "
        f"in {num(run.get('seconds'), '.1f')} s (rc {run.get('rc')})"
    )
    for case in run.get("cases", []):
        if case["outcome"] != "passed":
            print(f"  {case['outcome']}: {case['name']}: {case.get('message', '')[:200]}")
t = tests.get("bf16_update_smollm2_shape", {})
if t:
    print(
        f"bf16 update (SmolLM2-135M shape, {t.get('sequences')} x {t.get('seq_len')} tokens): "
        f"{num(t.get('seconds_per_update'), '.3f')} s/update, "
        f"{num(t.get('tokens_per_second'), ',.0f')} tokens/s, "
        f"MFU {num(t.get('mfu'), '.3f')} of {num(t.get('gemm_peak_tflops'), '.0f')} TFLOP/s "
        f"measured bf16 GEMM, peak memory {num(t.get('peak_memory_gib'), '.2f')} GiB"
    )
t = tests.get("fp16_scaler_clip", {})
if t:
    print(
        f"16-mixed + GradScaler: update norm / (lr * clip) {num(t.get('update_norm_ratio_fp16'), '.4f')}, "
        f"grad_norm fp16 / fp32 {num(t.get('grad_norm_ratio_fp16'), '.4f')}, "
        f"bf16 / fp32 {num(t.get('grad_norm_ratio_bf16'), '.4f')}"
    )
t = tests.get("fsdp2_one_rank", {})
if t:
    print(f"FSDP2 one rank vs single device: max rel diff {num(t.get('max_rel_diff'), '.2e')}")
t = tests.get("hf_engine_logprob_parity", {})
if t:
    print(
        f"HF engine parity (fp32): max abs diff {num(t.get('max_abs_diff'), '.2e')} "
        f"over {t.get('tokens')} tokens"
    )
t = tests.get("one_step_off_cuda", {})
if t:
    print(
        f"one-step-off on CUDA: engine log-probs vs the previous step's weights max abs diff "
        f"{num(t.get('max_abs_diff'), '.2e')} (vs the step's own weights >= "
        f"{num(t.get('newer_weights_min_gap'), '.2e')}), fit {num(t.get('fit_seconds'), '.1f')} s"
    )
t = tests.get("one_step_off_engine_on_gpu", {})
if t:
    print(
        f"one-step-off, update on the CPU, engine on the GPU: log-probs vs the previous step's "
        f"weights max abs diff {num(t.get('max_abs_diff'), '.2e')}"
    )
t = tests.get("qlora_4bit", {})
if t:
    if t.get("skipped"):
        print(f"QLoRA 4-bit: skipped ({t['skipped']})")
    else:
        print(
            f"QLoRA 4-bit: loss {num(t.get('loss'), '.4f')}, {t.get('trainable_params')} "
            f"trainable params, peak memory {num(t.get('peak_memory_gib'), '.2f')} GiB"
        )
print("============================================================")
PYEOF
}

if [ "$MODE" = summary ]; then
    summary "$SUMMARY_FILE"
    exit $?
fi

if ! pick_python; then
    echo "gpu_check: no python with torch found (tried GPU_CHECK_PYTHON, python3, .venv/bin/python)" >&2
    exit 2
fi

# ---------------------------------------------------------------- --prepare-wheels
if [ "$MODE" = wheels ]; then
    # Pure-Python wheels (py3-none-any: any Python >= 3.10 of the GPU machine) of pytest and what
    # it needs, pinned to this repository's .venv versions; exceptiongroup/tomli are only used on
    # Python < 3.11.
    mkdir -p "$WHEELS"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --implementation py --abi none \
        --platform any --python-version 3.10 --dest "$WHEELS" \
        pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0 \
        pytest-timeout==2.4.0 exceptiongroup==1.3.0 tomli==2.2.1 || exit 2
    ls -l "$WHEELS"
    du -sh "$WHEELS"
    echo "gpu_check: wheels ready; device run: carry=[\"${WHEELS#"$REPO"/}\"]"
    exit 0
fi

mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

echo "==================== nvidia-smi ===================="
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi || true
else
    echo "nvidia-smi: not found"
fi

# ---------------------------------------------------------------- import mapping (setup.cfg)
"$PY" - "$REPO" "$WORK/site" <<'PYEOF' || exit 2
import configparser
import os
import sys

repo, site = sys.argv[1], sys.argv[2]
cfg = configparser.ConfigParser()
cfg.read(os.path.join(repo, "setup.cfg"))
mapping = {}
for line in cfg.get("options", "package_dir", fallback="").splitlines():
    name, sep, folder = (part.strip() for part in line.partition("="))
    if sep and name:
        mapping[name] = os.path.join(repo, folder)
    elif sep:
        sys.exit("gpu_check: setup.cfg maps the root package folder (package_dir = src): unsupported")
os.makedirs(site, exist_ok=True)
TEMPLATE = '''"""Written by scripts/gpu_check.sh for a run without installing the project.

Maps the packages of setup.cfg's [options] package_dir that live in other folders (as an
install would), optionally hides modules (DAPO_GPU_CHECK_HIDE), then runs the next
sitecustomize on sys.path, if any.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

PACKAGE_DIR = @MAPPING@


class PackageDirFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        folder = PACKAGE_DIR.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )


sys.meta_path.insert(0, PackageDirFinder())

_hide = [m.strip() for m in os.environ.get("DAPO_GPU_CHECK_HIDE", "").split(",") if m.strip()]
if _hide:
    import importlib.metadata as _md

    def _key(name):
        return str(name).lower().replace("-", "_").replace(".", "_")

    _hidden = {_key(m) for m in _hide}
    for _name in _hide:
        sys.modules[_name] = None  # import fails, importlib.util.find_spec gives None

    def _guard(function):
        def guarded(name, *args, **kwargs):
            if _key(name) in _hidden:
                raise _md.PackageNotFoundError(name)
            return function(name, *args, **kwargs)

        return guarded

    _md.version = _guard(_md.version)
    _md.distribution = _guard(_md.distribution)
    _md.metadata = _guard(_md.metadata)

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
'''
with open(os.path.join(site, "sitecustomize.py"), "w") as f:
    f.write(TEMPLATE.replace("@MAPPING@", repr(mapping)))
print("package_dir mapping (setup.cfg): " + ", ".join(f"{k} -> {v}" for k, v in mapping.items()))
PYEOF
export PYTHONPATH="$WORK/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"

# ---------------------------------------------------------------- pytest (machine or wheels)
if [ "$MODE" = run ]; then
    unpack() {  # unpack the wheels matching $1 into $WORK/wheels
        # pytest's own dependencies that the machine already has (packaging, pygments, ...) are
        # kept: transformers and lightning import packaging too, and must see their own.
        local found=0 whl module
        for whl in "$WHEELS"/$1; do
            [ -f "$whl" ] || continue
            module=$(basename "$whl" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
            case $module in
                packaging | pygments | exceptiongroup | tomli)
                    if "$PY" -c "import $module" >/dev/null 2>&1; then continue; fi
                    ;;
            esac
            "$PY" -m zipfile -e "$whl" "$WORK/wheels" || return 1
            echo "  unpacked $(basename "$whl")"
            found=1
        done
        [ $found = 1 ]
    }
    if [ "${GPU_CHECK_FORCE_WHEELS:-0}" = 1 ] || ! "$PY" -c "import pytest" >/dev/null 2>&1; then
        if unpack "*.whl"; then
            export PYTHONPATH="$WORK/wheels:$PYTHONPATH"
            echo "pytest: from the wheels in $WHEELS"
        else
            echo "gpu_check: $PY has no pytest and $WHEELS holds no wheels: run" \
                "'bash scripts/gpu_check.sh --prepare-wheels' where there is network, and carry" \
                "build/gpu_wheels to this machine (device run: carry=[\"build/gpu_wheels\"])" >&2
            exit 2
        fi
    elif ! "$PY" -c "import pytest_timeout" >/dev/null 2>&1 && unpack "pytest_timeout-*.whl"; then
        export PYTHONPATH="$WORK/wheels:$PYTHONPATH"
        echo "pytest-timeout: from $WHEELS"
    fi
fi

# ---------------------------------------------------------------- environment + imports
echo "==================== environment ===================="
"$PY" - "$REPO" "$JSON" <<'PYEOF'
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

repo, out = sys.argv[1], sys.argv[2]
env = {"python": platform.python_version(), "executable": sys.executable}
import torch

env.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda=torch.cuda.is_available())
if env["cuda"]:
    props = torch.cuda.get_device_properties(0)
    env.update(
        device_name=props.name,
        device_count=torch.cuda.device_count(),
        capability=f"{props.major}.{props.minor}",
        total_memory_gib=round(props.total_memory / 2**30, 1),
        bf16_supported=torch.cuda.is_bf16_supported(),
    )
try:
    query = "name,driver_version,memory.total,power.limit,clocks.max.sm"
    smi = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=30,
    )
    if smi.returncode == 0:
        env["nvidia_smi"] = smi.stdout.strip().splitlines()
except (OSError, subprocess.TimeoutExpired):
    pass

# (module, distribution, what needs it)
PACKAGES = [
    ("lightning", "lightning", "required"),
    ("transformers", "transformers", "required"),
    ("tokenizers", "tokenizers", "required (dapo_lightning.testing)"),
    ("pytest", "pytest", "runs the tests"),
    ("pytest_timeout", "pytest-timeout", "per-test timeouts (else only the outer timeout)"),
    ("peft", "peft", "QLoRA test (skips without)"),
    ("bitsandbytes", "bitsandbytes", "QLoRA test (skips without)"),
    ("math_verify", "math-verify", "not used by the gpu tests"),
    ("jsonargparse", "jsonargparse", "not used by the gpu tests (CLI)"),
    ("datasets", "datasets", "not used by the gpu tests"),
    ("pyarrow", "pyarrow", "not used by the gpu tests"),
    ("tensorboard", "tensorboard", "not used by the gpu tests"),
    ("rich", "rich", "not used by the gpu tests"),
    ("matplotlib", "matplotlib", "not used by the gpu tests"),
    ("vllm", "vllm", "not used by the gpu tests"),
    ("deepspeed", "deepspeed", "not used by the gpu tests"),
]
missing = []
for module, dist, use in PACKAGES:
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    version = None
    if found:
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            version = "found"
    else:
        missing.append(module)
    env[module] = version
    where = ""
    if module == "pytest" and found:
        where = " (" + os.path.dirname(importlib.util.find_spec(module).origin) + ")"
    print(f"  {module:15s} {version or 'MISSING':12s} {use}{where}")
env["missing_optional"] = [m for m in missing if m not in ("lightning", "transformers", "tokenizers")]

try:
    from packaging.requirements import Requirement

    project = open(os.path.join(repo, "pyproject.toml")).read()
    for pin in ("torch>=2.6", "lightning>=2.6,<2.7", "transformers>=5.16.1,<5.20"):
        req = Requirement(pin)
        have = env.get(req.name)
        if pin in project and have and not req.specifier.contains(have.split("+")[0], prereleases=True):
            print(f"  WARNING: {req.name} {have} is outside the project's pin {pin}")
except ImportError:
    pass

problems = []
for module in ("lightning", "transformers", "tokenizers"):
    if env.get(module) is None:
        problems.append(f"{module} is not installed")
checks = {}
MODULES = (
    "dapo_lightning", "dapo_lightning.callbacks", "dapo_lightning.testing",
    "dapo_lightning.module", "dapo_lightning.strategy", "dapo_lightning.logprobs",
    "dapo_lightning.rollout", "dapo_lightning.lora", "tests._module_harness", "benchmarks.roofline",
)  # fmt: skip
for module in MODULES:
    try:
        importlib.import_module(module)
        checks[module] = "ok"
    except Exception as err:  # noqa: BLE001 - reported, then the run stops
        if module == "dapo_lightning.lora" and isinstance(err, ModuleNotFoundError) and err.name == module:
            checks[module] = "absent"
            continue
        checks[module] = f"{type(err).__name__}: {err}"
        problems.append(f"import {module}: {checks[module]}")
env["imports"] = checks
if checks.get("dapo_lightning.callbacks") == "ok":
    import dapo_lightning
    import dapo_lightning.callbacks

    paths = {
        "dapo_lightning": os.path.realpath(dapo_lightning.__file__),
        "dapo_lightning.callbacks": os.path.realpath(dapo_lightning.callbacks.__file__),
    }
    env["package_files"] = paths
    wanted = {
        "dapo_lightning": os.path.realpath(os.path.join(repo, "dapo_lightning", "__init__.py")),
        "dapo_lightning.callbacks": os.path.realpath(os.path.join(repo, "callbacks", "__init__.py")),
    }
    for name, path in wanted.items():
        if paths[name] != path:
            problems.append(f"{name} imported from {paths[name]}, not this tree's {path}")
print(f"  imports: {', '.join(f'{k}={v}' for k, v in checks.items())}")
print(f"  torch {env['torch']} (CUDA build {env['torch_cuda']}), CUDA available: {env['cuda']}"
      + (f", {env['device_name']} x{env['device_count']}" if env["cuda"] else ""))
data = {
    "schema": 1,
    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "status": "setup_error" if problems else "env_ok",
    "problems": problems,
    "env": env,
    "tests": {},
}
with open(out, "w") as f:
    json.dump(data, f, indent=2, sort_keys=True)
for p in problems:
    print(f"gpu_check: SET-UP PROBLEM: {p}", file=sys.stderr)
sys.exit(2 if problems else 0)
PYEOF
env_rc=$?
if [ $env_rc -ne 0 ]; then
    summary "$JSON"
    exit 2
fi

set_status() {  # set_status STATUS: write the final status into the JSON
    "$PY" - "$JSON" "$1" <<'PYEOF'
import json
import sys

path, status = sys.argv[1], sys.argv[2]
data = json.load(open(path))
data["status"] = status
json.dump(data, open(path, "w"), indent=2, sort_keys=True)
PYEOF
}

CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
if [ "$CUDA" != 1 ] && [ $REQUIRE_CUDA = 1 ]; then
    set_status no_cuda
    echo "gpu_check: NO CUDA on this machine and --require-cuda was given: exit 3" >&2
    exit 3
fi
if [ "$MODE" = env ]; then
    echo "gpu_check: environment checked (--env-only): $JSON"
    exit 0
fi

# ---------------------------------------------------------------- pytest -m gpu
mapfile -t GPU_FILES < <(grep -l "mark\.gpu" tests/test_*.py)
if [ ${#GPU_FILES[@]} -eq 0 ]; then
    echo "gpu_check: no test file under tests/ uses the gpu marker" >&2
    exit 2
fi
echo "==================== pytest -m gpu (${GPU_FILES[*]}) ===================="
if [ "$CUDA" != 1 ]; then
    echo "gpu_check: NO CUDA on this machine: the gpu tests will be skipped"
fi
export GPU_CHECK_JSON=$JSON
STARTED=$(date +%s)
TIMEOUT_CMD=()
if command -v timeout >/dev/null 2>&1; then TIMEOUT_CMD=(timeout -k 30 "$TIMEOUT"); fi
"${TIMEOUT_CMD[@]}" "$PY" -m pytest -m gpu "${GPU_FILES[@]}" -q -p no:cacheprovider \
    --continue-on-collection-errors --durations=10 --junitxml="$OUT/gpu_pytest.xml" 2>&1 | tee "$OUT/gpu_pytest.txt"
rc=${PIPESTATUS[0]}
SECONDS_TAKEN=$(($(date +%s) - STARTED))

"$PY" - "$JSON" "$OUT/gpu_pytest.xml" "$rc" "$SECONDS_TAKEN" "$CUDA" <<'PYEOF'
import json
import os
import sys
import xml.etree.ElementTree as ET

path, xml, rc, seconds, cuda = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5] == "1"
data = json.load(open(path))
run = {"rc": rc, "seconds": seconds, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "cases": []}
if os.path.exists(xml):
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome, message = name, node.get("message", "")
                break
        run["passed" if outcome == "passed" else outcome] += 1
        run["cases"].append({
            "name": f"{case.get('classname')}::{case.get('name')}",
            "outcome": outcome if outcome != "errors" else "error",
            "seconds": float(case.get("time", 0.0)),
            "message": message,
        })
data["pytest"] = run
if rc in (124, 137):
    status = "timeout"
elif rc != 0:
    status = "failed"
elif not cuda:
    status = "no_cuda"
else:
    status = "passed"
data["status"] = status
json.dump(data, open(path, "w"), indent=2, sort_keys=True)
PYEOF

summary "$JSON"
echo "gpu_check: numbers in $JSON, pytest output in $OUT/gpu_pytest.txt"
case $rc in
    0)
        if [ "$CUDA" != 1 ]; then
            echo "gpu_check: NO CUDA: every gpu test skipped (exit 0; --require-cuda makes this exit 3)"
        fi
        exit 0
        ;;
    124 | 137)
        echo "gpu_check: pytest stopped by the ${TIMEOUT}s timeout" >&2
        exit 124
        ;;
    *)
        echo "gpu_check: pytest exit status $rc: a gpu test failed (see above)" >&2
        exit 1
        ;;
esac
