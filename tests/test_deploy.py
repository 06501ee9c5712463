"""deploy/: the Dockerfile and the Kubernetes manifests carry the fields a 2-node x 8-GPU job needs.

The image is not built here (no Docker, no GPU); the launch commands go through `trainaccel run --dry-run`.
"""

import re
import shlex
from pathlib import Path

import yaml

from trainaccel.launch.run import main as run_main

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
NODES, GPUS = 2, 8


def _load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / "kubernetes" / name).read_text())


def _pod(replica: dict) -> tuple[dict, dict]:
    spec = replica["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


def _assert_gpu_pod_with_shared_memory(spec: dict, container: dict) -> None:
    assert container["resources"]["limits"]["nvidia.com/gpu"] == GPUS
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"


def _dry_run(args: list[str], capsys) -> str:
    assert run_main(["--dry-run", *args]) == 0
    return capsys.readouterr().out


def test_the_dockerfile_installs_cuda_torch_and_trainaccel_and_starts_trainaccel_run():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-cudnn-runtime-", text, re.M)
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX=https://download.pytorch.org/whl/cu\d+$", text, re.M)
    assert 'pip install --no-cache-dir "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"' in text
    assert re.search(r'^RUN pip install --no-cache-dir "/opt/trainaccel\[data,embedding\]"$', text, re.M)
    assert re.search(r'^ENTRYPOINT \["trainaccel", "run"\]$', text, re.M)
    assert "openssh-server" in text  # the MPIJob workers run sshd from this image


def test_the_pytorchjob_runs_one_trainaccel_run_per_node(capsys):
    job = _load("pytorchjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == NODES
    images, argvs = set(), []
    for role in ("Master", "Worker"):
        spec, container = _pod(replicas[role])
        assert container["name"] == "pytorch" and "command" not in container  # the image's entry point: trainaccel run
        _assert_gpu_pod_with_shared_memory(spec, container)
        images.add(container["image"])
        argvs.append(container["args"])
    assert len(images) == 1 and not images.pop().endswith(":latest")
    assert argvs[0] == argvs[1]
    env = {"RANK": "1", "MASTER_ADDR": "trainaccel-resnet50-master-0", "MASTER_PORT": "23456"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in argvs[0]]
    out = _dry_run(args, capsys)
    assert f"--nnodes {NODES} --nproc-per-node {GPUS} --node-rank 1 --master-addr trainaccel-resnet50-master-0" in out
    assert out.rstrip().endswith("trainaccel.launch.bootstrap /workspace/train.py")


def test_the_mpijob_launcher_reaches_every_gpu_of_its_workers(tmp_path, capsys):
    job = _load("mpijob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    spec = job["spec"]
    assert spec["slotsPerWorker"] == GPUS and spec["mpiReplicaSpecs"]["Worker"]["replicas"] == NODES
    _, launcher = _pod(spec["mpiReplicaSpecs"]["Launcher"])
    worker_spec, worker = _pod(spec["mpiReplicaSpecs"]["Worker"])
    assert (
        launcher["image"]
        == worker["image"]
        == _pod(_load("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]["Master"])[1]["image"]
    )
    assert worker["command"] == ["/usr/sbin/sshd", "-De"]
    _assert_gpu_pod_with_shared_memory(worker_spec, worker)
    assert launcher["command"] == ["trainaccel", "run"]
    args = launcher["args"]
    assert args[args.index("-np") + 1] == str(NODES * GPUS)
    # The hostfile as the operator writes it, at a path of ours.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(
        "".join(f"trainaccel-resnet50-mpi-worker-{i}.trainaccel-resnet50-mpi slots={GPUS}\n" for i in range(NODES))
    )
    assert args[args.index("--hostfile") + 1] == "/etc/mpi/hostfile"
    args[args.index("--hostfile") + 1] = str(hostfile)
    out = _dry_run(args, capsys)
    for i in range(NODES):
        assert f"# node {i}: trainaccel-resnet50-mpi-worker-{i}.trainaccel-resnet50-mpi, {GPUS} processes" in out
    ssh_lines = [shlex.split(line) for line in out.splitlines() if line.startswith("ssh ")]
    assert len(ssh_lines) == NODES and all("--nproc-per-node 8" in line[-1] for line in ssh_lines)
