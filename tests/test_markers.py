"""The `multiprocess` marker is enforced (see conftest.py): a test that starts a process without it fails, naming it.

Each test here runs pytest in this process (pytester) on a small test file, with conftest.py as a plugin.
"""

import pytest

import conftest

INI = """
[pytest]
addopts = --strict-markers
markers =
    multiprocess: starts other processes
"""

UNMARKED = """
import multiprocessing
import subprocess
import sys

import pytest

from conftest import run, run_checks, run_nodes


def test_subprocess():
    subprocess.run([sys.executable, "-c", "pass"])


def test_run():
    run([sys.executable, "-c", "pass"])


def test_run_nodes():
    run_nodes("script.py")


def test_run_checks(tmp_path):
    run_checks("checks.py", tmp_path, 2)


def test_multiprocessing():
    multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.fixture(scope="module")
def launched():
    subprocess.run([sys.executable, "-c", "pass"])


def test_module_fixture(launched):
    pass


def test_in_process():
    pass
"""

MARKED = """
import subprocess
import sys

import pytest

from conftest import run

pytestmark = pytest.mark.multiprocess


def test_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_run():
    assert run([sys.executable, "-c", "print('ran')"]).stdout == "ran\\n"
"""


@pytest.fixture(autouse=True)
def only_the_named_plugins(monkeypatch):
    """The runs inside load conftest.py alone: an installed plugin may start a process while pytest configures
    (pytest-benchmark runs git), inside this file's unmarked tests."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def test_an_unmarked_test_that_starts_a_process_fails_before_starting_it(pytester):
    pytester.makeini(INI)
    pytester.makepyfile(test_unmarked=UNMARKED)
    result = pytester.runpytest_inprocess("-p", "conftest")
    result.assert_outcomes(passed=1, failed=5, errors=1)
    result.stdout.fnmatch_lines_random(
        [
            f"*test_unmarked.py::{test} starts a process ({what}* but is not marked multiprocess: "
            "add @pytest.mark.multiprocess to the test*"
            for test, what in [
                ("test_subprocess", "subprocess "),
                ("test_run", "conftest.run: "),
                ("test_run_nodes", "conftest.run_nodes: 2 torchrun launches of script.py"),
                ("test_run_checks", "conftest.run_checks: 2 workers of checks.py"),
                ("test_multiprocessing", "multiprocessing "),
                ("test_module_fixture", "subprocess "),
            ]
        ]
    )


def test_the_check_reads_the_running_tests_marker(request):
    with pytest.raises(
        pytest.fail.Exception,
        match=r"test_markers.py::test_the_check_reads_the_running_tests_marker starts a process \(a worker\) but is not marked multiprocess",
    ):
        conftest.require_multiprocess("a worker")
    request.node.add_marker(pytest.mark.multiprocess)
    conftest.require_multiprocess("a worker")


@pytest.mark.multiprocess
def test_a_marked_test_starts_processes(pytester):
    pytester.makeini(INI)
    pytester.makepyfile(test_marked=MARKED)
    pytester.runpytest_inprocess("-p", "conftest").assert_outcomes(passed=2)
