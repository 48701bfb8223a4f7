"""NIAH through the vLLM plugin against kvmerge's transformers runtime, on the same samples.

    .venv-vllm/bin/python benchmarks/vllm_niah.py --methods full,snapkv,mixedmerge --budget 0.25 --samples 10

Needs the main venv (.venv: the transformers runtime, `benchmarks/vllm_reference.py`) beside
.venv-vllm. Per method: kvmerge's NIAH prompts of about `--length` tokens (context and question, the
whole prompt compressed: the question-aware protocol), greedy `--tokens` tokens from `kvmerge.Session`
and from vLLM with the plugin (same method; the same entry count: a method that only selects keeps
its first kept block full in vLLM, and the runtime is given that count), both decoded and scored by kvmerge_eval's NIAH
scorer. Prints per method: samples answered by each, and on how many the two token sequences are
identical; `--out` also keeps every sample's texts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

BLOCK = 32


def through_vllm(model: str, prompts: list, method: str, budget: float, tokens: int) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=4096, enforce_eager=True, block_size=BLOCK,
              enable_prefix_caching=False, max_num_batched_tokens=9000,
              additional_config={"kvmerge": {"method": method, "budget": budget}})
    try:
        outs = llm.generate([{"prompt_token_ids": p["ids"]} for p in prompts],
                            SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="full,snapkv,mixedmerge")
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="a JSON lines file for every sample's texts")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer

    from kvmerge.model import cache_dir
    from vllm_reference import call, greedy_as_vllm_keeps
    from kvmerge_eval import niah

    model = str(cache_dir() / "smollm2-135m")
    tok = AutoTokenizer.from_pretrained(model)
    prompts = call("prompts", "--samples", str(args.samples), "--length", str(args.length))
    rows = []
    for method in args.methods.split(","):
        want = greedy_as_vllm_keeps(prompts, method, args.budget, args.tokens, BLOCK)
        got = through_vllm(model, prompts, method, args.budget, args.tokens)
        for i, (p, w, g) in enumerate(zip(prompts, want, got)):
            texts = {side: tok.decode(ids, skip_special_tokens=True) for side, ids in (("transformers", w["tokens"]),
                                                                                       ("vllm", g))}
            rows.append({"method": method, "budget": args.budget, "sample": i, "answer": p["answer"],
                         "identical": w["tokens"] == g, **{f"{k}_text": v for k, v in texts.items()},
                         **{f"{k}_score": niah.score(v, p["answer"]) for k, v in texts.items()}})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"NIAH, SmolLM2-135M, {args.samples} samples of ~{args.length} tokens, {args.budget:.0%}, "
          f"{args.tokens} greedy tokens")
    print("| method | transformers runtime | vLLM plugin | identical tokens |\n|---|---|---|---|")
    for method in args.methods.split(","):
        mine = [r for r in rows if r["method"] == method]
        print(f"| {method} | {sum(r['transformers_score'] for r in mine):g}/{len(mine)} | "
              f"{sum(r['vllm_score'] for r in mine):g}/{len(mine)} | {sum(r['identical'] for r in mine)}/{len(mine)} |")


if __name__ == "__main__":
    main()
