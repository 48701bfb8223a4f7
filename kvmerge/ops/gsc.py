"""SemantiCache's pure parts: the delimiter table, semantic chunking, Greedy Seed-based Clustering."""

from __future__ import annotations

import unicodedata
import weakref

import torch

STRONG = set(".?!\n")
WEAK = set(",;:")
DELIMITERS = STRONG | WEAK | {"\t"}
SPACE_MARKERS = "\u2581\u0120\u010a"  # SentencePiece ▁, byte-BPE Ġ and Ċ

_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

ANCHOR, STRONG_ANCHOR = 1, 2  # table codes: 0 plain, 1 weak delimiter, 2 strong delimiter / special


def token_kind(text: str) -> int:
    """0 plain, 1 weak delimiter (`, ; :`), 2 strong (`. ? !`, newline, tab) for one decoded token."""
    if "\n" in text or "\t" in text:
        return STRONG_ANCHOR
    core = text.strip().strip(SPACE_MARKERS).strip()
    if not core or not all(unicodedata.category(c).startswith("P") for c in core):
        return 0
    if any(c in STRONG for c in core):
        return STRONG_ANCHOR
    return ANCHOR if any(c in WEAK for c in core) else 0


def delimiter_table(tokenizer) -> torch.Tensor:
    """`(vocab,)` int8 codes for every token id (special and chat tokens are strong anchors); cached."""
    try:
        return _TABLES[tokenizer]
    except (KeyError, TypeError):
        pass
    size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    table = torch.zeros(size, dtype=torch.int8)
    for piece, i in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([piece])
        table[i] = token_kind(text)
    for i in tokenizer.all_special_ids + list(getattr(tokenizer, "added_tokens_decoder", {}) or {}):
        table[i] = STRONG_ANCHOR
    try:
        _TABLES[tokenizer] = table
    except TypeError:
        pass
    return table


def chunk_layout(is_anchor: torch.Tensor, cap: int):
    """Chunks of consecutive non-anchor tokens, at most `cap` long.

    is_anchor `(b, n)` bool → (chunk_of `(b, n)` global chunk index or -1 for anchors, offset `(b, n)`
    position inside its chunk, row_of_chunk `(C,)`, length of the longest chunk).
    """
    b, n = is_anchor.shape
    t = torch.arange(n, device=is_anchor.device).expand(b, n)
    prev_anchor = torch.nn.functional.pad(is_anchor, (1, 0), value=True)[:, :-1]
    starts = ~is_anchor & prev_anchor
    run = starts.cumsum(-1) - 1
    run_start = torch.where(starts, t, torch.zeros_like(t)).cummax(-1).values
    pos = t - run_start
    pieces = n // max(cap, 1) + 2
    local = run * pieces + pos // cap  # unique per (run, piece) inside a row
    key = torch.where(is_anchor, torch.full_like(local, -1), local + torch.arange(b, device=is_anchor.device)[:, None] * (n + 1) * pieces)
    uniq, chunk_of = torch.unique(key, return_inverse=True)
    has_anchor = bool((uniq == -1).any())
    chunk_of = chunk_of - int(has_anchor)
    chunk_of = torch.where(is_anchor, torch.full_like(chunk_of, -1), chunk_of)
    offset = pos % cap
    n_chunks = len(uniq) - int(has_anchor)
    row_of_chunk = torch.zeros(n_chunks, dtype=torch.long, device=is_anchor.device)
    if n_chunks:
        rows = torch.arange(b, device=is_anchor.device)[:, None].expand(b, n)
        row_of_chunk[chunk_of[~is_anchor]] = rows[~is_anchor]
    longest = int(offset[~is_anchor].max()) + 1 if n_chunks else 0
    return chunk_of, offset, row_of_chunk, longest


def greedy_seed_clustering(sim: torch.Tensor, valid: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """GSC over each chunk: the first unassigned slot seeds and absorbs every later unassigned slot
    whose similarity to it is ≥ τ.

    sim `(C, h, L, L)`, valid `(C, h, L)` (a prefix of each chunk), tau `(..., C, h)` → root
    `(..., C, h, L)`: the seed's offset for each slot (its own offset for seeds and invalid slots).
    Loops over the L offsets only; at offset t just the chunks longer than t and the columns after t
    are touched (chunks are visited longest first).
    """
    C, h, L = valid.shape
    lengths = valid.sum(-1).amax(-1)
    order = lengths.argsort(descending=True)
    inverse = order.argsort()
    sim, valid, tau = sim[order], valid[order], tau[..., order, :]
    shape = torch.broadcast_shapes(valid.shape, tau.shape + (L,))
    root = torch.arange(L, device=sim.device).expand(shape).clone()
    assigned = (~valid).expand(shape).clone()
    active = (lengths[order][None, :] > torch.arange(L, device=sim.device)[:, None]).sum(-1).tolist()
    for t in range(L - 1):
        n = active[t]
        a = assigned[..., :n, :, t + 1:]
        seed = ~assigned[..., :n, :, t, None]
        absorb = (sim[:n, :, t, t + 1:] >= tau[..., :n, :, None]) & ~a & seed
        r = root[..., :n, :, t + 1:]
        r.masked_fill_(absorb, t)
        a |= absorb
    return root[..., inverse, :, :]
