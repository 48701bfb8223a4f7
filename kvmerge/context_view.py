"""What a compression kept, shown over the context's own text: in the terminal (kept tokens
highlighted), as an HTML page or as a PNG with a per-layer heatmap.

`Provenance` records, while a context is compressed, which position each kept entry is. A token's
**survival** in a compressed layer is the share of its KV heads that keep it as an entry of
its own (`CompressedContext.kept`); a token kept by no head was merged into another entry or dropped.
"""

from __future__ import annotations

import html as _html

import torch


def survival(context) -> torch.Tensor:
    """`(compressed layers, tokens)`: the share of each layer's KV heads that keep each token as an entry."""
    if context.kept is None:
        raise ValueError("this compressed context does not know which tokens it kept (its token ids were not kept)")
    out = torch.zeros(len(context.kept), context.tokens)
    for i, pos in enumerate(context.kept):  # (heads, slots)
        for head in pos:
            out[i, head[head >= 0]] += 1.0 / pos.shape[0]
    return out


def pieces(context) -> list[str]:
    """The context's text, one piece per token."""
    if context.context_ids is None:
        raise ValueError("this compressed context kept only its token ids' hash: there is no text to show")
    return [context.tokenizer.decode([t]) for t in context.context_ids]


def terminal(context, color: bool = True) -> str:
    """The context with each token shaded by its survival over all layers: bold on green where most
    heads keep it, yellow where some do, dim where none (merged or dropped)."""
    share = survival(context).mean(0)
    out = []
    for text, s in zip(pieces(context), share.tolist()):
        if not color:
            out.append(text if s > 0 else "·" * len(text.strip() and text))
            continue
        style = "1;30;42" if s >= 0.5 else "33" if s > 0 else "2"
        out.append(f"\x1b[{style}m{text}\x1b[0m")
    return "".join(out)


def legend(color: bool = True) -> str:
    """What `terminal`'s shading means, one line."""
    if not color:
        return "(tokens as text: kept as their own entry by at least one head; ····: by none, merged or dropped)"
    return ("(\x1b[1;30;42mkept by most heads\x1b[0m, \x1b[33mby some\x1b[0m, \x1b[2mby none: merged or "
            "dropped\x1b[0m; over every compressed layer)")


def entries_line(context) -> str:
    """Entries per compressed layer and head as compressed, over the layers: "36–131 (mean 59) over
    30 layers" (from the kept positions where the context has them, else from its cache)."""
    cache = context.session.cache
    entries = [int((pos >= -1).sum()) / pos.shape[0] for pos in context.kept] if context.kept is not None else \
        [cache.layers[i].mean_entries for i in cache.compressible]
    return f"{min(entries):.0f}–{max(entries):.0f} (mean {sum(entries) / len(entries):.0f}) over {len(entries)} layers"


def summary(context, path_bytes: int | None = None) -> str:
    """Metadata and entries per compressed layer, a few lines."""
    m = context.meta
    lines = [f"model {m['model_name'] or '?'} (fingerprint {m['model']}), tokenizer {m['tokenizer']}, {m['dtype']}",
             f"method {m['method']} at budget {m['budget']}; {m['tokens']:,} context tokens"
             + (" (chat template)" if m["chat_template"] else ""),
             f"entries per compressed layer and head: {entries_line(context)}",
             f"cache {context.nbytes / 2**20:.2f} MiB, {context.nbytes / m['full_bytes']:.1%} of the full cache's "
             f"{m['full_bytes'] / 2**20:.2f} MiB"]
    if path_bytes is not None:
        lines.append(f"file {path_bytes / 2**20:.2f} MiB ({path_bytes / m['full_bytes']:.1%} of the full cache)")
    if context.kept is not None:
        share = survival(context)
        some, most, n = int((share.amax(0) > 0).sum()), int((share.mean(0) >= 0.5).sum()), share.shape[1]
        lines.append(f"tokens kept as their own entry by at least one head: {some:,} of {n:,} ({some / n:.1%}); "
                     f"by most heads of most layers: {most:,} ({most / n:.1%})")
    return "\n".join(lines)


def heatmap(context, path) -> None:
    """A PNG: the per-layer survival of every token (layers down, tokens across)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share = survival(context).numpy()
    fig, ax = plt.subplots(figsize=(12, 1.5 + 0.12 * share.shape[0]))
    image = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xlabel("context token")
    ax.set_ylabel("compressed layer")
    ax.set_title(f"{context.meta['method']} at {context.meta['budget']}: share of KV heads keeping each token")
    fig.colorbar(image, ax=ax, fraction=0.02)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def page(context, heatmap_png: str | None = None) -> str:
    """An HTML page: the summary, the text shaded by survival (a token's title gives its share per
    layer), and the heatmap when its PNG file name is given."""
    share = survival(context)
    mean = share.mean(0).tolist()
    spans = []
    for i, text in enumerate(pieces(context)):
        title = " ".join(f"{x:.2f}" for x in share[:, i].tolist())
        spans.append(f'<span style="background: rgba(40, 160, 70, {mean[i]:.2f})" title="{title}">'
                     f"{_html.escape(text)}</span>")
    img = f'<p><img src="{_html.escape(heatmap_png)}" style="max-width: 100%"></p>' if heatmap_png else ""
    return ("<!doctype html><meta charset='utf-8'><title>kvmerge: what was kept</title>"
            "<body style='font-family: sans-serif; max-width: 70em; margin: auto'>"
            f"<pre>{_html.escape(summary(context))}</pre>{img}"
            "<p>Shade: the share of KV heads, over all compressed layers, that keep the token as its own entry "
            "(white: merged into another entry or dropped).</p>"
            f"<div style='white-space: pre-wrap; font-family: monospace; line-height: 1.5'>{''.join(spans)}</div>")


class Provenance:
    """Which context position each kept entry is: the keys of each compressible layer's plain slots are
    recorded before every compression of a prefill, and each entry left afterwards is matched to the
    one it equals (a merged entry, an average, equals none)."""

    def __init__(self, session):
        self.session, self.keys = session, {i: [] for i in session.cache.compressible}
        session.before_compress = self.record

    def record(self) -> None:
        s = self.session
        plain, seen = int(s.plain[0]), int(s.seen[0])
        for i, keys in self.keys.items():
            layer = s.cache.layers[i]
            fresh = layer.kv().keys[0, :, -plain:].float().clone()
            done = sum(k.shape[1] for k in keys)
            keys.append(fresh[:, done - (seen - plain):] if done > seen - plain else fresh)

    @torch.no_grad()
    def kept(self) -> list[torch.Tensor] | None:
        self.session.before_compress = None
        if not any(self.keys.values()):
            return None
        out = []
        for i, parts in self.keys.items():
            source = torch.cat(parts, 1)  # (h, n): the context's keys in order
            kv = self.session.cache.layers[i].kv()
            keys, log_n = kv.keys[0].float(), kv.log_n[0]
            dist = torch.cdist(keys, source)  # (h, slots, n)
            near, at = dist.min(-1)
            exact = near <= 1e-3 * source.norm(dim=-1).mean(-1, keepdim=True)
            pos = torch.where(exact & (log_n.abs() < 1e-6), at, torch.full_like(at, -1))
            out.append(pos.masked_fill(torch.isinf(log_n), -2).cpu())
        return out
