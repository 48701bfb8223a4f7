"""`kvmerge demo`: full cache vs each method on needle-in-a-haystack prompts, as a table."""

from __future__ import annotations

import time

from kvmerge.cli import DEMO_METHODS as DEFAULT_METHODS  # one list for the demo and its --help


def run_demo(methods: list[str] | None = None, budget: float = 0.25, length: int = 2048, samples: int = 3,
             model_path: str | None = None) -> list[dict]:
    """Each of `methods` (default: `DEFAULT_METHODS` and the model's default method) at `budget` on
    `samples` needle prompts of `length` tokens; prints a table (found, cache bytes against the full
    cache, seconds) and returns its rows."""
    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    from kvmerge import generate_ids, get_method, load_model
    from kvmerge.defaults import default_method
    from kvmerge.eval_commands import with_default

    from .niah import make_sample, score
    from .runner import prompt_ids

    console = Console(width=max(Console().width, 100))
    names = methods or list(DEFAULT_METHODS)
    built = {n: get_method(n, None if n == "full" else budget) for n in names if n != "default"}  # unknown names fail first
    console.print(f"Loading model {model_path or 'SmolLM2-135M-Instruct (bundled)'} ...")
    model, tok = load_model(model_path)
    if methods is None:  # the method kvmerge generate would run on this model, beside the others
        names.append("default")
    if "default" in names:
        names = with_default(names, model)
        own = default_method(model)
        built.setdefault(own, get_method(own, budget))
    tasks = [make_sample(tok, length, depth=0.1 + 0.8 * i / max(samples - 1, 1), seed=i) for i in range(samples)]
    rows = []
    with tqdm(total=len(names) * len(tasks), desc="demo", unit="prompt") as bar:
        for name in names:
            method = built[name]
            correct, cache, full, seconds, example = 0.0, 0, 0, 0.0, ""
            for s in tasks:
                t0 = time.perf_counter()
                out = generate_ids(model, *prompt_ids(tok, s), method, max_new_tokens=24,
                                   eos_token_id=tok.eos_token_id, tokenizer=tok)
                text = tok.decode(out.tokens[0], skip_special_tokens=True).strip()
                seconds += time.perf_counter() - t0
                correct += score(text, s.answer)
                cache += out.stats["cache_bytes"]
                full += out.stats["full_cache_bytes"]
                example = example or text
                bar.update(1)
            rows.append({"method": name, "budget": method.budget, "correct": correct, "samples": len(tasks),
                         "cache_fraction": cache / full, "seconds": seconds / len(tasks), "example": example})
    table = Table(title=f"Needle in a haystack, {length} tokens of prose, {samples} needle{'s' * (samples > 1)}",
                  caption=f"each method keeps {budget:.0%} of the context's cache (full: all of it); correct: the "
                  "hidden number is in the answer")
    for col in ("method", "budget", "correct", "cache vs full", "s / prompt"):
        table.add_column(col, no_wrap=True)
    table.add_column("first answer", overflow="ellipsis", max_width=34)
    for r in rows:
        table.add_row(r["method"], f"{r['budget']}", f"{r['correct']:.0f}/{r['samples']}",
                      f"{r['cache_fraction']:.1%}", f"{r['seconds']:.1f}", r["example"][:48])
    console.print(table)
    return rows
