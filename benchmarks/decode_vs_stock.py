"""Issue #18: one decoding step through kvmerge's Session (plain cache) against stock transformers
(`DynamicCache`, sdpa), alternated in one process on the same context so the machine's noise hits
both alike: what kvmerge's runtime adds per step beyond the model's own kernels.

    python benchmarks/decode_vs_stock.py 1024 1      # context tokens, batch
"""

import sys
import time

import torch
from transformers import DynamicCache

from kvmerge import Session, load_model


@torch.inference_mode()
def main(n: int, batch: int, rounds: int = 5, steps: int = 4) -> None:
    model, tok = load_model(None)
    ids = torch.randint(3, 40000, (batch, n), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    model(ids, past_key_values=cache, use_cache=True)
    session = Session(model, batch, None, tok)
    session.prefill(ids.tolist())
    session.reserve(rounds * steps)
    token = torch.full((batch, 1), 7)
    ms = {"stock": [], "kvmerge": []}
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            model(token, past_key_values=cache, use_cache=True)
        ms["stock"].append(1e3 * (time.perf_counter() - t0) / steps)
        t0 = time.perf_counter()
        for _ in range(steps):
            session.forward(token.tolist())
        ms["kvmerge"].append(1e3 * (time.perf_counter() - t0) / steps)
    s, k = (sorted(ms[x])[rounds // 2] for x in ("stock", "kvmerge"))
    print(f"{n} tokens x batch {batch}: stock transformers {s:.1f} ms/step, kvmerge {k:.1f} ms/step "
          f"(median of {rounds}), kvmerge/stock {k / s:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
