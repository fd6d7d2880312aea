"""argparse flags generated from the config dataclasses in `ladle/config.py`.

Every field of a component config (`COMPONENTS` plus `ServerConfig`) carries `metadata["flag"]` (vLLM's
flag name where vLLM has one) and `metadata["help"]`. Types come from the field annotation:
bool -> `--flag/--no-flag` (argparse.BooleanOptionalAction, as vLLM), int -> int (with vLLM's human-readable
suffixes for the token/byte counts: 1k = 1000, 1K = 1024, 2G = 2**31), float -> float, a tuple/list of ints ->
one or more ints (`--cuda-graph-sizes 1 8 32`, nargs="+", stored as a tuple), else str. A flag without dashes
(`model`) is an optional positional argument. Values with a fixed set of choices (the backends) are checked by
config resolution, not by argparse, so a vLLM value ladle lacks gets a message naming what ladle offers.

A real vLLM flag (`ladle/data/vllm_serve_flags.txt`) that ladle does not implement fails with
"not supported yet: FLAG" instead of argparse's usage dump.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from importlib import resources
from typing import Any, Optional

from ladle.config import COMPONENTS, EngineConfig, ServerConfig

# Fields that accept vLLM's human-readable integers (vllm/engine/arg_utils.py: human_readable_ints).
_HUMAN_READABLE = {"max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"}
_SERVER = "server"


class UnsupportedFlagError(SystemExit):
    """A vLLM flag ladle does not implement yet: prints the message, exits with status 2 (like argparse)."""

    def __init__(self, message: str):
        sys.stderr.write(message + "\n")
        super().__init__(2)
        self.message = message


def human_readable_int(value: str) -> int:
    """'1k' -> 1000, '1K' -> 1024, '25.6k' -> 25600, '2G' -> 2 * 2**30, '123' -> 123 (vLLM's rules).

    Raises argparse.ArgumentTypeError on anything else.
    """
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        decimal = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
        binary = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        if suffix in decimal:
            return int(float(number) * decimal[suffix])
        if "." in number:
            raise argparse.ArgumentTypeError(f"decimals are not allowed with binary suffix {suffix}: {value}")
        return int(number) * binary[suffix]
    try:
        return int(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from e


def _base_type(annotation: Any) -> str:
    """'bool' | 'int' | 'float' | 'str' | 'ints' from a (string) annotation such as 'Optional[int]' or
    'tuple[int, ...]' ('ints': a sequence of ints)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if re.match(r"(tuple|list)\[int\b", text):
        return "ints"
    for name in ("bool", "int", "float"):
        if re.search(rf"\b{name}\b", text):
            return name
    return "str"


def config_fields() -> list[tuple[str, dataclasses.Field]]:
    """(component name, field) for every flag-carrying field, in declaration order."""
    out = []
    for comp, cls in list(COMPONENTS.items()) + [(_SERVER, ServerConfig)]:
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                out.append((comp, f))
    return out


def _default(f: dataclasses.Field) -> Any:
    """The field's default value (calling its default_factory if it has one)."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def _shown_default(f: dataclasses.Field) -> Any:
    """The default as help and the README show it (a sequence of ints space-separated, as typed)."""
    default = _default(f)
    return " ".join(map(str, default)) if _base_type(f.type) == "ints" else default


def _dest(comp: str, f: dataclasses.Field) -> str:
    return f"{comp}__{f.name}"


def add_config_args(parser: argparse.ArgumentParser, include_server: bool = True) -> None:
    """Add one argument per config field (default: the dataclass default), with vLLM's short aliases
    (`-tp` for `--tensor-parallel-size`) where vLLM has them. `include_server=False` leaves out the HTTP flags
    (host, port, api key) for commands that serve nothing."""
    aliases: dict[str, list[str]] = {}
    for name, canonical in load_vllm_flags().items():
        if name != canonical and not name.startswith("--"):
            aliases.setdefault(canonical, []).append(name)
    for comp, f in config_fields():
        if comp == _SERVER and not include_server:
            continue
        flag, help_text = f.metadata["flag"], f.metadata["help"]
        default = _default(f)
        kind = _base_type(f.type)
        if not flag.startswith("-"):
            parser.add_argument(_dest(comp, f), nargs="?", default=default, metavar=flag.upper(), help=help_text)
            continue
        shown = help_text if "default" in help_text else f"{help_text} (default: {_shown_default(f)})"
        kw: dict[str, Any] = {"dest": _dest(comp, f), "default": default, "help": shown}
        if kind != "bool":
            kw["metavar"] = f.name.upper()
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif kind == "int":
            kw["type"] = human_readable_int if f.name in _HUMAN_READABLE else int
        elif kind == "float":
            kw["type"] = float
        elif kind == "ints":
            kw.update(type=int, nargs="+", metavar="N")
        parser.add_argument(flag, *aliases.get(flag, []), **kw)


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Build the frozen configs from a namespace produced by a parser with `add_config_args`."""
    values: dict[str, dict[str, Any]] = {comp: {} for comp in list(COMPONENTS) + [_SERVER]}
    for comp, f in config_fields():
        default = _default(f)
        value = getattr(args, _dest(comp, f), default)
        values[comp][f.name] = tuple(value) if _base_type(f.type) == "ints" else value
    engine = EngineConfig(**{comp: cls(**values[comp]) for comp, cls in COMPONENTS.items()})
    return engine, ServerConfig(**values[_SERVER])


def load_vllm_flags() -> dict[str, str]:
    """vLLM's `vllm serve` flags -> canonical name, including aliases and `--no-` forms of bool flags."""
    text = resources.files("ladle").joinpath("data/vllm_serve_flags.txt").read_text()
    flags: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        canonical = parts[0]
        for name in parts:
            if name == "[bool]":
                flags["--no-" + canonical[2:]] = "--no-" + canonical[2:]
            else:
                flags[name] = canonical
    return flags


def vllm_flags_version() -> str:
    """The header line naming the vLLM version the flag list came from."""
    text = resources.files("ladle").joinpath("data/vllm_serve_flags.txt").read_text()
    return text.splitlines()[0].lstrip("# ").strip()


# vLLM flags that ask for what ladle always does, or that concern features ladle lacks by design (remote code);
# accepted and ignored so a pasted vLLM recipe keeps working. Value-taking ones consume their value.
NO_OP_VLLM_FLAGS = {
    "--enable-chunked-prefill": "chunked prefill is always on in ladle",
    "--no-enable-chunked-prefill": None,  # turning it off is a real change: reported as not supported
    "--disable-log-requests": "ladle does not log request contents",
    "--disable-log-stats": "ladle logs no periodic stats",
    "--trust-remote-code": "ladle never runs model repository code (configs are parsed as plain JSON)",
    "--disable-uvicorn-access-log": "accepted; access logs follow --uvicorn-log-level",
}


def strip_no_op_flags(argv: list[str]) -> list[str]:
    """Drop the NO_OP_VLLM_FLAGS (bare form or `--flag=true`) with a one-line note each; other tokens unchanged."""
    out: list[str] = []
    for token in argv:
        name, _, value = token.partition("=")
        note = NO_OP_VLLM_FLAGS.get(name)
        if note and value.lower() in ("", "true", "1"):
            print(f"ladle: ignoring {name}: {note}", file=sys.stderr)
            continue
        out.append(token)
    return out


def check_unsupported(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Exit with "not supported yet: FLAG" for a known vLLM flag that `parser` does not define."""
    known = set(parser._option_string_actions)  # every option string the parser accepts
    vllm = load_vllm_flags()
    for token in argv:
        if token == "--":
            break
        if not token.startswith("-") or token in ("-", "-h", "--help"):
            continue
        name = token.split("=", 1)[0]
        if name in known:
            continue
        # argparse also accepts unambiguous prefixes; only exact vLLM names are reported here.
        if name in vllm or name.replace("_", "-") in vllm:
            raise UnsupportedFlagError(
                f"{parser.prog}: error: not supported yet: {name} "
                f"(a `vllm serve` flag, {vllm_flags_version().split(' `')[0]}, that ladle does not implement; "
                f"see `{parser.prog} --help` for the supported flags)"
            )


def flags_markdown() -> str:
    """The README's flags table, generated from the config fields."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for comp, f in config_fields():
        flag = f.metadata["flag"]
        default = _shown_default(f)
        if _base_type(f.type) == "bool" and flag.startswith("--"):
            flag = f"{flag} / --no-{flag[2:]}"
        if not flag.startswith("-"):
            flag = f"{flag.upper()} (positional)"
        rows.append(f"| `{flag}` | `{default}` | {f.metadata['help']} |")
    return "\n".join(rows)


def parse_serve_args(parser: argparse.ArgumentParser, argv: list[str]) -> Optional[argparse.Namespace]:
    """check_unsupported then parse; argparse's own errors (bad values, unknown flags) stay as they are."""
    argv = strip_no_op_flags(argv)
    check_unsupported(parser, argv)
    return parser.parse_args(argv)
