"""kvmerge's transformers runtime as the reference the vLLM plugin is compared with.

Runs in kvmerge's main environment (transformers 5.24; the runtime needs it), never imports vLLM:

    .venv/bin/python benchmarks/vllm_reference.py prompts --samples 4 --length 2048 > prompts.json
    .venv/bin/python benchmarks/vllm_reference.py greedy --method snapkv --budget 0.25 --tokens 32 < prompts.json > ref.json

(`--imports` names modules or .py files registering methods of one's own, as the plugin's setting does.)
The vLLM-side tests and benchmarks call it through `call` (KVMERGE_MAIN_PYTHON: another interpreter).

`prompts`: kvmerge's NIAH samples (kvmerge_eval), each a whole chat prompt of token ids (context and
question together: the plugin compresses the whole prompt, i.e. kvmerge's question-aware protocol).
`greedy`: per prompt, the greedy tokens of `Session` prefill (compressed with the method at `--budget`,
or at the prompt's own "kept" entry count when it has one) + decode,
and at each step the log-probabilities of the top `top` tokens, to locate and size divergences.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch


def niah_prompts(tokenizer, samples: int, length: int, seed: int = 0) -> list[dict]:
    """`samples` NIAH prompts of about `length` context tokens (depths spread over the context):
    [{"ids": whole prompt ids, "answer": str, "question_start": index of the question's first id}]."""
    from kvmerge_eval import niah
    from kvmerge_eval.runner import prompt_ids

    out = []
    for i in range(samples):
        sample = niah.make_sample(tokenizer, length, depth=(i + 0.5) / samples, seed=seed + i)
        context, question = prompt_ids(tokenizer, sample)
        out.append({"ids": context + question, "answer": sample.answer, "question_start": len(context)})
    return out


@torch.inference_mode()
def greedy(model, prompt: list[int], method, tokens: int, top: int = 5, tokenizer=None) -> dict:
    """{"tokens": greedy ids, "top": per step [[id, logprob], ...] best first} for one prompt compressed
    whole by `method` right after its prefill (kvmerge's question-aware protocol, empty question)."""
    from kvmerge import Session

    runtime = Session(model, 1, method, tokenizer=tokenizer)
    logits = runtime.prefill([list(prompt)], window=method.window)
    runtime.reserve(tokens)
    ids, tops = [], []
    for _ in range(tokens):
        logp = torch.log_softmax(logits[0].float(), -1)
        best = logp.topk(top)
        tops.append([[int(i), float(v)] for i, v in zip(best.indices, best.values)])
        ids.append(int(best.indices[0]))
        logits = runtime.forward([[ids[-1]]])
    return {"tokens": ids, "top": tops}


MAIN_PYTHON = Path(os.environ.get("KVMERGE_MAIN_PYTHON",
                                  Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python"))


def call(*args: str, stdin: str | None = None, timeout: float | None = None) -> list:
    """This script's command `args` run in kvmerge's main environment (from the vLLM one); its JSON."""
    out = subprocess.run([str(MAIN_PYTHON), __file__, *args], input=stdin, capture_output=True,
                         text=True, check=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.stdout)


def greedy_as_vllm_keeps(prompts: list[dict], method: str, budget: float, tokens: int, block_size: int,
                         timeout: float | None = None, imports: tuple[str, ...] = ()) -> list:
    """`greedy` on `prompts` at the entry count the plugin keeps for each (`config.layout`: a method that
    only selects fills its first kept block, up to `block_size` − 1 entries over the budget)."""
    from kvmerge import get_method
    from kvmerge.methods.registry import load_plugins
    from kvmerge.vllm.config import layout

    load_plugins(list(imports))
    spec = get_method(method, budget)
    kept = [{**p, "kept": layout(spec, len(p["ids"]), block_size).kept} for p in prompts]
    return call("greedy", "--method", method, "--budget", str(budget), "--tokens", str(tokens),
                *[a for x in imports for a in ("--imports", x)], stdin=json.dumps(kept), timeout=timeout)


def main(argv=None) -> None:
    import kvmerge

    parser = argparse.ArgumentParser(prog="benchmarks/vllm_reference.py")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    g = sub.add_parser("greedy")
    g.add_argument("--method", default="full")
    g.add_argument("--budget", type=float, default=None)
    g.add_argument("--tokens", type=int, default=32)
    g.add_argument("--imports", action="append", default=[], help="a module or .py file registering methods")
    args = parser.parse_args(argv)
    if args.command == "greedy":
        from kvmerge.methods.registry import load_plugins

        load_plugins(args.imports)
    model, tok = kvmerge.load_model()
    if args.command == "prompts":
        json.dump(niah_prompts(tok, args.samples, args.length, args.seed), sys.stdout)
        return
    prompts = json.load(sys.stdin)  # a prompt's "kept" (entries), when given, overrides --budget
    json.dump([greedy(model, p["ids"], kvmerge.get_method(args.method, p.get("kept", args.budget)), args.tokens,
                      tokenizer=tok) for p in prompts], sys.stdout)


if __name__ == "__main__":
    main()
