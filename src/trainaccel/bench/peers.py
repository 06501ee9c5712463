"""Arms of `trainaccel bench quality` run by the project users would pick instead: torchft's DiLoCo.

The `torchft` arm trains the quality worker's task with `torchft.local_sgd.DiLoCo` at the DiLoCo options the
trainaccel arm is given (`--sync-every`, `--sync-fragments`, `--sync-overlap` as torchft's `fragment_sync_delay`,
`--sync-scope`, `--outer-optimizer`, `--outer-lr`, `--outer-momentum`), so that both arms run one setting by
construction. A `--variant torchft-LABEL:options` is a torchft arm of its own: those options, and torchft's
`fragment_update_alpha` (how much of the steps taken while a delayed fragment synced its result keeps; torchft's
default 0 drops them, where trainaccel keeps them on top). The bench starts torchft's lighthouse (on node 0 when
emulated) and one replica group per replica as trainaccel's `sync_scope` makes it (a node's workers, or each
worker), each group a torchrun job of its own, and stops them all however the run ends.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainaccel.bench.emulate import EmulatedCluster, Emulation
from trainaccel.bench.stores import listen_ports
from trainaccel.bench.tasks import task_flags
from trainaccel.bench.train import variant_options
from trainaccel.config import Config, ConfigError
from trainaccel.launch.local import TORCHRUN, plain_env, run_together, stop

PEER_ARMS = ("torchft",)
WORKER_MODULE = "trainaccel.bench.torchft_worker"
INSTALL = "the torchft arm needs torchft: pip install 'trainaccel[peers]'"
# trainaccel's DiLoCo options the torchft arm runs with, as its worker's flags (sync_overlap: fragment_sync_delay).
SETTINGS = ("sync_every", "sync_fragments", "sync_overlap", "outer_optimizer", "outer_lr", "outer_momentum")
# torchft's own DiLoCo options a torchft variant may set, with their defaults (torchft's).
OWN = {"fragment_update_alpha": 0.0}
# trainaccel's options with no counterpart in torchft's DiLoCo, at the value that leaves them off.
UNMATCHED = {"sync_warmup": 0, "outer_compression": "none"}
# torchft's own lighthouse server, in a process the bench can stop; it prints READY once it listens.
READY = "lighthouse listening"
LIGHTHOUSE = (
    "import signal, sys\n"
    "from torchft.coordination import LighthouseServer\n"
    "server = LighthouseServer(bind=sys.argv[1], min_replicas=int(sys.argv[2]))\n"
    f"print({READY!r}, server.address(), flush=True)\n"
    "signal.pause()\n"
)
# Under --emulate, each replica group's torchrun store: the run's port plus a multiple of this (a run's ports stay its
# own, in namespaces nothing else uses).
GROUP_PORTS = 1000


def is_peer_variant(text: str) -> bool:
    """Whether a --variant is a torchft arm's: its label `torchft`, or `torchft-` and a name."""
    label = text.partition(":")[0].strip()
    return label == "torchft" or label.startswith("torchft-")


def parse_peer_variant(text: str) -> tuple[str, dict[str, str]]:
    """`torchft-LABEL:option=value,...` -> (label, options): trainaccel's DiLoCo options and torchft's own (`OWN`)."""
    label, _, rest = text.partition(":")
    label = label.strip()
    if label != "torchft" and (
        not label.startswith("torchft-") or label == "torchft-" or any(c.isspace() for c in label)
    ):
        raise ValueError(f"invalid --variant {text!r}; accepted: torchft-LABEL:option=value,...")
    return label, variant_options(label, rest, (*SETTINGS, "sync_scope", *OWN), tuple(UNMATCHED))


def torchft_settings(options: dict[str, str]) -> dict[str, Any]:
    """The torchft arm's DiLoCo settings from trainaccel's options (and torchft's own, `OWN`, from a torchft variant);
    ValueError (one line) if it cannot run them."""
    if importlib.util.find_spec("torchft") is None:
        raise ValueError(INSTALL)
    own = {name: options.get(name, default) for name, default in OWN.items()}
    try:
        config = Config.resolve(env={}, flags={k: v for k, v in options.items() if k not in OWN})
    except ConfigError as e:
        raise ValueError(f"the torchft arm: {e}") from None
    every = config.sync_every
    if every == "auto" or not every:
        raise ValueError(
            f"the torchft arm runs DiLoCo at the trainaccel arm's settings and needs --sync-every N, an integer >= 1 "
            f"(got {every}; torchft has no sync_every=auto)"
        )
    if every % config.sync_fragments:
        raise ValueError(
            f"the torchft arm needs --sync-fragments to divide --sync-every (torchft syncs one fragment every "
            f"sync_every / F steps): {config.sync_fragments} does not divide {every}"
        )
    for name, off in UNMATCHED.items():
        if getattr(config, name) != off:
            raise ValueError(
                f"the torchft arm has no counterpart of {Config.flag_name(name)} {getattr(config, name)}; it takes "
                f"{', '.join(Config.flag_name(n) for n in (*SETTINGS, 'sync_scope'))}"
            )
    if config.sync_overlap >= every // config.sync_fragments:
        raise ValueError(
            f"the torchft arm needs --sync-overlap (its fragment_sync_delay) under the steps between two fragments' "
            f"syncs: {config.sync_overlap} is not under {every} / {config.sync_fragments}"
        )
    try:
        alpha = float(own["fragment_update_alpha"])
    except ValueError:
        alpha = math.nan
    if not 0 <= alpha <= 1:
        raise ValueError(
            f"invalid fragment_update_alpha={own['fragment_update_alpha']!r}; accepted: a number in [0, 1] (the share "
            "of the steps taken while a delayed fragment synced that its result keeps)"
        )
    return {**{name: getattr(config, name) for name in (*SETTINGS, "sync_scope")}, "fragment_update_alpha": alpha}


def replica_groups(emulation: Emulation | None, nproc_per_node: int, scope: str) -> list[tuple[int, int]]:
    """(node, workers) of each replica group: a node's workers where trainaccel's sync_scope makes the node one
    replica (auto: a node of several workers), else each worker alone."""
    nodes, per_node = (emulation.nodes, emulation.procs_per_node) if emulation else (1, nproc_per_node)
    if emulation is not None and per_node > 1 and scope != "rank":
        return [(node, per_node) for node in range(nodes)]
    return [(node, 1) for node in range(nodes) for _ in range(per_node)]


@contextlib.contextmanager
def lighthouse(prefix: list[str], port: int, groups: int, env: dict[str, str], log: Path) -> Iterator[None]:
    """torchft's lighthouse on `port` (inside `prefix`, a node's namespace), listening until the block ends."""
    command = [*prefix, sys.executable, "-c", LIGHTHOUSE, f"[::]:{port}", str(groups)]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while READY not in log.read_text():  # the groups' managers connect to it as they start
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(log.read_text().splitlines()[-30:])
                raise RuntimeError(f"arm torchft: the lighthouse did not start (exit {proc.poll()}):\n{tail}")
            time.sleep(0.1)
        yield
    finally:
        stop([proc])


def run_torchft(
    args: Any, settings: dict[str, Any], out: Path, cluster: EmulatedCluster | None, port: int, seed: int
) -> dict:
    """One run of the torchft arm: the lighthouse, then every replica group to completion; rank 0's result."""
    emulation = cluster.emulation if cluster is not None else None
    groups = replica_groups(emulation, args.nproc_per_node, settings["sync_scope"])
    if cluster is None:  # this machine's ports are shared with whatever else runs on it: free ones
        port, *ports = listen_ports(len(groups) + 1)
    else:  # the namespaces are the bench's own: the run's port for the lighthouse, multiples above it for the groups
        ports = [port + GROUP_PORTS * (k + 1) for k in range(len(groups))]
        if ports[-1] > 65535:
            raise RuntimeError(f"arm torchft: {len(groups)} replica groups need more ports than there are above {port}")

    def address(node: int) -> str:
        return cluster.address(node) if cluster is not None else "127.0.0.1"

    def prefix(node: int) -> list[str]:
        return cluster.exec_prefix(node) if cluster is not None else []

    env = plain_env()
    if emulation is not None:
        env = emulation.node_env(env)
    elif args.nproc_per_node > 1:  # what torchrun gives the other arms' workers on this machine (one group of all)
        env.setdefault("OMP_NUM_THREADS", "1")
    worker = [
        "-m",
        WORKER_MODULE,
        *task_flags(args, seed, out),
        f"--groups={len(groups)}",
        f"--lighthouse=http://{address(0)}:{port}",
        f"--clock={address(0)}:{ports[0]}",
        *(f"--{name.replace('_', '-')}={settings[name]}" for name in (*SETTINGS, *OWN)),
    ]
    commands = [
        [
            *prefix(node),
            *TORCHRUN,
            "--nnodes=1",
            "--node-rank=0",
            f"--nproc-per-node={size}",
            f"--master-addr={address(node)}",
            f"--master-port={ports[k]}",
            *worker,
            f"--group={k}",
            f"--host={address(node)}",
        ]
        for k, (node, size) in enumerate(groups)
    ]
    logs = [out.with_suffix(f".group{k}.log") for k in range(len(groups))]
    began = time.monotonic()
    with lighthouse(prefix(0), port, len(groups), env, out.with_suffix(".lighthouse.log")):
        code, failed = run_together(commands, [env] * len(commands), logs)
    if failed is not None or not out.exists():
        tail = "\n".join(logs[failed or 0].read_text().splitlines()[-30:])
        raise RuntimeError(f"arm torchft failed in replica group {failed} (exit {code}):\n{tail}")
    return {**json.loads(out.read_text()), "wall_seconds": time.monotonic() - began}  # the lighthouse's start too
