"""Where a method's KL comes from, layer by layer: compress the context, then put every compressed layer
but one back from the full cache and teacher-force the continuation (the `fidelity` task's texts):

    .venv/bin/python benchmarks/kl_by_layer.py gemma3-270m --text docs --methods zipguardmerge,mixedmerge
    .venv/bin/python benchmarks/kl_by_layer.py gemma3-270m --text code --budget 0.1 --methods zipguardmerge

Per text and method: KL(full ‖ method) per token with every layer compressed, then with only each
compressed layer compressed (the others full), and each layer's slots per KV head (its widest head's).
The parts need not add up: errors in several layers compound. Models with many compressed layers
print the first `--max-layers` only."""

import argparse

import torch

import kvmerge
from kvmerge_eval import fidelity


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--text", default="docs", help="the fidelity genre (docs, code, dialogue, legal, table)")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--methods", default="zipguardmerge,mixedmerge", help="method specs, comma-separated")
    p.add_argument("--texts", type=int, default=3, help="the fidelity task's first texts (its seeds)")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--max-layers", type=int, default=6)
    args = p.parse_args()
    model, tok = kvmerge.load_model(args.model)
    with torch.inference_mode():
        for i in range(args.texts):
            sample = fidelity.make_sample(tok, args.length, seed=1000 * args.length + i, text=args.text)
            full = kvmerge.Session(model, 1, None, tok)
            logits = full.prefill([sample.context])
            full_layers = full.snapshot()[1]
            reference = fidelity.teacher_forced(full, logits, sample.answer)
            layers = full.cache.compressible[:args.max_layers]
            for spec in args.methods.split(","):
                session = kvmerge.Session(model, 1, kvmerge.get_method(spec, args.budget), tok)
                first = session.prefill([sample.context])
                compressed = session.snapshot()
                kept = [session.cache.layers[j].entries for j in layers]
                kl = []
                for only in [None] + layers:
                    state, own, states = compressed  # sliding layers are the same in both sessions
                    session.restore((state, [x if only in (None, j) else full_layers[j] for j, x in enumerate(own)], states))
                    logp = fidelity.teacher_forced(session, first, sample.answer)
                    kl.append(fidelity.compare(reference, logp, sample.answer)["kl"])
                parts = ", ".join(f"layer {j} {k:.4f} ({n} kept)" for j, k, n in zip(layers, kl[1:], kept))
                print(f"{args.text} text {i} · {spec} @ {args.budget:.0%}: all {kl[0]:.4f}; alone: {parts}", flush=True)


if __name__ == "__main__":
    main()
