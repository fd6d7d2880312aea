"""argparse flags generated from the config dataclasses in `ladle/config.py`.

Every field of a component config (`COMPONENTS` plus `ServerConfig`) carries `metadata["flag"]` (vLLM's
flag name where vLLM has one) and `metadata["help"]`. Types come from the field annotation:
bool -> `--flag/--no-flag` (argparse.BooleanOptionalAction, as vLLM), int -> int (with vLLM's human-readable
suffixes for the token/byte counts: 1k = 1000, 1K = 1024, 2G = 2**31), float -> float, a tuple/list of ints ->
one or more ints (`--cuda-graph-sizes 1 8 32`, nargs="+", stored as a tuple), else str. A flag without dashes
(`model`) is an optional positional argument. Values with a fixed set of choices (the backends) are checked by
config resolution, not by argparse, so a vLLM value ladle lacks gets a message naming what ladle offers.

A real vLLM flag (`ladle/data/vllm_serve_flags.txt`, regenerated from a vLLM release) that ladle does not
implement is refused with "not supported yet: FLAG" and what ladle offers instead, never argparse's usage dump.
`collect_refusals` gathers every such refusal of one command line (its values skipped by the flag's arity in the
list) and argparse's own error on the rest, so the command reports them all in one message (`format_refusals`).
A ladle on/off flag also takes vLLM's other spellings of "off" (`--disable-prefix-caching`).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from importlib import resources
from typing import Any, Optional, Sequence

from ladle.config import COMPONENTS, EngineConfig, ServerConfig, format_refusals

# Fields that accept vLLM's human-readable integers (vllm/engine/arg_utils.py: human_readable_ints).
_HUMAN_READABLE = {"max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"}
_SERVER = "server"
# Flags of fields outside ServerConfig that only the HTTP server reads: left out with the server flags.
SERVING_ONLY_FLAGS = frozenset({"--served-model-name"})
_REFUSED = "_refused_flags"  # namespace attribute where `_RefusedFlag` leaves its refusals


@dataclasses.dataclass(frozen=True)
class VllmFlag:
    """One option string of `vllm serve`: the flag it belongs to, whether it turns an on/off flag off, and how
    many values follow it ('one' | 'none' | 'list' | 'optional')."""

    canonical: str
    arity: str
    negative: bool = False


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
        if not include_server and _is_serving(comp, f):
            continue
        flag, help_text = f.metadata["flag"], f.metadata["help"]
        default = _default(f)
        kind = _base_type(f.type)
        if not flag.startswith("-"):
            parser.add_argument(_dest(comp, f), nargs="?", default=default, metavar=flag.upper(), help=help_text)
            continue
        shown = help_text if "default" in help_text else f"{help_text} (default: {_shown_default(f)})"
        kw: dict[str, Any] = {"dest": _dest(comp, f), "default": default, "help": shown}
        names = [flag, *aliases.get(flag, [])]
        if kind != "bool":
            kw["metavar"] = f.name.upper()
        if kind == "bool":
            kw["off"] = [n for n in _negations(flag) if n != "--no-" + flag[2:]]
            kw["action"] = OnOffAction
        elif kind == "int":
            kw["type"] = human_readable_int if f.name in _HUMAN_READABLE else int
        elif kind == "float":
            kw["type"] = float
        elif kind == "ints":
            kw.update(type=int, nargs="+", metavar="N")
        parser.add_argument(*names, **kw)


def _is_serving(comp: str, f: dataclasses.Field) -> bool:
    return comp == _SERVER or f.metadata["flag"] in SERVING_ONLY_FLAGS


class _RefusedFlag(argparse.Action):
    """A flag a command parses (its value too; hidden from --help) only to refuse it: each use leaves
    "FLAG: message" for `collect_refusals`."""

    def __init__(self, option_strings: list[str], dest: str, message: str = "", **kw: Any):
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)
        self.message = message

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: D401 (argparse's signature)
        setattr(namespace, _REFUSED, getattr(namespace, _REFUSED, []) + [f"{option_string}: {self.message}"])


def refuse_serving_flags(parser: argparse.ArgumentParser, message: str, messages: dict[str, str]) -> None:
    """For a command built with `add_config_args(include_server=False)`: each serving flag it left out (and the
    "off" forms of on/off ones) is refused by name with messages.get(flag, message) as a flag refusal (exit 2),
    instead of vLLM's "not supported yet" or argparse's "unrecognized arguments"."""
    for comp, f in config_fields():
        if not _is_serving(comp, f):
            continue
        flag = f.metadata["flag"]
        switch = _base_type(f.type) == "bool"
        names = [flag, "--no-" + flag[2:], *_negations(flag)] if switch else [flag]
        parser.add_argument(*dict.fromkeys(names), action=_RefusedFlag, nargs=0 if switch else None,
                            message=messages.get(flag, message))


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Build the frozen configs from a namespace produced by a parser with `add_config_args`."""
    values: dict[str, dict[str, Any]] = {comp: {} for comp in list(COMPONENTS) + [_SERVER]}
    for comp, f in config_fields():
        default = _default(f)
        value = getattr(args, _dest(comp, f), default)
        values[comp][f.name] = tuple(value) if _base_type(f.type) == "ints" else value
    engine = EngineConfig(**{comp: cls(**values[comp]) for comp, cls in COMPONENTS.items()})
    return engine, ServerConfig(**values[_SERVER])


class OnOffAction(argparse.BooleanOptionalAction):
    """`--x` / `--no-x` (argparse's BooleanOptionalAction) plus vLLM's other "off" spellings given as `off`
    (`--disable-x` for `--enable-x`, ladle/data/vllm_serve_flags.txt); further option strings are "on" aliases
    (vLLM's `-ep` for `--enable-expert-parallel`)."""

    def __init__(self, option_strings: list[str], dest: str, off: Sequence[str] = (), **kw: Any):
        on, no = list(option_strings), "--no-" + option_strings[0][2:]
        super().__init__(on[:1], dest, **kw)
        self._off = set(off) | {no}
        self.option_strings = [on[0], *on[1:], no] + sorted(set(off) - {no})

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: D401 (argparse's signature)
        setattr(namespace, self.dest, option_string not in self._off)


def _flag_lines() -> list[list[str]]:
    text = resources.files("ladle").joinpath("data/vllm_serve_flags.txt").read_text()
    return [line.split() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def vllm_flag_info() -> dict[str, VllmFlag]:
    """Every option string of `vllm serve` (aliases and "off" forms included) -> VllmFlag."""
    flags: dict[str, VllmFlag] = {}
    for parts in _flag_lines():
        canonical = parts[0]
        arity = next((m[1:-1] for m in parts if m in ("[switch]", "[list]", "[optional]")), "one")
        arity = "none" if arity == "switch" or "[bool]" in parts else arity
        off = parts.index("[bool]") if "[bool]" in parts else len(parts)
        for i, name in enumerate(parts):
            if name.startswith("-"):
                flags[name] = VllmFlag(canonical, arity, negative=i > off)
    return flags


def load_vllm_flags() -> dict[str, str]:
    """vLLM's `vllm serve` option strings -> the canonical flag they belong to (aliases, "off" forms included)."""
    return {name: info.canonical for name, info in vllm_flag_info().items()}


def _negations(flag: str) -> list[str]:
    """vLLM's "off" option strings of the on/off flag `flag` ([] when vLLM has no such flag)."""
    return [name for name, info in vllm_flag_info().items() if info.canonical == flag and info.negative]


def vllm_flags_version() -> str:
    """The header line naming the vLLM version the flag list came from."""
    text = resources.files("ladle").joinpath("data/vllm_serve_flags.txt").read_text()
    return text.splitlines()[0].lstrip("# ").strip()


# vLLM flags that ask for what ladle always does, or that concern features ladle lacks by design (remote code);
# accepted and ignored so a pasted vLLM recipe keeps working. Value-taking ones consume their value.
NO_OP_VLLM_FLAGS = {
    "--enable-chunked-prefill": "chunked prefill is always on in ladle",
    "--disable-log-requests": "ladle does not log request contents",
    "--trust-remote-code": "ladle never runs model repository code (configs are parsed as plain JSON)",
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


# What ladle offers instead of a vLLM flag it does not implement (the rest get the generic sentence).
INSTEAD = {
    "--pipeline-parallel-size": "ladle has no pipeline parallelism; --tensor-parallel-size splits a model over GPUs",
    "--data-parallel-size": "ladle runs one engine; start one `ladle serve` per GPU behind a load balancer",
    "--speculative-config": "ladle has no speculative decoding",
    "--enable-lora": "ladle serves no LoRA adapters",
    "--cudagraph-capture-sizes": "ladle's --cuda-graph-sizes takes the decode batch sizes to capture",
    "--max-cudagraph-capture-size": "ladle's --cuda-graph-sizes N captures 1 2 4 and the multiples of 8 up to N",
    "--compilation-config": "ladle compiles nothing; --enforce-eager / --cuda-graph-sizes set CUDA graph capture",
}


def _unsupported_refusal(name: str, canonical: str, prog: str) -> str:
    instead = INSTEAD.get(canonical)
    if instead:
        return f"not supported yet: {name} ({instead})"
    return (f"not supported yet: {name} (a `vllm serve` flag, {vllm_flags_version().split(' `')[0]}, that ladle does "
            f"not implement; see `{prog} --help` for the supported flags)")


def split_unsupported(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """(refusals, the rest of argv): one "not supported yet: FLAG (...)" per known vLLM option string that `parser`
    does not define, its values dropped by the flag's arity (`--flag=v` is one token). Only exact vLLM names
    (or their underscore spellings) are refused here; anything else stays for argparse."""
    known = set(parser._option_string_actions)  # every option string the parser accepts
    vllm = vllm_flag_info()
    refusals: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        name, has_value = token.split("=", 1)[0], "=" in token
        info = vllm.get(name) or vllm.get(name.replace("_", "-"))
        if token == "--":
            rest += argv[i - 1:]
            break
        if not token.startswith("-") or name in known or info is None or token in ("-", "-h", "--help"):
            rest.append(token)
            continue
        refusals.append(_unsupported_refusal(name, info.canonical, parser.prog))
        if has_value or info.arity == "none":
            continue
        if info.arity == "one" and i < len(argv):
            i += 1
        else:  # list / optional: every following token that is not a flag
            while i < len(argv) and not argv[i].startswith("-"):
                i += 1
    return refusals, rest


class _ArgparseError(Exception):
    pass


def _raise_instead_of_exit(message: str) -> None:
    raise _ArgparseError(message)


def collect_refusals(parser: argparse.ArgumentParser,
                     argv: list[str]) -> tuple[list[str], Optional[argparse.Namespace]]:
    """(refusals, namespace or None) for one command line: the unsupported vLLM flags, unknown flags (the rest still
    parsed, so the caller's value checks join the same message), then argparse's error on the rest if any (then no
    namespace). argparse's error alone exits as argparse does (usage + error, status 2), and so does `--help`."""
    argv = strip_no_op_flags(argv)
    refusals, rest = split_unsupported(parser, argv)
    error = parser.error
    parser.error = _raise_instead_of_exit  # type: ignore[method-assign]
    try:
        args, unknown = parser.parse_known_args(rest)
        refusals += vars(args).pop(_REFUSED, [])
        if not unknown:
            return refusals, args
        message = f"unrecognized arguments: {' '.join(unknown)}"
        if all(u.startswith("-") for u in unknown):  # unknown flags alone: the rest parsed, so its checks still run
            return refusals + [f"{message} (`{parser.prog} --help` lists the flags)"], args
        raise _ArgparseError(message)  # a stray value: the parse of the rest cannot be trusted
    except _ArgparseError as e:
        if not refusals:
            parser.error = error  # type: ignore[method-assign]
            parser.error(str(e))
        return refusals + [str(e)], None
    finally:
        parser.error = error  # type: ignore[method-assign]


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
    """Parse, or exit with status 2 and every flag refusal in one message (argparse's own error alone: its usual
    usage + error)."""
    refusals, args = collect_refusals(parser, argv)
    if refusals:
        raise UnsupportedFlagError(f"{parser.prog}: error: {format_refusals(refusals)}")
    return args
