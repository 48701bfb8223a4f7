"""The methods table behind `kvmerge methods`: every registered method and preset with one line on
what it does, its cost class, where it runs and its parameters, built from the methods themselves.

Building it imports the methods (and so torch, over a second). The rows are cached as JSON under
`$KVMERGE_CACHE`, keyed by a hash of kvmerge's own source files, so a later `kvmerge methods` reads
them without importing torch; any edit to a method, a preset or a runtime makes a new key.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from .spec import parse_spec

RUNTIME_NAMES = {"transformers": "transformers", "vllm": "vLLM"}  # `Runtime.name` → shown (transformers: one-shot
SHORT_RUNTIME_NAMES = {"transformers": "hf", "vllm": "vLLM"}       # and chunked prefill alike)
SHORT = {  # the table's line per method (`kvmerge methods NAME` shows the whole description)
    "cam": "H2O's picks; evicted values merged ahead",
    "centroidkv": "similar keys merged into centroids",
    "d2o": "layer budgets by attention density",
    "echo": "what the model reads while repeating",
    "evictmerge": "a base's picks; the rest merged in",
    "expectedattention": "attention of modelled future queries",
    "full": "no compression",
    "h2o": "attention from every prompt query",
    "keydiff": "keys least like the mean key",
    "kmeans": "k-means clusters of keys, as centroids",
    "kvzip": "attention while repeating the context",
    "learnedmerge": "learnedzip's picks; the rest merged in",
    "learnedzip": "KVzip's scores, predicted in one pass",
    "mergingpress": "a base's picks; evicted values folded in",
    "mixedattention": "Expected Attention and SnapKV mixed",
    "mixedmerge": "surprise and mixed attention; merged",
    "pyramidkv": "budgets shrinking with depth",
    "semanticache": "clusters within sentences, merged",
    "snapkv": "attention of the last prompt queries",
    "streamingllm": "the first tokens and the most recent",
    "surprisal": "the most surprising sentences",
    "surprisemerge": "surprise and SnapKV's picks; merged",
    "surprisezip": "surprising sentences and learnedzip's picks",
    "tova": "attention of the last prompt query",
    "zipguard": "KVzip, copy heads ranked otherwise",
    "zipguardmerge": "zipguard's picks; the rest merged in",
    "zipmerge": "KVzip's picks; the rest merged in",
}


def _source_key() -> str:
    root = Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted([*root.glob("*.py"), *root.glob("methods/*.py"), *root.glob("vllm/*.py")]):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def rows() -> list[dict]:
    """One dict per method and preset (see `build`), from the cache when the source is unchanged."""
    from .model import cache_dir

    path = cache_dir() / f"methods-{_source_key()}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    table = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table))
        tmp.replace(path)
    except OSError:
        pass
    return table


def _first_sentence(doc: str | None) -> str:
    text = " ".join((doc or "").split())
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def _first_paragraph(doc: str | None) -> str:
    """A module docstring's first paragraph on one line (a method's source: its paper, or kvmerge's own)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def _paragraphs(doc: str | None) -> list[str]:
    """A docstring's paragraphs, each on one line, the first sentence (the summary) left out; a
    paragraph of bullets ("* ...") keeps one line per bullet."""
    import inspect

    text = inspect.cleandoc(doc or "")
    first = _first_sentence(text)
    out = []
    for block in text.split("\n\n"):
        lines = block.splitlines()
        if any(line.lstrip().startswith(("* ", "- ")) for line in lines):
            items, current = [], []
            for line in lines:
                if line.lstrip().startswith(("* ", "- ")) and current:
                    items.append(" ".join(current))
                    current = []
                current.append(line.strip())
            out += items + [" ".join(current)]
        else:
            out.append(" ".join(block.split()))
    if out and " ".join(out[0].split()).startswith(first):
        out[0] = out[0][len(first):].strip()
    return [p for p in out if p]


def build() -> list[dict]:
    """Rows with: name, kind ("method" or "preset"), summary, recommended, experimental, aliases,
    spec (a preset's), second_pass, where (runtime → bool), where_with (runtime → the setting it runs
    the method with, where it refuses the defaults), refusals (runtime → reasons) and params
    (name, default, type) of each method built with its defaults."""
    from dataclasses import MISSING, fields

    from .defaults import LEARNED
    from .methods import get_method
    from .methods.presets import PRESETS
    from .methods.registry import _REGISTRY, old_names
    from .params import accepted_names
    from .runtime import SessionRuntime
    from .vllm.runtime import VllmRuntime

    presets = {p.name: p for p in PRESETS}
    out = []
    for name in sorted(set(_REGISTRY) | set(presets)):
        preset = presets.get(name)
        cls = _REGISTRY[preset.method] if preset else _REGISTRY[name]
        row = {"name": name, "kind": "preset" if preset else "method",
               "summary": preset.summary if preset else (cls.summary or _first_sentence(cls.__doc__)),
               "recommended": bool(preset and preset.recommended) or name == LEARNED,
               "experimental": bool(not preset and getattr(cls, "experimental", False)),
               "aliases": old_names(name), "spec": preset.spec if preset else None,
               "ties": sorted(preset.ties) if preset else [], "doc": _paragraphs(None if preset else cls.__doc__),
               "source": None if preset else _first_paragraph(sys.modules[cls.__module__].__doc__),
               "params": [], "second_pass": None, "where": {}, "where_with": {}, "refusals": {}}
        try:
            method = get_method(name)
        except Exception as e:  # a method that needs a parameter to exist: listed, its columns unknown
            row["summary"] = row["summary"] or f"(cannot build with defaults: {e})"
            out.append(row)
            continue
        row["second_pass"] = bool(method.needs.second_pass)
        row["refusals"] = {r.name: r.refusals(method) for r in (SessionRuntime, VllmRuntime)}
        row["where"] = {r: not reasons for r, reasons in row["refusals"].items()}
        row["where_with"] = {r.name: "alloc=uniform" for r in (SessionRuntime, VllmRuntime)
                             if not row["where"][r.name] and _runs_uniform(name, method, r)}
        for f in fields(method):
            if f.init:
                value = getattr(method, f.name)
                shown = getattr(value, "name", None) or repr(value) if f.default is MISSING else repr(value)
                row["params"].append([f.name, shown, f.type if isinstance(f.type, str) else
                                      getattr(f.type, "__name__", str(f.type)), accepted_names(f)])
        out.append(row)
    return out


def _runs_uniform(name: str, method, runtime) -> bool:
    """Whether `runtime`, which refuses `method`, runs it with `alloc=uniform` (vLLM and a global
    allocation)."""
    from .methods import get_method

    if getattr(method, "alloc", "uniform") == "uniform":
        return False
    try:
        return not runtime.refusals(get_method(name, alloc="uniform"))
    except (ValueError, TypeError):
        return False


def _where(row, short: bool = False) -> str:
    if not row["where"]:
        return "?"
    names = SHORT_RUNTIME_NAMES if short else RUNTIME_NAMES
    with_ = row.get("where_with", {})
    return ", ".join(names[r] + (f" ({with_[r]})" if r in with_ else "") for r, ok in row["where"].items()
                     if ok or r in with_) or "none"


def _cost(row) -> str:
    return "?" if row["second_pass"] is None else "2nd pass" if row["second_pass"] else "one pass"


def _cut(text: str, room: int) -> str:
    """`text` cut at a word boundary to at most `room` characters, "…" marking the cut."""
    if len(text) <= room:
        return text
    cut = text[:room - 1].rsplit(" ", 1)[0] if " " in text[:room - 1] else text[:room - 1]
    return cut.rstrip(" ,;:(") + "…"


def table(width: int | None = None) -> str:
    """The methods table as text, one line per method of at most `width` characters (default 100):
    its name (`*` recommended), kind, cost, runtimes and the start of its summary (`kvmerge methods
    NAME` has the whole text); then the legend, wrapped to `width`."""
    import textwrap

    width = width or 100
    data = rows()
    head = ("  name", "kind", "cost", "runs in", "what it does")
    from .defaults import FALLBACK, LEARNED, RULE, UNIFORM

    mark = {LEARNED: " (default)", UNIFORM: " (default in vLLM)", FALLBACK: " (fallback)"}
    cells = [(("* " if r["recommended"] else "  ") + r["name"] + mark.get(r["name"], ""),
              r["kind"] if not r["experimental"] else "part", _cost(r), _where(r, short=True),
              SHORT.get(r["name"], r["summary"])) for r in data]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(4)]
    room = max(20, width - sum(widths) - 2 * 4)
    lines = ["  ".join(x.ljust(w) for x, w in zip(c, widths)) + "  " + _cut(c[4], room) for c in [head, *cells]]
    legend = [f"Default (kvmerge generate, kvmerge.compressing, the vLLM plugin): {RULE}, which logs one line "
              "naming `kvmerge train-scorer --model PATH`.", "* recommended (README: which method to pick).",
              "kind: method, preset (a method with other defaults), part (experimental: a piece of a preset, not "
              "meant alone). cost: one pass = scored during the prefill; 2nd pass = another forward over the context "
              "before compressing. runs in: hf = transformers (one-shot and with --prefill-chunk), vLLM (the plugin).",
              "kvmerge methods NAME: the whole description, old names, parameters and refusals."]
    return "\n".join([*lines, "", *(line for text in legend for line in textwrap.wrap(text, width,
                                                                                       break_on_hyphens=False))])


def detail(name: str, width: int | None = None) -> str:
    """One method in full: its whole description, parameters with defaults, and why each runtime
    refuses it; prose wrapped to `width` characters (default 100)."""
    import textwrap

    from .errors import UnknownNameError, suggest

    width = width or 100
    data = {r["name"]: r for r in rows()}
    alias = {a: r["name"] for r in data.values() for a in r["aliases"]}
    name = name.split(":", 1)[0]  # a spec names its method first
    found = row(name)
    if found is None:
        raise UnknownNameError(f"unknown method {name!r}{suggest(name, [*data, *alias])}; `kvmerge methods` lists "
                               "them")
    r = found
    wrap = lambda text, indent="": textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False)  # noqa: E731
    from .defaults import FALLBACK, LEARNED, RULE

    marks = "".join([", recommended" if r["recommended"] else "", ", experimental" if r["experimental"] else "",
                     ", the default where the model has learned-scorer weights" if r["name"] == LEARNED else "",
                     ", the default where the model has no learned-scorer weights" if r["name"] == FALLBACK else ""])
    doc = r.get("doc") or []
    kind = "part" if r["experimental"] else r["kind"]  # as the table names it
    out = wrap(f"{r['name']} ({kind}{marks}): {' '.join([r['summary'], *doc[:1]])}")
    for paragraph in doc[1:]:
        out += ["", *wrap(paragraph)]
    if r.get("source"):
        out += ["", *wrap(f"source: {r['source']}")]
    out.append("")
    if r["name"] in (LEARNED, FALLBACK):
        out += wrap(f"default: {RULE}")
    if r["aliases"]:
        out.append(f"old names: {', '.join(r['aliases'])}")
    if r["spec"]:
        out += _wrap_spec(f"spec: {r['spec']}", width)
    out.append(f"cost: {_cost(r)}; runs in: {_where(r)}")
    for runtime, reasons in r["refusals"].items():
        for reason in reasons:
            out += wrap(f"not in {RUNTIME_NAMES[runtime]}: {reason}", "  ")
    if r["params"]:
        out.append("parameters (name = default, type), set as NAME:param=value:")
        out += [f"  {p} = {d}  ({t})" for p, d, t, _ in r["params"]]
    return "\n".join(out)


def _wrap_spec(text: str, width: int) -> list[str]:
    """A spec on lines of at most `width` characters, broken after its colons (never inside a
    parameter; one longer than a line stays whole), continuation lines indented by two spaces."""
    import re

    lines = [""]
    for piece in re.findall(r"[^:]*:|[^:]+$", text):
        if lines[-1].strip() and len(lines[-1]) + len(piece) > width:
            lines.append("  ")
        lines[-1] += piece
    return lines


def _normal(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def row(name: str) -> dict | None:
    """The table's row of a method or preset name (an old name resolved), or None."""
    data = {_normal(r["name"]): r for r in rows()}
    for r in list(data.values()):
        data.update({_normal(a): r for a in r["aliases"]})
    return data.get(_normal(name))


def check_spec(spec: str) -> None:
    """Refuse, from the table alone (no torch once it is cached), a spec whose method is unknown, or
    that names a parameter the method lacks or gives one a value of the wrong type; close names are
    suggested. What the table cannot tell is left to the method's own checks."""
    from .errors import ParameterTypeError, UnknownNameError, suggest
    from .params import check_value

    name, params = parse_spec(spec)
    found = row(name)
    if found is None:
        names = sorted({r["name"] for r in rows()} | {a for r in rows() for a in r["aliases"]})
        raise UnknownNameError(f"unknown method {name!r}{suggest(name, names)}; `kvmerge methods` lists them")
    if not params or not found["params"]:
        return
    declared = {p: (default, accepted) for p, default, _t, accepted in found["params"]}
    known = set(declared) | set(found["ties"])
    for key, value in params.items():
        if key not in known and not key.startswith("base."):
            raise ParameterTypeError(f"{found['name']} has no parameter {key!r}{suggest(key, known)}; "
                                     f"`kvmerge methods {found['name']}` lists its parameters")
        if key in declared:
            check_value(found["name"], key, value, declared[key][1], declared[key][0])
