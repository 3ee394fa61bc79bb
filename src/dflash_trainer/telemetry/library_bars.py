"""The progress bars of the libraries that load models and data: off unless asked for (`--verbose`).

transformers ("Loading weights"), its GGUF converter ("Converting and de-quantizing GGUF
tensors...", a plain `tqdm.auto` bar that transformers' own switch does not reach), datasets
("Loading dataset from disk") and huggingface_hub draw tqdm bars with `\\r` on stderr; in a log
file each becomes one huge line. The run shows its own progress (telemetry/progress.py).

Each library reads its switch from the environment when it is first imported, so the CLI calls
`set_library_bars` before importing any of them; processes started afterwards (pipeline ranks)
inherit the environment. Libraries already imported are switched off through their own API
(tqdm itself cannot be, once imported). Imports nothing heavy: the CLI calls it before torch.

torchao (the `fp8` extra), once installed, is imported by transformers with every model load; on a
torch it was not built for (the CPU build here) it logs a failed load of each compiled extension and
torch logs a deprecation per enum it registers. Neither matters unless `fp8` is on (drafter/fp8.py
checks torchao itself), so quiet runs raise those two loggers to errors.
"""

from __future__ import annotations

import logging
import os
import sys

# Each library's documented switch: huggingface_hub (and transformers, which follows it),
# datasets, and tqdm's TQDM_<argument> defaults (disable=True) for bars drawn with tqdm directly.
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
# torchao's import-time warnings (its compiled extensions; torch's pytree enum deprecation it triggers)
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def set_library_bars(verbose: bool) -> None:
    """Turn the loaders' progress bars off for this process and the processes it starts; a quiet
    variable the user already set in the environment is left as it is. `verbose`: bars shown, the
    quiet variables removed from the environment (an explicit --verbose wins over an inherited
    switch, e.g. from a parent process that ran quiet)."""
    if verbose:
        for key in QUIET_ENV:
            os.environ.pop(key, None)
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if "transformers" in sys.modules:  # imported before this call: the environment came too late
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
