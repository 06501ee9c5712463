"""The GPU pass (`tools/gpu-check`): what only a CUDA machine can show, in one command, within about 9 minutes.

Runs from the repository root of a checkout, against the interpreter's own torch, with no network: trainaccel comes
from `src/` (PYTHONPATH; `--install` for `pip install --no-deps --no-build-isolation -e .`), and the wheels in
`wheels/` (pure-Python dependencies the machine lacks) are installed into a temporary folder first. Stages, each
with its own timeout (a stage that fails or hangs is reported and the pass goes on):

  env        torch, CUDA, the GPU, NCCL, the driver; which runtime and test dependencies import
  gpu-tests  pytest -m gpu (tests/gpu: CUDA-only code paths)
  options    one training step of every option on CUDA, world size 1 over NCCL (tools/gpu_check_steps.py); the
             steady-state steps under torch.cuda.set_sync_debug_mode("warn"): host-device syncs and where
  replicas   2 emulated nodes x 2 workers, all on the one GPU over Gloo: every codec flat and hierarchical,
             sync_every's scopes and codecs; replicas equal, losses finite and falling
  amp        amp fp16 (GradScaler through trainaccel.amp.scaled), bf16 and on: the loss falls
  overlap    `trainaccel bench train`: a DDP model with trainaccel's hook (compression fp16) vs no communication
  resnet     `trainaccel bench train --model resnet50`: eager vs compile=on vs amp=bf16 step times
  suite      pytest -m "not multiprocess and not gpu": the in-process suite on this torch

It writes OUT/gpu-report.json, OUT/gpu-report.md (printed at the end) and OUT/logs/ (each stage's output), where
OUT is --out, else $OUT/gpu-report when $OUT is set, else ./gpu-report. Without a CUDA device it prints one line
and exits with status 2 at once. `--allow-cpu` runs the stages on the CPU with small sizes: for developing this
tool only (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS_SCRIPT = ROOT / "tools" / "gpu_check_steps.py"
# Device files a CUDA (or ROCm, or WSL) GPU brings; without any of them torch.cuda.is_available() is False.
DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")
EXIT_FAILED, EXIT_NO_GPU, EXIT_SETUP, EXIT_USAGE = 1, 2, 3, 64
# The order they run in: the in-process suite, which a CPU machine also runs, last, so a short --budget cuts it
# rather than a GPU figure.
STAGES = ("env", "gpu-tests", "multi-gpu", "options", "replicas", "amp", "overlap", "resnet", "suite")
TITLES = {
    "env": "a. environment",
    "gpu-tests": "a. pytest -m gpu",
    "multi-gpu": "g. several GPUs over NCCL",
    "suite": "a. in-process suite",
    "options": "b. every option, world 1 (NCCL)",
    "replicas": "c. replicas, 2 nodes x 2 workers (Gloo, one GPU)",
    "amp": "d. AMP on CUDA",
    "resnet": "e. ResNet-50 step time",
    "overlap": "f. communication overlap",
}
DISPLAY_ORDER = ["env", "gpu-tests", "suite", "options", "replicas", "amp", "resnet", "overlap", "multi-gpu"]
TIMEOUTS = {  # seconds: each stage's own limit, cut to what is left of --budget
    "env": 90,
    "gpu-tests": 240,  # the lost-replica jobs start 3 nodes of workers, twice
    "multi-gpu": 300,
    "options": 240,
    "replicas": 180,
    "amp": 90,
    "suite": 200,
    "overlap": 220,
    "resnet": 240,
}
# Which dependency each stage needs beyond torch (and numpy, which trainaccel.init() imports).
NEEDS = {
    "gpu-tests": ("pytest",),
    "multi-gpu": ("pytest",),
    "suite": ("pytest",),
    "overlap": ("rich",),
    "resnet": ("rich",),
}
DEPENDENCIES = {  # module -> what it is for
    "torch": "required",
    "numpy": "required by trainaccel (checkpoints)",
    "rich": "required by trainaccel's CLI: bench, info",
    "pytest": "stages gpu-tests and suite",
    "pytest_timeout": "optional: a hung test fails alone",
    "triton": "optional: compile=on on CUDA",
}
OPTIONS_B = [
    "defaults",
    "none+nan_check",
    "fp16",
    "bf16",
    "topk",
    "randomk",
    "powersgd",
    "fp16+hierarchical",
    "fp16+dynamic",
    "sync_every=2",
    "sync_every=2+nesterov",
    "sync_every=4+fragments=2+overlap=1",
    "sync_every=2+outer=int8",
    "sync_every=2+outer=fp4",
    "amp=bf16",
    "amp=fp16",
    "amp=on",
    "shard=full",
    "shard=full+amp=bf16",
    "nan_check=raise",
    "metrics_every=2",
    "straggler_every=2",
    "timeline",
    "autotune",
    "bucket_mb=0.25",
    "compile",
]
CODEC_CELLS = [f"{c}/hier={h}" for c in ("none", "fp16", "bf16", "topk", "randomk", "powersgd") for h in ("off", "on")]
OPTIONS_C = [
    "defaults",
    *CODEC_CELLS,
    "fp16+dynamic/hier=off",
    "fp16+dynamic/hier=on",
    "sync_every=2",
    "sync_every=2+scope=rank",
    "sync_every=4+fragments=2+overlap=1",
    "sync_every=2+outer=int8",
    "sync_every=2+outer=fp4",
]
OPTIONS_D = ["amp=fp16", "amp=bf16", "amp=on"]
SYNC_MESSAGE = "called a synchronizing CUDA operation"


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"gpu-check: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = Parser(
        prog="tools/gpu-check",
        description=__doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0],  # what runs; --allow-cpu stays unlisted
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 every stage passed, 1 a stage failed, 2 no CUDA device, 3 setup failed, 64 bad usage.",
    )
    parser.add_argument("--out", type=Path, help="report folder (default: $OUT/gpu-report, else ./gpu-report)")
    parser.add_argument("--budget", type=float, default=520.0, help="seconds for the whole pass (default 520)")
    parser.add_argument("--stages", help=f"comma-separated subset of {', '.join(STAGES)} (default: all)")
    parser.add_argument("--wheels", type=Path, default=ROOT / "wheels", help="folder of wheels to install first")
    parser.add_argument("--install", action="store_true", help="pip install --no-deps --no-build-isolation -e .")
    parser.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # development only
    args = parser.parse_args(argv)
    chosen = STAGES if args.stages is None else tuple(s.strip() for s in args.stages.split(",") if s.strip())
    bad = [s for s in chosen if s not in STAGES]
    if bad or not chosen:
        parser.error(f"invalid --stages {args.stages!r}; accepted: a comma-separated subset of {', '.join(STAGES)}")
    args.stages = [s for s in STAGES if s in chosen]
    if args.out is None:
        args.out = Path(os.environ["OUT"]) / "gpu-report" if os.environ.get("OUT") else Path("gpu-report")
    return args


# -- processes -------------------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun puts its workers in sessions of their own: a group kill misses them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each process and everything it started, SIGKILL what is left after 5 s."""
    pids = [pid for p in procs if p.poll() is None for pid in (p.pid, *descendants(p.pid))]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(text: str, lines: int = 12) -> str:
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def last_error_line(text: str) -> str | None:
    """The last line of a log that names an error (a Python exception's `Type: message` line)."""
    for line in reversed(text.splitlines()):
        stripped = re.sub(r"^\[rank\d+\]:\s*", "", line.strip())
        if re.match(r"^[\w.]*(Error|Exception|Failed)\b.*:", stripped) and "ChildFailedError" not in stripped:
            return stripped[:300]
    return None


# -- the pass --------------------------------------------------------------------------------------------------


class Pass:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cpu = args.allow_cpu
        self.out = args.out.resolve()
        self.logs = self.out / "logs"
        self.began = time.monotonic()
        self.deadline = self.began + args.budget
        self.site: str | None = None
        self.report: dict = {
            "tool": "tools/gpu-check",
            "mode": "cpu (--allow-cpu: development only, figures mean nothing)" if self.cpu else "gpu",
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "budget_s": args.budget,
            "stages": {},
        }
        self.missing: dict[str, str] = {}

    # Environment of every command: trainaccel from src/, then the wheels' folder, no TRAINACCEL_* from outside.
    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINACCEL_")}
        paths = [p for p in (str(ROOT / "src"), self.site, env.get("PYTHONPATH")) if p]  # src/ is never shadowed
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # no network here: Gloo on loopback, whatever the host name says
        if self.cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        env.update(extra)
        return env

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log_path(self, stage: str) -> Path:
        return self.logs / f"{stage}.log"

    def start(self, stage: str, commands: list[list[str]], env: dict[str, str] | None = None) -> list:
        log = self.log_path(stage).open("a")
        procs = []
        for command in commands:
            log.write(f"\n$ {' '.join(command)}\n")
            log.flush()
            procs.append(
                subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=env or self.env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        log.close()
        return procs

    def run(self, stage: str, command: list[str], timeout: float, env: dict[str, str] | None = None) -> int | None:
        """Run a command to completion or `timeout` (then its whole tree is killed: None)."""
        (proc,) = self.start(stage, [command], env)
        try:
            return proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            kill_tree([proc])
            with self.log_path(stage).open("a") as f:
                f.write(f"\ngpu-check: killed after {timeout:.0f} s\n")
            return None

    def log_text(self, stage: str) -> str:
        path = self.log_path(stage)
        return path.read_text(errors="replace") if path.exists() else ""

    def save(self) -> None:
        self.report["seconds"] = round(time.monotonic() - self.began, 1)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu-report.json").write_text(json.dumps(self.report, indent=1, default=str))
        (self.out / "gpu-report.md").write_text(render(self.report))

    def trim_logs(self, limit: int = 256 * 1024) -> None:
        for path in self.logs.glob("**/*.log"):
            data = path.read_bytes()
            if len(data) > limit:
                path.write_bytes(b"[gpu-check: log cut to its last 256 KiB]\n" + data[-limit:])

    # -- stages ------------------------------------------------------------------------------------------------

    def stage(self, name: str) -> None:
        needs = [m for m in ("numpy", *NEEDS.get(name, ())) if m in self.missing]
        timeout = min(TIMEOUTS[name], self.left() - 10)  # 10 s to end a stage's processes and write the report
        print(f"gpu-check: {TITLES[name]} ...", flush=True)
        began = time.monotonic()
        if name != "env" and needs:
            result = {
                "status": "skipped",
                "summary": f"needs {', '.join(needs)}, missing: carry it as a wheel (docs/operations.md, The GPU pass)",
            }
        elif timeout < 15:
            result = {"status": "skipped", "summary": f"out of time ({self.left():.0f} s of --budget left)"}
        else:
            try:
                result = getattr(self, "stage_" + name.replace("-", "_"))(timeout)
            except Exception as e:  # a bug of this tool: reported as the stage's, the pass goes on
                result = {"status": "error", "summary": f"gpu-check itself failed: {type(e).__name__}: {e}"}
        result["seconds"] = round(time.monotonic() - began, 1)
        result.setdefault("log", str(self.log_path(name).relative_to(self.out)))
        self.report["stages"][name] = result
        self.save()
        print(f"gpu-check: {TITLES[name]}: {result['status']} ({result['seconds']} s): {result['summary']}", flush=True)

    def stage_env(self, timeout: float) -> dict:
        details: dict = {}
        if self.args.wheels.is_dir() and list(self.args.wheels.glob("*.whl")):
            self.site = tempfile.mkdtemp(prefix="gpu-check-site-")
            wheels = sorted(str(w) for w in self.args.wheels.glob("*.whl"))
            code = self.run(
                "env",
                [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", self.site, *wheels],
                min(120, timeout / 2),
            )
            details["wheels"] = {"installed": [Path(w).name for w in wheels], "pip_status": code}
        if self.args.install:
            command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", str(ROOT)]
            details["install_status"] = self.run("env", command, min(120, self.left() - 5))
        probe = ROOT / "tools" / "gpu_check_env.py"
        out = self.logs / "env.json"
        code = self.run("env", [sys.executable, str(probe), str(out)], min(90, self.left() - 5))
        if code is None or not out.exists():
            return {"status": "failed", "summary": f"the probe failed (status {code}): {tail(self.log_text('env'), 3)}"}
        probed = json.loads(out.read_text())
        details.update(probed)
        details["nvidia_smi"] = nvidia_smi()
        details["git"] = git_state()
        details["gpu_check_env"] = {k: v for k, v in self.env().items() if k in ("PYTHONPATH", "GLOO_SOCKET_IFNAME")}
        self.missing = {m: v["error"] for m, v in probed["dependencies"].items() if v.get("error")}
        problems = [f"{m} missing ({DEPENDENCIES[m]})" for m in self.missing if not DEPENDENCIES[m].startswith("opt")]
        if probed.get("trainaccel_error"):
            problems.append(f"trainaccel does not import: {probed['trainaccel_error']}")
        t = probed.get("torch", {})
        summary = (
            f"torch {t.get('version')}, CUDA {t.get('cuda')}, {t.get('device') or 'no GPU'}, "
            f"NCCL {t.get('nccl') or 'unavailable'}, python {probed.get('python')}"
        )
        optional = [m for m in self.missing if DEPENDENCIES[m].startswith("opt")]
        if optional:
            summary += f"; optional missing: {', '.join(optional)}"
        return {
            "status": "failed" if problems else "passed",
            "summary": summary + ("; " + "; ".join(problems) if problems else ""),
            "details": details,
        }

    def pytest(self, stage: str, marker: str, timeout: float, extra_env: dict[str, str] | None = None) -> dict:
        junit = self.logs / f"{stage}.xml"
        command = [sys.executable, "-m", "pytest", "-m", marker, "-p", "no:cacheprovider", "-q", "-rfE"]
        command += ["--continue-on-collection-errors", f"--junitxml={junit}", "tests"]
        if "pytest_timeout" not in self.missing:
            command += ["-o", "timeout=120"]  # one hung test fails alone instead of taking the stage
        code = self.run(stage, command, timeout, self.env(**(extra_env or {})))
        if not junit.exists():
            why = "timed out" if code is None else f"exited with status {code}"
            return {"status": "timeout" if code is None else "failed", "summary": f"pytest {why} without a report"}
        result = read_junit(junit)
        counts = result["counts"]
        summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n or k in ("passed", "failed"))
        if result["not_collected"]:
            modules = sorted({m for _, m in result["not_collected"]})
            summary += f"; {len(result['not_collected'])} test files not collected (missing {', '.join(modules)})"
        bad = counts["failed"] + counts["errors"]
        status = "timeout" if code is None else ("failed" if bad else "passed")
        if code is None:
            summary = "timed out; so far: " + summary
        return {"status": status, "summary": summary, "details": result}

    def stage_gpu_tests(self, timeout: float) -> dict:
        return self.pytest(
            "gpu-tests", "gpu and not many_gpus", timeout, {"GPU_TESTS_ON_CPU": "1"} if self.cpu else None
        )

    def stage_multi_gpu(self, timeout: float) -> dict:
        gpus = 0 if self.cpu else self.gpu_count()
        if gpus < 2:
            return {
                "status": "skipped",
                "summary": f"needs two or more GPUs, found {gpus}: the other stages ran on one",
            }
        return self.pytest("multi-gpu", "many_gpus", timeout)

    def gpu_count(self) -> int:
        """The GPUs a worker process sees (asked of a child: this process does not import torch)."""
        probe = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=120,
        )
        return int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0

    def stage_suite(self, timeout: float) -> dict:
        return self.pytest("suite", "not multiprocess and not gpu", timeout)

    def steps_job(
        self,
        stage: str,
        options: list[str],
        timeout: float,
        *,
        nodes: int = 1,
        per_node: int = 1,
        script_args: list[str],
        option_timeout: float = 90.0,
    ) -> dict[str, dict]:
        """Run tools/gpu_check_steps.py over `options`; a job that fails or hangs is restarted after its option."""
        deadline = time.monotonic() + timeout
        world = nodes * per_node
        results: dict[str, dict] = {}
        remaining = list(options)
        attempt = 0
        device = "cpu" if self.cpu else "cuda"
        while remaining:
            attempt += 1
            if deadline - time.monotonic() < 10:
                for name in remaining:
                    results[name] = {"ok": False, "error": "not run: out of time", "not_run": True}
                break
            folder = self.logs / f"{stage}-job{attempt}"
            worker = [str(STEPS_SCRIPT), str(folder), "--options", ",".join(remaining), "--device", device]
            worker += script_args
            torchrun = [sys.executable, "-m", "torch.distributed.run"]
            if nodes == 1:
                commands = [[*torchrun, "--standalone", f"--nproc-per-node={per_node}", *worker]]
            else:
                port = free_port()
                commands = [
                    [
                        *torchrun,
                        f"--nnodes={nodes}",
                        f"--node-rank={node}",
                        f"--nproc-per-node={per_node}",
                        "--master-addr=127.0.0.1",
                        f"--master-port={port}",
                        *worker,
                    ]
                    for node in range(nodes)
                ]
            log_start = len(self.log_text(stage))
            procs = self.start(stage, commands)
            current, since = None, time.monotonic()
            killed = None
            while True:
                time.sleep(0.5)
                progress = read_progress(folder)
                now = time.monotonic()
                running = next((n for n in remaining if n in progress and len(progress[n]["done"]) < world), None)
                if running != current:
                    current, since = running, now
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                    if any(c not in (None, 0) for c in codes):
                        time.sleep(1)  # the other launches' workers end on their own, or are ended below
                    break
                limit = (240.0 if current and current.startswith("compile") else option_timeout) if current else 150.0
                if now - since > limit or now > deadline:
                    killed = f"no result after {now - since:.0f} s" if now <= deadline else "the stage's time ran out"
                    break
            kill_tree(procs)
            codes = [p.returncode for p in procs]
            progress = read_progress(folder)
            log = self.log_text(stage)[log_start:]
            began_here = [n for n in remaining if n in progress]
            for name in began_here:
                done = progress[name]["done"]
                if len(done) == world:
                    results[name] = merge_ranks(done, log)
                else:
                    why = f"hung: {killed}" if killed else f"crashed: the job exited with status {codes}"
                    error = last_error_line(log)
                    results[name] = {"ok": False, "error": why + (f"; last error: {error}" if error else "")}
                    results[name]["log_tail"] = tail(log, 8)
            if not began_here:
                for name in remaining:
                    results[name] = {
                        "ok": False,
                        "not_run": True,
                        "error": f"not run: the job did not start (status {codes}): {last_error_line(log) or ''}",
                        "log_tail": tail(log, 8),
                    }
                break
            remaining = [n for n in remaining if n not in results]
        return {name: results[name] for name in options}

    def stage_options(self, timeout: float) -> dict:
        backend = "gloo" if self.cpu else "nccl"
        options = [o for o in OPTIONS_B if not (self.cpu and o.startswith("compile"))] if self.cpu else OPTIONS_B
        args = ["--backend", backend, "--steps", "8", "--warmup", "4", "--record-syncs", "4"]
        results = self.steps_job("options", options, timeout, script_args=args)
        errors = [n for n, r in results.items() if not r["ok"]]
        synced = [n for n, r in results.items() if r.get("syncs") or r.get("cpp_syncs")]
        summary = f"{len(results) - len(errors)}/{len(results)} options ran"
        if errors:
            summary += f"; errors: {', '.join(errors)}"
        if not self.cpu:
            summary += f"; host syncs in steady steps: {', '.join(synced) if synced else 'none'}"
        return {"status": "failed" if errors else "passed", "summary": summary, "details": results}

    def stage_replicas(self, timeout: float) -> dict:
        backend_args = ["--backend", "gloo", "--steps", "30", "--check-replicas", "--group-timeout", "60"]
        results = self.steps_job("replicas", OPTIONS_C, timeout, nodes=2, per_node=2, script_args=backend_args)
        problems = {}
        for name, r in results.items():
            found = []
            if not r["ok"]:
                found.append("error")
            else:
                if not r.get("replicas_equal"):
                    found.append("replicas differ")
                if not falling(r, 0.9):
                    found.append("loss not falling")
                want_hier = name.endswith("hier=on") and not name.startswith("powersgd")
                if name in CODEC_CELLS and bool(r.get("hierarchical")) != want_hier:
                    found.append(f"hierarchical={r.get('hierarchical')}")
                if name.startswith("sync_every"):
                    want = "rank" if "scope=rank" in name else "node"
                    if r.get("sync_scope") != want:
                        found.append(f"sync_scope={r.get('sync_scope')}, expected {want}")
            if found:
                problems[name] = found
                r["problems"] = found
        summary = f"{len(results) - len(problems)}/{len(results)} cells as expected"
        if problems:
            summary += "; " + "; ".join(f"{n}: {', '.join(p)}" for n, p in problems.items())
        return {"status": "failed" if problems else "passed", "summary": summary, "details": results}

    def stage_amp(self, timeout: float) -> dict:
        args = ["--backend", "gloo" if self.cpu else "nccl", "--steps", "40"]
        results = self.steps_job("amp", OPTIONS_D, timeout, script_args=args)
        expected = {"amp=fp16": "float16", "amp=bf16": "bfloat16"}
        problems = {}
        for name, r in results.items():
            # amp=on: bfloat16 where the device computes it natively (CPUs, A100/H100 on), float16 on older GPUs.
            expected["amp=on"] = "bfloat16" if r.get("native_bf16", True) else "float16"
            found = []
            if not r["ok"]:
                found.append("error")
            else:
                if not falling(r, 0.7):
                    found.append(f"loss {r.get('first_loss'):.4g} -> {r.get('final_loss'):.4g}: not falling")
                if r.get("compute_dtype") != expected[name]:
                    found.append(f"computed in {r.get('compute_dtype')}, expected {expected[name]}")
                if expected[name] == "float16" and not r.get("loss_scale"):
                    found.append("no GradScaler")
            if found:
                problems[name] = r["problems"] = found
        summary = f"{len(results) - len(problems)}/{len(results)} as expected"
        if problems:
            summary += "; " + "; ".join(f"{n}: {', '.join(p)}" for n, p in problems.items())
        return {"status": "failed" if problems else "passed", "summary": summary, "details": results}

    def bench(self, stage: str, flags: list[str], timeout: float, repeats: int) -> tuple[int | None, dict | None]:
        out = self.logs / f"{stage}.json"
        size = ["--model", "mlp", "--batch-size", "8", "--steps", "6", "--warmup", "2", "--repeats", "1"]
        if not self.cpu:
            size = ["--model", "resnet50", "--batch-size", "64", "--steps", "30", "--warmup", "10"]
            size += ["--repeats", str(repeats)]
        command = [sys.executable, "-m", "trainaccel", "bench", "train", "--nproc-per-node", "1", *size, *flags]
        code = self.run(stage, [*command, "--json", str(out)], timeout)
        return code, json.loads(out.read_text()) if code == 0 and out.exists() else None

    def bench_result(self, stage: str, code: int | None, report: dict | None, reference: str) -> dict:
        if report is None:
            why = "timed out" if code is None else f"exited with status {code}"
            error = last_error_line(self.log_text(stage))
            return {
                "status": "timeout" if code is None else "failed",
                "summary": f"trainaccel bench train {why}" + (f": {error}" if error else ""),
                "log_tail": tail(self.log_text(stage), 10),
            }
        batch = report["settings"]["batch_size"]
        arms = {}
        for arm, s in report["arms"].items():
            arms[arm] = {
                "step_ms": round(1000 * batch / s["median"], 2),
                "examples_per_s": round(s["median"], 1),
                "runs_examples_per_s": [round(v, 1) for v in s["examples_per_s_per_worker"]],
                "compiled": s.get("compiled"),
                "amp": s.get("amp"),
                "comm_hook": s.get("comm_hook"),
                "peak_memory_mib": round(s["peak_memory_bytes"] / 2**20),
            }
        base = arms.get(reference, {}).get("step_ms")
        for arm in arms.values():
            arm[f"vs_{reference}"] = round(arm["step_ms"] / base, 3) if base else None
        details = {"model": report["settings"]["model"], "batch_size": batch, "arms": arms}
        details["timing"] = (
            "each run: torch.cuda.synchronize(), then the steps after the warm-up timed together and divided by "
            "their number; the median over the repeats (arms interleaved)"
        )
        return {"status": "passed", "details": details}

    def stage_resnet(self, timeout: float) -> dict:
        flags = ["--arms", "trainaccel", "--variant", "compile:compile=on", "--variant", "amp-bf16:amp=bf16"]
        code, report = self.bench("resnet", flags, timeout, repeats=1)  # one compile (a minute or two) is enough
        result = self.bench_result("resnet", code, report, "trainaccel")
        if report is not None:
            arms = result["details"]["arms"]
            arms["eager"] = arms.pop("trainaccel")
            for arm in arms.values():
                arm["vs_eager"] = arm.pop("vs_trainaccel")
            parts = [f"{a} {v['step_ms']:.1f} ms ({v['vs_eager']:.2f}x)" for a, v in arms.items()]
            result["summary"] = "step time: " + ", ".join(parts)
            if arms.get("compile", {}).get("compiled") is False:
                result["status"] = "failed"
                result["summary"] += "; compile=on ran eager (see the log: trainaccel says why)"
        return result

    def stage_overlap(self, timeout: float) -> dict:
        # fp16 as configured by default (fp16_scale=auto: peak on a GPU, no host read); fp16 with the dynamic scale
        # reads each bucket's sum on the host (its exact retry); bf16 sends as many bytes and reads nothing. Side by
        # side they tell the read's cost from the codec's and the hook's.
        flags = ["--arms", "local,baseline,trainaccel", "--compression", "fp16"]
        flags += ["--variant", "trainaccel-bf16:compression=bf16"]
        flags += ["--variant", "trainaccel-dynamic:compression=fp16,fp16_scale=dynamic"]
        code, report = self.bench("overlap", flags, timeout, repeats=2)
        result = self.bench_result("overlap", code, report, "local")
        if report is not None:
            arms = result["details"]["arms"]
            arms["trainaccel-fp16"] = arms.pop("trainaccel")
            ratio = arms["trainaccel-fp16"]["vs_local"]
            result["details"]["ratio"] = ratio
            others = ", ".join(
                f"{a[11:]} {arms[a]['vs_local']:.2f}x" for a in ("trainaccel-bf16", "trainaccel-dynamic")
            )
            result["summary"] = (
                f"trainaccel fp16 {arms['trainaccel-fp16']['step_ms']:.1f} ms vs no communication "
                f"{arms['local']['step_ms']:.1f} ms: {ratio:.2f}x "
                f"({others}; plain DDP {arms['baseline']['vs_local']:.2f}x)"
            )
        return result


def falling(r: dict, factor: float) -> bool:
    first, final = r.get("first_loss"), r.get("final_loss")
    return isinstance(first, float) and isinstance(final, float) and final == final and final < factor * first


def read_progress(folder: Path) -> dict[str, dict]:
    """option -> {"began": ranks, "done": {rank: result}} from the job's rank*.jsonl."""
    progress: dict[str, dict] = {}
    for path in folder.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # being written
            slot = progress.setdefault(entry["option"], {"began": set(), "done": {}})
            if entry["event"] == "began":
                slot["began"].add(entry["rank"])
            else:
                slot["done"][entry["rank"]] = entry
    return progress


def merge_ranks(done: dict[int, dict], log: str) -> dict:
    """One option's result: rank 0's figures; not ok if any rank failed, with the first failing rank's error."""
    result = dict(done[0])
    for key in ("event", "rank"):
        result.pop(key, None)
    failed = [r for _, r in sorted(done.items()) if not r["ok"]]
    if failed:
        result["ok"] = False
        for key in ("error", "error_type", "where"):
            result[key] = failed[0].get(key)
        if len(done) > 1:
            result["error"] = f"rank {failed[0]['rank']}: {failed[0].get('error')}"
    # Syncs in C++ threads print torch's warning on stderr, between the option's begin and end lines.
    name = result["option"]
    section = log.split(f"gpu-check option {name} begin", 1)[-1].split(f"gpu-check option {name} end", 1)[0]
    result["cpp_syncs"] = section.count(SYNC_MESSAGE) if f"gpu-check option {name} begin" in log else 0
    return result


def read_junit(path: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, not_collected, skips = [], [], {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = "::".join(p for p in (case.get("classname", "").replace(".", "/"), case.get("name", "")) if p)
        failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
        if error is not None and error.get("message") == "collection failure":
            missing = re.search(r"No module named '([\w.]+)'", error.text or "")
            if missing and not missing.group(1).startswith("trainaccel"):
                not_collected.append((case.get("name"), missing.group(1).split(".")[0]))
                continue
        if failure is not None or error is not None:
            node = failure if failure is not None else error
            counts["failed" if failure is not None else "errors"] += 1
            message = (node.get("message") or "").strip().splitlines()
            if node.get("message") == "collection failure":  # the error itself is the traceback's last `E` line
                message = [line[1:].strip() for line in (node.text or "").splitlines() if line.startswith("E ")][-1:]
            failures.append({"test": name, "message": message[0][:300] if message else ""})
        elif skipped is not None:
            counts["skipped"] += 1
            reason = (skipped.get("message") or "").strip()[:160]
            skips[reason] = skips.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return {"counts": counts, "failures": failures, "not_collected": not_collected, "skip_reasons": skips}


def nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"]
    try:
        return subprocess.run(query, capture_output=True, text=True, timeout=15).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def git_state() -> dict | None:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"commit": head.stdout.strip() or None, "changed_files": len(status.stdout.splitlines())}


# -- the summary -------------------------------------------------------------------------------------------------


def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def stage_table(report: dict) -> list[str]:
    lines = ["| stage | status | s | summary |", "|---|---|---|---|"]
    for name in sorted(report["stages"], key=DISPLAY_ORDER.index):
        s = report["stages"][name]
        lines.append(f"| {TITLES[name]} | {s['status']} | {s.get('seconds', '')} | {cell(s['summary'])} |")
    return lines


def render(report: dict) -> str:
    stages = report["stages"]
    env = stages.get("env", {}).get("details", {})
    t = env.get("torch", {})
    lines = ["# gpu-check report", ""]
    if t:
        lines.append(
            f"torch {t.get('version')} (CUDA {t.get('cuda')}, cuDNN {t.get('cudnn')}), {t.get('device') or 'no GPU'}"
            f" {t.get('capability') or ''}, NCCL {t.get('nccl')}; python {env.get('python')}, {env.get('cpus')} CPUs;"
            f" driver: {env.get('nvidia_smi') or '-'}"
        )
    lines.append(f"mode {report['mode']}, started {report['started']}, {report.get('seconds', '?')} s")
    lines += ["", *stage_table(report)]
    for name in ("gpu-tests", "suite"):
        failures = stages.get(name, {}).get("details", {}).get("failures", [])
        if failures:
            lines += ["", f"## {TITLES[name]}: failures", ""]
            lines += [f"- `{f['test']}`: {cell(f['message'])}" for f in failures[:25]]
            if len(failures) > 25:
                lines.append(f"- ... {len(failures) - 25} more in the JSON report")
    options = stages.get("options", {}).get("details")
    if options:
        syncs_title = "host syncs in steady steps" if report["mode"] == "gpu" else "host syncs (not recorded on CPU)"
        lines += ["", f"## {TITLES['options']}", "", f"| option | result | {syncs_title} |"]
        lines.append("|---|---|---|")
        for name, r in options.items():
            if r["ok"]:
                result = f"ok, loss {r.get('first_loss', float('nan')):.3g} -> {r.get('final_loss', float('nan')):.3g}"
            else:
                result = f"**{r.get('error')}**" + (f" at {r['where']}" if r.get("where") else "")
            found = r.get("syncs") or []
            syncs = [
                f"{s['count']}x {s['thread']}: {s['trainaccel_frame'] or '-'} <- {s['innermost_frame']}"
                for s in found[:3]
            ]
            if len(found) > 3:
                syncs.append(f"{len(found) - 3} more places in the JSON report")
            if r.get("cpp_syncs"):
                syncs.append(f"{r['cpp_syncs']}x in C++ threads (see the log)")
            lines.append(f"| {name} | {cell(result)} | {cell('; '.join(syncs) or '-')} |")
    for name, columns in (("replicas", ("hierarchical", "sync_scope")), ("amp", ("compute_dtype", "loss_scale"))):
        details = stages.get(name, {}).get("details")
        if not details:
            continue
        header = ["option", "loss first -> final", "replicas equal", *columns, "problems"]
        lines += ["", f"## {TITLES[name]}", "", "| " + " | ".join(header) + " |"]
        lines.append("|---" * (4 + len(columns)) + "|")
        for option, r in details.items():
            if r["ok"]:
                losses = f"{r['first_loss']:.4g} -> {r['final_loss']:.4g}"
            else:
                losses = f"**{r.get('error')}**" + (f" at {r['where']}" if r.get("where") else "")
            values = " | ".join(cell(r.get(c, "-")) for c in columns)
            row = f"| {option} | {cell(losses)} | {r.get('replicas_equal', '-')} | {values}"
            lines.append(row + f" | {cell(', '.join(r.get('problems', [])) or '-')} |")
    for name, reference in (("resnet", "eager"), ("overlap", "local")):
        details = stages.get(name, {}).get("details")
        if not details or "arms" not in details:
            continue
        lines += ["", f"## {TITLES[name]}: {details['model']}, batch {details['batch_size']}", ""]
        lines.append(f"| arm | step ms | vs {reference} | examples/s | compiled | amp | peak MiB |")
        lines.append("|---|---|---|---|---|---|---|")
        for arm, a in details["arms"].items():
            lines.append(
                f"| {arm} | {a['step_ms']} | {a.get('vs_' + reference)} | {a['examples_per_s']} | {a['compiled']} |"
                f" {a['amp']} | {a['peak_memory_mib']} |"
            )
    lines += ["", "Details: gpu-report.json; each stage's output: logs/.", ""]
    return "\n".join(lines)


def cuda_probe() -> tuple[bool | None, str]:
    """(torch.cuda.is_available(), torch's version) from a short-lived process; (None, why) if torch fails."""
    code = "import torch; print(torch.cuda.is_available(), torch.__version__)"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return None, "importing torch took over 120 s"
    words = proc.stdout.split()
    if proc.returncode != 0 or len(words) != 2:
        return None, last_error_line(proc.stderr) or f"python -c 'import torch' exited with status {proc.returncode}"
    return words[0] == "True", words[1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.allow_cpu:
        # Before anything heavy: without a GPU's device files CUDA cannot be there.
        if not any(os.path.exists(p) for p in DEVICE_FILES):
            print(
                "gpu-check: no CUDA device (no GPU device files here, so torch.cuda.is_available() is False); "
                "run it on a GPU machine",
                file=sys.stderr,
            )
            return EXIT_NO_GPU
        available, version = cuda_probe()
        if available is None:
            print(f"gpu-check: cannot import torch with {sys.executable}: {version}", file=sys.stderr)
            return EXIT_SETUP
        if not available:
            print(
                f"gpu-check: no CUDA device (torch.cuda.is_available() is False with torch {version}); "
                "run it on a GPU machine",
                file=sys.stderr,
            )
            return EXIT_NO_GPU
    check = Pass(args)
    shutil.rmtree(check.logs, ignore_errors=True)
    check.logs.mkdir(parents=True, exist_ok=True)
    try:
        check.stage("env")
        env = check.report["stages"]["env"]
        if not env.get("details", {}).get("torch"):
            print(f"gpu-check: cannot go on: {env['summary']}", file=sys.stderr)
            return EXIT_SETUP
        for name in args.stages:
            if name != "env":
                check.stage(name)
    finally:
        check.trim_logs()
        check.save()
        if check.site:
            shutil.rmtree(check.site, ignore_errors=True)
    print()
    print(render(check.report))
    # The stages once more, last: a reader of the output's tail sees them whatever the details' length.
    print("\n".join(["## Summary", "", *stage_table(check.report), ""]))
    print(f"gpu-check: report in {check.out}", flush=True)
    failed = [n for n, s in check.report["stages"].items() if s["status"] != "passed"]
    return EXIT_FAILED if failed else 0


if __name__ == "__main__":
    sys.exit(main())
