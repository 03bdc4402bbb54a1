"""Tokenizing a big corpus: the runner's token store against datasets' own map, and a second run's start.

It writes a corpus of `--mb` megabytes (the Python standard library's sources, repeated, in files of about 1 MB),
then measures, each in a fresh cache and in one run of this script (`--parts` picks some):
  - one-core, every-core: `run --prepare-data` with data.num_proc=1 pinned to one core, and with every core: MB/s
    and the peak memory of its whole process tree (sampled every 0.1 s);
  - datasets: datasets' `load_dataset("text", sample_by="document")` and `map(num_proc=<cores>)` with the same
    tokenizer, the same way (`--datasets-batch-size`: its map's batch, by default datasets' own 1000);
  - whole: `run --prepare-data` on every core of the whole corpus, where `--subset-mb` made the three above compare
    on its first files only (at 2 GB, one core alone takes half an hour);
  - second-run: a 1-step training run on the prepared corpus: the seconds from launch to its first step's log line.

    python bench/data_throughput.py --mb 20
    python bench/data_throughput.py --mb 2000 --subset-mb 200 --work /var/tmp/corpus    # about 12 GB of free disk

Timings vary with the machine's load: compare the figures of one run with each other, not across runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_corpus(folder: Path, megabytes: int) -> int:
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    folder.mkdir(parents=True, exist_ok=True)
    written, index, chunk = 0, 0, []
    for path in itertools.cycle(sources):
        try:
            chunk.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if sum(map(len, chunk)) >= 1 << 20:
            text = "".join(chunk)
            (folder / f"part{index:05d}.txt").write_text(text)
            written += len(text.encode())
            index, chunk = index + 1, []
            if written >= megabytes * 10**6:
                return written
    return written


class PeakMemory:
    """The largest sum of RSS over a process and its descendants, sampled every 0.1 s."""

    def __init__(self, pid: int):
        import psutil

        self.process, self.peak, self.done = psutil.Process(pid), 0, False
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        import psutil

        while not self.done:
            try:
                tree = [self.process, *self.process.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.1)

    def stop(self) -> float:
        self.done = True
        self.thread.join()
        return self.peak / 2**30


def measured(command: list[str], env: dict[str, str], cwd: Path, one_core: bool = False) -> tuple[float, float, str]:
    """Seconds, peak GiB of the process tree, and the output; `one_core`: the process tree pinned to one core."""
    started = time.perf_counter()
    pin = (lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})) if one_core else None
    process = subprocess.Popen(
        command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=pin
    )
    peak = PeakMemory(process.pid)
    output, _ = process.communicate()
    seconds = time.perf_counter() - started
    gib = peak.stop()
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output}")
    return seconds, gib, output


DATASETS_MAP = """
import sys, datasets
from runner.components.modeling import byte_tokenizer
tokenizer = byte_tokenizer()
files = sorted(__import__("glob").glob(sys.argv[1] + "/*.txt"))
documents = datasets.load_dataset("text", data_files=files, split="train", sample_by="document", cache_dir=sys.argv[2])
def encode(batch):
    return {"input_ids": [ids + [tokenizer.eos_token_id]
                          for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]}
documents.map(encode, batched=True, remove_columns=["text"], num_proc=int(sys.argv[3]), batch_size=int(sys.argv[4]))
"""


def first_files(corpus: Path, work: Path, megabytes: int) -> Path:
    """A folder of links to the corpus's first files, about `megabytes` of them."""
    first = work / "first"
    shutil.rmtree(first, ignore_errors=True)
    first.mkdir()
    total = 0
    for path in sorted(corpus.iterdir()):
        if total >= megabytes * 10**6:
            break
        (first / path.name).symlink_to(path)
        total += path.stat().st_size
    return first


PARTS = ("one-core", "every-core", "datasets", "whole", "second-run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=20, help="corpus size in megabytes")
    parser.add_argument("--work", type=Path, default=None, help="where the corpus and the caches go")
    parser.add_argument(
        "--subset-mb",
        type=int,
        default=None,
        help="compare one core, every core and datasets on about this many megabytes of the corpus "
        "(its first files; default: all of it)",
    )
    parser.add_argument("--datasets-batch-size", type=int, default=1000, help="datasets' map batch size (its default)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which measurements, of {', '.join(PARTS)}")
    args = parser.parse_args()
    parts = args.parts.split(",")
    work = args.work or Path(tempfile.mkdtemp(prefix="data_throughput_"))
    corpus = work / "corpus"
    size = write_corpus(corpus, args.mb) if not corpus.exists() else sum(p.stat().st_size for p in corpus.iterdir())
    subset, subset_size = corpus, size
    if args.subset_mb:
        subset = first_files(corpus, work, args.subset_mb)
        subset_size = sum(path.stat().st_size for path in subset.iterdir())
    cores = len(os.sched_getaffinity(0))
    print(
        f"corpus: {size / 1e6:,.0f} MB in {len(list(corpus.iterdir()))} files; {cores} cores; the comparisons on "
        f"{subset_size / 1e6:,.0f} MB"
    )
    rates = {}
    for part, folder, procs in (("one-core", subset, 1), ("every-core", subset, cores), ("whole", corpus, cores)):
        if part not in parts or (part == "whole" and folder == subset and "every-core" in parts):
            continue
        rates[part] = prepare(work, folder, procs, part)
    if {"one-core", "every-core"} <= rates.keys():
        print(
            f"runner: {cores} processes on {cores} cores / 1 process on one core: "
            f"{rates['every-core'] / rates['one-core']:.2f}x"
        )
    if "datasets" in parts:
        shutil.rmtree(work / "hf_cache", ignore_errors=True)
        try:
            seconds, gib, _ = measured(
                [
                    sys.executable,
                    "-c",
                    DATASETS_MAP,
                    str(subset),
                    str(work / "hf_cache"),
                    str(cores),
                    str(args.datasets_batch_size),
                ],
                dict(os.environ),
                work,
            )
        except RuntimeError as failed:
            print(
                f"datasets load_dataset + map(num_proc={cores}, batch_size={args.datasets_batch_size}), "
                f"{subset_size / 1e6:,.0f} MB: failed: {str(failed).strip().splitlines()[-1]}"
            )
        else:
            rate = subset_size / 1e6 / seconds
            compared = f"; runner / datasets: {rates['every-core'] / rate:.2f}x" if "every-core" in rates else ""
            print(
                f"datasets load_dataset + map(num_proc={cores}, batch_size={args.datasets_batch_size}), "
                f"{subset_size / 1e6:,.0f} MB: {seconds:.1f} s, {rate:.1f} MB/s, peak {gib:.2f} GiB{compared}"
            )
    if "second-run" in parts:
        print(second_run(work, corpus))
    if args.work is None:
        shutil.rmtree(work)


def prepare(work: Path, folder: Path, procs: int, part: str) -> float:
    """`run --prepare-data` of `folder` on `procs` processes (one: pinned to one core), in a fresh cache: MB/s."""
    cache = work / f"cache_{part}"
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "RUNNER_TOKEN_CACHE": str(cache)}
    seconds, gib, _ = measured(
        [
            sys.executable,
            "-m",
            "runner",
            "--prepare-data",
            "data=text_files",
            f"data.files={folder}",
            f"data.num_proc={procs}",
        ],
        env,
        work,
        one_core=procs == 1,
    )
    megabytes = sum(path.stat().st_size for path in folder.iterdir()) / 1e6
    print(
        f"runner --prepare-data, num_proc={procs}{' on one core' if procs == 1 else ''}, {megabytes:,.0f} MB: "
        f"{seconds:.1f} s, {megabytes / seconds:.1f} MB/s, peak {gib:.2f} GiB (process tree)"
    )
    return megabytes / seconds


def second_run(work: Path, corpus: Path) -> str:
    """A 1-step run of the corpus prepared on every core: the seconds from launch to its first step's log line."""
    cache = next(path for path in (work / "cache_whole", work / "cache_every-core") if path.exists())
    shutil.rmtree(work / "second_run", ignore_errors=True)
    started = time.perf_counter()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runner",
            "data=text_files",
            f"data.files={corpus}",
            "train.max_steps=1",
            "train.log_every=1",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.save_model=false",
            "hydra.run.dir=second_run",
        ],
        env={**os.environ, "RUNNER_TOKEN_CACHE": str(cache)},
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first_step = None
    for line in process.stdout:
        if first_step is None and re.search(r"\bstep 1\b", line):
            first_step = time.perf_counter() - started
    process.wait()
    return (
        f"a second run of the same data: its first step {first_step:.1f} s after launch"
        if first_step
        else "a second run of the same data logged no step 1"
    )


if __name__ == "__main__":
    main()
