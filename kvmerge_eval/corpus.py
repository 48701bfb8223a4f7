"""Text shipped with Python, used as haystacks and long documents (no downloads)."""

from __future__ import annotations

import functools
import re
from pathlib import Path


@functools.lru_cache(maxsize=4)
def prose(path: str | None = None) -> str:
    """English prose: Python's own `pydoc_data.topics` (the language reference), a genre's text
    (`genre_text`: docs, legal, manual, code, table, dialogue), or a UTF-8 file."""
    if path in GENRES:
        return genre_text(path)
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            para = " ".join(line.strip() for line in para.splitlines())
            # keep paragraphs that read as sentences, not code or tables
            if len(para) > 200 and para.count(".") >= 2 and not re.search(r"[{}=<>|]{2}|^\s*[>*+-]", para):
                paragraphs.append(para)
    return "\n\n".join(paragraphs)


def sentences(text: str) -> list[str]:
    """Split prose into sentences (keeps the terminal punctuation)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


LICENCES = Path("/usr/share/common-licenses")
MANUAL = Path("/usr/share/man/man1")
# Commands of Debian's essential packages (coreutils, tar, grep, sed, findutils, gzip, diffutils):
# their manual pages are the `manual` genre, and their names its keys.
COMMANDS = ("basename", "cat", "chmod", "chown", "cmp", "comm", "cp", "csplit", "cut", "date", "dd", "df",
            "diff", "diff3", "dirname", "du", "echo", "env", "expand", "expr", "find", "fmt", "fold", "grep",
            "gzip", "head", "install", "join", "ln", "ls", "mkdir", "mktemp", "mv", "nice", "nl", "numfmt",
            "od", "paste", "pr", "printf", "ptx", "readlink", "rm", "sdiff", "sed", "seq", "shred", "shuf",
            "sort", "split", "stat", "stty", "sum", "tail", "tar", "tee", "timeout", "touch", "tr", "truncate",
            "uniq", "wc", "xargs")


def _running_text(para: str) -> bool:
    """A paragraph of prose, not a heading, a list of options or a table: long and mostly letters."""
    return len(para) > 120 and sum(c.isalpha() for c in para) > 0.7 * len(para)


def _roff_text(page: str) -> list[str]:
    """A manual page's running text: paragraphs of the roff source with macros and escapes removed
    (font macros keep their words; every other request ends a paragraph). Deliberately simple, and
    kept as measured: alternating-font macros (`.BR chmod .`) keep a space between their arguments,
    and string escapes such as `\\*(lq` stay as written."""
    paragraphs, current = [], []
    for line in page.splitlines():
        if line.startswith((".", "'")):
            macro, _, rest = line[1:].partition(" ")
            if macro in ("B", "I", "BR", "BI", "IB", "IR", "RB", "RI", "SM"):
                current.append(rest.replace('"', ""))
                continue
            if current:
                paragraphs.append(" ".join(current))
            current = []
            continue
        current.append(line)
    if current:
        paragraphs.append(" ".join(current))
    out = []
    for para in paragraphs:
        para = re.sub(r"\\f(\(..|\[[^]]*\]|.)", "", para)  # font changes
        para = re.sub(r"\\\(..|\\\[[^]]*\]", " ", para).replace("\\-", "-").replace("\\e", "\\")
        para = re.sub(r"\\[&|^/,%:]", "", para).replace("\\ ", " ")
        para = re.sub(r"\s+", " ", para).strip()
        if _running_text(para):
            out.append(para)
    return out


@functools.lru_cache(maxsize=8)
def genre_text(genre: str) -> str:
    """Text of one genre, paragraphs separated by blank lines, all shipped with the system or Python:
    `docs` Python's language reference; `legal` the licence texts in /usr/share/common-licenses and
    Python's own LICENSE.txt; `code` standard-library source; `table` rows of the Unicode database;
    `legal` depends on the licences the system ships (Debian's base-files: the same on every machine
    of one image); `manual` the manual pages of the commands in `COMMANDS` (section 1, as installed); `dialogue` two speakers' alternating turns made of the language reference's sentences (a
    dialogue's form, not its content: no dialogue corpus ships with the system)."""
    if genre == "docs":
        return prose()
    if genre == "legal":
        import sys

        files = sorted(p for p in LICENCES.glob("*") if p.is_file() and not p.is_symlink()) if LICENCES.is_dir() else []
        files += [p for p in Path(sys.base_prefix).glob("lib/python3*/LICENSE.txt")]
        if not files:
            raise FileNotFoundError(f"the legal genre needs licence texts: none in {LICENCES} or Python's LICENSE.txt")
        paragraphs = []
        for f in files:
            for para in f.read_text(encoding="utf-8", errors="replace").split("\n\n"):
                para = " ".join(line.strip() for line in para.splitlines())
                if _running_text(para):
                    paragraphs.append(para)
        return "\n\n".join(dict.fromkeys(paragraphs))
    if genre == "manual":
        import gzip

        missing = [c for c in COMMANDS if not (MANUAL / f"{c}.1.gz").is_file()]
        if missing:  # every page, or the haystacks would differ from machine to machine
            raise FileNotFoundError(f"the manual genre needs the manual pages of {len(COMMANDS)} essential commands in "
                                    f"{MANUAL}; missing: {', '.join(missing)}")
        paragraphs = []
        for c in COMMANDS:
            with gzip.open(MANUAL / f"{c}.1.gz", "rt", encoding="utf-8", errors="replace") as f:
                paragraphs += _roff_text(f.read())
        return "\n\n".join(dict.fromkeys(paragraphs))
    if genre == "code":
        import argparse, json.decoder, textwrap, inspect, dataclasses  # noqa: E401 - sources, not uses

        return "\n\n".join(inspect.getsource(m) for m in (textwrap, json.decoder, dataclasses, argparse))
    if genre == "dialogue":  # the form of a dialogue (two speakers' turns), the language reference's sentences
        turns = [f"{'Ana' if i % 2 == 0 else 'Ben'}: {x}" for i, x in enumerate(sentences(prose()))]
        return "\n\n".join("\n".join(turns[i:i + 6]) for i in range(0, len(turns), 6))
    if genre == "table":
        import unicodedata

        rows = [f"U+{c:04X} | {unicodedata.name(chr(c))} | {unicodedata.category(chr(c))}"
                for c in range(0x20, 0x3000) if unicodedata.name(chr(c), "")]
        return "\n\n".join("\n".join(rows[i:i + 20]) for i in range(0, len(rows), 20))
    raise ValueError(f"unknown genre {genre!r}; genres: {', '.join(GENRES)}")


GENRES = ("docs", "legal", "manual", "code", "table", "dialogue")
