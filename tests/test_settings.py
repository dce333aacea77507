"""Reply settings are defined once (medusa_chat/settings.py): every entry point's parser takes its generation
options from that one definition and yields the same settings for the same arguments; the modes' names and
labels live there alone; temperature 0 means greedy in one function."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
from pathlib import Path

import pytest

from medusa_chat import cli, settings
from medusa_chat.cliargs import settings_from_args
from medusa_chat.errors import MedusaChatError
from medusa_chat.events import GenerationSettings
from medusa_chat.settings import (
    DRY_DEFAULT,
    ENTRY_OPTIONS,
    EXACT,
    GREEDY,
    OPTIONS,
    OVERRIDE_ONLY,
    PENALTY_OPTIONS,
    SAMPLER_OPTIONS,
    TYPICAL,
)

PACKAGE = Path(settings.__file__).parent
ENTRY_POINTS = ("chat", "ask", "bench", "serve", "web", "calibrate")
PROMPT = {"ask": ["hello"]}  # positional arguments an entry point needs


def _parse(entry: str, *argv: str) -> argparse.Namespace:
    return cli.build_parser(entry).parse_args([entry, *argv, *PROMPT.get(entry, [])])


def _actions(entry: str) -> dict[str, argparse.Action]:
    """The entry point's sub-parser actions, by dest."""
    parser = cli.build_parser(entry)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[entry]._actions}


def test_every_field_is_an_option_with_its_default() -> None:
    fields = dataclasses.fields(GenerationSettings)
    assert [f.name for f in fields] == list(OPTIONS)
    assert {f.name: f.default for f in fields} == {n: o.default for n, o in OPTIONS.items()}
    GenerationSettings().validate()  # the defaults pass their own checks
    for entry in (*ENTRY_POINTS, "api"):
        for name, option in OPTIONS.items():
            value = option.default_for(entry)
            assert value is None or option.check(value), (entry, name)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_each_entry_point_declares_exactly_its_options_from_the_definition(entry: str) -> None:
    actions = _actions(entry)
    all_flags = {flag for o in OPTIONS.values() for flag in o.flags}
    declared = {flag for a in actions.values() for flag in a.option_strings if flag in all_flags}
    assert declared == {flag for name in ENTRY_OPTIONS[entry] for flag in OPTIONS[name].flags}
    for name in ENTRY_OPTIONS[entry]:
        action, option = actions[name], OPTIONS[name]
        assert tuple(action.option_strings) == option.flags
        assert action.default == (None if entry in OVERRIDE_ONLY else option.default_for(entry))
        assert action.choices == option.choices
        assert action.help is not None and option.help.split("(")[0] in action.help


ARGS = ["--temperature", "0.7", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "40", "--accept", "exact"]


def test_every_entry_point_yields_the_same_settings_for_the_same_arguments() -> None:
    given = {"max_new_tokens": 40, "temperature": 0.7, "top_p": 0.9, "seed": 3, "accept": EXACT}
    for entry in ("chat", "ask", "bench"):
        # over the entry's own defaults (the app's DRY included): chat's flags change its session's settings
        app = GenerationSettings.for_entry(entry)
        assert app.dry_multiplier == DRY_DEFAULT
        base = app if entry in OVERRIDE_ONLY else None
        want = dataclasses.replace(app, **given)
        assert settings_from_args(_parse(entry, *ARGS), base) == want, entry
        assert settings_from_args(_parse(entry, "--temp", "0.7", *ARGS[2:]), base) == want, entry
        off = settings_from_args(_parse(entry, *ARGS, "--dry-multiplier", "0"), base)
        assert off == dataclasses.replace(want, dry_multiplier=0.0), entry
    # serve takes the rule only (a request brings the rest), the web page and calibrate none
    assert settings_from_args(_parse("serve", "--accept", EXACT)) == GenerationSettings(accept=EXACT)
    for entry in ("web", "calibrate"):
        assert settings_from_args(_parse(entry)) == GenerationSettings()
    with pytest.raises(SystemExit):
        _parse("ask", "--accept", "lossless")


def test_defaults_that_differ_per_entry_point_are_the_definitions() -> None:
    app = GenerationSettings(dry_multiplier=DRY_DEFAULT)  # the app's replies: mild DRY on
    assert settings_from_args(_parse("chat")) == GenerationSettings()  # no flag given: nothing changed
    assert GenerationSettings.for_entry("chat") == app  # the session's (chat's and the web page's) defaults
    assert settings_from_args(_parse("ask")) == app
    assert settings_from_args(_parse("serve")) == GenerationSettings()  # a request brings its own settings
    bench = settings_from_args(_parse("bench"))
    assert bench == dataclasses.replace(app, max_new_tokens=128, seed=0)  # short replies, seeded sampling
    from medusa_chat.bench.harness import BenchConfig

    assert BenchConfig().settings == bench
    # the OpenAI API samples at temperature 1 unless the request says otherwise, and runs to the context window
    from medusa_chat.openai.protocol import ChatRequest

    request = ChatRequest(model="m", messages=[])
    assert (request.temperature, request.top_p, request.max_tokens) == (1.0, 1.0, None)
    assert request.temperature == OPTIONS["temperature"].default_for("api")


def test_bad_values_fail_before_any_load() -> None:
    with pytest.raises(MedusaChatError, match=r"temperature must be >= 0 \(got -1.0\)"):
        settings_from_args(_parse("ask", "--temperature", "-1"))
    with pytest.raises(MedusaChatError, match=r"top_p must be in \(0, 1\]"):
        settings_from_args(_parse("bench", "--top-p", "0"))
    with pytest.raises(MedusaChatError, match="max_new_tokens must be >= 1"):
        settings_from_args(_parse("chat", "--max-new-tokens", "0"))
    with pytest.raises(MedusaChatError, match="accept must be 'typical' or 'exact'"):
        GenerationSettings(accept="lossless").validate()
    with pytest.raises(MedusaChatError, match="typical_epsilon must be in"):
        GenerationSettings(typical_epsilon=2.0).validate()


def test_one_mapping_from_temperature_and_rule_to_the_mode() -> None:
    for temperature in (0, 0.0, -0.0, None):
        for accept in (*settings.ACCEPT_MODES, None):
            assert settings.accept_mode(temperature, accept) == GREEDY
    assert settings.accept_mode(0.7) == TYPICAL == settings.DEFAULT_ACCEPT
    assert settings.accept_mode(0.7, EXACT) == EXACT
    assert GenerationSettings(temperature=0.7, accept=EXACT).accept_mode == EXACT
    assert set(settings.MODE_TEXT) == set(settings.MODES) == {GREEDY, TYPICAL, EXACT}


def test_the_mode_names_are_written_only_where_the_modes_are_defined() -> None:
    """No module but settings.py spells a mode's name as a string literal: the others use the constants."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value == TYPICAL:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, f"the literal {TYPICAL!r} outside medusa_chat/settings.py: {found}"


def test_typed_values_are_parsed_by_their_option() -> None:
    """What a slash command or a web control sends, in the field's type (the session's update_settings)."""
    from medusa_chat.settings import parse_settings

    parsed = parse_settings(
        {"temperature": "0.5", "max_new_tokens": 40.0, "seed": "none", "accept": " Exact ", "context_lookup": "off"}
    )
    assert parsed == {"temperature": 0.5, "max_new_tokens": 40, "seed": None, "accept": EXACT, "context_lookup": False}
    assert parse_settings({"seed": "7", "stop_strings": ["a"]}) == {"seed": 7, "stop_strings": ("a",)}
    with pytest.raises(MedusaChatError, match="bad value for temperature"):
        parse_settings({"temperature": "nan"})
    with pytest.raises(MedusaChatError, match="bad value for context_lookup"):
        parse_settings({"context_lookup": "maybe"})
    with pytest.raises(MedusaChatError, match="unknown setting 'temp'"):
        parse_settings({"temp": 1})


def test_parsing_checks_each_value_by_its_option() -> None:
    """parse_settings is where a value is both converted and checked: a bad value fails there, named."""
    from medusa_chat.settings import parse_settings

    with pytest.raises(MedusaChatError, match=r"temperature must be >= 0 \(got -1.0\)"):
        parse_settings({"temperature": "-1"})
    with pytest.raises(MedusaChatError, match="typical_epsilon must be in"):
        parse_settings({"typical_epsilon": "1.5"})
    with pytest.raises(MedusaChatError, match="accept must be 'typical' or 'exact'"):
        parse_settings({"accept": "lossless"})
    with pytest.raises(MedusaChatError, match="max_new_tokens must be >= 1"):
        parse_settings({"max_new_tokens": "0"})
    with pytest.raises(MedusaChatError, match="bad value for seed"):
        parse_settings({"seed": 2.5})
    with pytest.raises(MedusaChatError, match="bad value for max_new_tokens"):
        parse_settings({"max_new_tokens": float("inf")})


def test_seed_and_stop_strings_take_every_form_an_entry_point_sends() -> None:
    from medusa_chat.settings import parse_settings

    # the web page's number control sends floats, -1 for "a new seed each reply"; /seed none; --seed -1
    for none in (None, "", "none", " None ", -1, -1.0, "-1"):
        assert parse_settings({"seed": none}) == {"seed": None}, none
    assert parse_settings({"seed": 42.0}) == {"seed": 42}
    # one string is one stop string (as the API's `stop`), not its characters
    assert parse_settings({"stop_strings": "END"}) == {"stop_strings": ("END",)}
    assert parse_settings({"stop_strings": ["a", "bc"]}) == {"stop_strings": ("a", "bc")}
    assert parse_settings({"stop_strings": ()}) == {"stop_strings": ()}


def test_command_line_values_go_through_the_same_parsing() -> None:
    assert settings_from_args(_parse("ask", "--seed", "-1")).seed is None
    assert settings_from_args(_parse("bench", "--no-context-lookup")).context_lookup is False


def test_every_option_the_session_takes_is_parsed_by_the_definition() -> None:
    """The session's update_settings takes every option, the ones no flag sets too (typical_epsilon,
    typical_delta, stop_strings), each converted and checked by settings.parse_settings alone."""
    from medusa_chat.chat.session import SessionManager

    session = SessionManager(auto_calibrate=False)
    new = session.update_settings(
        typical_epsilon="0.2", typical_delta=0.5, stop_strings="###", seed=-1.0, context_lookup="off"
    )
    assert (new.typical_epsilon, new.typical_delta, new.stop_strings, new.seed, new.context_lookup) == (
        0.2, 0.5, ("###",), None, False,
    )  # fmt: skip
    before = session.settings
    for bad in ({"typical_delta": "2"}, {"temperature": "warm"}, {"posterior_threshold": 0.1}):
        with pytest.raises(MedusaChatError):
            session.update_settings(**bad)
        assert session.settings is before  # unchanged
    source = (PACKAGE / "chat" / "session.py").read_text(encoding="utf-8")
    assert "parse_settings" in source and "isfinite" not in source


def test_the_api_takes_its_names_and_bounds_from_the_definitions() -> None:
    """The OpenAI-compatible API's request names map to the options; OpenAI's narrower bounds are declared
    with them, and the request parser checks each value with its option."""
    from medusa_chat.openai.protocol import APIError, parse_chat_request

    names = {n: o.name for o in OPTIONS.values() for n in o.api_names}
    assert names == {
        "max_completion_tokens": "max_new_tokens",
        "max_tokens": "max_new_tokens",
        "temperature": "temperature",
        "top_p": "top_p",
        "seed": "seed",
        "stop": "stop_strings",
        **{name: name for name in (*SAMPLER_OPTIONS, *PENALTY_OPTIONS, "dry_sequence_breakers")},
    }
    assert OPTIONS["temperature"].api_error(2.5, "temperature") == "temperature must be <= 2 (got 2.5)"
    assert OPTIONS["temperature"].api_error(-1.0, "temperature") == "temperature must be >= 0 (got -1.0)"
    assert OPTIONS["max_new_tokens"].api_error(0, "max_tokens") == "max_tokens must be >= 1 (got 0)"
    assert OPTIONS["top_p"].api_error(1.0, "top_p") is None
    assert OPTIONS["seed"].api_error(2**64, "seed") == f"seed must be >= {-(2**63)} and <= {2**64 - 1} (got {2**64})"
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "seed": 3}'
    request = parse_chat_request(body)
    assert (request.temperature, request.seed) == (0.5, 3)

    for field, value in (("temperature", "2.5"), ("top_p", "0"), ("max_tokens", "0"), ("seed", str(2**64))):
        raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})[:-1] + f', "{field}": {value}}}'
        with pytest.raises(APIError) as info:
            parse_chat_request(raw.encode())
        assert info.value.param == field and info.value.message.startswith(f"{field} must be"), info.value.message


def test_the_configuration_page_lists_every_option_and_flag() -> None:
    page = (PACKAGE.parent / "docs" / "configuration.md").read_text(encoding="utf-8")
    table = page[page.index("## Reply settings") :]
    for name, option in OPTIONS.items():
        assert f"`{name}`" in table, name
        for flag in option.flags:
            assert f"`{flag}" in table, flag
