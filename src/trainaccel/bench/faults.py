"""`trainaccel bench faults`: each fault on an emulated 2-node cluster, and how long until every process ended.

Each node is a network namespace with its own `trainaccel run` (see bench/emulate.py). One worker meets
the fault at a set step: it hangs in Python, is stopped (SIGSTOP), is killed (SIGKILL), aborts (SIGABRT, as
NCCL's watchdog ends a worker, while its peer trains alone as if blocked in an NCCL collective) or raises; or the
runner takes its node's link down, or kills every process of the first node (the store's host). The
figure is the time from the fault until every process of every node (launchers and workers, found
through /proc while they run) has exited; what survives the limit is killed and reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from trainaccel.bench.emulate import EmulatedCluster, Emulation, EmulationError, why_not_emulated
from trainaccel.config import Config, ConfigError
from trainaccel.launch.watchdog import process_stat

FAULTS = ("hang", "stop", "kill", "abort", "raise", "link-down", "master-dies", "slow")
DESCRIPTIONS = {
    "hang": "a worker hangs in Python (a sleep that never ends)",
    "stop": "a worker is stopped (SIGSTOP): alive, never runs again",
    "kill": "a worker is killed (SIGKILL)",
    "abort": "a worker aborts (SIGABRT, as from NCCL's watchdog) while its peer trains without a collective",
    "raise": "a worker raises",
    "link-down": "a node's link goes down (`ip link set eth0 down` in its namespace)",
    "master-dies": "every process of the first node (the store's host) is killed",
    "slow": "a straggler: one step of a worker takes --slow-s seconds (past half of hang_timeout)",
}
NODES = 2
PORT = 29500  # each namespace has its own ports
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?(trainaccel(?: run)?: .*)$")
_RAISED_LINE = re.compile(r"^\[rank\d+\]: (\w+(?:Error|Exception): .*)$")  # a worker's uncaught exception
_AGENT_LINE = re.compile(r"\] (failed \(exitcode: .*)$")  # torchrun's agent on a worker that died


@dataclasses.dataclass
class FaultResult:
    fault: str
    seconds: float | None  # from the fault until every process had exited; None: some were alive at the limit
    first_lines: list[str]  # per node: the first `trainaccel: ...` or `trainaccel run: ...` line of its output
    exit_codes: list[int | None]  # per node's `trainaccel run`
    survivors: int  # processes still alive at the limit (then killed)
    outputs: list[str]


class ProcessTree:
    """Every process started under the launchers, remembered by (pid, start time) even once orphaned."""

    def __init__(self, roots: list[int]):
        self.roots = roots
        self.seen: dict[tuple[int, str], int] = {}  # (pid, start time) -> node
        self.scan()

    def scan(self) -> None:
        parents: dict[int, tuple[int, str]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                stat = process_stat(int(entry.name))
                if stat is not None:
                    parents[int(entry.name)] = (stat[1], stat[2])
        known = {pid: node for (pid, _), node in self.seen.items()}
        known.update({pid: node for node, pid in enumerate(self.roots) if pid in parents})
        grew = True
        while grew:
            grew = False
            for pid, (ppid, _) in parents.items():
                if pid not in known and ppid in known:
                    known[pid], grew = known[ppid], True
        for pid, node in known.items():
            if pid in parents:
                self.seen.setdefault((pid, parents[pid][1]), node)

    def alive(self) -> list[tuple[int, int]]:
        """(pid, node) of the remembered processes still running (a zombie has ended)."""
        out = []
        for (pid, started), node in self.seen.items():
            stat = process_stat(pid)
            if stat is not None and stat[2] == started and stat[0] != "Z":
                out.append((pid, node))
        return out

    def kill(self) -> list[tuple[int, int]]:
        """SIGKILL every remembered process still running (a stopped one too); returns (pid, node) of each."""
        left = self.alive()
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


def run_fault(
    fault: str,
    *,
    per_node: int = 1,
    options: list[str] | None = None,
    at: int = 30,
    step_s: float = 0.2,
    slow_s: float = 40.0,
    limit_s: float = 200.0,
    prefix: str | None = None,
) -> FaultResult:
    """Run one fault on a fresh emulated cluster; the faulty worker is the last rank (on node 1)."""
    if fault not in FAULTS:
        raise ValueError(f"invalid fault {fault!r}; accepted: {', '.join(FAULTS)}")
    worker = str(Path(__file__).with_name("fault_worker.py"))
    in_worker = fault if fault in ("hang", "stop", "kill", "abort", "raise", "slow") else "none"
    steps = at + 20 if fault == "slow" else 10**6  # a straggler's job ends on its own
    last = NODES * per_node - 1
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINACCEL_")}
    # A launcher killed with its node cannot remove its temporary folders: they go here, removed after the run.
    scratch = tempfile.TemporaryDirectory(prefix="trainaccel-faults-")
    env["TMPDIR"] = scratch.name
    with scratch, EmulatedCluster(Emulation(NODES, per_node, "1gbit"), prefix) as cluster:
        env = cluster.emulation.node_env(env)  # Gloo on the node's own link, not the loopback its host name resolves to
        procs = []
        for node in range(NODES):
            command = [
                *cluster.exec_prefix(node),
                *[sys.executable, "-m", "trainaccel", "run", "--nnodes", str(NODES), "--node-rank", str(node)],
                *["--nproc-per-node", str(per_node), "--master-addr", cluster.address(0)],
                *["--master-port", str(PORT), *(options or []), worker, "--fault", in_worker],
                *["--rank", str(last), "--at", str(at), "--step-s", str(step_s), "--slow-s", str(slow_s)],
                *["--steps", str(steps)],
                # The peer sees no error from the aborted worker (as on NCCL): only its publication can end it.
                *(["--peers-no-sync-s", str(10**6)] if fault == "abort" else []),
            ]
            procs.append(
                subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            )
        tree = ProcessTree([p.pid for p in procs])
        lines: list[list[str]] = [[] for _ in procs]
        fault_at: list[float] = []
        reached = threading.Event()
        # The fault's moment: the worker saying it meets it, or (faults from outside) rank 0 beginning the step.
        marker = f"meets fault {in_worker} at step {at}" if in_worker != "none" else f"rank 0 step {at}"
        readers = [
            threading.Thread(target=_read, args=(p, lines[k], reached, marker), daemon=True)
            for k, p in enumerate(procs)
        ]
        for reader in readers:
            reader.start()
        survivors, seconds = 0, None
        try:
            if not reached.wait(timeout=limit_s):
                tails = "; ".join(f"node {k}: {' | '.join(node_lines[-5:])}" for k, node_lines in enumerate(lines))
                raise RuntimeError(f"no worker reached step {at} within {limit_s:.0f} s ({tails})")
            fault_at.append(time.monotonic())
            if fault == "link-down":
                subprocess.run(["ip", "-n", cluster.nodes[1], "link", "set", "eth0", "down"], check=True)
            elif fault == "master-dies":
                tree.scan()
                for pid, node in tree.alive():
                    if node == 0:
                        os.kill(pid, signal.SIGKILL)
            while time.monotonic() - fault_at[0] < limit_s:
                tree.scan()
                if not tree.alive():
                    seconds = time.monotonic() - fault_at[0]
                    break
                time.sleep(0.2)
        finally:
            survivors = len(tree.kill())
            for p in procs:
                p.wait(timeout=30)
            for reader in readers:
                reader.join(timeout=10)
    firsts = []
    for node_lines in lines:
        found = [m.group(1) for m in map(_ERROR_LINE.match, node_lines) if m]
        found += [m.group(1) for m in map(_RAISED_LINE.match, node_lines) if m]
        found += [m.group(1) for m in map(_AGENT_LINE.search, node_lines) if m]
        firsts.append(found[0] if found else "")
    return FaultResult(fault, seconds, firsts, [p.returncode for p in procs], survivors, ["\n".join(x) for x in lines])


def _read(proc: subprocess.Popen, into: list[str], reached: threading.Event, marker: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        into.append(line.rstrip("\n"))
        if line.rstrip("\n").endswith(marker):
            reached.set()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, from {', '.join(FAULTS)}")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="workers per emulated node (default 1)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each fault; the median time is kept")
    parser.add_argument("--slow-s", type=float, default=40.0, help="the straggler's one slow step (default 40 s)")
    parser.add_argument("--limit-s", type=float, default=300.0, help="give up on a fault after this (default 300)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "options", nargs=argparse.REMAINDER, help="trainaccel run options for every node, e.g. --hang-timeout 30"
    )


def main(args: argparse.Namespace) -> int:
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    try:
        unknown = [f for f in faults if f not in FAULTS]
        if unknown or not faults:
            accepted = f"a comma-separated list of {', '.join(FAULTS)}"
            raise ValueError(f"invalid --faults {args.faults!r}; accepted: {accepted}")
        if args.nproc_per_node < 1 or args.repeats < 1 or not args.limit_s > 0 or not args.slow_s > 0:
            raise ValueError("invalid --nproc-per-node/--repeats/--limit-s/--slow-s; accepted: each >= 1 (> 0)")
        missing = why_not_emulated()
        if missing is not None:
            raise EmulationError(f"bench faults needs {missing}")
        from trainaccel.launch.run import build_parser

        options = [o for o in args.options if o != "--"]
        Config.resolve(env={}, flags=Config.flags_from(build_parser().parse_args([*options, "script.py"])))
    except (ValueError, EmulationError, ConfigError) as e:
        print(f"trainaccel bench faults: error: {e}", file=sys.stderr)
        return 2
    except SystemExit:
        print(f"trainaccel bench faults: error: invalid trainaccel run options {options}", file=sys.stderr)
        return 2
    print(
        f"2 emulated nodes x {args.nproc_per_node} workers; the faulty worker is the last rank, on node 1; "
        f"trainaccel run options: {' '.join(options) or '(defaults)'}",
        flush=True,
    )
    rows = []
    for fault in faults:
        runs = [
            run_fault(fault, per_node=args.nproc_per_node, options=options, slow_s=args.slow_s, limit_s=args.limit_s)
            for _ in range(args.repeats)
        ]
        times = [r.seconds for r in runs]
        median = statistics.median(times) if None not in times else None
        rows.append({"fault": fault, "seconds": median, "runs": [dataclasses.asdict(r) for r in runs]})
        shown = f"{median:.1f} s" if median is not None else f"not within {args.limit_s:.0f} s"
        print(f"{fault}: {shown}; exit codes {runs[0].exit_codes}; survivors killed: {runs[0].survivors}", flush=True)
        for node, line in enumerate(runs[0].first_lines):
            print(f"  node {node}: {line or '(nothing)'}", flush=True)
    print()
    print("| fault | every process exited after | node 0 | node 1 |")
    print("|---|---|---|---|")
    for row in rows:
        first = row["runs"][0]
        seconds = f"{row['seconds']:.1f} s" if row["seconds"] is not None else "did not"
        print(f"| {DESCRIPTIONS[row['fault']]} | {seconds} | {first['first_lines'][0]} | {first['first_lines'][1]} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"options": options, "rows": rows}, indent=1))
    return 0 if all(r["seconds"] is not None and all(x["survivors"] == 0 for x in r["runs"]) for r in rows) else 1
