"""Command-line mistakes named. Upstream's argument validation (megatron-training's
``validate_args``) stops on bare ``assert`` statements: a wrong flag shows as an ``AssertionError``
traceback on every rank, often with no message. :func:`parse_and_validate_args` runs upstream's and
turns such a failure into one line naming the flags the failed check reads, with their values, and
refuses at start an upstream default that fails later (``--eval-interval``). Everything happens
before any process group exists, on every rank alike."""

from __future__ import annotations

import argparse
import ast
import functools
import linecache
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron.overlay.errors import OverlayError

#: Values upstream derives from flags, by the flag (or setting) that decides them.
DERIVED = {
    "transformer_pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "eval_global_batch_size": "--global-batch-size",  # unless --eval-global-batch-size is given
    "eval_micro_batch_size": "--micro-batch-size",
    "world_size": "world size (ranks launched)",
    "data_parallel_size": "data-parallel size (world size / TP x PP x CP)",
}


#: Seconds a rank of a multi-rank launch waits, after printing its mistake, before it exits:
#: torchrun stops the other ranks as soon as one exits, and a rank a little behind (2 ranks on 2
#: cores: up to 0.16 s apart in 6 launches) would be stopped before it named the mistake too.
LINGER_S = 1.0


class ArgumentMistake(SystemExit, OverlayError):
    """A command-line mistake: exit status 1 with one line saying which flags and why."""


def mistake(line: str) -> ArgumentMistake:
    """The :class:`ArgumentMistake` for ``line``. In a multi-rank launch (``$LOCAL_WORLD_SIZE`` >
    1, as torchrun sets it) the line is printed now and the rank waits :data:`LINGER_S` so that
    every rank's line reaches the log; the exception then exits with status 1 and prints nothing
    more (``str()`` of it is still the line)."""
    mistake = ArgumentMistake(line)
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) > 1:
        sys.stderr.write(line + "\n")  # one write: two ranks' lines cannot interleave
        sys.stderr.flush()
        time.sleep(LINGER_S)
        mistake.code = 1
    return mistake


@functools.lru_cache(maxsize=None)
def _tree(filename: str) -> Optional[ast.AST]:
    src = "".join(linecache.getlines(filename))
    try:
        return ast.parse(src) if src else None
    except SyntaxError:
        return None


def _args_attrs(node: ast.AST) -> List[str]:
    """``X`` of every ``args.X`` under ``node``, in source order."""
    found = [
        (n.lineno, n.col_offset, n.attr)
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "args"
    ]
    return [a for _, _, a in sorted(found)]


def analyse_assert(filename: str, lineno: int) -> Tuple[str, List[str], List[str]]:
    """What a failed ``assert`` at ``filename:lineno`` checks.

    Returns:
        (the condition's source text, the ``args`` attributes it reads, directly or through a local
        variable assigned earlier in the function, and those of the ``if`` tests around it): empty
        when no ``assert`` spans that line.
    """
    tree = _tree(filename)
    if tree is None:
        return "", [], []
    src = "".join(linecache.getlines(filename))
    best: Optional[Tuple[ast.Assert, List[ast.AST], Optional[ast.AST]]] = None

    def visit(node: ast.AST, ifs: List[ast.AST], func: Optional[ast.AST]) -> None:
        nonlocal best
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Assert) and child.lineno <= lineno <= child.end_lineno:
                best = (child, list(ifs), func)
            if (
                getattr(child, "lineno", 0) > lineno
                or getattr(child, "end_lineno", 1 << 30) < lineno
            ):
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, [], child)
            elif isinstance(child, ast.If):
                in_body = any(s.lineno <= lineno <= s.end_lineno for s in child.body)
                visit(child, ifs + ([child.test] if in_body else []), func)
            else:
                visit(child, ifs, func)

    visit(tree, [], None)
    if best is None:
        return "", [], []
    node, ifs, func = best
    attrs = _args_attrs(node.test)
    local_names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name) and n.id != "args"}
    if func is not None and local_names:
        for stmt in ast.walk(func):
            if isinstance(stmt, ast.Assign) and stmt.lineno < node.lineno:
                targets = {t.id for t in stmt.targets if isinstance(t, ast.Name)}
                if targets & local_names:
                    attrs += _args_attrs(stmt.value)
    context: List[str] = []
    for test in ifs:
        context += _args_attrs(test)
    condition = ast.get_source_segment(src, node.test) or ""
    return " ".join(condition.split()), list(dict.fromkeys(attrs)), list(dict.fromkeys(context))


def _flag_names(parser: Optional[argparse.ArgumentParser]) -> Dict[str, str]:
    if parser is None:
        return {}
    out: Dict[str, str] = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and action.dest not in out:
            out[action.dest] = longs[0]
    return out


def _describe(attrs: List[str], args: Any, flags: Dict[str, str]) -> List[str]:
    given = {a.split("=", 1)[0] for a in sys.argv[1:] if a.startswith("--")}
    out = []
    for attr in attrs:
        name = flags.get(attr)
        if attr in DERIVED and name not in given:  # derived from another flag, or not a flag
            name = DERIVED[attr]
        if name is None:
            continue
        value = getattr(args, attr, "?") if args is not None else "?"
        item = f"{name}={value}"
        if item not in out:
            out.append(item)
    return out


def explain(
    error: AssertionError, parser: Optional[argparse.ArgumentParser] = None
) -> Optional[str]:
    """One line for an ``AssertionError`` raised by upstream's argument validation, or None when
    it was not raised there (then it is not a command-line mistake this module can name).

    Args:
        error: the exception, with its traceback.
        parser: the entrypoint's argument parser (maps each ``args`` attribute to its flag).
    """
    frames = traceback.walk_tb(error.__traceback__)
    last = None
    for frame, lineno in frames:
        last = (frame, lineno)
    if last is None:
        return None
    frame, lineno = last
    filename = frame.f_code.co_filename
    if os.path.join("megatron", "training", "") not in filename:
        return None
    condition, attrs, context = analyse_assert(filename, lineno)
    flags = _flag_names(parser)
    args = frame.f_locals.get("args")
    named = _describe(attrs, args, flags)
    # the settings that made the check apply (only those set: an unset one did not)
    set_ = [a for a in context if getattr(args, a, None) not in (None, False)]
    around = [c for c in _describe(set_, args, flags) if c not in named]
    message = str(error).strip()
    why = message or (f"upstream requires {condition}" if condition else "upstream's check failed")
    where = ", ".join(named) if named else "the command line"
    line = f"invalid arguments ({where}"
    if around:
        line += f"; with {', '.join(around)}"
    return f"{line}): {why}"


def parse_and_validate_args(
    upstream: Callable[..., Any],
    parser_for: Callable[[], argparse.ArgumentParser],
    prog: str = "pretrain_gpt.py",
    **kwargs: Any,
) -> Any:
    """``upstream(**kwargs)`` (megatron-training's ``parse_and_validate_args``) with its
    command-line mistakes named, then this fork's checks of upstream defaults that fail later.

    Args:
        upstream: upstream's ``parse_and_validate_args``.
        parser_for: builds the entrypoint's parser (only called to name the flags of a failure).
        prog: the program named in the message.

    Returns:
        The parsed and validated arguments (``argparse.Namespace``).

    Raises:
        ArgumentMistake: (``SystemExit``, status 1, no traceback) naming the flags and values of a
            failed upstream check, or ``--eval-interval`` when it is missing.
    """
    try:
        args = upstream(**kwargs)
    except AssertionError as e:
        try:
            parser = parser_for()
        except Exception:  # noqa: BLE001 - without a parser the message names the flags as given
            parser = None
        line = explain(e, parser)
        if line is None:
            raise
        raise mistake(f"{prog}: {line}") from None
    check_later_failures(args, prog)
    return args


def check_later_failures(args: argparse.Namespace, prog: str = "pretrain_gpt.py") -> None:
    """Refuse upstream defaults that pass validation and fail once training starts.

    Raises:
        ArgumentMistake: ``--replication-jump`` x ``--replication-factor`` does not divide the
            world size (NVRx asserts when it builds the replication groups: a traceback, not a
            line, typically at a restart on fewer nodes); ``--use-megatron-fsdp`` with
            ``--pipeline-model-parallel-size`` > 1 (upstream's model build fails with an
            ``einops.EinopsError`` traceback); ``--eval-interval`` missing in
            iteration-based training (upstream's default is None; ``training.py`` computes
            ``args.train_iters // args.eval_interval`` when it builds the data loaders:
            ``TypeError``).
    """
    if getattr(args, "non_persistent_ckpt_type", None) == "local" and getattr(
        args, "replication", False
    ):
        jump = int(getattr(args, "replication_jump", 1) or 1)
        factor = int(getattr(args, "replication_factor", 2) or 2)
        world = getattr(args, "world_size", None)
        if world and (jump < 1 or factor < 1 or world % (jump * factor)):
            fits = (
                "--replication-jump 1 --replication-factor 2"
                if world % 2 == 0
                else "no --replication"
            )
            raise mistake(
                f"{prog}: invalid arguments (--replication-jump={jump}, --replication-factor="
                f"{factor}, world size={world}): NVRx's replication groups need jump x factor to "
                f"divide the world size. A restart on fewer nodes needs its own values (here e.g. "
                f"{fits}); the local checkpoints written with the old ones are still used"
            )
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if getattr(args, "use_megatron_fsdp", False) and pp > 1:
        # upstream's Megatron-FSDP builds its device mesh as (dp_cp ep tp) over the whole world:
        # with PP > 1 the world is larger and the model build fails with an einops.EinopsError
        raise mistake(
            f"{prog}: invalid arguments (--use-megatron-fsdp with --pipeline-model-parallel-size="
            f"{pp}): Megatron-FSDP does not support pipeline parallelism (its device mesh spans "
            "data, expert and tensor parallel ranks only); use --pipeline-model-parallel-size 1, "
            "or --use-distributed-optimizer without --use-megatron-fsdp"
        )
    if (
        getattr(args, "eval_interval", 0) is None
        and not getattr(args, "full_validation", False)
        and not getattr(args, "skip_train", False)
    ):
        raise mistake(
            f"{prog}: --eval-interval is required (upstream's default is None, and training "
            "divides --train-iters by it when it builds the data loaders): give --eval-interval N, "
            "the iterations between evaluations (any N with --eval-iters 0)"
        )
