"""`trainaccel.init` takes one typed keyword per Config option, written from Config by tools/init_signature.py."""

import dataclasses
import importlib.util
import inspect
import os
import pydoc
from pathlib import Path

import pytest

import trainaccel
from trainaccel.config import Config

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("init_signature", ROOT / "tools" / "init_signature.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_written_part_is_up_to_date():
    tool = _tool()
    text = tool.PACKAGE_INIT.read_text()
    written = text[text.index(tool.BEGIN) : text.index(tool.END) + len(tool.END)]
    assert written == tool.render(), "run: python tools/init_signature.py"


def test_every_option_is_a_keyword_in_configs_order_defaulting_to_none():
    params = inspect.signature(trainaccel.init).parameters
    names = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert names == ["start_process_group", *Config.option_names()]
    assert all(params[n].default is None for n in Config.option_names())
    assert params["start_process_group"].default is True
    assert [p.kind for p in params.values()][-1] is inspect.Parameter.VAR_KEYWORD


def test_help_lists_every_option_with_what_it_accepts_and_its_default():
    text = " ".join(pydoc.render_doc(trainaccel.init, renderer=pydoc.plaintext).split())
    for f in dataclasses.fields(Config):
        accepted = " ".join(f.metadata["parse"].accepted.split())
        shown = "empty" if f.default is None else str(f.default)
        assert f"{f.name}: " in text and f"Accepted: {accepted}; default: {shown}." in text, f.name


@pytest.mark.parametrize(
    ("keywords", "env", "expected"),
    [
        ({}, {}, Config()),
        ({"compression": "fp16"}, {}, Config(compression="fp16")),
        ({}, {"TRAINACCEL_COMPRESSION": "bf16"}, Config(compression="bf16")),
        ({"compression": "fp16"}, {"TRAINACCEL_COMPRESSION": "bf16"}, Config(compression="fp16")),
        ({"compression": None}, {"TRAINACCEL_COMPRESSION": "bf16"}, Config(compression="bf16")),
        ({"sync_every": "auto", "outer_compression": "int8"}, {}, Config(sync_every="auto", outer_compression="int8")),
        ({"compile": True, "nan_check": True}, {}, Config(compile="on", nan_check="raise")),
    ],
)
def test_a_keyword_wins_over_the_environment_and_none_leaves_it(monkeypatch, keywords, env, expected):
    for name in [k for k in os.environ if k.startswith("TRAINACCEL_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        assert trainaccel.init(start_process_group=False, **keywords) == expected
    finally:
        trainaccel.shutdown()


def test_a_misspelt_keyword_names_the_closest_option():
    with pytest.raises(TypeError, match=r"\['sync_evry'\] \(did you mean sync_every\?\)"):
        trainaccel.init(start_process_group=False, sync_evry=4)
