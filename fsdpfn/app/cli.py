"""The ``fsdpfn`` command: run a recipe from a YAML config, the embedded demo, default configs.

    fsdpfn demo                                    # GRPO on addition: 2 CPU ranks + 1 server
    fsdpfn demo steps=10 warmup.steps=100          # dotted overrides, validated like the YAML
    fsdpfn run examples/ppo.yaml launch.nproc=1    # any recipe config
    fsdpfn run runs/demo/config.yaml --resume      # continue from the latest checkpoint
    fsdpfn config grpo > my.yaml                   # a recipe's full default config
    fsdpfn config my.yaml engine.dtype=float32     # a config file, resolved

``run`` and ``demo`` validate the config (fsdpfn.serde; unknown keys and bad values are errors
naming the dotted key) and hand it to the launcher (fsdpfn/app/launcher.py: the run_dir, the
rollout servers, the trainer ranks, Ctrl-C and supervision). Exit status: 0 done, 130 stopped by
a signal, 2 bad config or command line, else the trainer's (a rank's error is one line:
``fsdpfn: error: <Type>: <message> (trace in run_dir/trainer.log)``). Overrides may come before
or after the flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdpfn.app.launcher import launch

__all__ = ["main", "build_parser", "launch"]


# ---------------------------------------------------------------- argument parsing


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line, like every other refusal of the command
    (``fsdpfn: error: ...``), with where the usage is instead of the usage itself."""

    def error(self, message: str, prog: str | None = None):
        self.exit(2, f"fsdpfn: error: {message} ('{prog or self.prog} --help' shows the "
                     f"usage)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fsdpfn", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="fsdpfn: functional RL and fine-tuning on PyTorch FSDP2.",
        epilog="examples:\n"
               "  fsdpfn demo                                 GRPO demo (CPU, a few minutes)\n"
               "  fsdpfn demo steps=5 warmup.steps=50         a shorter demo\n"
               "  fsdpfn run examples/sft.yaml steps=20       run a recipe config\n"
               "  fsdpfn run runs/demo/config.yaml --resume   continue a run\n"
               "  fsdpfn run job.yaml --prepare               for torchrun on several hosts\n"
               "  fsdpfn config ppo                           print a default config\n"
               "\n'fsdpfn COMMAND --help' describes each command.")
    from fsdpfn import __version__
    parser.add_argument("--version", action="version", version=f"fsdpfn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def launch_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="dotted overrides, values parsed as YAML (steps=10 ppo.kl_coef=0.0 "
                            "launch.nproc=1)")
        p.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in run_dir")
        p.add_argument("--overwrite", action="store_true",
                       help="delete a previous run's files in run_dir and start over")
        p.add_argument("--dry-run", action="store_true",
                       help="validate and print the resolved config and commands; run nothing")

    run = sub.add_parser(
        "run", help="run a recipe from a YAML config",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a recipe (grpo, ppo, sft, rw, dpo) from a YAML config: start the "
                    "rollout server when the recipe needs one, launch the trainer ranks, "
                    "write metrics.jsonl, metrics.png and checkpoints to run_dir.",
        epilog="example: fsdpfn run examples/grpo.yaml steps=20 launch.nproc=2")
    run.add_argument("config", help="recipe config (YAML or JSON) with a 'recipe:' key, or a "
                                    "recipe name (grpo, ppo, sft, rw, dpo) for its defaults")
    launch_options(run)
    run.add_argument("--prepare", action="store_true",
                     help="check and write run_dir (config.yaml, data/), print the torchrun "
                          "command that starts the trainer ranks on each host; start nothing")
    run.set_defaults(func=_cmd_run)

    demo = sub.add_parser(
        "demo", help="GRPO on multi-digit addition with the embedded default (CPU)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The embedded demo: a small Qwen2 and a character tokenizer built in code, "
                    "an SFT warm-up, then GRPO with the built-in rollout server (2 trainer "
                    "ranks, weights pushed every step). Takes a few minutes on a 2-core CPU; "
                    "writes runs/demo/ (run_dir=... to change).",
        epilog="examples:\n  fsdpfn demo\n  fsdpfn demo steps=10 --overwrite\n"
               "  fsdpfn demo --resume")
    launch_options(demo)
    demo.set_defaults(func=_cmd_demo)

    config = sub.add_parser(
        "config", help="print a recipe's full config as YAML (defaults, or a file resolved)",
        description="Print the full config of a recipe (every key, engine: included, with its "
                    "default), a starting point for your own YAML; or a config file resolved "
                    "with its overrides, as `fsdpfn run` would use it.")
    config.add_argument("recipe", nargs="?", help="grpo, ppo, sft, rw or dpo (omit to list), "
                                                  "or a config file")
    config.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    config.set_defaults(func=_cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, sys.argv[1:] if argv is None else list(argv))
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    from fsdpfn.errors import (BatchError, CheckpointError, ConfigError, StaleStateError,
                               WeightSyncError)

    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"fsdpfn: error: {exc}", file=sys.stderr)
        return 2
    except (BatchError, CheckpointError, StaleStateError, WeightSyncError) as exc:
        print(f"fsdpfn: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse with KEY=VALUE overrides accepted anywhere (``run cfg.yaml --resume steps=5`` as
    well as ``run cfg.yaml steps=5 --resume``): argparse's positional list stops at the first
    flag, so what it leaves over that looks like an override joins the others."""
    args, extra = parser.parse_known_args(argv)
    prog = f"{parser.prog} {args.command}" if getattr(args, "command", None) else parser.prog
    flags = [a for a in extra if a.startswith("-")]
    if flags or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(flags or extra)}", prog)
    for override in [*(getattr(args, "overrides", None) or []), *extra]:
        if "=" not in override:  # argparse takes any word as a positional: say what it must be
            parser.error(f"override {override!r}: must be KEY=VALUE (a dotted key, a YAML "
                         f"value: steps=10 optimizer.lr=1e-6)", prog)
    if extra:
        args.overrides = [*(args.overrides or []), *extra]
    return args


# ---------------------------------------------------------------- commands


def _cmd_config(args) -> int:
    from fsdpfn import serde
    from fsdpfn.app.recipes import RECIPE_CONFIGS

    if not args.recipe:
        for name, cls in RECIPE_CONFIGS.items():
            print(f"{name:5s} {(cls.__doc__ or '').strip().splitlines()[0]}")
        return 0
    from fsdpfn.app.terminal import say

    notes: list[str] = []
    print(serde.to_yaml(_resolve(args.recipe, args.overrides, notes)), end="")
    for note in notes:  # on stderr: the YAML on stdout stays a config file as it is
        say(note)
    return 0


def _resolve(config: str, overrides, notes: list | None = None):
    """A recipe name's defaults, or a config file, with the overrides applied and validated;
    ``notes`` gets the launcher's lines on the values chosen for the model (config_from_data)."""
    from fsdpfn.app.recipes import RECIPE_CONFIGS, default_config, load_recipe_config

    if config in RECIPE_CONFIGS and not Path(config).is_file():  # a directory named like a
        return default_config(config, overrides, notes=notes)     # recipe (a run_dir) is none
    if not Path(config).exists():  # a name (a recipe misspelt) or a path: say which is which
        import difflib

        from fsdpfn.errors import ConfigError

        close = difflib.get_close_matches(config, list(RECIPE_CONFIGS), n=1, cutoff=0.6)
        raise ConfigError(f"config: must be a recipe name ({', '.join(RECIPE_CONFIGS)}) or an "
                          f"existing YAML or JSON file, got {config!r} (no such file"
                          f"{f'; did you mean {close[0]!r}?' if close else ''})")
    return load_recipe_config(config, overrides, notes=notes)


def _cmd_run(args) -> int:
    notes: list[str] = []
    cfg = _resolve(args.config, args.overrides, notes)
    return launch(cfg, resume=args.resume, overwrite=args.overwrite, dry_run=args.dry_run,
                  prepare=args.prepare, notes=notes)


def _cmd_demo(args) -> int:
    from fsdpfn.app.recipes import demo_config

    notes: list[str] = []
    cfg = demo_config(args.overrides, notes=notes)
    return launch(cfg, resume=args.resume, overwrite=args.overwrite, dry_run=args.dry_run,
                  notes=notes)


if __name__ == "__main__":
    raise SystemExit(main())
