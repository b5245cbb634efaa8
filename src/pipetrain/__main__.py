"""``python -m pipetrain``: the same as the ``pipetrain`` command."""

import os
import sys

from pipetrain.cli.main import main

if __name__ == "__main__":
    status = main()
    from pipetrain.launch import in_worker

    if in_worker():
        # A worker of a job has written and closed everything it keeps (records,
        # checkpoint, TensorBoard events) when main returns. The interpreter's tear-down
        # of torch's objects after that has been seen to hang (a resumed run's worker,
        # past its last step, until killed) or abort: the worker ends here instead.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    raise SystemExit(status)
