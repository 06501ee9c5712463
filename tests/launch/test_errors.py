"""Bad options fail at once in `trainaccel run`, with one line, before any worker starts."""

import pytest

from conftest import SCRIPTS

GROWS = ["--nnodes", "3:4", "--store", "etcd://10.0.0.1:2379", "--rdzv-id", "g"]  # a job that may grow to 4 nodes
SURVIVES = ["--sync-every", "4", "--on-lost-replica", "continue"]


@pytest.mark.parametrize(
    "flags, env, expected",
    [
        (
            [],
            {"TRAINACCEL_COMPRESSION": "zip"},
            "trainaccel run: error: invalid compression='zip' (from TRAINACCEL_COMPRESSION); "
            "accepted: none, fp16, bf16, topk, randomk, powersgd",
        ),
        (
            ["--compression", "topk", "--compression-ratio", "1.5"],
            {},
            "trainaccel run: error: invalid compression_ratio='1.5' (from --compression-ratio); accepted: a number in (0, 1]",
        ),
        (
            ["--compression", "topk"],
            {"TRAINACCEL_COMPRESSION_RATIO": "0"},
            "trainaccel run: error: invalid compression_ratio='0' (from TRAINACCEL_COMPRESSION_RATIO); "
            "accepted: a number in (0, 1]",
        ),
        (
            ["--compression", "powersgd", "--powersgd-rank", "0"],
            {},
            "trainaccel run: error: invalid powersgd_rank='0' (from --powersgd-rank); accepted: an integer >= 1",
        ),
        (
            ["--bucket-mb", "-1"],
            {},
            "trainaccel run: error: invalid bucket_mb='-1' (from --bucket-mb); accepted: a number > 0 (MiB)",
        ),
        (
            ["--nan-check", "sometimes"],
            {},
            "trainaccel run: error: invalid nan_check='sometimes' (from --nan-check); accepted: off, warn, raise",
        ),
        (
            ["--amp-level", "O1"],
            {"TRAINACCEL_AMP_POLICY": "loss:hold=3"},
            "trainaccel run: error: invalid amp_policy='loss:hold=3' (from TRAINACCEL_AMP_POLICY); accepted: always, "
            "auto[:setting=value,...] or time[:setting=value,...]; here: mode 'loss' needs its value at every call, "
            "before the first step too: use it through the API",
        ),
        (
            ["--store", "etcd://10.0.0.1"],
            {},
            "trainaccel run: error: invalid store='etcd://10.0.0.1' (from --store); accepted: agent, or "
            "etcd://HOST:PORT[,HOST:PORT...] (the etcd members' client addresses)",
        ),
        (
            ["--store", "etcd://10.0.0.1:2379"],
            {},
            "trainaccel run: error: --store etcd://10.0.0.1:2379 needs --rdzv-id NAME: the job's name in the store, "
            "the same on every node and new for each job (the jobs on one etcd cluster are kept apart by it)",
        ),
        (
            ["--rdzv-id", "j", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"],
            {"TRAINACCEL_STORE": "etcd://10.0.0.1:2379"},
            "trainaccel run: error: --store etcd://10.0.0.1:2379 takes the place of --rdzv-backend c10d: leave "
            "--rdzv-backend out (each node's rank is its --node-rank, as with static rendezvous)",
        ),
        (
            [*GROWS, "--sync-every", "4"],
            {},
            "trainaccel run: error: --nnodes 3:4 with --store: nodes join a running job at a sync, so it needs "
            "--sync-every and --on-lost-replica continue (each replica trains alone between syncs); give --nnodes one "
            "number otherwise",
        ),
        (
            [*GROWS, *SURVIVES, "--sync-warmup", "2"],
            {},
            "trainaccel run: error: --nnodes 3:4 with --sync-warmup 2: the warm-up's per-step exchange runs over the "
            "default group, which a job that grows cannot start (its nodes are not all there); use 0",
        ),
        (
            [*GROWS, *SURVIVES, "--nproc-per-node", "auto"],
            {},
            "trainaccel run: error: --nnodes 3:4 with --nproc-per-node auto: a job that grows needs the same number of "
            "workers on every node, given as a number (each worker's rank follows from its node's)",
        ),
        (
            [*GROWS, *SURVIVES, "--node-rank", "4"],
            {},
            "trainaccel run: error: invalid --node-rank 4 with --nnodes 3:4; accepted: 0 to 3",
        ),
    ],
)
def test_invalid_option_exits_before_workers(cli, tmp_path, flags, env, expected):
    # (`cli` fails the test if a launch starts; test_cli.py runs two such cases as the command's own process)
    proc = cli(["run", "--nproc-per-node", "2", *flags, SCRIPTS / "touch_marker.py", tmp_path / "started"], env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == expected


def test_the_store_on_etcd_rendezvouses_through_trainaccels_own_backend(cli, tmp_path):
    flags = ["--store", "etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379", "--rdzv-id", "job-7", "--node-rank", "2"]
    proc = cli(["run", "--dry-run", "--nnodes", "3", "--nproc-per-node", "8", *flags, SCRIPTS / "touch_marker.py"])
    assert proc.returncode == 0, proc.stderr
    comment, command = proc.stdout.strip().splitlines()
    assert comment.startswith("# the trainaccel-etcd rendezvous exists inside trainaccel run")
    assert "--rdzv-backend trainaccel-etcd --rdzv-endpoint etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379" in command
    assert "--rdzv-id job-7 --rdzv-conf rank=2" in command  # the node's rank travels to the rendezvous
    assert " TRAINACCEL_STORE=etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379 " in command  # the workers read it


def test_run_path_is_refused_clearly(cli, tmp_path):
    proc = cli(["run", "--run-path", SCRIPTS / "touch_marker.py", tmp_path / "m"])
    assert proc.returncode == 2 and "--run-path is not supported" in proc.stderr


def test_the_scripts_own_flags_are_never_taken_for_abbreviations_of_ours(capsys):
    from trainaccel.launch.run import main

    # --out is a prefix of --outer-lr and --outer-momentum: with argparse's abbreviations it was refused as ambiguous.
    assert main(["--standalone", "--nproc-per-node", "2", "--dry-run", "train.py", "--out=/tmp/x", "--outer", "3"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("train.py --out=/tmp/x --outer 3")


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--nproc-per-node", "0"], "invalid --nproc-per-node '0'; accepted: an integer >= 1, or auto, cpu, gpu, xpu"),
        (
            ["--nproc-per-node", "two"],
            "invalid --nproc-per-node 'two'; accepted: an integer >= 1, or auto, cpu, gpu, xpu",
        ),
        (["--nnodes", "0"], "invalid --nnodes '0'; accepted: an integer >= 1, or MIN:MAX with 1 <= MIN <= MAX"),
        (["--nnodes", "3:2"], "invalid --nnodes '3:2'; accepted: an integer >= 1, or MIN:MAX with 1 <= MIN <= MAX"),
        (["--max-restarts", "-1"], "invalid --max-restarts -1; accepted: an integer >= 0"),
    ],
)
def test_torchruns_counts_are_checked_with_one_line_where_torchrun_asserts(capsys, flags, expected):
    from trainaccel.launch.run import main

    assert main([*flags, "--dry-run", "train.py"]) == 2
    assert capsys.readouterr().err == f"trainaccel run: error: {expected}\n"


@pytest.mark.parametrize("flags", [["--nproc-per-node", "auto"], ["--nproc-per-node", "3", "--nnodes", "1:2"]])
def test_torchruns_accepted_counts_pass(capsys, flags):
    from trainaccel.launch.run import main

    assert main([*flags, "--dry-run", "train.py"]) == 0


@pytest.mark.parametrize(
    "backend, lost, warned", [("c10d", "continue", True), ("static", "continue", False), ("c10d", "stop", False)]
)
def test_restarts_under_a_dynamic_rendezvous_say_that_every_node_restarts(caplog, backend, lost, warned):
    """Under on_lost_replica=continue, torchrun's c10d rendezvous restarts the survivors too when one node restarts."""
    from trainaccel.launch.run import main

    rendezvous = ["--rdzv-backend", backend, "--rdzv-endpoint", "127.0.0.1:29400", "--nnodes", "2"]
    options = ["--sync-every", "4", "--on-lost-replica", lost, "--max-restarts", "1"]
    assert main([*rendezvous, *options, "--dry-run", "train.py"]) == 0
    said = [r.getMessage() for r in caplog.records if "--max-restarts with --rdzv-backend" in r.getMessage()]
    assert len(said) == warned
    if warned:
        assert said[0].startswith("--max-restarts with --rdzv-backend c10d: when a node's agent restarts its workers")
