"""Issue #18: one decode step over a plain (full) cache with transformers' stock SDPA call (GQA by
`enable_gqa`) against kvmerge's `packed_sdpa` (query heads packed per KV head), alternated in
one process on one prefilled cache so the machine's noise hits both alike.

    python benchmarks/decode_gqa_ab.py 8192 8      # context tokens, batch
"""

import sys
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kvmerge.attention as attention
from kvmerge import Session
from kvmerge.model import load_model

packed = attention.packed_sdpa


def stock(query, key, value, bias=None, scaling=None):
    class Module:
        num_key_value_groups = query.shape[1] // key.shape[1]

    return sdpa_attention_forward(Module, query, key, value, None, scaling=scaling, is_causal=True)[0]


@torch.inference_mode()
def main(n: int, batch: int, rounds: int = 4, steps: int = 4) -> None:
    model, tok = load_model(None)
    session = Session(model, 1, None, tok)
    session.prefill([torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(0)).tolist()])
    session.repeat_rows(batch)
    session.reserve(2 * rounds * (steps + 1))
    token = [[7]] * batch
    ms = {"stock": [], "packed": []}
    for _ in range(rounds):
        for name, fn in (("stock", stock), ("packed", packed)):
            attention.packed_sdpa = fn
            session.forward(token)
            t0 = time.perf_counter()
            for _ in range(steps):
                session.forward(token)
            ms[name].append(1e3 * (time.perf_counter() - t0) / steps)
    attention.packed_sdpa = packed
    s, p = (sorted(ms[k])[rounds // 2] for k in ("stock", "packed"))
    print(f"{n} tokens x batch {batch}: stock {s:.1f} ms/step, packed {p:.1f} ms/step (median of {rounds}), "
          f"packed/stock {p / s:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
