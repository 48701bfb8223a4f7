"""`Stats`: what a request reports about itself (`GenerationOutput.stats`)."""

from __future__ import annotations

MiB = 2 ** 20


class Stats(dict):
    """A request's statistics: a dict (`stats["cache_bytes"]`) whose `str` is one line
    (method, budget, context tokens, entries, MiB against the full cache, seconds per phase).

    Keys: `method`, `budget`, `protocol`, `context_tokens` (an int for one prompt, else one per row),
    `cache_entries` (one per layer: the most any row holds), `cache_bytes` and `full_cache_bytes`
    (the whole cache against what transformers' own would hold), `compressed_layers_bytes` and
    `compressed_layers_full_bytes` (the layers the budget applies to), `prefill_seconds`,
    `compress_seconds`, `decode_seconds`, `graph_capture_seconds` (with `cuda_graph`), `prefill_chunk`
    (where the prefill ran in chunks), `new_tokens` (one per row), `final_cache_bytes`, and what the
    method reports of itself. An answer from a compressed
    context has no prefill or compress seconds of its own: `compressed_before` holds those of its
    compression."""

    @property
    def layers(self) -> list[int]:
        """Entries per layer (`cache_entries`)."""
        return list(self.get("cache_entries", []))

    @property
    def ratio(self) -> float | None:
        """The cache's bytes against the full cache's."""
        return self["cache_bytes"] / self["full_cache_bytes"] if self.get("full_cache_bytes") else None

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per phase (prefill, compress, decode), rounded to 0.01."""
        return {k.removesuffix("_seconds"): round(v, 2) for k, v in self.items()
                if k.endswith("_seconds") and isinstance(v, (int, float))}

    def summary(self) -> str:
        tokens = self.get("context_tokens")
        tokens = f"{tokens:,}" if isinstance(tokens, int) else "/".join(f"{t:,}" for t in tokens or [])
        entries = sorted(set(self.layers))
        kept = (f"{entries[0]:,}" if len(entries) == 1 else f"{entries[0]:,}–{entries[-1]:,}") if entries else "?"
        chunk = f" (prefilled in chunks of {self['prefill_chunk']:,})" if self.get("prefill_chunk") else ""
        parts = [f"{self.get('method', '?')} at budget {self.get('budget')}", f"{tokens} context tokens{chunk}",
                 f"{kept} entries per layer (its widest head)"]
        budget, counts = self.get("budget"), self.get("context_tokens")
        counts = [counts] if isinstance(counts, int) else list(counts or [])
        if isinstance(budget, int) and not isinstance(budget, bool) and counts and budget >= max(counts):
            parts[0] += " (entries, at least the context's tokens: nothing was compressed)"
        if self.ratio is not None:
            parts.append(f"cache {self['cache_bytes'] / MiB:.2f} MiB of {self['full_cache_bytes'] / MiB:.2f} MiB "
                         f"({self.ratio:.1%})")
            budgeted = self.get("compressed_layers_full_bytes")
            if budgeted and budgeted < self["full_cache_bytes"]:
                parts.append(f"the layers the budget applies to {self['compressed_layers_bytes'] / budgeted:.1%} "
                             "(sliding-window layers keep their window)")
        parts.append(", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()))
        if self.get("compressed_before"):
            parts.append("compressed before (" + ", ".join(f"{k.removesuffix('_seconds')} {v:.1f} s" for k, v in
                                                          self["compressed_before"].items()) + ")")
        return "; ".join(p for p in parts if p)

    __str__ = summary

    def __repr__(self) -> str:
        return f"Stats({self.summary()}; dict keys: {', '.join(self)})"
