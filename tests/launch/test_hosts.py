import shlex

import pytest

from trainaccel.launch.hosts import Host, allocate, parse_hostfile, parse_hosts, reachable_name
from trainaccel.launch.run import LaunchError


def test_parse_hosts_and_default_slot():
    assert parse_hosts("a:8, b:8,c") == [Host("a", 8), Host("b", 8), Host("c", 1)]
    for bad in ("a:0", "a:x", ":4", "a,,b"):
        with pytest.raises(LaunchError, match="accepted: HOST or HOST:SLOTS"):
            parse_hosts(bad)


def test_parse_hostfile(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# cluster\nnode1 slots=8\nnode2 slots=4 max_slots=8  # smaller\n\nnode3\n")
    assert parse_hostfile(f) == [Host("node1", 8), Host("node2", 4), Host("node3", 1)]
    f.write_text("node1 gpus=8\n")
    with pytest.raises(LaunchError, match=r"hosts:1: cannot read 'gpus=8'"):
        parse_hostfile(f)


def test_allocate_fills_hosts_in_order():
    hosts = [Host("a", 2), Host("b", 2), Host("c", 2)]
    assert allocate(hosts, 3) == [Host("a", 2), Host("b", 1)]
    assert allocate(hosts, None) == hosts
    with pytest.raises(LaunchError, match="invalid -np 7; accepted: 1 to 6"):
        allocate(hosts, 7)


def _commands(stdout: str) -> list[list[str]]:
    lines = stdout.strip().splitlines()
    assert all(line.startswith("# node ") for line in lines[::2]), stdout
    return [shlex.split(line) for line in lines[1::2]]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_dry_run_prints_one_torchrun_per_host(cli):
    proc = cli(
        [
            "run",
            "-np",
            "4",
            "-H",
            "localhost:2,otherhost:2",
            "--compression",
            "fp16",
            "--max-restarts",
            "1",
            "--dry-run",
            "train.py",
            "--epochs",
            "3",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    local, remote = _commands(proc.stdout)
    assert "TRAINACCEL_COMPRESSION=fp16" in local
    torchrun_local = local[local.index("-m") - 1 :]
    assert torchrun_local[1:3] == ["-m", "trainaccel.launch"]  # each host's own `trainaccel run`, with its watchdog
    master = reachable_name()
    assert master != "localhost" and not master.startswith("127.")
    for node_rank, argv in enumerate([torchrun_local, remote]):
        joined = " ".join(argv)
        assert "-m trainaccel.launch " in joined
        if argv is remote:
            assert argv[:4] == ["ssh", "-o", "BatchMode=yes", "otherhost"]
            argv = shlex.split(argv[4].split("&&", 1)[1])
            assert "TRAINACCEL_COMPRESSION=fp16" in argv
        assert _flag(argv, "--nnodes") == "2"
        assert _flag(argv, "--node-rank") == str(node_rank)
        assert _flag(argv, "--nproc-per-node") == "2"
        assert _flag(argv, "--master-addr") == master
        assert _flag(argv, "--master-port") == "29500"
        assert _flag(argv, "--max-restarts") == "1"
        assert argv[-3:] == ["train.py", "--epochs", "3"]


def test_hostfile_and_partial_np(cli, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA slots=4\nnodeB slots=4\n")
    proc = cli(["run", "-np", "6", "--hostfile", hostfile, "--dry-run", "-m", "pkg.train"])
    assert proc.returncode == 0, proc.stderr
    first, second = _commands(proc.stdout)
    assert first[:4] == ["ssh", "-o", "BatchMode=yes", "nodeA"]
    inner = [shlex.split(c[4].split("&&", 1)[1]) for c in (first, second)]
    assert [_flag(a, "--nproc-per-node") for a in inner] == ["4", "2"]
    assert all(_flag(a, "--master-addr") == "nodeA" for a in inner)
    assert all("-m" in a[a.index("trainaccel.launch") :] and a[-1] == "pkg.train" for a in inner)


@pytest.mark.parametrize(
    "args, message",
    [
        (["-H", "a:2", "--nnodes", "2"], "--nnodes is set from the host list"),
        (["-np", "5", "-H", "a:2,b:2"], "invalid -np 5; accepted: 1 to 4"),
        (["-H", "a:2,a:2"], "a host is listed twice"),
        (["-H", "a:two"], "invalid host 'a:two'"),
        (["-np", "0"], "invalid -np 0; accepted: an integer >= 1"),
        (["-H", "a:2", "--standalone"], "--standalone is set from the host list"),
    ],
)
def test_bad_host_lists_fail_with_one_line(cli, args, message):
    proc = cli(["run", *args, "--dry-run", "train.py"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_single_host_dry_run_routes_through_bootstrap(cli):
    proc = cli(["run", "--nproc_per_node", "2", "--bucket_mb", "4", "--dry-run", "train.py", "-x"])
    assert proc.returncode == 0, proc.stderr
    (argv,) = [shlex.split(line) for line in proc.stdout.strip().splitlines()]
    assert argv[0] == "TRAINACCEL_BUCKET_MB=4.0"
    assert _flag(argv, "--nproc-per-node") == "2"
    assert argv[-4:] == ["-m", "trainaccel.launch.bootstrap", "train.py", "-x"]
