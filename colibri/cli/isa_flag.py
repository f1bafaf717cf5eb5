"""`--isa` of the commands that run a model: the target numba compiles the kernels for, settled
before any kernel is compiled (`runtime/isa_choice.py` chooses one by timing, for `auto`).

numba reads its target when it first compiles, so another target than this process's means
running the same command again in a process that compiles for it (`os.execve`, the command line
unchanged). Only a command started from a shell does that; one called in-process (`main([...])`,
as the demo and the tests do) keeps its process's target under `auto`.
"""

from __future__ import annotations

import argparse
import os
import sys

from colibri.runtime.isa_choice import AUTO, CHOICES, IsaError, choose, process_target

ENV = "COLIBRI_ISA"  # the default of --isa, when set
_NUMBA_TARGET = ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")


def add_isa_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--isa", choices=CHOICES, default=None,
                   help="the instructions the kernels are compiled for: auto = whichever multiplies this model's "
                        "matrices fastest on this machine, timed on the first run (seconds, plus numba compiling "
                        "each candidate once) and kept beside numba's cache; native = all this CPU has; avx2 = AVX2 "
                        "and FMA only (an AMD Zen 2/3); avx2-vnni = AVX2 with AVX-VNNI (Intel Alder Lake); generic "
                        f"= no AVX. The answers are the same to within float rounding (default: ${ENV}, else auto)")


def _threads(args: argparse.Namespace) -> int:
    from colibri.runtime.kernels import most_threads

    return args.threads if isinstance(args.threads, int) else most_threads()


def settle_isa(args: argparse.Namespace, command: str) -> str:
    """The target this command's kernels compile for; replaces the process with one that
    compiles for another when --isa (or auto's timing) asks for it and the command may."""
    requested = args.isa or os.environ.get(ENV) or AUTO
    if requested not in CHOICES:
        raise SystemExit(f"colibri {command}: error: ${ENV}={requested!r} unknown (known: {', '.join(CHOICES)})")
    current, restartable = process_target(), getattr(args, "restartable", False)
    if requested == AUTO:
        if not restartable or os.environ.get("NUMBA_CPU_NAME"):
            return current  # chosen by whoever started this process
        try:
            choice = choose(args.model, _threads(args), report=lambda line: _say(command, line))
        except IsaError as e:
            _say(command, f"{e}; the kernels stay {current}")
            return current
        if not choice.cached and choice.seconds_per_token:
            _say(command, f"kernels for {choice.target} (this model's products a token: {choice.timings()})")
        requested = choice.target
    if requested == current:
        return current
    if not restartable:
        raise SystemExit(f"colibri {command}: error: --isa {requested} needs a process of its own (this one "
                         f"compiles for {current}); run the command from a shell")
    env = {k: v for k, v in os.environ.items() if k not in _NUMBA_TARGET}
    if requested != "native":
        from colibri.runtime.kernels.emitter import target_environment

        env.update(target_environment(requested))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _say(command: str, line: str) -> None:
    print(f"colibri {command}: {line}", file=sys.stderr, flush=True)
