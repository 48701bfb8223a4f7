"""What KVzip's reconstruction scores look like per layer and KV head, and where a needle's digits rank
among them (question-agnostic, one prefill per needle, no compression applied):

    .venv/bin/python benchmarks/kvzip_scores.py gemma3-270m --seeds 3
    .venv/bin/python benchmarks/kvzip_scores.py smollm2-135m --seeds 3 --summary

Per head: the median score and the share of entries scoring above 0.5 (a head that gives most
entries a high score ranks them by little), and the needle's digits' worst rank as a fraction of the
context (below 0.25: every digit survives a uniform 25% budget in that head)."""

import argparse

import torch

import kvmerge
from kvmerge_eval.niah import make_sample
from kvmerge_eval.runner import prompt_ids


def digit_slots(tok, ids, answer):
    """Positions of the answer's tokens in `ids` (the needle's number)."""
    for sub in (tok(" " + answer, add_special_tokens=False)["input_ids"], tok(answer, add_special_tokens=False)["input_ids"]):
        sub = [t for t in sub if tok.decode([t]).strip()]
        for i in range(len(ids) - len(sub) + 1):
            if ids[i:i + len(sub)] == sub:
                return list(range(i, i + len(sub)))
    raise ValueError("needle not found in the context")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--summary", action="store_true", help="one line per needle instead of one per head")
    args = p.parse_args()
    model, tok = kvmerge.load_model(args.model)
    for seed in range(args.seeds):
        sample = make_sample(tok, args.length, 0.5, seed=seed)
        ctx, _ = prompt_ids(tok, sample)
        slots = digit_slots(tok, ctx, sample.answer)
        method = kvmerge.get_method("kvzip", 0.25)
        session = kvmerge.Session(model, 1, method, tok)
        with torch.inference_mode():
            session.feed_prompt([ctx])
            layers = list(session.cache.compressible)
            method.prepare_all(session.runtime, [ctx], layers)
        kept, heads, saturated = 0, 0, 0
        for i in layers:
            scores = session.states[i].scratch["_kvzip_fresh"][0].float()  # (h, n)
            rank = scores.argsort(-1, descending=True).argsort(-1).float() / scores.shape[-1]
            for h, row in enumerate(scores):
                worst, high = rank[h, slots].max().item(), (row > 0.5).float().mean().item()
                kept, heads, saturated = kept + (worst < 0.25), heads + 1, saturated + (high > 0.25)
                if not args.summary:
                    print(f"seed {seed} layer {i:2d} head {h}: median {row.median():.3f}, above 0.5 {high:.2f}, "
                          f"needle's worst rank {worst:.2f}")
        print(f"seed {seed}: the needle's digits all in the top 25% in {kept} of {heads} KV heads; "
              f"{saturated} heads score over a quarter of the entries above 0.5")


if __name__ == "__main__":
    main()
