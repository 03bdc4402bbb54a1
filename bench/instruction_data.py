"""Instruction data for bench/compare_loops.py, made on this machine: prompt/response pairs of very different
lengths, like a real instruction set, from text nobody here wrote.

    python bench/instruction_data.py out.jsonl --examples 4000

The text is the Python standard library's own source, the `.py` files under `sysconfig.get_paths()["stdlib"]` of
the Python that runs this (its test packages left out): every function and method with a docstring, found by
`ast`, gives one pair,

    prompt    Write the Python function `<module>.<qualname><signature>`: <the docstring's first paragraph>
    response  the function's source (its decorators too), dedented, without the docstring

from a one-line getter (tens of characters) to functions of several thousand characters. The files are read in
sorted order and `examples` of the pairs are drawn with a seeded random sample: the same file for the same Python,
`examples` and `seed`. One JSON object per line, {"prompt": ..., "response": ...}, the format the runner's
`data=instruction_files` reads.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sysconfig
import textwrap
import tokenize
from pathlib import Path
from typing import Optional

# Test suites and test data (some of it deliberately unparsable) are not the library itself.
SKIPPED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def write_instruction_set(path: Path, examples: int, seed: int = 0) -> Path:
    """Writes `examples` prompt/response pairs (fewer if the library holds fewer) to `path` as JSONL; returns it."""
    pairs = stdlib_pairs()
    chosen = random.Random(seed).sample(pairs, min(examples, len(pairs)))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for prompt, response in chosen:
            out.write(json.dumps({"prompt": prompt, "response": response}, ensure_ascii=False) + "\n")
    return path


def stdlib_pairs() -> list[tuple[str, str]]:
    """Every documented function's (prompt, response), the files in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pairs = []
    for file in sorted(root.rglob("*.py")):
        relative = file.relative_to(root)
        if SKIPPED_PARTS & set(relative.parts[:-1]) or not all(
            part.isidentifier() for part in relative.with_suffix("").parts
        ):
            continue
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        try:
            with tokenize.open(file) as f:
                source = f.read()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        pairs += list(_functions(tree, source.splitlines(), module))
    return pairs


def _functions(tree: ast.Module, lines: list[str], module: str):
    def visit(node: ast.AST, scope: list[str]):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                pair = _pair(child, lines, module, ".".join([*scope, child.name]))
                if pair:
                    yield pair
                yield from visit(child, [*scope, child.name, "<locals>"])
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, [*scope, child.name])

    yield from visit(tree, [])


def _pair(
    function: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str], module: str, qualname: str
) -> Optional[tuple[str, str]]:
    docstring = ast.get_docstring(function)
    if not docstring or len(function.body) < 2:
        return None  # undocumented, or nothing but the docstring to write
    doc, after = function.body[0], function.body[1]
    alone = (
        not lines[doc.lineno - 1][: doc.col_offset].strip()
        and doc.end_lineno < after.lineno
        and lines[doc.end_lineno - 1].encode()[doc.end_col_offset :].strip() in (b"",)
    )
    if not alone:
        return None  # the docstring shares a line with the signature or the code: no clean cut
    summary = re.sub(r"\s+", " ", docstring.strip().split("\n\n")[0]).strip()
    first = min([function.lineno, *(d.lineno for d in function.decorator_list)])
    kept = lines[first - 1 : doc.lineno - 1] + lines[doc.end_lineno : function.end_lineno]
    response = textwrap.dedent("\n".join(kept)).strip("\n")
    signature = f"({ast.unparse(function.args)})" + (f" -> {ast.unparse(function.returns)}" if function.returns else "")
    return f"Write the Python function `{module}.{qualname}{signature}`: {summary}", response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--examples", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = write_instruction_set(args.path, args.examples, args.seed)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    lengths = sorted(len(r["prompt"]) + len(r["response"]) for r in rows)
    print(
        f"{path}: {len(rows)} examples, characters per example: min {lengths[0]}, median "
        f"{lengths[len(lengths) // 2]}, max {lengths[-1]}"
    )


if __name__ == "__main__":
    main()
