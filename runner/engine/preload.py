"""What a CPU job's workers import, imported once in the forkserver they are forked from (runner/engine/launch.py),
after the libraries' loggers are quieted as in the `run` process: the workers then start without importing them."""

from runner.quiet import quiet_loggers

quiet_loggers()

import datasets  # noqa: E402,F401
import transformers.models.llama.modeling_llama  # noqa: E402,F401

import runner.engine.job  # noqa: E402,F401
import runner.engine.launch  # noqa: E402,F401
import runner.engine.loop  # noqa: E402,F401
