"""One rank of test_native's failing-fill test: the native engine on `world` ranks, rank 0's fill
raising part way through init_from_rank0_fill, then a good fill. Prints one JSON line: what each
call raised and the master weights after the second."""
import json
import os
import sys

import numpy as np

import strata

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
stage = int(sys.argv[1])
cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
       "zero_optimization": {"stage": stage}}
e = strata.Engine([("g", [("w", [64, 3]), ("b", [64])]), ("h", [("v", [5])])], json.dumps(cfg),
                  rank, world, timeout_ms=int(os.environ["TEST_TIMEOUT_MS"]))
calls = []


def values(g, p, begin, end):
    return (np.arange(begin, end, dtype=np.float32) + 1000 * (2 * g + p)) / 7


def breaks(g, p, begin, end):
    calls.append((g, p, begin, end))
    if len(calls) == 2:
        raise ValueError("the fill broke at its second range")
    return values(g, p, begin, end)


out = {"rank": rank}
try:
    e.init_from_rank0_fill(breaks)
    out["first"] = "no error"
except Exception as ex:  # noqa: BLE001 - the test compares what each rank raised
    out["first"] = f"{type(ex).__name__}: {ex}"
e.init_from_rank0_fill(values)
out["calls"] = len(calls)
out["master"] = [e.read_master(g).tolist() for g in range(2)]
e.close()
print(json.dumps(out))
