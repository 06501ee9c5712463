import pytest
from torch.nn.parallel import DistributedDataParallel

import trainaccel
from trainaccel import runtime


@pytest.fixture
def clean(monkeypatch, trainaccel_messages):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name in list(__import__("os").environ):
        if name.startswith("TRAINACCEL_"):
            monkeypatch.delenv(name)
    original = DistributedDataParallel.__init__
    yield trainaccel_messages
    trainaccel.shutdown()
    assert DistributedDataParallel.__init__ is original and runtime.current_config() is None


def test_init_is_idempotent_and_logs_the_config_once(clean):
    original = DistributedDataParallel.__init__
    config = trainaccel.init(compression="fp16")
    assert config.compression == "fp16" and runtime.current_config() == config
    patched = DistributedDataParallel.__init__
    assert patched is not original and patched.__wrapped__ is original
    assert trainaccel.init(compression="fp16") == config
    assert DistributedDataParallel.__init__ is patched  # not wrapped twice
    assert [m for m in clean if m.startswith("trainaccel config")] == [f"trainaccel config: {config.describe()}"]
    assert "compression=fp16" in config.describe().split()


def test_init_with_new_options_updates_the_config(clean, monkeypatch):
    monkeypatch.setenv("TRAINACCEL_NAN_CHECK", "warn")
    monkeypatch.setenv("TRAINACCEL_COMPRESION", "fp16")
    monkeypatch.setenv("TRAINACCEL_UNKNOWN_ENV", "warn")  # reported, not refused
    assert trainaccel.init().nan_check == "warn"
    assert trainaccel.init(nan_check="raise").nan_check == "raise"  # keyword beats env
    assert runtime.current_config().nan_check == "raise"
    assert sum(m.startswith("trainaccel config") for m in clean) == 2
    said = "ignoring TRAINACCEL_COMPRESION is not a trainaccel option (did you mean TRAINACCEL_COMPRESSION?)"
    assert said in clean


def test_init_refuses_a_misspelt_env_option_naming_the_closest(clean, monkeypatch):
    """A misspelt option would train without it, silently: refused in one line, before anything is patched."""
    monkeypatch.setenv("TRAINACCEL_COMPRESION", "fp16")
    original = DistributedDataParallel.__init__
    with pytest.raises(trainaccel.ConfigError) as raised:
        trainaccel.init()
    assert str(raised.value) == (
        "TRAINACCEL_COMPRESION is not a trainaccel option (did you mean TRAINACCEL_COMPRESSION?); set "
        "TRAINACCEL_UNKNOWN_ENV=warn to ignore it"
    )
    assert DistributedDataParallel.__init__ is original
    with pytest.raises(
        TypeError, match=r"unknown trainaccel option\(s\) \['compresion'\] \(did you mean compression\?\)"
    ):
        trainaccel.init(compresion="fp16")


def test_init_rejects_bad_values_without_patching(clean):
    original = DistributedDataParallel.__init__
    with pytest.raises(trainaccel.ConfigError, match=r"invalid compression='zip' \(from keyword\)"):
        trainaccel.init(compression="zip")
    with pytest.raises(
        trainaccel.ConfigError, match=r"invalid compression_ratio=0 \(from keyword\); accepted: a number in \(0, 1\]"
    ):
        trainaccel.init(compression="topk", compression_ratio=0)
    with pytest.raises(
        trainaccel.ConfigError, match=r"invalid powersgd_rank=0 \(from keyword\); accepted: an integer >= 1"
    ):
        trainaccel.init(compression="powersgd", powersgd_rank=0)
    assert DistributedDataParallel.__init__ is original


def test_under_torchrun_an_env_group_is_keyed_by_the_attempt_until_shutdown(clean, monkeypatch):
    import importlib
    from datetime import timedelta

    import torch.distributed as dist

    from conftest import free_port

    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    original = handlers["env"]
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    env = {"TORCHELASTIC_RESTART_COUNT": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in {**env, "RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)
    trainaccel.init(start_process_group=False)
    assert handlers["env"] is not original
    store, rank, world = next(dist.rendezvous("env://"))
    store.set("addresses", "attempt 3's")
    # A restarted group's keys do not meet the last attempt's: they live under the attempt's prefix.
    assert server.check(["trainaccel/attempt3/addresses"]) and not server.check(["addresses"])
    trainaccel.shutdown()
    assert handlers["env"] is original
