"""Tokenizing a big corpus: the runner's token store against datasets' own map, and a second run's start.

It writes a corpus of `--mb` megabytes (the Python standard library's sources, repeated, in files of about 1 MB),
then measures, each in a fresh cache and in one run of this script:
  - `run --prepare-data` with data.num_proc=1 on one core (the process pinned to it), and with every core: MB/s
    and the peak memory of its whole process tree (sampled every 0.1 s); `--one-core-mb` measures the one-core rate
    on the corpus's first files only, to spare an hour at 2 GB;
  - datasets' `load_dataset("text", sample_by="document")` and `map(num_proc=<cores>)` with the same tokenizer,
    the same way: MB/s and peak memory;
  - a 1-step training run on the prepared corpus: the seconds from launch to its first step's log line.

    python bench/data_throughput.py --mb 20
    python bench/data_throughput.py --mb 2000 --one-core-mb 200 --work /var/tmp/corpus   # about 12 GB of free disk

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
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=pin)
    peak = PeakMemory(process.pid)
    output, _ = process.communicate()
    seconds = time.perf_counter() - started
    gib = peak.stop()
    if process.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{output}")
    return seconds, gib, output


DATASETS_MAP = """
import sys, datasets
from runner.config.model import byte_tokenizer
tokenizer = byte_tokenizer()
files = sorted(__import__("glob").glob(sys.argv[1] + "/*.txt"))
documents = datasets.load_dataset("text", data_files=files, split="train", sample_by="document", cache_dir=sys.argv[2])
def encode(batch):
    return {"input_ids": [ids + [tokenizer.eos_token_id]
                          for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]}
documents.map(encode, batched=True, remove_columns=["text"], num_proc=int(sys.argv[3]))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=20, help="corpus size in megabytes")
    parser.add_argument("--work", type=Path, default=None, help="where the corpus and the caches go")
    parser.add_argument("--one-core-mb", type=int, default=None,
                        help="measure the one-core rate on about this many megabytes of the corpus (default: all)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="data_throughput_"))
    corpus = work / "corpus"
    size = write_corpus(corpus, args.mb) if not corpus.exists() else sum(p.stat().st_size for p in corpus.iterdir())
    cores = len(os.sched_getaffinity(0))
    run = [sys.executable, "-m", "runner"]
    data = ["data=text_files", f"data.files={corpus}"]
    print(f"corpus: {size / 1e6:,.0f} MB in {len(list(corpus.iterdir()))} files; {cores} cores")
    rates = {}
    for procs in (1, cores):
        cache = work / f"cache_{procs}"
        shutil.rmtree(cache, ignore_errors=True)
        env = {**os.environ, "RUNNER_TOKEN_CACHE": str(cache)}
        files, measured_size = data, size
        if procs == 1 and args.one_core_mb:
            files, measured_size = ["data=text_files", f"data.files={first_files(corpus, work, args.one_core_mb)}"], \
                sum(path.stat().st_size for path in (work / "first").iterdir())
        seconds, gib, _ = measured([*run, "--prepare-data", *files, f"data.num_proc={procs}"], env, work,
                                   one_core=procs == 1)
        rates[procs] = measured_size / 1e6 / seconds
        print(f"runner --prepare-data, num_proc={procs}{' on one core' if procs == 1 else ''}, "
              f"{measured_size / 1e6:,.0f} MB: {seconds:.1f} s, {rates[procs]:.1f} MB/s, peak {gib:.2f} GiB "
              "(process tree)")
    print(f"runner: {cores} processes on {cores} cores / 1 process on one core: {rates[cores] / rates[1]:.2f}x")
    shutil.rmtree(work / "hf_cache", ignore_errors=True)
    seconds, gib, _ = measured([sys.executable, "-c", DATASETS_MAP, str(corpus), str(work / "hf_cache"), str(cores)],
                               dict(os.environ), work)
    print(f"datasets load_dataset + map(num_proc={cores}): {seconds:.1f} s, {size / 1e6 / seconds:.1f} MB/s, "
          f"peak {gib:.2f} GiB; runner / datasets: {rates[cores] / (size / 1e6 / seconds):.2f}x")
    env = {**os.environ, "RUNNER_TOKEN_CACHE": str(work / f"cache_{cores}")}
    started = time.perf_counter()
    process = subprocess.Popen([*run, *data, "train.max_steps=1", "train.log_every=1", "train.eval_every=0",
                                "train.eval_batches=1", "train.save_model=false", "hydra.run.dir=second_run"],
                               env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step = None
    for line in process.stdout:
        if first_step is None and re.search(r"\bstep 1\b", line):
            first_step = time.perf_counter() - started
    process.wait()
    print(f"a second run of the same data: its first step {first_step:.1f} s after launch" if first_step else
          "a second run of the same data logged no step 1")
    if args.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
