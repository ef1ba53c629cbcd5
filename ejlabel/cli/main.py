"""The ``ejlabel`` command: audit programs, tune their unseen calls, manage the config cache.

Exit codes: 0 success, 1 failure (an error, or calls that could not be tuned), 2 bad usage.
Errors go to stderr as one line; ``--debug`` adds the traceback and keeps the exit code.

The options that are not a command's own (``--import``, ``--cache-dir``, ``--debug``,
``--version``) are accepted anywhere on the line, before or after the command. A module the user
names (``--import MODULE``, ``module:function``) is imported as ``python -m`` finds it: the
current directory comes first on the import path; ``--import`` also takes a path to a ``.py``
file (:func:`~ejlabel.core.registry.import_user_modules`). :func:`usage_text` is the synopsis
README shows.

What the command prints from data (cache entries, errors and warnings that quote a program, a
dump or a cache) goes through :func:`~ejlabel.utils.sanitize.sanitize` first, so no escape code
from a file reaches the terminal.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ejlabel.kernels  # noqa: F401  (registers the library's kernels and their config types)
from ejlabel.core.registry import import_user_modules
from ejlabel.execution.tuning import DEFAULT_BUDGET_S
from ejlabel.utils.sanitize import sanitize
from ejlabel.utils.serialize import check_array_size
from ejlabel.utils.version import VERSION

__all__ = ["main", "build_parser", "usage_text"]

_SPEC_RE = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9, ]*)\]")
_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64", "i32": "int32", "s32": "int32", "i64": "int64", "s64": "int64", "i8": "int8", "u8": "uint8", "bool": "bool", "pred": "bool"}


def _positive(kind: type) -> Any:
    """An argparse type: a number of ``kind`` greater than 0 (argparse names the flag on error)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


class UsageError(Exception):
    """Bad arguments discovered after parsing (exit code 2)."""


def _parse_example_args(text: str) -> list[Any]:
    """``"f32[8,16] i32[8]"`` → ShapeDtypeStructs."""
    import jax
    import jax.numpy as jnp

    specs = []
    for token in text.split():
        match = _SPEC_RE.fullmatch(token)
        if match is None or match.group("dtype") not in _DTYPES:
            raise UsageError(f"--example-args: expected specs like 'f32[8,16] i32[8]', got {token!r}")
        dims = tuple(int(d) for d in match.group("dims").replace(" ", "").split(",") if d)
        dtype = jnp.dtype(_DTYPES[match.group("dtype")])
        try:
            check_array_size(dims, dtype, "--example-args")
        except ValueError as err:
            raise UsageError(str(err)) from None
        specs.append(jax.ShapeDtypeStruct(dims, dtype))
    return specs


def _program(path: str, example_args: str | None) -> Any:
    """A path to an HLO file / dump directory, or ``module:function`` lowered on example args."""
    if Path(path).exists():
        if example_args:
            raise UsageError("--example-args only applies to a module:function target")
        return Path(path)
    module_name, sep, attr = path.partition(":")
    if not sep:
        raise UsageError(f"PATH: {path!r} is neither an existing file or directory nor 'module:function'")
    if example_args is None:
        raise UsageError("--example-args is required to lower a module:function target")
    import jax

    fn = _import_function(path, "PATH")
    return jax.jit(fn).lower(*_parse_example_args(example_args))


def _selector(cache_dir: str | None) -> Any:
    from ejlabel.config.persistent import PersistentCache
    from ejlabel.config.selection import ConfigSelectorChain

    return ConfigSelectorChain(persistent=PersistentCache(cache_dir))


def _cmd_audit(args: argparse.Namespace) -> int:
    from ejlabel.analysis import audit, draw, to_dot

    report = audit(_program(args.path, args.example_args), selector=_selector(args.cache_dir))
    if args.json:
        print(report.to_json())
    elif args.markdown:
        print(report.to_markdown())
    else:
        print(report.render())
    if args.dot:
        Path(args.dot).write_text(to_dot(report.graph))
    for image in (args.svg, args.png):
        if image:
            draw(report.graph, image)
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    if ":" in args.path and not Path(args.path).exists() and args.ray is None:
        return _tune_step_in_context(args)
    import dataclasses

    from ejlabel.analysis import tune_unseen

    for flag in ("baseline", "samples", "candidates", "confirm_slower", "exhaustive"):
        if getattr(args, flag) not in (None, False):
            raise UsageError(f"--{flag.replace('_', '-')} only applies to tuning a module:function step in context")
    selector = _selector(args.cache_dir)
    policy = dataclasses.replace(
        selector.policy,
        time_budget_s=args.budget,
        num_iters=args.iters,
        max_configs=args.max_configs,
    )
    # --ray: the unseen calls go to a Ray cluster's workers, which import the --import modules.
    on_ray = {} if args.ray is None else {"backend": "ray", "address": args.ray or None, "modules": args.imports, "progress": True}
    report = tune_unseen(_program(args.path, args.example_args), selector=selector, policy=policy, **on_ray)
    for (op_id, call_key), result in report.results.items():
        where = f"  on {sanitize(report.worker_of[op_id, call_key])}" if on_ray else ""
        print(f"tuned  {op_id}:{call_key}  {result.best.timing.median_ms:.4g} ms  {result.best_cfg!r}{where}")
        if result.skipped:
            print(f"       {_skipped_line(result)}")
    for lab, error in report.errors.items():
        print(f"error  {lab}  {sanitize(error)}", file=sys.stderr)
    print(sanitize(report.summary()))  # it names the Ray workers, as they name themselves
    if report.results:
        print(
            "these picks come from isolated timings (each call alone, outside its program), not "
            "confirmed in context; to confirm them in the whole step run "
            "`ejlabel tune module:function --example-args ...`"
        )
    return 1 if report.errors else 0


def _skipped_line(result: Any, shown: int = 8) -> str:
    """``skipped 5 of 8 candidates (time budget): cfg, cfg, ...``; the floor never is."""
    names = [repr(c.cfg) for c in result.skipped]
    more = f", and {len(names) - shown} more (`ejlabel cache show {result.call_key}` lists all)" if len(names) > shown else ""
    return (
        f"skipped {len(names)} of {len(result.candidates)} candidates (time budget; the heuristic and plain-path "
        f"candidates were timed): {', '.join(names[:shown])}{more}"
    )


def _from_current_directory() -> None:
    """Put the current directory first on the import path, as ``python -m`` does (unless Python
    runs with ``-P`` / ``PYTHONSAFEPATH``): the user's modules are found where the user is."""
    here = os.getcwd()
    if not sys.flags.safe_path and here not in sys.path:
        sys.path.insert(0, here)


def _import_function(target: str, flag: str) -> Any:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{flag}: expected 'module:function', got {target!r}")
    _from_current_directory()
    fn = importlib.import_module(module_name)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise UsageError(f"{flag}: {target} is a {type(fn).__name__}, not a function")
    return fn


def _tune_step_in_context(args: argparse.Namespace) -> int:
    """``ejlabel tune module:function --example-args ...``: whole-step tuning from the all-XLA floor."""
    import dataclasses

    from ejlabel.execution.tuning import tune_in_context

    if args.example_args is None:
        raise UsageError("--example-args is required to tune a module:function step")
    fn = _import_function(args.path, "PATH")
    baseline = _import_function(args.baseline, "--baseline") if args.baseline else None
    selector = _selector(args.cache_dir)
    policy = dataclasses.replace(selector.policy, num_iters=args.iters, max_configs=args.max_configs)
    # Only the flags given: tune_in_context's own defaults are the command's.
    given = {"budget_s": args.budget, "samples": args.samples, "candidates_per_call": args.candidates}
    report = tune_in_context(
        fn,
        *_parse_example_args(args.example_args),
        baseline_fn=baseline,
        skip_slower_in_isolation=not args.confirm_slower,
        exhaustive=args.exhaustive,
        policy=policy,
        selector=selector,
        **{name: value for name, value in given.items() if value is not None},
    )
    if report.stored:
        print(f"stored {len(report.calls)} picks with provenance 'in-context' in {selector.persistent.path}")
    for what, error in report.errors.items():
        print(f"error  {what}  {sanitize(error)}", file=sys.stderr)
    return 1 if report.errors else 0


def _cmd_cache(args: argparse.Namespace) -> int:
    from ejlabel.config.persistent import PersistentCache

    cache = PersistentCache(args.cache_dir)
    action = args.action
    if action == "ls":
        entries = cache.entries(include_undecodable=True)
        if not entries:
            print(f"no entries in {cache.path}")
        for entry in entries:
            median = (entry.stats or {}).get("median_ms")
            timing = f"{median:.4g} ms" if isinstance(median, (int, float)) else "-"
            config = _shown_config(entry)
            op_id, provenance, device = (sanitize(text) for text in (entry.op_id, entry.provenance, entry.device))
            print(f"{op_id:28} {entry.call_key}  {provenance:10} {timing:>12}  {device}  {config}")
    elif action == "show":
        matches = [e for e in cache.entries(include_undecodable=True) if _names_entry(args.key, e.op_id, e.call_key)]
        if not matches:
            raise LookupError(f"KEY: no cache entry matches {args.key!r} (give a call key or a unique prefix of one, op@vN:key or a label)")
        if len({(e.op_id, e.call_key) for e in matches}) > 1:
            listed = ", ".join(sorted({f"{e.op_id}:{e.call_key}" for e in matches}))
            raise UsageError(f"KEY: {args.key!r} matches several calls ({listed}); give more of the key")
        from ejlabel.utils.serialize import to_jsonable

        for entry in matches:
            data = {f: getattr(entry, f) for f in entry.__dataclass_fields__}
            data["config"] = to_jsonable(entry.config)
            print(json.dumps(data, indent=2, default=repr))
    elif action == "stats":
        print(json.dumps(cache.stats(), indent=2, default=str))
    elif action == "export":
        print(f"exported {cache.export(args.file, device=args.device, op_id=args.op_id)} entries to {args.file}")
    elif action == "import":
        count = cache.import_(args.file, overwrite=args.overwrite)
        kept = "" if count or args.overwrite else " (entries already in the cache are kept; --overwrite replaces them)"
        print(f"imported {count} entries from {args.file}{kept}")
    elif action == "clear":
        if not args.yes:
            raise UsageError(f"clear removes every entry of {cache.path}; pass --yes to confirm")
        print(f"removed {cache.clear()} entries from {cache.path}")
    return 0


def _shown_config(entry: Any) -> str:
    """The config column of ``cache ls``: the config, or why it cannot serve its call."""
    from ejlabel.core.registry import config_type_problem

    if entry.status != "ok":
        return sanitize(f"UNDECODABLE: {entry.error}")
    problem = config_type_problem(entry.op_id, entry.config)
    if problem is not None:  # never served: the call counts as unseen, and tuning replaces it
        return sanitize(f"WRONG TYPE: {entry.config!r} ({problem})")
    return sanitize(repr(entry.config))


def _names_entry(key: str, op_id: str, call_key: str) -> bool:
    """Whether ``key`` (a call key or a prefix of >= 4 of its digits, ``op@vN:key``, or a label)
    names the entry."""
    if len(key) >= 4 and call_key.startswith(key):
        return True
    return key == f"{op_id}:{call_key}" or key.endswith(f"#{op_id}:{call_key}")


def _cmd_demo(args: argparse.Namespace) -> int:
    from ejlabel.cli.demo import run_demo

    return run_demo(fresh=args.fresh, workdir=args.workdir)


_IMPORT_HELP = (
    "import MODULE first, registering its kernels and config types (repeatable): a module name, found "
    "from the current directory as python -m finds it, or a path to a .py file; ejlabel.kernels is always "
    "imported. Nothing read from a program or cache is ever imported."
)
_CACHE_HELP = "persistent cache directory (default: $EJLABEL_CACHE_DIR or ~/.cache/ejlabel)"


def _add_global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The options every command accepts, before or after its name. After it they land in
    ``*_after`` (argparse would let the command's value replace the one given before it)."""
    suffix, default = ("", None) if top else ("_after", argparse.SUPPRESS)
    parser.add_argument("--import", dest="imports" + suffix, action="append", default=[] if top else default, metavar="MODULE", help=_IMPORT_HELP)
    parser.add_argument("--cache-dir", dest="cache_dir" + suffix, default=default, metavar="DIR", help=_CACHE_HELP)
    # Read from the command line before parsing (main); listed here for --help.
    parser.add_argument("--debug", action="store_true", default=default, help="add the traceback to an error (the exit code stays)")
    parser.add_argument("--version", action="store_true", default=default, help="print the version and exit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ejlabel", description=__doc__.splitlines()[0])
    _add_global_options(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_commands(commands)
    for sub in commands.choices.values():
        _add_global_options(sub, top=False)
    for sub in _nested_parsers(commands):
        _add_global_options(sub, top=False)
    return parser


def _nested_parsers(commands: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:  # type: ignore[type-arg]
    """The parsers of sub-subcommands (``cache ls``, ...)."""
    found = []
    for sub in commands.choices.values():
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                found.extend(action.choices.values())
    return found


def _add_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    audit = commands.add_parser("audit", help="list every kernel call of a program with its config")
    audit.add_argument("path", help="HLO file, XLA dump directory, or module:function")
    audit.add_argument("--example-args", help="argument specs for module:function, e.g. 'f32[8,16] i32[8]'")
    form = audit.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="print JSON")
    form.add_argument("--markdown", action="store_true", help="print Markdown")
    audit.add_argument("--dot", metavar="FILE", help="write the call graph as DOT")
    audit.add_argument("--svg", metavar="FILE", help="draw the call graph as SVG (needs Graphviz)")
    audit.add_argument("--png", metavar="FILE", help="draw the call graph as PNG (needs Graphviz)")
    audit.set_defaults(run=_cmd_audit)

    tune = commands.add_parser(
        "tune",
        help="tune a step in context (module:function), or the unseen calls of a program dump in isolation",
        description=(
            "With module:function and --example-args: time the whole compiled step, starting from "
            "every call on XLA, and keep a kernel config only where the step gets faster. With an "
            "HLO file or dump directory: tune each unseen call alone (isolated timings)."
        ),
    )
    tune.add_argument("path", help="module:function (in context), or an HLO file / XLA dump directory (isolated)")
    tune.add_argument("--example-args", help="argument specs for module:function, e.g. 'f32[8,16] i32[8]'")
    tune.add_argument("--budget", type=_positive(float), default=None, metavar="SECONDS", help=f"in context: seconds for the whole search (default {DEFAULT_BUDGET_S:g}); isolated: seconds per call, compile time "
        "included (the heuristic and plain-path candidates are always timed; the report lists what was skipped)")
    tune.add_argument("--iters", type=_positive(int), default=10, help="timed runs per candidate in isolation (default 10)")
    tune.add_argument("--max-configs", type=_positive(int), default=None, help="candidates per call at most")
    tune.add_argument("--samples", type=_positive(int), default=None, help="in context: paired rounds per comparison before more are taken while undecided (default 10)")
    tune.add_argument("--candidates", type=_positive(int), default=None, help="in context: the fastest candidates in isolation confirmed per call (default 2)")
    tune.add_argument("--confirm-slower", action="store_true", help="in context: also confirm candidates slower than XLA in isolation")
    tune.add_argument("--baseline", metavar="MODULE:FUNCTION", help="in context: the step in plain JAX, timed alongside")
    tune.add_argument("--exhaustive", action="store_true", help="in context: rank every call and candidate, ignoring what earlier runs decided and learned")
    tune.add_argument(
        "--ray", nargs="?", const="", default=None, metavar="ADDRESS",
        help="tune the unseen calls (in isolation, of any PATH) on a Ray cluster: ADDRESS as ray.init takes it ('auto', "
        "'ray://host:10001'; none: RAY_ADDRESS or a new local cluster); one worker per GPU (per CPU for a CPU "
        "program), each importing the --import modules "
        '(needs pip install "ejlabel[ray]")',
    )
    tune.set_defaults(run=_cmd_tune)

    cache = commands.add_parser("cache", help="inspect and move tuned configs")
    actions = cache.add_subparsers(dest="action", required=True)
    actions.add_parser("ls", help="list entries")
    show = actions.add_parser("show", help="show one entry with its statistics")
    show.add_argument("key", help="call key, op@vN:key, or a full label")
    actions.add_parser("stats", help="counts by op and device")
    export = actions.add_parser("export", help="write entries to a JSON file")
    export.add_argument("file")
    export.add_argument("--device", help="only the entries of this device fingerprint")
    export.add_argument("--op-id", help="only the entries of this op id (op@vN)")
    imp = actions.add_parser("import", help="read entries from a JSON file")
    imp.add_argument("file")
    imp.add_argument("--overwrite", action="store_true", help="replace existing entries")
    clear = actions.add_parser("clear", help="remove every entry")
    clear.add_argument("--yes", action="store_true", help="confirm")
    cache.set_defaults(run=_cmd_cache)

    demo = commands.add_parser("demo", help="the whole workflow on the example model: lower, audit, tune a dump, audit again, tune in context")
    demo.add_argument("--fresh", action="store_true", help="use a temporary cache instead of the persistent one")
    demo.add_argument("--workdir", default=None, help="where to write the program dump (default: a temporary directory)")
    demo.set_defaults(run=_cmd_demo)


#: The command line in one block: what README shows (a test compares them).
_SYNOPSIS = (
    ("ejlabel audit PATH [--json | --markdown] [--dot FILE] [--svg FILE] [--png FILE]", "PATH: an HLO file, a dump dir, or module:function --example-args 'f32[8,16]'"),
    ("ejlabel tune PATH [--budget SECONDS] [--iters N] [--max-configs N]", "a dump or HLO file: each unseen call alone (isolated)"),
    ("ejlabel tune PATH --ray [ADDRESS]", "the same, across a Ray cluster"),
    ("ejlabel tune module:function --example-args 'f32[8,16]' [--budget SECONDS]", "in context: whole-step timings"),
    ("ejlabel cache ls | show KEY | stats | export FILE [--device D] [--op-id OP] | import FILE [--overwrite] | clear --yes", ""),
    ("ejlabel demo [--fresh] [--workdir DIR]", ""),
    ("anywhere on the line: --import MODULE|FILE.py  --cache-dir DIR  --debug  --version  --help", ""),
)


def usage_text() -> str:
    """The synopsis of every command, one per line (README's "Command line" block)."""
    width = max(len(line) for line, note in _SYNOPSIS if note)
    return "\n".join(f"{line:{width}}   # {note}".rstrip(" #") if note else line for line, note in _SYNOPSIS)


def _global_flags(argv: list[str]) -> tuple[list[str], bool, bool]:
    """``argv`` without ``--debug`` and ``--version`` (accepted anywhere up to ``--``), and
    whether each was given."""
    end = argv.index("--") if "--" in argv else len(argv)
    head, tail = argv[:end], argv[end:]
    return [a for a in head if a not in ("--debug", "--version")] + tail, "--debug" in head, "--version" in head


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: str | None = None) -> None:
    """``warnings.showwarning`` with the message sanitized (its lines kept)."""
    text = warnings.formatwarning(sanitize(str(message), multiline=True), category, filename, lineno, line)  # type: ignore[arg-type]
    try:
        (file if file is not None else sys.stderr).write(text)
    except OSError:  # as the default does: a closed or broken stderr loses the warning
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv, debug, version = _global_flags(list(sys.argv[1:] if argv is None else argv))
    if version:
        print(f"ejlabel {VERSION}")
        return 0
    args = parser.parse_args(argv)
    args.debug = debug
    args.imports = [*args.imports, *getattr(args, "imports_after", [])]
    args.cache_dir = getattr(args, "cache_dir_after", None) or args.cache_dir
    if args.cache_dir is not None:
        # Every part of the command (the demo's child process too) uses the one cache.
        os.environ["EJLABEL_CACHE_DIR"] = str(Path(args.cache_dir).expanduser().absolute())
    try:
        # The registry that decoding programs and cache entries consults is filled by the
        # library's own kernels (imported above) and the modules the user named, never by data.
        if args.imports:
            _from_current_directory()
        import_user_modules(args.imports)
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning  # warnings quote programs and caches too
            return args.run(args)
    except UsageError as err:
        return _fail(args, f"ejlabel {args.command}: error: {sanitize(str(err))}", 2)
    except BrokenPipeError:  # `ejlabel cache ls | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (Exception, KeyboardInterrupt) as err:  # the command line reports, it does not crash
        return _fail(args, f"ejlabel {args.command}: error: {type(err).__name__}: {sanitize(str(err))}", 1)


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    """Report an error on stderr (``--debug``: its traceback first) and return ``code``."""
    if args.debug:
        traceback.print_exc()
    print(message, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
