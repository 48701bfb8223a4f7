"""`kvmerge report`: method × budget tables and plots (PNG) from a results folder."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from kvmerge.methods.registry import current_spec

from .runner import METRICS, TASKS, _read, summarize


def table(rows: list[dict], metric: str) -> str:
    """Markdown table: one line per (task, method), one column per (budget, length); the full cache
    (budget 1) is shown in every column as the reference. Counts of samples in the last column.
    A task the full cache scores under 50% on is marked as beyond the model, not hidden."""
    full = {(r["task"], r["length"]): r for r in rows if r["method"] == "full"}
    cols = sorted({(r["budget"], r["length"]) for r in rows if r["method"] != "full"}, key=lambda c: (-c[0], c[1]))
    cols = cols or sorted({(1.0, r["length"]) for r in rows})
    cells = {(r["task"], r["method"], r["budget"], r["length"]): r for r in rows}
    lines_of = sorted({(r["task"], r["method"]) for r in rows}, key=lambda k: (k[0], k[1] != "full", k[1]))
    fmt = (lambda x: f"{x:.4f}") if metric in ("kl", "ppl_ratio") else (lambda x: f"{x:.0%}")
    head = " | ".join(f"{b:.0%} · {n}" for b, n in cols)
    lines = [f"| task | method | {head} | n |", "|---|---|" + "---|" * (len(cols) + 1)]
    beyond = {t for (t, _n), r in full.items() if metric == "score" and r["score"] < 0.5}
    for task, method in lines_of:
        got = [full.get((task, n)) if method == "full" else cells.get((task, method, b, n)) for b, n in cols]
        if task in beyond:
            task = f"{task} (beyond the model: full < 50%)"
        counts = sorted({c["n"] for c in got if c})
        lines.append(f"| {task} | {method} | " + " | ".join(fmt(c[metric]) if c else "–" for c in got)
                     + f" | {'/'.join(map(str, counts))} |")
    return "\n".join(lines)


def report(folder, plots: bool = True, methods: list[str] | None = None, plot_dir=None,
           wrote: list | None = None) -> str:
    """Tables (markdown) of every task in `folder`, restricted to `methods` (specs, as run) if given;
    plots go to `plot_dir` (default: `folder`), and the path of each PNG written is appended to
    `wrote` if given."""
    folder = Path(folder)
    plot_dir = Path(plot_dir or folder)
    wrote = [] if wrote is None else wrote
    if plots:
        plot_dir.mkdir(parents=True, exist_ok=True)
    texts = []
    wanted = None if methods is None else {current_spec(m) for m in methods}  # rows read under current names
    for task in TASKS:
        raw = [r for r in _read(folder / f"{task}.jsonl") if methods is None or r["method"] in wanted]
        if not raw:
            continue
        rows = summarize(raw)
        for metric in METRICS.get(task, ("score",)):
            texts.append(f"### {task}: {metric}\n\n" + table(rows, metric))
        if plots:
            wrote.append(_curves(rows, task, plot_dir))
            if task == "niah":
                wrote.append(_heatmaps(raw, plot_dir))
    if not texts:
        raise FileNotFoundError(f"no results (<task>.jsonl) in {folder}")
    return "\n\n".join(texts)


def _curves(rows, task, folder) -> Path:
    """Metric vs budget, one line per method (mean over lengths and subtasks); full cache dashed. The
    budget axis spans 0 to 1 and a score axis 0 to 1, so that one point or flat lines read as such."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = METRICS.get(task, ("score",))[0]
    series: dict = defaultdict(lambda: defaultdict(list))
    for r in rows:
        series[r["method"]][r["budget"]].append(r[metric])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (method, by_budget) in enumerate(sorted(series.items())):
        xs = sorted(by_budget)
        ys = [sum(by_budget[x]) / len(by_budget[x]) for x in xs]
        if method == "full":
            if metric != "kl":  # KL is plotted on a log scale, where the full cache's 0 has no place
                ax.axhline(ys[0], color="black", linestyle="--", label="full")
        else:
            ax.plot(xs, ys, marker="osD^v<>"[i % 7], color=plt.cm.tab20(i % 20), label=method)
    if metric == "kl" and any(x > 0 for by in series.values() for ys in by.values() for x in ys):
        ax.set_yscale("log")
    ax.set_xlim(0, 1.05)
    if metric in ("score", "top1"):
        ax.set_ylim(-0.03, 1.03)
    elif metric != "kl" or ax.get_yscale() != "log":
        low, high = ax.get_ylim()
        if high - low < 1e-6:  # a single value: a band around it instead of matplotlib's ±4%
            ax.set_ylim(low - max(abs(low), 1) * 0.5, high + max(abs(high), 1) * 0.5)
    ax.set_xlabel("budget (fraction of context kept)")
    ax.set_ylabel({"kl": "KL(full ‖ method) per token", "score": "score"}.get(metric, metric))
    ax.set_title(task)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
    fig.tight_layout()
    path = folder / f"{task}_{metric}_vs_budget.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _heatmaps(raw, folder) -> Path:
    """Needle accuracy, depth × length, one panel per (method, budget), with one colour bar (0–1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells: dict = defaultdict(lambda: defaultdict(list))
    for r in raw:
        cells[(r["method"], float(r["budget"]))][(round(r["depth"], 2), r["length"])].append(r.get("score", r.get("correct")))
    panels = sorted(cells, key=lambda k: (k[0] != "full", k[0], -k[1]))
    depths = sorted({d for p in cells.values() for d, _ in p})
    lengths = sorted({n for p in cells.values() for _, n in p})
    cols = min(4, len(panels))
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3 * cols + 1, 2.6 * rows_n), squeeze=False)
    image = None
    for ax, key in zip(axes.flat, panels):
        grid = [[sum(cells[key][(d, n)]) / len(cells[key][(d, n)]) if cells[key][(d, n)] else float("nan")
                 for n in lengths] for d in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_title("full cache" if key[0] == "full" else f"{key[0]} at {key[1]:.0%}", fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=6)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=6)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    fig.supxlabel("context length (tokens)")
    fig.supylabel("needle depth")
    fig.tight_layout()
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), label="needles found (fraction)", shrink=0.9)
    path = folder / "niah_heatmaps.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


KVPRESS_TWINS = {  # kvpress press names (benchmarks/kvpress_ruler.py, as kvpress spells them) → kvmerge specs
    "snapkv": "snapkv", "keydiff": "keydiff", "streaming_llm": "streamingllm", "kvzip": "kvzip",
    "expected_attention": "expectedattention:alloc=adakv:floor=0.2:epsilon=0.01",
    "expected_attention_uniform": "expectedattention", "kvzip_plus": "kvzip:plus=true",
    "merging_expected_attention": "mergingpress"}


def ruler_curves(by_model: dict[str, list[dict]], kvpress: list[dict], path, length: int = 4096) -> Path:
    """RULER's average against the budget, a panel per model: `by_model[model]` kvmerge's rows
    (`ruler-real.jsonl`), `kvpress` the rows of benchmarks/kvpress_ruler.py (dashed, in the colour of
    kvmerge's method of that name), each point the mean score over every sample that method ran at
    that budget (n in the legend); the full cache a black line. Rows of one context `length`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in by_model if by_model[m]]
    fig, axes = plt.subplots(1, len(models), figsize=(7.5 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [(r, "") for r in by_model[model]] + [(r, "kvpress") for r in kvpress if r.get("model") == model]
        ran: dict = defaultdict(set)
        for r, src in rows:
            ran[(r["method"], src, r["budget"])].add((r["task"], r["seed"]))
        # one point's own sample set, among those with every task: the one that the most points ran all of (kvpress's
        # included), then the largest; a point that did not run it all is left out
        tasks = {t for c in ran.values() for t, _ in c}
        whole = [c for c in ran.values() if {t for t, _ in c} == tasks] or list(ran.values())
        common = max(whole, key=lambda c: (sum(c <= other for other in ran.values()), len(c)))
        points: dict = defaultdict(lambda: defaultdict(list))
        for r, src in rows:
            if (r["task"], r["seed"]) in common and common <= ran[(r["method"], src, r["budget"])]:
                points[(r["method"], src)][r["budget"]].append(r["score"])
        names = sorted({KVPRESS_TWINS.get(m.split(":", 1)[-1], m) if src else m for m, src in points})
        for (name, src), by_budget in sorted(points.items()):
            xs = sorted(by_budget)
            ys = [sum(by_budget[x]) / len(by_budget[x]) for x in xs]
            twin = KVPRESS_TWINS.get(name.split(":", 1)[-1], name) if src else name
            style = dict(linestyle="--" if src else "-", label=name)
            if 1.0 in by_budget:  # the full cache (kvpress: no press)
                ax.axhline(ys[xs.index(1.0)], color="black", **style)
                continue
            ax.plot(xs, ys, marker="o" if not src else "x", color=plt.cm.tab20(names.index(twin) % 20), **style)
        ax.set_xlim(0, 0.55)
        ax.set_ylim(-0.02, 1.0)
        ax.set_xlabel("budget (fraction kept; kvpress's ratio = 1 − budget)")
        ax.set_ylabel("RULER average score")
        ax.set_title(f"RULER {length / 1024:g}k, {model}: {len(common)} samples", fontsize=10)
        ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
