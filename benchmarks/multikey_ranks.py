"""Why `surprisemerge` misses multikey facts (issue #17): each fact sentence's rank by mean surprisal
among the context's sentences, against how many top sentences fill the exact share at 25% (a
sixteenth of the context's tokens; sinks and window ignored). Agnostic prompts, 2k, SmolLM2:

    .venv/bin/python benchmarks/multikey_ranks.py [model] [samples]
"""
import sys

import torch

import kvmerge
from kvmerge.model import token_surprisal
from kvmerge.ops.gsc import STRONG_ANCHOR, delimiter_table
from kvmerge.ops.scores import sentence_mean
from kvmerge_eval.runner import build_samples, prompt_ids


@torch.inference_mode()
def ranks(model, tok, table, ids):
    """(fact sentences as (rank, mean surprisal), sentences the share holds, sentences)."""
    s = kvmerge.Session(model, 1)
    _, hidden, x, _ = s._feed([ids], hidden=True)
    mean = sentence_mean(token_surprisal(model, hidden, x), table[x] == STRONG_ANCHOR)[0]
    seg = torch.nn.functional.pad((table[x[0]] == STRONG_ANCHOR).long().cumsum(-1), (1, 0))[:-1]
    per = torch.zeros(int(seg.max()) + 1).scatter_reduce(0, seg, mean, "amax")
    order = per.argsort(descending=True)
    sizes = torch.bincount(seg)[order].cumsum(0)
    holds = int((sizes <= len(ids) // 16).sum())
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(len(order)))
    facts = [(int(rank[g]), round(float(per[g]), 2)) for g in range(len(per))
             if "special magic" in tok.decode([ids[p] for p in (seg == g).nonzero().squeeze(1).tolist()])
             and g != int(seg[-1])]  # the question's own sentence is not a fact
    return facts, holds, len(per)


def main(name=None, samples=6):
    model, tok = kvmerge.load_model(name)
    table = delimiter_table(tok)
    for task in ("single_number", "multikey"):
        for sample in build_samples("ruler", tok, [2048], samples, subtasks=[task]):
            facts, holds, total = ranks(model, tok, table, prompt_ids(tok, sample)[0])
            print(f"{task} seed {sample.meta['seed']}: the share holds the top {holds} of {total} sentences; "
                  f"facts in context order (rank, mean nats): {facts}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, int(sys.argv[2]) if len(sys.argv) > 2 else 6)
