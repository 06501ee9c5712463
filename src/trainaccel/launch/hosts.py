"""Host lists (`-np 16 -H host1:8,host2:8`, `--hostfile`): one `trainaccel run` per host, rendezvous on the first.

Each host runs `python -m trainaccel.launch` (torchrun underneath), so every node has the launcher's watchdog.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import socket
import sys
from pathlib import Path

from trainaccel.launch.torchrun import LaunchError, torchrun_flags

SSH = ["ssh", "-o", "BatchMode=yes"]
DEFAULT_MASTER_PORT = 29500
# torchrun flags that the host list decides; passing them too would contradict it.
_HOST_LIST_OWNS = {
    "nnodes": "1:1",
    "node_rank": 0,
    "nproc_per_node": "1",
    "master_addr": "127.0.0.1",
    "standalone": False,
    "rdzv_backend": "static",
    "rdzv_endpoint": "",
}


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclasses.dataclass(frozen=True)
class HostCommand:
    """The `trainaccel run` that one host runs."""

    host: str
    node_rank: int
    nproc: int
    env: dict[str, str]
    argv: list[str]
    local: bool

    def process_argv(self) -> list[str]:
        """What this machine executes: the command itself, or ssh running it on the host."""
        if self.local:
            return self.argv
        inner = shlex.join(["env", *(f"{k}={v}" for k, v in sorted(self.env.items())), *self.argv])
        return [*SSH, self.host, f"cd {shlex.quote(os.getcwd())} && {inner}"]

    def shell(self) -> str:
        """The command as a line a person can run (`--dry-run` prints these)."""
        if self.local:
            env = [f"{k}={v}" for k, v in sorted(self.env.items())]
            return shlex.join([*env, *self.argv])
        return shlex.join(self.process_argv())


def parse_hosts(spec: str) -> list[Host]:
    """`host1:8,host2:8` (a host without `:N` has one slot, as in mpirun)."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        name, sep, slots = item.rpartition(":")
        if not sep:
            name, slots = item, "1"
        if not name or not slots.isdigit() or int(slots) < 1:
            raise LaunchError(f"invalid host {item!r} in -H {spec!r}; accepted: HOST or HOST:SLOTS with SLOTS >= 1")
        hosts.append(Host(name, int(slots)))
    return hosts


def parse_hostfile(path: str | Path) -> list[Host]:
    """Lines of `host [slots=N] [max_slots=M]`; `#` starts a comment."""
    hosts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = 1
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key == "slots" and value.isdigit() and int(value) >= 1:
                slots = int(value)
            elif key != "max_slots":
                raise LaunchError(f"{path}:{number}: cannot read {word!r}; accepted: `host slots=N`")
        hosts.append(Host(words[0], slots))
    if not hosts:
        raise LaunchError(f"{path}: no hosts listed")
    return hosts


def allocate(hosts: list[Host], np: int | None) -> list[Host]:
    """Fill hosts in order, as mpirun does; returns the hosts used with their process counts."""
    total = sum(h.slots for h in hosts)
    if np is None:
        return hosts
    if not 1 <= np <= total:
        raise LaunchError(f"invalid -np {np}; accepted: 1 to {total} (the slots in the host list)")
    used, left = [], np
    for host in hosts:
        if left == 0:
            break
        used.append(Host(host.name, min(host.slots, left)))
        left -= used[-1].slots
    return used


def is_local(host: str) -> bool:
    return is_loopback(host) or host in (socket.gethostname(), socket.getfqdn())


def reachable_name() -> str:
    """This machine's name as other hosts know it (never a loopback name)."""
    fqdn = socket.getfqdn()
    return fqdn if not fqdn.startswith("localhost") and not is_loopback(fqdn) else socket.gethostname()


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def plan_hosts(args: argparse.Namespace, env: dict[str, str]) -> list[HostCommand]:
    """One torchrun command per host for a host-list launch."""
    for dest, default in _HOST_LIST_OWNS.items():
        if getattr(args, dest) != default:
            flag = "--" + dest.replace("_", "-")
            raise LaunchError(f"{flag} is set from the host list; drop it when using -np/-H/--hostfile")
    if args.hosts and args.hostfile:
        raise LaunchError("give the hosts once: -H or --hostfile, not both")
    if args.hosts:
        hosts = parse_hosts(args.hosts)
    elif args.hostfile:
        hosts = parse_hostfile(args.hostfile)
    elif args.np < 1:
        raise LaunchError(f"invalid -np {args.np}; accepted: an integer >= 1")
    else:
        hosts = [Host("localhost", args.np)]
    hosts = allocate(hosts, args.np)
    if len({h.name for h in hosts}) != len(hosts):
        raise LaunchError(f"a host is listed twice in {[h.name for h in hosts]}; list each host once with its slots")

    local = [is_local(h.name) for h in hosts]
    master_addr = hosts[0].name
    if local[0] and not all(local):
        # Remote hosts must reach the first host by a name other than "localhost".
        master_addr = reachable_name()
    if args.master_port is not None:
        master_port = args.master_port
    else:
        master_port = _free_port() if all(local) else DEFAULT_MASTER_PORT
    commands = []
    for node_rank, (host, is_here) in enumerate(zip(hosts, local)):
        flags = torchrun_flags(
            args,
            nnodes=len(hosts),
            node_rank=node_rank,
            nproc_per_node=host.slots,
            master_addr=master_addr,
            master_port=master_port,
        )
        # Each host's own `trainaccel run`: torchrun underneath, the bootstrap in each worker, and the watchdog
        # that ends a worker which cannot run Python (options travel as TRAINACCEL_* in the environment).
        argv = [sys.executable, "-m", "trainaccel.launch", *flags, args.training_script, *args.training_script_args]
        commands.append(HostCommand(host.name, node_rank, host.slots, dict(env), argv, is_here))
    return commands


def run_plan(commands: list[HostCommand]) -> int:
    """Run every host's `trainaccel run`; the first failure stops the rest and is the exit code."""
    from trainaccel.launch.local import run_together

    envs = [{**os.environ, **c.env} if c.local else None for c in commands]
    try:
        code, failed = run_together([c.process_argv() for c in commands], envs)
    except KeyboardInterrupt:
        return 130
    if failed is not None:
        command = commands[failed]
        print(f"trainaccel run: node {command.node_rank} ({command.host}) exited with {code}", file=sys.stderr)
    return code
