#!/usr/bin/env python3
"""Cuts the first N tokens of each domain of shared/data/olmoe-routing into tests/data/olmoe-routing.

The slice lets CI replay real routing without the full data set (see that folder's README.md).
Usage: scripts/make_routing_slice.py SRC_DIR DST_DIR [N=2048]
"""
import sys
import numpy as np

src, dst = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
for domain in ("general", "coding"):
    for name in ("topk_idx", "topk_weights", "sequence_id", "generated_token_index"):
        a = np.load(f"{src}/{domain}.{name}.npy")
        np.save(f"{dst}/{domain}.{name}.npy", np.ascontiguousarray(a[:n]))
