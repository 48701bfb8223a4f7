"""The methods table behind `kvmerge methods`: every registered method and preset with one line on
what it does, its cost class, where it runs and its parameters, built from the methods themselves.

Building it imports the methods (and so torch, over a second). The rows are cached as JSON under
`$KVMERGE_CACHE`, keyed by a hash of kvmerge's own source files, so a later `kvmerge methods` reads
them without importing torch; any edit to a method, a preset or the capabilities makes a new key.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .spec import parse_spec

RUNTIME_NAMES = {"transformers": "transformers", "chunked": "chunked", "vllm": "vLLM"}


def _source_key() -> str:
    root = Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted([*root.glob("*.py"), *root.glob("methods/*.py")]):
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


def build() -> list[dict]:
    """Rows with: name, kind ("method" or "preset"), summary, recommended, experimental, aliases,
    spec (a preset's), second_pass, where (runtime → bool), refusals (runtime → reasons) and params
    (name, default, type) of each method built with its defaults."""
    from dataclasses import MISSING, fields

    from .capabilities import RUNTIMES, refusals
    from .errors import accepted_names
    from .methods import get_method
    from .methods.presets import PRESETS
    from .methods.registry import _REGISTRY

    presets = {p.name: p for p in PRESETS}
    out = []
    for name in sorted(set(_REGISTRY) | set(presets)):
        preset = presets.get(name)
        cls = _REGISTRY[preset.method] if preset else _REGISTRY[name]
        row = {"name": name, "kind": "preset" if preset else "method",
               "summary": preset.summary if preset else (cls.summary or _first_sentence(cls.__doc__)),
               "recommended": bool(preset and preset.recommended),
               "experimental": bool(not preset and getattr(cls, "experimental", False)),
               "aliases": list(preset.aliases) if preset else [], "spec": preset.spec if preset else None,
               "ties": sorted(preset.ties) if preset else [],
               "params": [], "second_pass": None, "where": {}, "refusals": {}}
        try:
            method = get_method(name)
        except Exception as e:  # a method that needs a parameter to exist: listed, its columns unknown
            row["summary"] = row["summary"] or f"(cannot build with defaults: {e})"
            out.append(row)
            continue
        row["second_pass"] = bool(method.needs.second_pass)
        row["refusals"] = {r: refusals(method, r) for r in RUNTIMES}
        row["where"] = {r: not reasons for r, reasons in row["refusals"].items()}
        for f in fields(method):
            if f.init:
                value = getattr(method, f.name)
                shown = getattr(value, "name", None) or repr(value) if f.default is MISSING else repr(value)
                row["params"].append([f.name, shown, f.type if isinstance(f.type, str) else
                                      getattr(f.type, "__name__", str(f.type)), accepted_names(f)])
        out.append(row)
    return out


def _where(row) -> str:
    if not row["where"]:
        return "?"
    return ", ".join(RUNTIME_NAMES[r] for r, ok in row["where"].items() if ok) or "none"


def _cost(row) -> str:
    return "?" if row["second_pass"] is None else "2nd pass" if row["second_pass"] else "one pass"


def table(width: int | None = None) -> str:
    """The methods table as text (each line cut to `width` characters, if given), then a legend."""
    data = rows()
    cells = [(("* " if r["recommended"] else "  ") + r["name"], r["kind"] if not r["experimental"]
              else "part", _cost(r), _where(r),
              r["summary"] + (f" (old name: {', '.join(r['aliases'])})" if r["aliases"] else ""))
             for r in data]
    head = ("  name", "kind", "cost", "runs in", "what it does")
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(4)]
    lines = []
    for c in [head, *cells]:
        line = "  ".join(x.ljust(w) for x, w in zip(c, widths)) + "  " + c[4]
        lines.append(line if width is None or len(line) <= width else line[:width - 1] + "…")
    lines += ["", "* recommended (README: which method to pick). kind: method, preset (a method with other defaults), "
              "part (experimental: a piece of a preset, not meant alone). cost: one pass = scored during the "
              "prefill; 2nd pass = another forward over the context before compressing. runs in: transformers "
              "(one-shot), chunked (--prefill-chunk), vLLM (the plugin). `kvmerge methods NAME`: parameters and "
              "refusals."]
    return "\n".join(lines)


def detail(name: str) -> str:
    """One method's row in full: summary, parameters with defaults, and why each runtime refuses it."""
    from .errors import UnknownNameError, suggest

    data = {r["name"]: r for r in rows()}
    alias = {a: r["name"] for r in data.values() for a in r["aliases"]}
    found = data.get(name) or data.get(alias.get(name, ""))
    if found is None:
        raise UnknownNameError(f"unknown method {name!r}{suggest(name, [*data, *alias])}; `kvmerge methods` lists "
                               "them")
    r = found
    out = [f"{r['name']} ({r['kind']}{', recommended' if r['recommended'] else ''}"
           f"{', experimental' if r['experimental'] else ''}): {r['summary']}"]
    if r["aliases"]:
        out.append(f"old names: {', '.join(r['aliases'])}")
    if r["spec"]:
        out.append(f"spec: {r['spec']}")
    out.append(f"cost: {_cost(r)}; runs in: {_where(r)}")
    for runtime, reasons in r["refusals"].items():
        for reason in reasons:
            out.append(f"not in {RUNTIME_NAMES[runtime]}: {reason}")
    if r["params"]:
        out.append("parameters (name = default, type), set as NAME:param=value:")
        out += [f"  {p} = {d}  ({t})" for p, d, t, _ in r["params"]]
    return "\n".join(out)


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
    from .errors import ParameterTypeError, UnknownNameError, check_value, suggest

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
