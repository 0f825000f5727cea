"""The reward worker process, and what both ends of its pipe share (stdlib only).

fsdpfn.app.recipes.reward starts this file as a script in a fresh interpreter
(``python -P _reward_worker.py FD PARENT_PID main|thread``): it never imports fsdpfn (nor torch),
so a worker starts in tens of milliseconds and a hung one is replaced at once. It dies with its
parent, mid-call too (fsdpfn/wire/lifeline.py's ``exit_with_parent``, loaded from its file; the
kernel's parent-death signal only when the parent started it from its main thread). Over the
socket FD it speaks multiprocessing.connection messages:

    parent -> worker   {"sys_path": [...], "spec": "pkg.mod:fn", "kwargs": {...}}   once, first
    worker -> parent   ("ready", pid) | ("init_error", "ImportError: ...")
    parent -> worker   ("one", prompt, completion, answer, sample)
                       ("batch", prompts, completions, answers, samples)
    worker -> parent   [outcome, ...]     one per sample: ("ok", float) | (kind, message)
    parent -> worker   None               exit

``kind`` is "exception" or "invalid"; timeouts and dead workers are the parent's to name.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import signal
import sys
import traceback

# built-in reward modules that need only the stdlib: a worker loads them from their file, under
# their own name, instead of importing the fsdpfn package (and torch) first
_LIGHT_MODULES = {"fsdpfn.app.recipes.rewards": os.path.join(os.path.dirname(__file__), "rewards.py")}
_LIFELINE_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                               "wire", "lifeline.py")


FORMAT_RULE = "must be 'package.module:function' or 'path/to/file.py:function'"


class SpecError(Exception):
    """A reward spec cannot be resolved; the message says why, without the key or the spec."""


# ---------------------------------------------------------------- resolving "module:function"


def split_spec(spec) -> tuple[str, str]:
    """'pkg.mod:fn' or 'path/to/file.py:fn' -> (module or path, attribute path)."""
    if not isinstance(spec, str) or ":" not in spec:
        raise SpecError(FORMAT_RULE)
    where, _, name = spec.rpartition(":")
    if not where or not name or not all(part.isidentifier() for part in name.split(".")):
        raise SpecError(FORMAT_RULE)
    return where, name


def _is_path(where: str) -> bool:
    return where.endswith(".py") or os.sep in where or "/" in where


def _import_file(path: str):
    path = os.path.abspath(path)
    name = "_fsdpfn_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    return _load_from_file(name, path)


def _load_from_file(name: str, path: str):
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_target(where: str, *, light: bool = False):
    """The module named by the part of a spec before the colon (``light``: built-ins by file).
    A module name is looked up on the Python path and in the directory the run started from,
    as ``python -m`` would (the ``fsdpfn`` command's own script does not put it there)."""
    try:
        if _is_path(where):
            return _import_file(where)
        if light and where in _LIGHT_MODULES:
            return _load_from_file(where, _LIGHT_MODULES[where])
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        return importlib.import_module(where)
    except Exception as exc:  # a module that fails at import time is as unusable as a missing one
        raise SpecError(f"cannot import {where!r} ({type(exc).__name__}: {exc})") from exc


def resolve(spec, *, light: bool = False):
    """The callable named by ``spec``; SpecError says which part fails."""
    where, name = split_spec(spec)
    obj = import_target(where, light=light)
    for part in name.split("."):
        if not hasattr(obj, part):
            raise SpecError(f"module {where!r} has no attribute {name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SpecError(f"{name!r} in {where!r} is not callable (it is a {type(obj).__name__})")
    return obj


# ---------------------------------------------------------------- calling and checking


def yields(fn) -> bool:
    """Whether calling ``fn`` (a function, or an object through its ``__call__``) makes a
    generator rather than a result: a reward or workflow that yields what it should return."""
    import inspect  # here: a worker's start imports only what it must

    return any(inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f)
               for f in (fn, getattr(fn, "__call__", None)))


FLOAT32_MAX = 3.4028234663852886e38  # a reward past it would be inf in the batch


def _is_numpy_bool(value) -> bool:
    # np.isclose(...) returns one; it is not a numbers.Real, and numpy is not imported here
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def to_reward(value) -> float:
    """bool -> 0.0/1.0, a finite real number within float32's range -> float; anything else
    raises ValueError."""
    if isinstance(value, bool) or _is_numpy_bool(value):
        return float(value)
    if isinstance(value, numbers.Real) and math.isfinite(value) and abs(value) <= FLOAT32_MAX:
        return float(value)
    text = repr(value)
    raise ValueError(f"must return a finite number within float32's range (|x| <= 3.4e38: the "
                     f"batch holds rewards in float32) or a bool, got {text[:200]}"
                     f" ({type(value).__name__})")


def describe(exc: BaseException) -> str:
    """'ZeroDivisionError: division by zero (at reward.py:12 in score)'."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        last = frames[-1]
        where = f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return f"{type(exc).__name__}: {exc}{where}"


def _checked(values, n: int) -> list[tuple]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"a {type(values).__name__}" + (f" of length {len(values)}"
                                              if isinstance(values, (list, tuple)) else "")
        return [("invalid", f"a batched reward must return a list of {n} numbers, got {got}")] * n
    return [_one_checked(v) for v in values]


def _one_checked(value) -> tuple:
    try:
        return ("ok", to_reward(value))
    except ValueError as exc:
        return ("invalid", str(exc))


def call(fn, request: tuple, kwargs: dict) -> list[tuple]:
    """Run one request (see the module docstring) and return one outcome per sample."""
    mode, prompts, completions, answers, samples = request
    try:
        if mode == "one":
            value = fn(prompts, completions, answer=answers, sample=samples, **kwargs)
        else:
            value = fn(list(prompts), list(completions), answers=list(answers),
                       samples=list(samples), **kwargs)
        if hasattr(value, "__await__"):  # an async def reward (an LLM judge's client...)
            value = _awaited(value)
    except Exception as exc:
        n = 1 if mode == "one" else len(prompts)
        return [("exception", describe(exc))] * n
    return [_one_checked(value)] if mode == "one" else _checked(value, len(prompts))


def _awaited(awaitable):
    """The result of an async reward's call, run to completion on an event loop of its own."""
    import asyncio

    async def wait():
        return await awaitable

    return asyncio.run(wait())


# ---------------------------------------------------------------- the worker loop


def _serve(conn) -> None:
    init = conn.recv()
    sys.path[:] = init["sys_path"]
    try:
        fn = resolve(init["spec"], light=True)
        prepare = getattr(fn, "prepare", None)
        if callable(prepare):  # the reward's one-time set-up, before any timed call
            prepare()
    except Exception as exc:
        conn.send(("init_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent is gone
            return
        if request is None:
            return
        conn.send(call(fn, request, init["kwargs"]))


def main(argv: list[str]) -> None:
    from multiprocessing.connection import Connection

    lifeline = _load_from_file("_fsdpfn_lifeline", _LIFELINE_FILE)  # stdlib only
    lifeline.exit_with_parent(int(argv[2]), kernel=argv[3] == "main")
    # Ctrl-C reaches the whole process group: the parent decides, the workers go on
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _serve(Connection(int(argv[1])))


if __name__ == "__main__":
    main(sys.argv)
