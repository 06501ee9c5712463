import subprocess
import sys

import pytest

from trainaccel.environment import is_distributed, map_mpi_env


def test_open_mpi_variables_map_to_torch_names():
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    added = map_mpi_env(env)
    assert added == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert env["RANK"] == "3" and is_distributed(env)


def test_pmi_variables_map_and_torch_variables_win():
    env = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "WORLD_SIZE": "4"}
    assert map_mpi_env(env) == {"RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    env = {"RANK": "0", "OMPI_COMM_WORLD_RANK": "5"}
    map_mpi_env(env)
    assert env["RANK"] == "0"


def test_no_launcher_variables_means_single_process():
    env = {"PATH": "/bin"}
    assert map_mpi_env(env) == {} and not is_distributed(env)


@pytest.mark.multiprocess
def test_import_is_light_and_patches_nothing():
    code = (
        "import sys, trainaccel; "
        "assert 'torch' not in sys.modules, 'import trainaccel loaded torch'; "
        "from torch.nn.parallel import DistributedDataParallel as D; "
        "assert D.__init__.__module__ == 'torch.nn.parallel.distributed', D.__init__.__module__"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
