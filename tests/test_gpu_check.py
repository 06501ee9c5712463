"""`tools/gpu-check` on a machine without CUDA ends at once with one line and status 2; its report-reading logic."""

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

from conftest import run

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "gpu-check"
NO_GPU = "gpu-check: no CUDA device"


def load_tool():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = load_tool()
HAS_GPU_FILES = any(os.path.exists(p) for p in gpu_check.DEVICE_FILES)


@pytest.mark.multiprocess
@pytest.mark.skipif(HAS_GPU_FILES, reason="this machine has GPU device files: tools/gpu-check would run its pass")
def test_without_a_gpu_it_ends_at_once_with_one_line(tmp_path):
    began = time.monotonic()
    proc = run([TOOL, "--out", tmp_path / "report"], env={"PYTHON": sys.executable}, timeout=60)
    took = time.monotonic() - began
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith(NO_GPU) and lines[0].endswith("run it on a GPU machine"), lines
    assert took < 2.0, f"took {took:.1f} s"
    assert not (tmp_path / "report").exists()  # no report: nothing ran


@pytest.mark.multiprocess
def test_a_torch_without_cuda_is_told_in_one_line_too(monkeypatch, capsys, tmp_path):
    # GPU device files present (as on a GPU machine) but this torch sees no CUDA: asked of torch itself.
    if gpu_check.cuda_probe()[0]:
        pytest.skip("this torch sees a CUDA device")
    monkeypatch.setattr(gpu_check, "DEVICE_FILES", (str(tmp_path),))
    assert gpu_check.main(["--out", str(tmp_path / "report")]) == gpu_check.EXIT_NO_GPU
    out, err = capsys.readouterr()
    lines = (out + err).splitlines()
    assert len(lines) == 1 and lines[0].startswith(NO_GPU) and "torch.cuda.is_available() is False" in lines[0]
    assert not (tmp_path / "report").exists()


def test_a_bad_stage_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--stages", "env,warp-drive"])
    assert exit_info.value.code == gpu_check.EXIT_USAGE
    assert "invalid --stages 'env,warp-drive'" in capsys.readouterr().err


def test_a_stage_whose_dependency_is_missing_is_skipped_saying_which(tmp_path):
    check = gpu_check.Pass(gpu_check.parse_args(["--allow-cpu", "--out", str(tmp_path)]))
    check.missing = {"rich": "ModuleNotFoundError: No module named 'rich'"}
    check.stage("overlap")  # skipped before anything starts
    stage = check.report["stages"]["overlap"]
    assert stage["status"] == "skipped" and "needs rich" in stage["summary"] and "wheel" in stage["summary"]
    assert (tmp_path / "gpu-report.json").exists() and (tmp_path / "gpu-report.md").exists()


def test_the_report_goes_under_OUT_when_it_is_set(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.parse_args([]).out == tmp_path / "gpu-report"
    monkeypatch.delenv("OUT")
    assert gpu_check.parse_args([]).out == Path("gpu-report")
    assert gpu_check.parse_args(["--out", "x"]).out == Path("x")


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="2" failures="1" skipped="1" tests="5">
<testcase classname="" name="tests.data.test_pack" time="0.0"><error message="collection failure">ImportError while
importing test module. E   ModuleNotFoundError: No module named 'PIL'</error></testcase>
<testcase classname="" name="tests.test_broken" time="0.0"><error message="collection failure">E   RuntimeError:
CUDA error: no kernel image is available</error></testcase>
<testcase classname="tests.gpu.test_cuda_codecs" name="test_round_trip[fp4]" time="0.1"><failure
message="RuntimeError: indices should be either on cpu or on the same device&#10;second line">trace</failure></testcase>
<testcase classname="tests.gpu.test_cuda_codecs" name="test_round_trip[int8]" time="0.1" />
<testcase classname="tests.gpu.test_cuda_codecs" name="test_exchange[nccl]" time="0.0"><skipped
message="NCCL needs CUDA" type="pytest.skip">skip</skipped></testcase>
</testsuite></testsuites>
"""


def test_junit_results_tell_missing_modules_from_failures(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    result = gpu_check.read_junit(path)
    assert result["counts"] == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert result["not_collected"] == [("tests.data.test_pack", "PIL")]  # an optional dependency: not a failure
    assert result["failures"] == [
        {"test": "tests.test_broken", "message": "RuntimeError:"},  # a collection error of another kind is one
        {
            "test": "tests/gpu/test_cuda_codecs::test_round_trip[fp4]",
            "message": "RuntimeError: indices should be either on cpu or on the same device",
        },
    ]
    assert result["skip_reasons"] == {"NCCL needs CUDA": 1}


def test_one_option_result_from_every_rank():
    ok = {"option": "fp16", "event": "done", "rank": 0, "ok": True, "first_loss": 1.0, "final_loss": 0.5}
    failed = {"option": "fp16", "event": "done", "rank": 1, "ok": False, "error": "RuntimeError: x", "where": "w"}
    log = "gpu-check option fp16 begin\n[W] Warning: called a synchronizing CUDA operation (f)\ngpu-check option fp16 end\n"
    merged = gpu_check.merge_ranks({0: ok, 1: failed}, log)
    assert merged["ok"] is False and merged["error"] == "rank 1: RuntimeError: x" and merged["where"] == "w"
    assert merged["first_loss"] == 1.0 and merged["cpp_syncs"] == 1
    assert gpu_check.merge_ranks({0: ok}, "")["ok"] is True


def test_the_summary_renders_a_partial_report():
    report = {
        "mode": "gpu",
        "started": "now",
        "seconds": 12.0,
        "stages": {
            "env": {"status": "passed", "seconds": 1, "summary": "torch 2.11", "details": {"torch": {"version": "2"}}},
            "options": {
                "status": "failed",
                "seconds": 9,
                "summary": "1/2 options ran",
                "details": {
                    "defaults": {"ok": True, "first_loss": 1.0, "final_loss": 0.5, "syncs": [], "cpp_syncs": 0},
                    "fp16": {
                        "ok": False,
                        "error": "RuntimeError: boom",
                        "where": "trainaccel/comm/codecs.py:1 (compress)",
                        "syncs": [
                            {"thread": "main", "trainaccel_frame": None, "innermost_frame": "x.py:1 (f)", "count": 2}
                        ],
                    },
                },
            },
        },
    }
    text = gpu_check.render(report)
    assert "| b. every option, world 1 (NCCL) | failed | 9 | 1/2 options ran |" in text
    assert "**RuntimeError: boom** at trainaccel/comm/codecs.py:1 (compress)" in text
    assert "2x main: - <- x.py:1 (f)" in text
