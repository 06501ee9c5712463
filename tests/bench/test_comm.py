"""`trainaccel bench comm` on tiny configurations: well-formed JSON, no timing asserted."""

import json
import os
import shutil

import pytest

from conftest import run, trainaccel_cmd
from trainaccel.bench.comm import parse_sizes


def test_parse_sizes():
    assert parse_sizes("4KiB, 1MiB,64,1GiB") == [4096, 2**20, 64, 2**30]
    for bad in ("3", "1kb", "0MiB", "-4", ""):
        with pytest.raises(ValueError, match="accepted: N, NKiB, NMiB or NGiB, a multiple of 4 bytes"):
            parse_sizes(bad)


def _check_rows(report: dict, world: int, link: float | None) -> None:
    assert report["benchmark"] == "comm" and report["world_size"] == world
    rows = report["rows"]
    assert [(r["compression"], r["size_bytes"]) for r in rows] == [
        ("none", 4096),
        ("none", 65536),
        ("fp16", 4096),
        ("fp16", 65536),
    ]
    for r in rows:
        assert r["time_s"] > 0 and r["busbw_gbit_s"] == pytest.approx(r["algbw_gbit_s"] * 2 * (world - 1) / world)
        assert r["payload_bytes"] == r["size_bytes"] // (2 if r["compression"] == "fp16" else 1)
        assert r["link_gbit_s"] == link


@pytest.mark.multiprocess
def test_bench_comm_tiny_local_run(tmp_path):
    out = tmp_path / "comm.json"
    plot = tmp_path / "busbw.png"
    proc = run(
        [*trainaccel_cmd(), "bench", "comm", "--sizes", "4KiB,64KiB", "--iters", "2", "--json", out, "--plot", plot]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bench comm" in proc.stdout and "2 sizes x 2 codecs, 2 iterations each: " in proc.stdout
    assert plot.read_bytes().startswith(b"\x89PNG")
    _check_rows(json.loads(out.read_text()), world=2, link=None)


@pytest.mark.multiprocess
@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="needs root and iproute2 to build network namespaces",
)
def test_bench_comm_tiny_emulated_run(tmp_path):
    out = tmp_path / "comm.json"
    proc = run(
        [
            *trainaccel_cmd(),
            "bench",
            "comm",
            "--sizes",
            "4KiB,64KiB",
            "--iters",
            "2",
            "--emulate",
            "nodes=2,procs-per-node=1,link=1gbit",
            "--json",
            out,
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_rows(json.loads(out.read_text()), world=2, link=1.0)


def test_bench_comm_rejects_bad_arguments(capsys):
    from trainaccel.cli import main

    for args, message in [
        (["--compression", "none,zip"], "invalid compression='zip'"),
        (["--sizes", "3"], "invalid size '3'"),
        (["--emulate", "nodes=1"], "invalid --emulate 'nodes=1'"),
    ]:
        assert main(["bench", "comm", *args]) == 2  # in this process: it fails before starting any worker
        assert message in capsys.readouterr().err
