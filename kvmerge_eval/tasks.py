"""Evaluation tasks as registered objects, as methods are: each says how to build its samples, how
many tokens to generate, how to build a sample's prompt ids and how to score a prediction. The runner,
the suites, the report and the CLI read this table; a new task is one `Task` here."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable


@dataclass(frozen=True)
class Task:
    """`build(tok, lengths, samples, text, subtasks)` → samples; `score(prediction, sample)` → [0, 1];
    `max_new_tokens(sample)`; `prompt(tok, sample)` → (context ids, question ids) (None: the runner's
    `prompt_ids`); `subtasks()`: the names of its subtasks, each a column of a suite's table (None: the
    task is one column); `metrics`: the summary's columns; `teacher_forced`: scored on a continuation
    (fidelity) rather than on generated text."""

    name: str
    build: Callable
    score: Callable | None = None
    max_new_tokens: Callable = lambda sample: 32
    prompt: Callable | None = None
    subtasks: Callable | None = None
    metrics: tuple[str, ...] = ("score",)
    teacher_forced: bool = False
    summary: str = ""


def _niah(tok, lengths, samples, text, subtasks):
    from . import niah

    depths = [0.1 + 0.8 * i / max(samples - 1, 1) for i in range(samples)]
    return [niah.make_sample(tok, n, d, seed=1000 * n + i, text=text) for n in lengths for i, d in enumerate(depths)]


def _ruler(tok, lengths, samples, text, subtasks):
    from . import ruler

    names = subtasks or list(ruler.TASKS)
    return [ruler.TASKS[t](tok, n, 1000 * n + i, text) for t in names for n in lengths for i in range(samples)]


def _family(tok, lengths, samples, text, subtasks):  # `text` names the genre of the haystack (families.GENRES)
    from . import families

    names = subtasks or list(families.TASKS)
    unknown = [t for t in names if t not in families.TASKS]
    if unknown:
        raise ValueError(f"unknown family {unknown[0]!r}; families: {', '.join(families.TASKS)}")
    return [families.TASKS[t](tok, n, 1000 * n + i, text or "docs") for t in names for n in lengths
            for i in range(samples)]


def _fidelity(tok, lengths, samples, text, subtasks):
    from . import fidelity

    return [fidelity.make_sample(tok, n, seed=1000 * n + i, text=text) for n in lengths for i in range(samples)]


def _code(tok, lengths, samples, text, subtasks):
    from . import code

    return [code.make_sample(tok, n, seed=1000 * n + i) for n in lengths for i in range(samples)]


def _ruler_real(tok, lengths, samples, text, subtasks):
    from . import ruler_real

    if text is not None:
        raise ValueError("RULER's generators choose their own haystacks: --text does not apply to ruler-real")
    out = [s for n in lengths for s in ruler_real.samples(tok.name_or_path, n, samples, subtasks)]
    return sorted(out, key=lambda s: (s.meta["seed"], s.meta["length"]))  # every task's first sample first


def _score(module: str, field: str = "answer"):
    def score(prediction, sample):
        import importlib

        return importlib.import_module(f"kvmerge_eval.{module}").score(prediction, getattr(sample, field))
    return score


def _ruler_real_score(prediction, sample):
    from . import ruler_real

    return ruler_real.score(sample.meta["task"], prediction, sample.answer)


def _ruler_real_prompt(tok, sample):
    from . import ruler_real

    return ruler_real.prompt_ids(tok, sample)


def _subtasks(module: str):
    def names():
        import importlib

        return list(importlib.import_module(f"kvmerge_eval.{module}").TASKS)
    return names


TASKS = {t.name: t for t in [
    Task("niah", _niah, _score("niah"), lambda s: 24, summary="a needle in prose, asked for by its key"),
    Task("ruler", _ruler, _score("ruler"), lambda s: 48, subtasks=_subtasks("ruler"),
         summary="RULER-style tasks written here from templates (needles, variable tracking, word counts)"),
    Task("fidelity", _fidelity, metrics=("kl", "ppl_ratio", "top1"), teacher_forced=True,
         summary="KL of a teacher-forced continuation against the full cache"),
    Task("code", _code, _score("code"), lambda s: 32, summary="complete the next lines of Python source"),
    Task("family", _family, _score("families"), lambda s: 32, subtasks=_subtasks("families"),
         summary="held-out task families: a fact in the document's own words, a two-hop fact, ..."),
    Task("ruler-real", _ruler_real, _ruler_real_score, lambda s: s.meta["max_new_tokens"], _ruler_real_prompt,
         _subtasks("ruler_real"), summary="NVIDIA's RULER, its own generators and metrics, split as kvpress's "
                                          "leaderboard (make setup-ruler)"),
]}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}")
    return TASKS[name]
