"""How much the estimated softmax normaliser (vocabularies of 32,768 ids or more) changes surprisal and
surprisemerge's exact share, and what it saves, on one model (the second argument: the threshold):

    .venv/bin/python benchmarks/surprisal_estimate.py gemma3-270m
    .venv/bin/python benchmarks/surprisal_estimate.py smollm2-135m
"""
import sys
import time

import torch

import kvmerge
from kvmerge.model import token_surprisal
from kvmerge.ops.gsc import STRONG_ANCHOR, delimiter_table
from kvmerge.ops.scores import sentence_mean
from kvmerge_eval.runner import build_samples, prompt_ids

name = sys.argv[1]
below = int(sys.argv[2]) if len(sys.argv) > 2 else kvmerge.model.EXACT_SURPRISAL_BELOW
model, tok = kvmerge.load_model(name)
table = delimiter_table(tok)
for task in ("niah", "fidelity"):
    for sample in build_samples(task, tok, [2048], 3):
        ids = prompt_ids(tok, sample)[0] if task == "niah" else sample.context
        s = kvmerge.Session(model, 1)
        with torch.inference_mode():
            hidden, x = s.hidden_states([ids])
            exact = token_surprisal(model, hidden, x, exact_below=10**9)
            approx = token_surprisal(model, hidden, x, exact_below=below)
        ends = table[x] == STRONG_ANCHOR
        se, sa = sentence_mean(exact, ends)[0], sentence_mean(approx, ends)[0]
        k = len(ids) // 16  # surprisemerge's exact share at 25%: a quarter of the budget
        te, ta = set(se.topk(k).indices.tolist()), set(sa.topk(k).indices.tolist())
        print(f"{name} {task} seed {sample.meta['seed']}: token |diff| mean {float((exact-approx).abs().mean()):.4f} "
              f"max {float((exact-approx).abs().max()):.3f}; exact-share overlap {len(te & ta) / k:.3f}")
with torch.inference_mode():
    t0 = time.perf_counter()
    token_surprisal(model, hidden, x, exact_below=10**9)
    t1 = time.perf_counter()
    token_surprisal(model, hidden, x, exact_below=below)
    t2 = time.perf_counter()
print(f"exact {t1-t0:.2f}s estimated {t2-t1:.2f}s")
