"""Reading back what the experiment trackers wrote: W&B's offline run files."""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path


def wandb_history(folder: Path) -> tuple[str, list[tuple[int, float]]]:
    """The run id and ``(step, train/loss)`` of the offline W&B run files in ``folder``
    (the ``.wandb`` file: records in 32 KiB blocks, each chunk a 7-byte header of CRC,
    length and kind: full, first, middle, last)."""
    import wandb.proto.wandb_internal_pb2 as pb

    (path,) = glob.glob(str(folder / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    chunks, pending, position = [], b"", 7
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left < 7 or (length, kind) == (0, 0):  # the rest of a block is padding
            position += left
            continue
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            chunks.append(pending)
    run_id, history = "", []
    for raw in chunks:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "run":
            run_id = record.run.run_id
        elif record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            history.append((items["_step"], items["train/loss"]))
    return run_id, history
