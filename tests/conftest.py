import getpass
import json
import logging
import multiprocessing.process
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import trainaccel
from trainaccel.bench.stores import free_port

# One compute thread in each process the tests start (pytest's own, its torch imported above, keeps its cores): the
# suite runs up to a dozen workers on a few cores, where each one's own thread pool only makes them wait on each
# other. torchrun sets the same for 2 or more workers per node; the tests check results, never speed.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Every process the tests start, and this one, runs under the check that each process group has one issuing thread
# (trainaccel.comm.owners): a collective from a second thread fails at once, however the threads' timing falls.
CHECK_OWNERS = {"TRAINACCEL_CHECK_OWNERS": "1"}
os.environ.update(CHECK_OWNERS)

# Full smoke runs of the benchmark commands and the slow-link demo take minutes: CI keeps their faster siblings
# (test_demo_measures_every_arm, the bench commands' option tests); `pytest -m bench_full` or TRAINACCEL_BENCH_FULL=1
# runs them too.
BENCH_FULL = "bench_full"
# The engine's jobs that repeat a sibling's path with one thing changed (a restart at another step, a world of 2
# beside one of 3, sharding's other modes, a zero-code run beside the feature's own test): CI keeps the sibling;
# `pytest -m comm_full` or TRAINACCEL_COMM_FULL=1.
COMM_FULL = "comm_full"
# Fault cases that repeat a sibling's path (each starts emulated nodes): CI keeps a zero-code node's rejoin (the node
# lost first), and one fault of each kind a restart follows; `pytest -m resilience_full` or
# TRAINACCEL_RESILIENCE_FULL=1.
RESILIENCE_FULL = "resilience_full"


def deselect_unless_asked(config: pytest.Config, items: list[pytest.Item], marker: str, env: str) -> None:
    """Deselect the tests marked `marker` unless asked for: `-m` names the marker, or `env`=1."""
    if marker in (config.getoption("markexpr") or "") or os.environ.get(env) == "1":
        return
    dropped = [item for item in items if item.get_closest_marker(marker) is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item.get_closest_marker(marker) is None]


def selected_params(request: pytest.FixtureRequest, name: str) -> set:
    """The values of parameter `name` among the selected tests of the requesting fixture's module: a module fixture
    that starts a job per value starts only those its tests read."""
    here = [item for item in request.session.items if item.module is request.module and hasattr(item, "callspec")]
    return {item.callspec.params[name] for item in here if name in item.callspec.params}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    deselect_unless_asked(config, items, BENCH_FULL, "TRAINACCEL_BENCH_FULL")
    deselect_unless_asked(config, items, COMM_FULL, "TRAINACCEL_COMM_FULL")
    deselect_unless_asked(config, items, RESILIENCE_FULL, "TRAINACCEL_RESILIENCE_FULL")


# Inductor compiles in this process (older torch releases fork a pool of compile workers for it, which the
# multiprocess check below would count as a process the test starts).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

SCRIPTS = Path(__file__).parent / "scripts"
BIN = Path(sys.executable).parent

# pytester: tests/test_markers.py runs pytest on small test files to show the marker check below at work.
pytest_plugins = ["pytester"]

# Tests that start processes (torchrun, `trainaccel run`, any subprocess, multiprocessing workers) are marked
# `multiprocess`, so that `pytest -m "not multiprocess"` runs the fast, in-process tests alone. The marker is
# enforced: while a test runs (setup, call and teardown, module-scoped fixtures included), starting a process
# fails the test unless it is marked.
MULTIPROCESS = "multiprocess"
_running: list[pytest.Item] = []  # the test being run; a stack, since pytester runs tests within a test


def require_multiprocess(what: str) -> None:
    """Fail the running test, if any, unless it is marked multiprocess; `what` names the process it would start."""
    __tracebackhide__ = True  # the failure shows where the test starts the process, not this check
    if _running and _running[-1].get_closest_marker(MULTIPROCESS) is None:
        pytest.fail(
            f"{_running[-1].nodeid} starts a process ({what}) but is not marked {MULTIPROCESS}: "
            f"add @pytest.mark.{MULTIPROCESS} to the test, or pytestmark = pytest.mark.{MULTIPROCESS} to its module "
            f'if all of its tests start processes, so that `pytest -m "not {MULTIPROCESS}"` stays in-process'
        )


def _described(command) -> str:
    words = [str(c) for c in command] if isinstance(command, (list, tuple)) else [str(command)]
    text = " ".join(words)
    return text if len(text) <= 200 else text[:197] + "..."


_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _checked_popen_init(self, *args, **kwargs):
    __tracebackhide__ = True
    command = args[0] if args else kwargs.get("args")
    try:
        require_multiprocess(f"subprocess {_described(command)}")
    except BaseException:
        self._child_created = False  # no child: Popen.__del__ has nothing to clean up
        raise
    _popen_init(self, *args, **kwargs)


def _checked_process_start(self):
    __tracebackhide__ = True
    require_multiprocess(f"multiprocessing {self.name}, target {getattr(self, '_target', None)!r}")
    _process_start(self)


_patches: dict[pytest.Config, pytest.MonkeyPatch] = {}


def pytest_configure(config: pytest.Config) -> None:
    # Once per process: pytester's in-process runs configure again within the outer run.
    if not _patches:
        patch = _patches[config] = pytest.MonkeyPatch()
        patch.setattr(subprocess.Popen, "__init__", _checked_popen_init)
        patch.setattr(multiprocessing.process.BaseProcess, "start", _checked_process_start)


def pytest_unconfigure(config: pytest.Config) -> None:
    if config in _patches:
        _patches.pop(config).undo()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


def trainaccel_cmd() -> list[str]:
    """The installed console script, as users run it."""
    script = BIN / "trainaccel"
    return [str(script)] if script.exists() else [sys.executable, "-m", "trainaccel"]


def torchrun_cmd() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def run(cmd: list[str], env: dict | None = None, timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    """Run a command with a clean TRAINACCEL_* environment plus `env`; never hangs the suite.

    On timeout the command's whole process group is killed (a launcher's workers too), then it raises.
    """
    require_multiprocess(f"conftest.run: {_described(cmd)}")
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINACCEL_")} | CHECK_OWNERS
    args = [str(c) for c in cmd]
    with subprocess.Popen(
        args,
        env={**base, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kw,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(args, timeout, out, err) from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def run_nodes(
    script,
    *args,
    nodes: int = 2,
    per_node: int | list[int] = 2,
    launcher: list[str] | None = None,
    env: dict | None = None,
    timeout: float = 240,
) -> list[subprocess.CompletedProcess]:
    """Start `script` as `nodes` emulated nodes on this host: one torchrun launch per node (--nnodes).

    `per_node` is the workers per node, or a list of them for nodes of different sizes.
    """
    require_multiprocess(f"conftest.run_nodes: {nodes} torchrun launches of {script}")
    port = free_port()
    sizes = per_node if isinstance(per_node, list) else [per_node] * nodes
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINACCEL_")} | CHECK_OWNERS
    procs = [
        subprocess.Popen(
            [
                str(c)
                for c in (
                    *(launcher or torchrun_cmd()),
                    "--nnodes",
                    nodes,
                    "--node-rank",
                    node,
                    "--nproc-per-node",
                    sizes[node],
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    port,
                    script,
                    *args,
                )
            ],
            env={**base, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(nodes)
    ]
    done = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    finally:
        for p in procs:
            p.kill()
    return done


def watch_launchers(
    procs: list[subprocess.Popen], waited: list[subprocess.Popen], deadline_s: float, tick=None, every_s: float = 0.2
) -> tuple[list[int | None], float]:
    """Emulated nodes' `trainaccel run` processes, watched until every one in `waited` ended (or `deadline_s`), with
    `tick(tree)` called at each look (it may kill, start or replace processes in `procs` and `waited`); then every
    process of theirs is ended, workers too, even orphaned. Returns `procs`' exit codes at the end (None: it was still
    alive) and when the watch ended (time.monotonic)."""
    from trainaccel.bench.faults import ProcessTree

    tree = ProcessTree([proc.pid for proc in procs])
    began = time.monotonic()
    try:
        while any(proc.poll() is None for proc in waited) and time.monotonic() - began < deadline_s:
            tree.scan()
            if tick is not None:
                tick(tree)
                tree.roots.extend(proc.pid for proc in procs if proc.pid not in tree.roots)  # those it started
            time.sleep(every_s)
        codes, ended = [proc.poll() for proc in procs], time.monotonic()
    finally:
        tree.scan()
        tree.kill()  # a frozen replica waits for its launcher's watchdog: ended here
        for proc in procs:
            proc.wait(timeout=30)
    return codes, ended


@pytest.fixture
def etcd(tmp_path):
    """A 3-member etcd cluster on loopback (without etcd on the PATH it fails naming the package, which
    tools/install-test-servers installs)."""
    from trainaccel.bench.stores import EtcdCluster

    cluster = EtcdCluster(tmp_path / "etcd")
    yield cluster
    cluster.close()


def worker_loader(dataset, **kwargs):
    """A DataLoader with two workers started by a fork server, each batch due within two minutes.

    The test process holds threads that earlier tests left behind (Gloo's, until their groups are
    collected); a worker forked from it copies them mid-work and once crashed, once hung. A fork
    server is a fresh process, and the timeout turns any hang into an error naming it.
    """
    return torch.utils.data.DataLoader(
        dataset, num_workers=2, multiprocessing_context="forkserver", timeout=120, **kwargs
    )


def read_ranks(directory: Path, world: int) -> list[dict]:
    files = sorted(directory.glob("rank*.json"))
    assert len(files) == world, f"expected {world} rank files, found {[f.name for f in files]}"
    return [json.loads(f.read_text()) for f in files]


def run_checks(script: str | Path, out_dir: Path, workers: int, *args) -> list[dict]:
    """Launch a worker script (a name in tests/scripts, or a path) that writes OUT_DIR/rank{r}.json (see
    scripts/checks.py); assert no check failed."""
    require_multiprocess(f"conftest.run_checks: {workers} workers of {script}")
    proc = run(
        [*trainaccel_cmd(), "run", "--standalone", "--nproc-per-node", workers, SCRIPTS / script, out_dir, *args]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = read_ranks(out_dir, workers)
    for rank, result in enumerate(ranks):
        assert result["failures"] == [], f"rank {rank}"
    return ranks


@pytest.fixture(scope="session", autouse=True)
def children_keep_temporary_files_here(tmp_path_factory):
    """Processes started by tests write temporary files (torchrun leaves a log folder per run) under pytest's own
    temporary folder, which pytest prunes, not in /tmp."""
    with pytest.MonkeyPatch.context() as patch:
        # Inductor's compile cache stays where torch keeps it by default (the system's temporary folder, across
        # runs), as on a user's machine: under the moved TMPDIR every run would compile from nothing.
        default_cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(default_cache)))
        patch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmp")))
        yield


@pytest.fixture(autouse=True)
def isolated_by_shutdown():
    """Each test leaves torch and the environment as trainaccel found them: init()'s changes undone, and the
    TRAINACCEL_* variables an in-process `trainaccel run` exports for its workers removed."""
    environment = dict(os.environ)
    yield
    trainaccel.shutdown()
    os.environ.clear()
    os.environ.update(environment)


@pytest.fixture
def cli(monkeypatch, capsys):
    """The `trainaccel` command run in this process, as its entry point runs it, where it must stop before any launch
    (bad input, --dry-run): a `run` that would start processes fails the test. A command's own process would spend
    seconds importing torch for each of these; test_cli.py runs a few as real processes."""
    from trainaccel.cli import main
    from trainaccel.launch import hosts
    from trainaccel.launch import run as launch_run

    def launched(*args, **kwargs):
        pytest.fail("trainaccel run started processes")

    monkeypatch.setattr(launch_run, "_run_torchrun", launched)
    monkeypatch.setattr(hosts, "run_plan", launched)

    def call(argv: list, env: dict | None = None) -> subprocess.CompletedProcess:
        for name in [n for n in os.environ if n.startswith("TRAINACCEL_")]:
            monkeypatch.delenv(name)
        for name, value in {**CHECK_OWNERS, **(env or {})}.items():  # as `run` gives a command
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        argv = [str(a) for a in argv]
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(["trainaccel", *argv], code, captured.out, captured.err)

    return call


@pytest.fixture
def scripts() -> Path:
    return SCRIPTS


@pytest.fixture
def trainaccel_messages() -> list[str]:
    """The messages trainaccel logs during the test, whatever its handlers and levels."""
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("trainaccel").addHandler(handler)
    yield seen
    logging.getLogger("trainaccel").removeHandler(handler)


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    """nginx serving a fresh folder (`.root`) at `.url`, for the tests of one module."""
    from servers import Nginx

    server = Nginx(tmp_path_factory.mktemp("www"), tmp_path_factory.mktemp("nginx"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server with bucket `.bucket`; `.options` for fsspec, `.env` for commands."""
    from servers import MotoS3

    server = MotoS3()
    yield server
    server.close()
