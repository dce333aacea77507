"""Reply settings, defined once: the acceptance modes, the one mapping from temperature and rule to a reply's
mode, and every generation option (name, default, check, help, command-line flags).

Names, one per idea:

- ``accept``: the rule a user picks for temperature > 0, one of `ACCEPT_MODES` (the `--accept` flag, the
  `/accept` command, the web page's radio, `GenerationSettings.accept`);
- ``accept_mode``: the rule a reply actually uses, one of `MODES`: `GREEDY` at temperature 0, else ``accept``
  (`accept_mode()`, `GenerationSettings.accept_mode`, `ReplySummary.accept_mode`, an acceptor's `accept_mode`);
- ``typical_epsilon`` / ``typical_delta``: the typical rule's two parameters (the reference implementation
  calls them posterior_threshold and posterior_alpha).

Every entry point takes its options from `OPTIONS`: chat, ask, bench and serve add their flags with
`cliargs.add_generation_args` (which ones: `ENTRY_OPTIONS`), the web page's controls and the OpenAI API's
request defaults read the same table, and calibrate's measuring replies are greedy (`GenerationSettings`'
defaults, no flags). An entry point whose default differs on purpose says so in its option's `defaults`.

No torch, no UI: `events.GenerationSettings`, the engine, the UIs and the server all import this module.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The DRY multiplier of the app's replies (chat, ask, the web page, bench with no flags): at 0.8, allowed length 4,
# 1 of 40 Vicuna-bench replies of 512 tokens ends in a loop (9 with none), and 2.4% of the greedy tokens of
# held-out text change (benchmarks/RESULTS.md, 2026-12-07)
DRY_DEFAULT = 0.8

# ---- acceptance modes ----------------------------------------------------------------------------------------
GREEDY = "greedy"  # temperature 0: a node is accepted when it is its parent's argmax (already exact)
TYPICAL = "typical"  # the Medusa paper's typical acceptance: fast, favours the heads' guesses
EXACT = "exact"  # distribution-preserving: the reply has the law of plain sampling
ACCEPT_MODES = (TYPICAL, EXACT)  # the rules a user picks for temperature > 0
MODES = (GREEDY, *ACCEPT_MODES)  # every rule a reply can use
DEFAULT_ACCEPT = TYPICAL
# The default repeat penalty (1: off). Measured (benchmarks/RESULTS.md, 2026-12-07): 1.1 over the last 64 tokens
# changed a quarter of the greedy tokens of held-out text, and the embedded model's capped Vicuna-bench replies
# measured then ended in no loop for it to remove.
REPEAT_PENALTY = 1.0


@dataclass(frozen=True)
class ModeText:
    """How the UIs name a mode and what they say it guarantees."""

    label: str  # the mode's name in prose: "typical acceptance"
    headline: str  # the label with its promise, where the UIs give the mode in one line
    guarantee: str  # what the reply is, in one line (the terminal's /accept)
    detail: str  # the same for the web page's note under the headline


MODE_TEXT: dict[str, ModeText] = {
    GREEDY: ModeText(
        "greedy",
        "greedy: identical to plain decoding",
        "identical to plain greedy decoding",
        "the reply is plain greedy decoding, token for token",
    ),
    TYPICAL: ModeText(
        "typical acceptance",
        "typical acceptance",
        "faster, but favours the heads' guesses: not the model's exact sampling distribution",
        "fast, but favours the heads' guesses: not the model's exact sampling distribution",
    ),
    EXACT: ModeText(
        "exact sampling",
        "exact sampling: same distribution as plain sampling",
        "same distribution as plain sampling (same seed, fp32: same reply as the plain loop)",
        "the reply follows the model's own sampling distribution (up to float rounding)",
    ),
}
ACCEPT_CHOICES = "|".join(ACCEPT_MODES)  # "typical|exact", as usage lines write it
ACCEPT_HELP = (
    f"rule at temperature > 0: {TYPICAL} (the paper's, default: fast, favours the heads' guesses) or "
    f"{EXACT} (replies keep the model's own sampling distribution)"
)
ACCEPT_SHORT_HELP = f"{TYPICAL}: faster, favours the heads' guesses; {EXACT}: the model's own distribution"


def accept_mode(temperature: float | None, accept: str | None = DEFAULT_ACCEPT) -> str:
    """The rule a reply uses: `GREEDY` at temperature 0 (or none given), else the rule picked for temperature
    > 0 (`DEFAULT_ACCEPT` when none was picked). The one place that says "temperature 0 means greedy"."""
    if not temperature or temperature <= 0:
        return GREEDY
    return accept or DEFAULT_ACCEPT


# ---- generation options ----------------------------------------------------------------------------------------
def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _number(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"not a finite number: {value!r}")
    return number


def _whole(value: Any) -> int:
    """An integer setting from a number or its text; a fraction is refused, not truncated."""
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"not an integer: {value!r}")
    return int(value)


def _seed(value: Any) -> int | None:
    """A seed, or None for a new seed each reply: none, nothing, or a negative number (the web page's -1)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"not an integer: {value!r}")
    seed = int(value)
    return None if seed < 0 else seed


def _strings(value: Any) -> tuple[str, ...]:
    """Stop strings: one string or a list of them (the API's `stop` takes either)."""
    if isinstance(value, str):
        return (value,)
    return tuple(str(s) for s in value)


def _lowercase_word(value: Any) -> str:
    return str(value).strip().lower()


def _switch(value: Any) -> bool:
    """A yes/no setting from a bool or the words people type (on/off, true/false, 1/0, yes/no)."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in ("on", "true", "1", "yes"):
        return True
    if word in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"expected on or off, got {value!r}")


@dataclass(frozen=True)
class Option:
    """One generation option: a `GenerationSettings` field and everything every entry point needs of it."""

    name: str  # the field, the session's and the web page's setting name
    default: Any
    help: str  # for --help (argparse expands %(default)s)
    check: Callable[[Any], bool]  # True for a good value
    valid: str  # what a good value is, for the error message ("must be <valid>")
    parse: Callable[[Any], Any]  # a typed or sent value (slash command, web control) as the field's type
    flags: tuple[str, ...] = ()  # command-line flags, the first the main one; () for options without any
    type: Callable[[str], Any] | None = None  # argparse type of the flags' value
    choices: tuple[str, ...] | None = None
    switch_off: bool = False  # the flag takes no value and turns the option off (--no-context-lookup)
    # an entry point whose default differs on purpose -> its default
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # the OpenAI-compatible API: the request's names for this option, and its bounds where they are narrower
    # than `check` (OpenAI's own); () for an option a request cannot set
    api_names: tuple[str, ...] = ()
    api_bounds: tuple[float | None, float | None] = (None, None)

    def default_for(self, entry: str) -> Any:
        return self.defaults.get(entry, self.default)

    def error(self, value: Any, name: str | None = None) -> str | None:
        """The message for a bad value, None for a good one (`name`: what the caller calls the option)."""
        return None if self.check(value) else f"{name or self.name} must be {self.valid} (got {value!r})"

    def api_error(self, value: Any, name: str) -> str | None:
        """`error` for a request's value, with the API's own bounds on top (`name`: the request's name)."""
        message = self.error(value, name)
        lo, hi = self.api_bounds
        if message is None and ((lo is not None and value < lo) or (hi is not None and value > hi)):
            within = " and ".join(f"{op} {b:g}" if isinstance(b, float) else f"{op} {b}"
                                  for op, b in ((">=", lo), ("<=", hi)) if b is not None)  # fmt: skip
            message = f"{name} must be {within} (got {value!r})"
        return message


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option(
            "max_new_tokens",
            512,
            "max new tokens per reply (default: %(default)s)",
            lambda v: _integer(v) and v >= 1,
            ">= 1",
            int,
            flags=("--max-new-tokens",),
            type=int,
            # bench: short replies, many prompts; API: no limit but the context window (None), as OpenAI's
            defaults={"bench": 128, "api": None},
            api_names=("max_completion_tokens", "max_tokens"),  # OpenAI's current name, its older alias
            api_bounds=(None, 2**31 - 1),
        ),
        Option(
            "temperature",
            0.0,
            "0 = greedy (default: %(default)s), > 0 = sampling (rule: --accept)",
            lambda v: _finite(v) and v >= 0,
            ">= 0",
            _number,
            flags=("--temperature", "--temp"),
            type=float,
            defaults={"api": 1.0},  # OpenAI's default when a request leaves it out
            api_names=("temperature",),
            api_bounds=(None, 2.0),  # OpenAI's range is [0, 2]
        ),
        Option(
            "top_p",
            1.0,
            "nucleus sampling at temperature > 0 (default: %(default)s)",
            lambda v: _finite(v) and 0 < v <= 1,
            "in (0, 1]",
            _number,
            flags=("--top-p",),
            type=float,
            api_names=("top_p",),
        ),
        Option(
            "typical_epsilon",
            0.09,
            "typical acceptance: a guess is kept when its probability exceeds min(epsilon, delta * exp(-H))",
            lambda v: _finite(v) and 0 <= v <= 1,
            "in [0, 1]",
            _number,
        ),
        Option(
            "typical_delta",
            0.3,
            "typical acceptance: delta in min(epsilon, delta * exp(-H))",
            lambda v: _finite(v) and 0 <= v <= 1,
            "in [0, 1]",
            _number,
        ),
        Option(
            "seed",
            None,
            "sampling seed at temperature > 0, so a reply can be repeated (default: %(default)s)",
            lambda v: v is None or _integer(v),
            "an integer or None",
            _seed,
            flags=("--seed",),
            type=int,
            defaults={"bench": 0},  # a sampled bench run is repeatable by default
            api_names=("seed",),
            api_bounds=(-(2**63), 2**64 - 1),  # OpenAI's: a 64-bit integer, either sign
        ),
        Option(
            "stop_strings",
            (),
            "the reply ends before the first of these strings (the API's `stop`)",
            lambda v: isinstance(v, (tuple, list)) and all(isinstance(s, str) for s in v),
            "a tuple of strings",
            _strings,
            api_names=("stop",),
        ),
        Option(
            "accept",
            DEFAULT_ACCEPT,
            ACCEPT_HELP,
            lambda v: v in ACCEPT_MODES,
            " or ".join(repr(m) for m in ACCEPT_MODES),
            _lowercase_word,
            flags=("--accept",),
            choices=ACCEPT_MODES,
        ),
        Option(
            "context_lookup",
            True,
            "Medusa without context-lookup guesses on the main chain (heads only)",
            lambda v: isinstance(v, bool),
            "on or off",
            _switch,
            flags=("--no-context-lookup",),
            switch_off=True,
        ),
        Option(
            "top_k",
            0,
            "sample only among the K most likely tokens at temperature > 0 (0: off; default: %(default)s)",
            lambda v: _integer(v) and v >= 0,
            ">= 0",
            _whole,
            flags=("--top-k",),
            type=int,
            api_names=("top_k",),
            api_bounds=(None, 2**31 - 1),
        ),
        Option(
            "min_p",
            0.0,
            "drop tokens below min_p x the top token's probability at temperature > 0 (0: off; default: "
            "%(default)s)",
            lambda v: _finite(v) and 0 <= v <= 1,
            "in [0, 1]",
            _number,
            flags=("--min-p",),
            type=float,
            api_names=("min_p",),
        ),
        Option(
            "repeat_penalty",
            REPEAT_PENALTY,
            "divide the logit of a token among the last --repeat-last-n ones by this (multiply when negative; 1: "
            "off; default: %(default)s)",
            lambda v: _finite(v) and v > 0,
            "> 0",
            _number,
            flags=("--repeat-penalty",),
            type=float,
            api_names=("repeat_penalty",),
        ),
        Option(
            "repeat_last_n",
            64,
            "the repeat penalty's window: the context's last N tokens, the prompt's included (-1: the whole "
            "context, 0: off; default: %(default)s)",
            lambda v: _integer(v) and v >= -1,
            ">= -1",
            _whole,
            flags=("--repeat-last-n",),
            type=int,
            api_names=("repeat_last_n",),
            api_bounds=(None, 2**31 - 1),
        ),
        Option(
            "presence_penalty",
            0.0,
            "subtract this from the logit of every token the reply has used (OpenAI's; default: %(default)s)",
            lambda v: _finite(v) and -2 <= v <= 2,
            "in [-2, 2]",
            _number,
            flags=("--presence-penalty",),
            type=float,
            api_names=("presence_penalty",),
        ),
        Option(
            "frequency_penalty",
            0.0,
            "subtract this x the token's count in the reply from its logit (OpenAI's; default: %(default)s)",
            lambda v: _finite(v) and -2 <= v <= 2,
            "in [-2, 2]",
            _number,
            flags=("--frequency-penalty",),
            type=float,
            api_names=("frequency_penalty",),
        ),
        Option(
            "dry_multiplier",
            0.0,
            "DRY: penalise the token that would extend a repeated run of text by multiplier x base ^ (run "
            "length - allowed length) (0: off; default: %(default)s)",
            lambda v: _finite(v) and v >= 0,
            ">= 0",
            _number,
            flags=("--dry-multiplier",),
            type=float,
            # The app's replies: on, mildly (measured: docs/sampling.md#repetition-controls); the engine itself,
            # the API (OpenAI's requests know no DRY, and llama-server's is off too) and calibration: off
            defaults={entry: DRY_DEFAULT for entry in ("chat", "ask", "bench")},
            api_names=("dry_multiplier",),
        ),
        Option(
            "dry_base",
            1.75,
            "DRY: the penalty's growth per repeated token (default: %(default)s)",
            lambda v: _finite(v) and v >= 1,
            ">= 1",
            _number,
            flags=("--dry-base",),
            type=float,
            api_names=("dry_base",),
        ),
        Option(
            "dry_allowed_length",
            4,  # llama.cpp's is 2: 4 leaves common short phrases alone and still stops loops (measured)
            "DRY: repeated runs up to this many tokens go unpenalised (default: %(default)s)",
            lambda v: _integer(v) and v >= 1,
            ">= 1",
            _whole,
            flags=("--dry-allowed-length",),
            type=int,
            api_names=("dry_allowed_length",),
            api_bounds=(None, 2**31 - 1),
        ),
        Option(
            "dry_sequence_breakers",
            ("\n", ":", '"', "*"),
            "DRY: a repeated run never crosses a token containing one of these strings",
            lambda v: isinstance(v, (tuple, list)) and all(isinstance(s, str) and s for s in v),
            "a tuple of non-empty strings",
            _strings,
            api_names=("dry_sequence_breakers",),
        ),
    )
}

# the repetition controls (engine/penalties.py) and the truncation samplers beside top_p
PENALTY_OPTIONS = (
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
)
SAMPLER_OPTIONS = ("top_k", "min_p")
REPLY_OPTIONS = (  # what a reply's user picks
    "temperature", "max_new_tokens", "top_p", "seed", "accept", *SAMPLER_OPTIONS, *PENALTY_OPTIONS,
)  # fmt: skip
# The generation options each entry point takes on its command line. The web page sets them in its controls, the
# OpenAI API per request (temperature, top_p, seed, max_tokens, stop) over the server's --accept; calibrate's
# measuring replies are greedy with the defaults.
ENTRY_OPTIONS: dict[str, tuple[str, ...]] = {
    "chat": REPLY_OPTIONS,
    "ask": REPLY_OPTIONS,
    "bench": (*REPLY_OPTIONS, "context_lookup"),
    "serve": ("accept",),
    "web": (),
    "calibrate": (),
}
# Entry points whose options change the session's settings only where given: their flags default to None.
OVERRIDE_ONLY = frozenset({"chat"})


def parse_settings(changes: Mapping[str, Any]) -> dict[str, Any]:
    """Setting changes as given (a flag's value, a slash command's text, a web control's value) in their
    fields' types, each checked by its option: the one place a setting's value is converted and checked. An
    unknown name, a value of the wrong kind or a bad value raises MedusaChatError."""
    from medusa_chat.errors import MedusaChatError

    parsed: dict[str, Any] = {}
    for name, value in changes.items():
        option = OPTIONS.get(name)
        if option is None:
            raise MedusaChatError(f"unknown setting {name!r} (known: {', '.join(OPTIONS)})")
        try:
            parsed[name] = option.parse(value)
        except (TypeError, ValueError, OverflowError):
            raise MedusaChatError(f"bad value for {name}: {value!r}") from None
        message = option.error(parsed[name])
        if message is not None:
            raise MedusaChatError(message)
    return parsed


def parse_request_value(option: str, value: Any, name: str) -> Any:
    """A setting as a JSON request sends it (the OpenAI API; `name`: the request's name for it), converted and
    checked here as every other entry point's values are: first the wire's kind (a JSON number, an integer or
    a list of non-empty strings, never text to convert nor `true` for 1), then the option's check with the API's
    bounds (Option.api_error). Raises ValueError with the message a 400 answer carries."""
    o = OPTIONS[option]
    if o.parse is _strings:
        if not (isinstance(value, list) and all(isinstance(s, str) and s for s in value)):
            raise ValueError(f"{name} must be a list of non-empty strings")
        return o.parse(value)
    if o.parse in (int, _whole, _seed):
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # some clients send 100.0
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {json.dumps(value)}")
    else:
        # bool is an int in Python, but `"temperature": true` is a client bug worth reporting
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {json.dumps(value)}")
        try:
            value = float(value)
        except OverflowError:  # an integer literal too large for a float
            value = math.inf
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number")
    message = o.api_error(value, name)
    if message is not None:
        raise ValueError(message)
    return value


def defaults_for(entry: str) -> dict[str, Any]:
    """Every option's default at `entry` ("api" for the OpenAI API's requests)."""
    return {name: o.default_for(entry) for name, o in OPTIONS.items()}


__all__ = [
    "DRY_DEFAULT",
    "ACCEPT_CHOICES",
    "ACCEPT_HELP",
    "ACCEPT_MODES",
    "ACCEPT_SHORT_HELP",
    "DEFAULT_ACCEPT",
    "ENTRY_OPTIONS",
    "EXACT",
    "GREEDY",
    "MODES",
    "MODE_TEXT",
    "OPTIONS",
    "OVERRIDE_ONLY",
    "PENALTY_OPTIONS",
    "REPEAT_PENALTY",
    "REPLY_OPTIONS",
    "SAMPLER_OPTIONS",
    "TYPICAL",
    "ModeText",
    "Option",
    "accept_mode",
    "defaults_for",
    "parse_request_value",
    "parse_settings",
]
