import pytest

from trainaccel.config import Config, ConfigError, env_setting


def test_defaults():
    c = Config.resolve(env={})
    assert (c.compression, c.hierarchical, c.bucket_mb, c.nan_check, c.log_level) == (
        "none",
        "auto",
        None,
        "off",
        "info",
    )


def test_precedence_keyword_over_flag_over_env():
    env = {"TRAINACCEL_COMPRESSION": "bf16", "TRAINACCEL_BUCKET_MB": "8", "TRAINACCEL_NAN_CHECK": "warn"}
    c = Config.resolve(env=env, flags={"compression": "fp16", "bucket_mb": None}, nan_check="raise")
    assert c.compression == "fp16"  # flag beats env
    assert c.bucket_mb == 8.0  # env beats default when no flag is given
    assert c.nan_check == "raise"  # keyword beats env
    assert Config.resolve(env=env, flags={"compression": "fp16"}, compression="none").compression == "none"


def test_values_are_normalised():
    c = Config.resolve(env={"TRAINACCEL_COMPRESSION": " FP16 "}, hierarchical=True, bucket_mb="2.5")
    assert (c.compression, c.hierarchical, c.bucket_mb) == ("fp16", "on", 2.5)
    described = Config.resolve(env={}, hierarchical=False, nan_check=True).describe().split()
    assert "hierarchical=off" in described and "nan_check=raise" in described


@pytest.mark.parametrize(
    "kwargs, env, flags, expected",
    [
        (
            {},
            {"TRAINACCEL_COMPRESSION": "zip"},
            {},
            "invalid compression='zip' (from TRAINACCEL_COMPRESSION); accepted: none, fp16, bf16, topk, randomk, powersgd",
        ),
        ({"compression_ratio": 0}, {}, {}, "invalid compression_ratio=0 (from keyword); accepted: a number in (0, 1]"),
        (
            {},
            {},
            {"compression_ratio": "1.5"},
            "invalid compression_ratio='1.5' (from --compression-ratio); accepted: a number in (0, 1]",
        ),
        (
            {},
            {"TRAINACCEL_POWERSGD_RANK": "0"},
            {},
            "invalid powersgd_rank='0' (from TRAINACCEL_POWERSGD_RANK); accepted: an integer >= 1",
        ),
        ({"powersgd_rank": 2.5}, {}, {}, "invalid powersgd_rank=2.5 (from keyword); accepted: an integer >= 1"),
        (
            {"fp16_scale": "inf"},
            {},
            {},
            "invalid fp16_scale='inf' (from keyword); accepted: auto, dynamic, peak, or a number > 0 (a fixed scale)",
        ),
        (
            {"compression_momentum": -0.1},
            {},
            {},
            "invalid compression_momentum=-0.1 (from keyword); accepted: auto, or a number in [0, 1]",
        ),
        ({"local_steps": "0"}, {}, {}, "invalid local_steps='0' (from keyword); accepted: an integer >= 1"),
        (
            {},
            {"TRAINACCEL_INTRA_COMPRESSION": "topk"},
            {},
            "invalid intra_compression='topk' (from TRAINACCEL_INTRA_COMPRESSION); accepted: none, fp16, bf16",
        ),
        ({"autotune": "maybe"}, {}, {}, "invalid autotune='maybe' (from keyword); accepted: off, on"),
        ({}, {}, {"bucket_mb": "-1"}, "invalid bucket_mb='-1' (from --bucket-mb); accepted: a number > 0 (MiB)"),
        ({"bucket_mb": 0}, {}, {}, "invalid bucket_mb=0 (from keyword); accepted: a number > 0 (MiB)"),
        ({"bucket_mb": "abc"}, {}, {}, "invalid bucket_mb='abc' (from keyword); accepted: a number > 0 (MiB)"),
        (
            {},
            {"TRAINACCEL_HIERARCHICAL": "maybe"},
            {},
            "invalid hierarchical='maybe' (from TRAINACCEL_HIERARCHICAL); accepted: auto, on, off",
        ),
        ({"nan_check": "loud"}, {}, {}, "invalid nan_check='loud' (from keyword); accepted: off, warn, raise"),
        (
            {"on_lost_replica": "continue", "compression": "fp16"},
            {},
            {},
            "invalid compression='fp16'; accepted: none with on_lost_replica=continue without sync_every (its "
            "exchange among the replicas present is exact; sync_every carries outer codecs)",
        ),
        (
            {"on_lost_replica": "continue", "hierarchical": "on"},
            {},
            {},
            "invalid hierarchical='on'; accepted: auto, off with on_lost_replica=continue without sync_every (its "
            "exchange is flat)",
        ),
        (
            {"on_lost_replica": "continue", "local_steps": 2},
            {},
            {},
            "invalid local_steps=2; accepted: 1 with on_lost_replica=continue without sync_every (use the script's "
            "no_sync())",
        ),
        (
            {"on_lost_replica": "continue", "autotune": "on"},
            {},
            {},
            "invalid autotune='on'; accepted: off with on_lost_replica=continue without sync_every (it times DDP's "
            "reductions)",
        ),
        (
            {"on_lost_replica": "continue", "nan_check": "warn"},
            {},
            {},
            "invalid nan_check='warn'; accepted: off with on_lost_replica=continue without sync_every (it checks "
            "trainaccel's per-step hook)",
        ),
        (
            {"on_lost_replica": "continue", "timeline": "t.json"},
            {},
            {},
            "invalid timeline='t.json'; accepted: empty with on_lost_replica=continue without sync_every (it traces "
            "trainaccel's per-step hook)",
        ),
        (
            {"on_lost_replica": "continue", "sync_every": 4, "shard": "hybrid"},
            {},
            {},
            "invalid on_lost_replica='continue'; accepted: stop with shard=hybrid (a sharded replica's workers "
            "exchange at every step)",
        ),
        (
            {},
            {"TRAINACCEL_ON_LOST_REPLICA": "pause"},
            {},
            "invalid on_lost_replica='pause' (from TRAINACCEL_ON_LOST_REPLICA); accepted: stop, continue",
        ),
        (
            {},
            {"TRAINACCEL_LOG_LEVEL": "chatty"},
            {},
            "invalid log_level='chatty' (from TRAINACCEL_LOG_LEVEL); accepted: debug, info, warning, error",
        ),
        ({"amp": "fp8"}, {}, {}, "invalid amp='fp8' (from keyword); accepted: off, bf16, fp16, on, O0, O1"),
        ({}, {}, {"compile": "fast"}, "invalid compile='fast' (from --compile); accepted: off, on"),
        (
            {},
            {"TRAINACCEL_COMPILE_PRESET": "turbo"},
            {},
            "invalid compile_preset='turbo' (from TRAINACCEL_COMPILE_PRESET); accepted: default, reduce-overhead, max-autotune",
        ),
        (
            {"amp_policy": "loss"},
            {},
            {},
            "invalid amp_policy='loss' (from keyword); accepted: always, auto[:setting=value,...] or time[:setting=value,...]; here: mode 'loss' needs its value at every call, before the first step too: use it through the API",
        ),
        (
            {},
            {"TRAINACCEL_AMP_POLICY": "auto:hold=x"},
            {},
            "invalid amp_policy='auto:hold=x' (from TRAINACCEL_AMP_POLICY); accepted: always, auto[:setting=value,...] or time[:setting=value,...]; here: invalid hold='x'; accepted: an integer",
        ),
        (
            {"amp_policy": "time:start=5,end=2"},
            {},
            {},
            "invalid amp_policy='time:start=5,end=2' (from keyword); accepted: always, auto[:setting=value,...] or time[:setting=value,...]; here: invalid end=2; accepted: None (to the end of training) or an integer >= start (5)",
        ),
    ],
)
def test_invalid_values_name_option_value_source_and_accepted(kwargs, env, flags, expected):
    with pytest.raises(ConfigError) as info:
        Config.resolve(env=env, flags=flags, **kwargs)
    assert str(info.value) == expected
    assert "\n" not in str(info.value)


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="compression"):
        Config(compression="gzip")
    with pytest.raises(ConfigError, match="bucket_mb"):
        Config(bucket_mb=float("inf"))


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="compresion"):
        Config.resolve(env={}, compresion="fp16")


def test_unknown_env_names_are_reported():
    env = {"TRAINACCEL_COMPRESION": "fp16", "TRAINACCEL_NAN_CHECK": "warn", "OTHER": "1"}
    assert Config.unknown_env(env) == ["TRAINACCEL_COMPRESION"]


def test_unknown_env_knows_settings_that_are_not_options():
    env = {"TRAINACCEL_ELASTIC_DIR": "/tmp/commits", "TRAINACCEL_COMPRESION": "fp16"}
    assert Config.unknown_env(env) == ["TRAINACCEL_COMPRESION"]
    assert env_setting("elastic_dir", env) == "/tmp/commits"
    assert env_setting("elastic_dir", {"TRAINACCEL_ELASTIC_DIR": ""}) is None
    with pytest.raises(KeyError, match="elastic_dri"):
        env_setting("elastic_dri", env)


def test_to_env_of_some_options():
    c = Config.resolve(env={}, compression="bf16", bucket_mb=4)
    assert c.to_env(["compression", "timeline"]) == {"TRAINACCEL_COMPRESSION": "bf16", "TRAINACCEL_TIMELINE": ""}
    assert c.to_env([]) == {}
    assert c.to_env() == c.to_env(Config.option_names())
    with pytest.raises(TypeError, match="compresion"):
        c.to_env(["compresion"])


def test_to_env_round_trips():
    c = Config.resolve(env={}, compression="bf16", bucket_mb=4, nan_check="warn")
    assert Config.resolve(env=c.to_env()) == c
    assert Config.resolve(env=Config().to_env()) == Config()


def test_names_match_across_code_cli_and_env():
    for name in Config.option_names():
        assert Config.env_name(name) == "TRAINACCEL_" + name.upper()
        assert Config.flag_name(name) == "--" + name.replace("_", "-")


def test_amp_levels_and_switches_normalise():
    assert Config.resolve(env={"TRAINACCEL_AMP": "O1"}).amp == "on"
    assert Config.resolve(env={}, amp="o0").amp == "off"
    described = Config.resolve(env={}, amp=True, compile=True).describe().split()
    wanted = ["amp=on", "compile=on"]  # the line names what differs from the defaults only
    assert [
        item for item in described if item.split("=")[0] in ("amp", "amp_policy", "compile", "compile_preset")
    ] == wanted
    assert Config.resolve(env={}, amp_policy=" Always ").amp_policy == "always"
    assert Config.resolve(env={}, amp_policy="auto:hold=50").amp_policy == "auto:hold=50"


def test_option_flags_parse_with_the_script_after_a_bare_switch():
    import argparse

    parser = argparse.ArgumentParser()
    Config.add_arguments(parser)
    parser.add_argument("script")
    args = parser.parse_args(["--compile", "train.py"])
    assert args.script == "train.py" and Config.flags_from(args)["compile"] == "on"
    args = parser.parse_args(["--amp-level", "O1", "--amp_policy", "auto", "--compile-preset", "max-autotune", "t.py"])
    flags = Config.flags_from(args)
    assert (flags["amp"], flags["amp_policy"], flags["compile_preset"], flags["compile"]) == (
        "O1",
        "auto",
        "max-autotune",
        None,
    )
