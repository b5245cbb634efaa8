"""``python -m pipetrain``: the same as the ``pipetrain`` command."""

import gc
import os
import signal


def _stop_quietly(number: int, frame: object) -> None:
    raise SystemExit(128 + number)


if os.environ.get("PIPETRAIN_LAUNCHED") == "1":  # a worker of `pipetrain train`
    # a Ctrl-C before training starts (while importing) ends it without a traceback;
    # training installs its own handler, which stops at a step boundary and saves
    signal.signal(signal.SIGINT, _stop_quietly)
    signal.signal(signal.SIGTERM, _stop_quietly)

from pipetrain.cli.main import main  # noqa: E402

if __name__ == "__main__":
    status = main()
    # The process ends as any Python program does (atexit handlers run, streams are
    # flushed). main's own objects are garbage now: collected here, while the interpreter
    # is whole (a job's pipeline and process groups close their connections now, not
    # from the tear-down). What is left (torch's, numpy's and matplotlib's modules: some
    # 300,000 objects) is frozen, so that the tear-down does not scan it for cycles
    # (about 1 s of CPU per process on a busy 2-core machine; 0.3 s frozen).
    gc.collect()
    gc.freeze()
    raise SystemExit(status)
