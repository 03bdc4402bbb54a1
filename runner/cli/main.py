"""`run`: the command line. Hydra composes the spec (runner/cli/app.py), which is checked before anything is
written, then the job runs; a few commands of the runner's own (recipes, accelerate files) answer without Hydra.

User errors (an unknown key or option, a wrong value, an impossible combination, a missing file) end in one
line on stderr and exit status 2, before Hydra creates an output directory. Exit statuses: runner/errors.py.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from runner.cli import recipes
from runner.cli.app import hydra_main
from runner.cli.compose import (
    RECIPES_DIR,
    checked_recipe,
    choosable_recipes,
    compose_config,
    mode_from_the_command_line,
    register,
)
from runner.cli.help import help_text, key_help
from runner.cli.recipes import new_recipe
from runner.cli.run_dir import resume_arguments, trained_arguments
from runner.cli.user_errors import USER_ERRORS, one_line
from runner.config.spec import load_spec
from runner.errors import (
    EndedInOneLine,
    ExitStatus,
    LaunchRefused,
    NonFiniteLoss,
    NothingToLaunch,
    RewardFailed,
    SpecError,
    Stopped,
    SweepStopped,
    WorkerFailed,
    WriteFailed,
)
from runner.library_noise import quiet_libraries


def main() -> None:
    quiet_libraries()
    args = sys.argv[1:]
    if only_prints(args):
        atexit.register(nothing_left_to_collect)
    recipe_dirs = recipes.search_path(RECIPES_DIR)
    if "--help" in args or "-h" in args:
        asked = args[args.index("--help" if "--help" in args else "-h") + 1 :][:1]
        try:
            print(key_help(asked[0]) if asked else help_text(recipe_dirs))
        except SpecError as error:
            refuse(str(error))
        return
    shown = shown_config(args)
    if shown == "job":  # the runner's own: the checked spec, as the run would see it (Hydra's is unchecked)
        sys.argv[1:] = [*without_flag(args), "hydra.callbacks.validate_spec.print_spec=true"]
    elif shown and "--resolve" not in args:
        sys.argv.append("--resolve")
    # Hydra would print its own multi-line report and exit 1; the runner reports user errors itself.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        if args[:1] and args[0] in COMMANDS:
            COMMANDS[args[0]](recipe_dirs, args[1:])
            return
        sys.argv[1:] = trained_arguments(resume_arguments(sys.argv[1:]))
        register(*choosable_recipes(recipe_dirs, sys.argv[1:]))
        mode_from_the_command_line(sys.argv[1:])
        hydra_main()
    except USER_ERRORS as error:
        refuse(one_line(error))
    except AssertionError as error:
        # OmegaConf asserts when an override reaches into a section that is null, such as an unselected tracker.
        if not str(error).startswith("Unexpected type for root: NoneType"):
            raise
        keys = [arg.split("=", 1)[0] for arg in sys.argv[1:] if "=" in arg and not arg.startswith("-")]
        refuse(
            f"a key in {', '.join(keys)} sits in a section this spec leaves unset; select it first "
            "(for example tracker=wandb before tracker.wandb.project=...)"
        )
    except LaunchRefused as refusal:
        refuse(str(refusal))
    except NothingToLaunch:
        return
    except (WorkerFailed, NonFiniteLoss, RewardFailed) as failure:
        print(f"run: error: {failure}", file=sys.stderr)
        sys.exit(ExitStatus.FAILED)
    except WriteFailed as failure:
        print(f"run: error: {failure}", file=sys.stderr)
        sys.exit(ExitStatus.WRITE_FAILED)
    except EndedInOneLine as ended:
        print(f"run: error: {ended}", file=sys.stderr)
        sys.exit(ended.status)
    except (Stopped, SweepStopped) as stopped:
        print(f"run: {stopped}", file=sys.stderr)
        sys.exit(ExitStatus.STOPPED)
    except KeyboardInterrupt:  # a job with nothing to checkpoint (evaluate, generate) writes its results at its end
        print("run: interrupted (Ctrl-C) before the job finished", file=sys.stderr)
        sys.exit(ExitStatus.STOPPED)


def only_prints(args: list[str]) -> bool:
    """Whether the command prints and ends, running no job: `--help`, `--cfg job|hydra|all`."""
    return "--help" in args or "-h" in args or shown_config(args) is not None


def nothing_left_to_collect() -> None:
    """At the exit of a command that only prints: what the process holds is left out of the collection Python makes
    as it exits, after the exit handlers, which would walk every object that the imports and Hydra's compositions
    made (a tenth of `run --cfg job`) to free memory that the exit frees anyway."""
    gc.freeze()


def shown_config(args: list[str]) -> Optional[str]:
    """What `--cfg job|hydra|all` (or `-c`) asks Hydra to print; None without it."""
    for flag in ("--cfg", "-c"):
        if flag in args and args.index(flag) + 1 < len(args):
            return args[args.index(flag) + 1]
    return None


def without_flag(args: list[str]) -> list[str]:
    """The arguments without `--cfg job` and `--resolve`: the job's spec is always shown resolved."""
    at = next(i for i, arg in enumerate(args) if arg in ("--cfg", "-c"))
    return [arg for arg in args[:at] + args[at + 2 :] if arg != "--resolve"]


def refuse(message: str) -> None:
    print(f"run: error: {message}", file=sys.stderr)
    sys.exit(ExitStatus.BAD_INPUT)


def list_recipes(recipe_dirs: list[Path], args: list[str]) -> None:
    print(recipes.listing(recipe_dirs, RECIPES_DIR))


def copy_recipe(recipe_dirs: list[Path], args: list[str]) -> None:
    if len(args) not in (1, 2):
        raise recipes.RecipeError("usage: run --copy-recipe <name> [<new name>]")
    target = recipes.copy(recipe_dirs, args[0], args[1] if len(args) == 2 else None)
    print(f"copied recipe {args[0]} to {target}; edit it and run it with: run recipe={target.stem}")


def recipe_from_accelerate(recipe_dirs: list[Path], args: list[str]) -> None:
    if len(args) not in (1, 2):
        raise recipes.RecipeError("usage: run --from-accelerate <accelerate config .yaml> [<recipe name>]")
    from runner.tools.accelerate.reader import recipe_of  # only here: every other command starts faster

    source = Path(args[0])
    target = new_recipe(args[1] if len(args) == 2 else source.stem, f"run --from-accelerate {source} <recipe name>")
    text, lines = recipe_of(source, target.stem)
    try:
        checked_recipe(text)
    except SpecError as refusal:
        raise SpecError(f"{source}: the recipe it makes would be refused: {refusal}") from None
    target.parent.mkdir(exist_ok=True)
    target.write_text(text)
    print("\n".join(lines))
    print(f"wrote {target}; run it with: run recipe={target.stem}")


def print_accelerate_config(recipe_dirs: list[Path], overrides: list[str]) -> None:
    """The accelerate config of the spec that `run <overrides>` would compose; what it cannot say, on stderr."""
    from runner.tools.accelerate.writer import accelerate_file  # only here: every other command starts faster

    text, notes = accelerate_file(load_spec(compose_config(overrides)))
    print(text, end="")
    print("\n".join(notes), file=sys.stderr)


def prepare_data(recipe_dirs: list[Path], overrides: list[str]) -> None:
    """Tokenizes the data of the spec that `run <overrides>` would compose into the token store, where its runs
    will read it: on a CPU or login node, before a GPU job starts."""
    from runner.cli.app import validated
    from runner.components.modeling import build_tokenizer
    from runner.config.data import DataFormat
    from runner.data.splits import token_splits
    from runner.data.store import size_on_disk

    spec = validated(compose_config(overrides), Path.cwd(), on_this_machine=False)
    if spec.data.streaming or spec.data.format is DataFormat.prompt:
        raise SpecError(
            f"data.{'streaming=true' if spec.data.streaming else 'format=prompt'} tokenizes as the job "
            "starts and stores nothing: --prepare-data has nothing to do"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    train, evaluation = token_splits(spec.data, build_tokenizer(spec.model), spec.seed)
    store = train.store.path.parent
    documents = train.store.meta["documents"]
    print(
        f"token store {store}: {size_on_disk(store) / 2**20:,.1f} MiB, {documents:,} documents; "
        f"{len(train):,} train and {len(evaluation):,} eval rows of up to {spec.data.seq_len} tokens "
        f"({int(train.tokens.sum()):,} train tokens)"
    )


def show_data(recipe_dirs: list[Path], arguments: list[str]) -> None:
    """Prints the first N (default 3) training rows of the spec that `run <overrides>` would compose, the tokens
    that train marked, and the counts of rows, tokens and trained tokens."""
    from runner.cli.app import validated
    from runner.components.modeling import build_tokenizer
    from runner.config.data import DataFormat
    from runner.data.show import counts, shown_row
    from runner.data.splits import token_splits

    count = int(arguments.pop(0)) if arguments and arguments[0].isdigit() else 3
    spec = validated(compose_config(arguments), Path.cwd(), on_this_machine=False)
    if spec.data.streaming:
        raise SpecError(
            "--show-data reads the token store, which data.streaming=true does not write; drop "
            "data.streaming to see the rows"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    tokenizer = build_tokenizer(spec.model)
    if spec.data.format is DataFormat.prompt:  # task=grpo's: prompts, whose completions are sampled as it trains
        from runner.data.prompts import prompt_splits, read_prompts
        from runner.data.show import shown_prompts

        print(
            shown_prompts(
                *prompt_splits(read_prompts(spec.data, tokenizer), spec.data.eval_fraction, spec.seed), count, tokenizer
            )
        )
        return
    train, evaluation = token_splits(spec.data, tokenizer, spec.seed)
    colour = sys.stdout.isatty()
    pairs = spec.data.format is DataFormat.preference
    for index in range(min(count, len(train))):
        rows = train.batch([index])  # a row, or a pair's two: the chosen, then the rejected
        names = [f"train pair {index}, chosen", f"train pair {index}, rejected"] if pairs else [f"train row {index}"]
        for name, values in zip(names, zip(*rows.values())):
            print(f"--- {name}\n{shown_row(dict(zip(rows, values)), tokenizer, colour)}")
    print(
        f"--- {'green' if colour else '[[ ]]'}: trained; {'┃'}: between packed examples\n"
        f"{counts(train, evaluation, spec.data.seq_len, 'pairs' if pairs else 'rows')}"
    )


# The runner's own commands, which answer without composing a job.
COMMANDS: dict[str, Callable[[list[Path], list[str]], None]] = {
    "--recipes": list_recipes,
    "--copy-recipe": copy_recipe,
    "--from-accelerate": recipe_from_accelerate,
    "--to-accelerate": print_accelerate_config,
    "--prepare-data": prepare_data,
    "--show-data": show_data,
}
