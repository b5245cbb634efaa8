"""``python -m pipetrain``: the same as the ``pipetrain`` command."""

import os
import sys

from pipetrain.cli.main import main

if __name__ == "__main__":
    status = main()
    from pipetrain.launch import in_worker

    if in_worker():
        # a worker of a job has written and closed everything it keeps (records, checkpoint,
        # TensorBoard events) when main returns: it skips the interpreter's tear-down of
        # torch's objects (about a second per worker on a small CPU)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    raise SystemExit(status)
