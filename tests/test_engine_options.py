"""runtime/options.py: every command's engine flags are EngineOptions' fields, and they reach
`open_model` as one EngineOptions."""

import dataclasses

import pytest

from colibri.cli import build_parser
from colibri.runtime.expert_store import IO_MODES, POLICIES
from colibri.runtime.kv_cache import KV_KINDS
from colibri.runtime.options import EngineOptions, OptionError, engine_options, flag_name

FIELDS = {f.name: f for f in dataclasses.fields(EngineOptions)}
# each command that opens a model: an argv it parses, and the options it sets itself
COMMANDS = {
    "run": (["run", "--model", "M", "--prompt", "hi"], {}),
    "serve": (["serve", "--model", "M"], {}),
    "smoke": (["smoke", "M", "--record", "B.json"], {"ctx": 1024}),
    "imatrix": (["imatrix", "M", "--text", "T", "-o", "O"], {}),
    "perplexity": (["perplexity", "M", "--text", "T"], {"ctx": 512, "parallel": 4}),
}


def engine_flags(command: str) -> dict:
    """The argparse actions of `command`'s engine flags, by option name."""
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    return {a.dest: a for a in subparsers.choices[command]._actions
            if a.dest in FIELDS and f"--{flag_name(a.dest)}" in a.option_strings}


@pytest.mark.parametrize("command", COMMANDS)
def test_each_flag_is_its_option(command):
    argv, fixed = COMMANDS[command]
    flags = engine_flags(command)
    assert {"threads", "ram_budget", "expert_cache", "kv_quant"} <= set(flags)
    for name, action in flags.items():
        meta = FIELDS[name].metadata
        assert action.help == meta["help"], name
        assert action.choices == meta["choices"], name
        assert action.default == fixed.get(name, FIELDS[name].default), name
    args = build_parser().parse_args(argv)
    assert engine_options(args, command) == EngineOptions(**fixed)


def test_the_choices_are_the_runtimes():
    assert FIELDS["kv_quant"].metadata["choices"] == KV_KINDS
    assert FIELDS["cache_policy"].metadata["choices"] == tuple(POLICIES)
    assert FIELDS["io"].metadata["choices"] == tuple(IO_MODES)
    assert set(engine_flags("run")) == set(FIELDS)  # run and serve take every option
    assert set(engine_flags("serve")) == set(FIELDS)


def test_flags_set_their_options():
    args = build_parser().parse_args(["run", "--model", "M", "--prompt", "hi", "--kv-quant", "q8_0", "--parallel", "3",
                                      "--prefetch", "on", "--ram-budget", "8G", "--direct-io", "--cache-policy", "lfru"])
    assert engine_options(args, "run") == EngineOptions(kv_quant="q8_0", parallel=3, prefetch=True, ram_budget=8 << 30,
                                                        io="direct", cache_policy="lfru")


@pytest.mark.parametrize("change, message", [({"parallel": 0}, "--parallel must be at least 1, got 0"),
                                             ({"kv_quant": "q4"}, "--kv-quant 'q4' unknown"),
                                             ({"threads": -1}, "--threads must be at least 1")])
def test_an_option_out_of_range_is_refused_naming_its_flag(change, message):
    with pytest.raises(OptionError, match=message):
        EngineOptions(**change)


def test_a_flag_out_of_range_exits_with_one_line(capsys):
    args = build_parser().parse_args(["serve", "--model", "M", "--parallel", "0"])
    with pytest.raises(SystemExit, match="^colibri serve: error: --parallel must be at least 1, got 0$"):
        engine_options(args, "serve")
