"""Text shipped with Python, used as haystacks and long documents (no downloads)."""

from __future__ import annotations

import functools
import re
from pathlib import Path


@functools.lru_cache(maxsize=4)
def prose(path: str | None = None) -> str:
    """English prose: Python's own `pydoc_data.topics` (the language reference), or a UTF-8 file."""
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
