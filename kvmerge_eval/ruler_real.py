"""NVIDIA's RULER (Hsieh et al., 2024), its own generators and metrics, from the PyPI package
`nvidia-long-context-eval==26.3` (`make setup-ruler`), run offline on a local tokenizer.

Generation mirrors the package's `data/prepare.py` with `--model_template_type base`, as kvpress's
`evaluation/benchmarks/ruler/generate.sh` runs it: per task, the generator script named by
`synthetic.yaml` runs in a subprocess with that task's arguments, seed 42, `--tokens_to_generate` from
`data/synthetic/constants.py` and the task template followed by its answer prefix. Each generated
`input` is then split as kvpress's RULER dataset (`simonjegou/ruler`, `create_huggingface_dataset.py`):
context = the text before the last match of the task family's question marker, question = from there
to the first answer marker after it, answer prefix = the rest. Predictions are scored by RULER's own
per-sample metric functions (`string_match_all`, `string_match_part` for qa) after kvpress's
post-processing.

One substitution: niah.py splits its essay haystacks with nltk's `sent_tokenize`, whose trained Punkt
parameters (punkt_tab) cannot be downloaded offline. An empty punkt_tab under `<cache dir>/nltk_data`
gives nltk's Punkt algorithm with no trained parameters (no abbreviation, collocation or sentence-starter
lists): sentence boundaries, hence where needles land between sentences, may differ from RULER's; the
haystack text, needles, questions and answers do not.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
QUESTION = {  # task family (the task name before "_") → question marker, kvpress's QUESTION_PATTERNS
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "fwe": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}
ANSWER = {"niah": re.compile(r"The special magic"), **{f: re.compile(r"Answer:") for f in ("vt", "cwe", "fwe", "qa")}}
INSTALL = ("`make setup-ruler` (or: pip install --no-deps nvidia-long-context-eval==26.3 && "
           "pip install wonderwords tenacity scipy nltk pyyaml)")
PUNKT_FILES = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model")


def _package() -> Path:
    """The installed `long_context_eval` folder, or a RuntimeError naming the install."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"NVIDIA's RULER package is not installed: run {INSTALL}")
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def _config() -> dict[str, dict]:
    """task → {"generator", "args", "tokens_to_generate", "template"} as prepare.py builds them: the
    `base` model template around the task template, then the task's answer prefix."""
    package = _package()
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS as base
    from long_context_eval.data.template import Templates

    tasks = yaml.safe_load((package / "synthetic.yaml").read_text())
    out = {}
    for task, cfg in tasks.items():
        b = base[cfg["task"]]
        template = Templates["base"].format(task_template=b["template"]) + b.get("answer_prefix", "")
        out[task] = {"generator": cfg["task"], "args": cfg["args"], "tokens_to_generate": b["tokens_to_generate"],
                     "template": template}
    return out


def tokenizer_dir(model_name_or_tokenizer_dir) -> Path:
    """A bundled model's name (its converted folder, `kvmerge.model._convert_once`) or a local folder
    holding Hugging Face tokenizer files."""
    from kvmerge.model import BUNDLED, _convert_once

    if str(model_name_or_tokenizer_dir) in BUNDLED:
        return _convert_once(str(model_name_or_tokenizer_dir))
    path = Path(model_name_or_tokenizer_dir).expanduser()
    if not path.is_dir():
        raise ValueError(f"{model_name_or_tokenizer_dir!r} is neither a bundled model ({', '.join(BUNDLED)}) "
                         "nor a local tokenizer folder")
    return path


def tokenizer_id(folder: Path) -> str:
    """12 hex digits of a SHA-256 over the folder's tokenizer files (names and bytes): the cache key."""
    h = hashlib.sha256()
    files = sorted({p for pattern in TOKENIZER_FILES for p in Path(folder).glob(pattern) if p.is_file()})
    if not files:
        raise ValueError(f"no tokenizer files in {folder}")
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def cache_path(folder: Path, length: int, task: str, samples: int) -> Path:
    """`<kvmerge cache dir>/ruler/<tokenizer id>/<length>/<task>_<samples>.jsonl`."""
    from kvmerge.model import cache_dir

    return cache_dir() / "ruler" / tokenizer_id(folder) / str(length) / f"{task}_{samples}.jsonl"


def nltk_data() -> Path:
    """An NLTK data folder whose punkt_tab/english is empty: Punkt with no trained parameters."""
    from kvmerge.model import cache_dir

    root = cache_dir() / "nltk_data"
    english = root / "tokenizers" / "punkt_tab" / "english"
    english.mkdir(parents=True, exist_ok=True)
    for name in PUNKT_FILES:
        (english / name).touch()
    return root


def split(task: str, text: str) -> tuple[str, str, str]:
    """(context, question, answer_prefix) of a generated `input`, as kvpress's RULER dataset splits it."""
    family = task.split("_")[0]
    found = list(QUESTION[family].finditer(text))
    if not found:
        raise ValueError(f"{task}: question marker {QUESTION[family].pattern!r} not found in the generated input")
    at = found[-1].start()
    answer = ANSWER[family].search(text, at)
    if answer is None:
        raise ValueError(f"{task}: answer marker {ANSWER[family].pattern!r} not found after the question")
    return text[:at], text[at:answer.start()], text[answer.start():]


def _run(task: str, folder: Path, length: int, samples: int, timeout_s: float) -> list[dict]:
    """RULER's raw rows {"index", "input", "outputs", "length"} of `task`, from its generator script."""
    cfg = _config()[task]
    script = _package() / "data" / "synthetic" / f"{cfg['generator']}.py"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(script), "--save_dir", tmp, "--save_name", task, "--subset", "validation",
               "--tokenizer_path", str(folder), "--tokenizer_type", "hf", "--max_seq_length", str(length),
               "--tokens_to_generate", str(cfg["tokens_to_generate"]), "--num_samples", str(samples),
               "--random_seed", "42", *[a for k, v in cfg["args"].items() for a in (f"--{k}", str(v))],
               *(["--pre_samples", "0"] if cfg["generator"] == "qa" else []), "--template", cfg["template"]]
        env = {**os.environ, "NLTK_DATA": str(nltk_data()), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        try:
            proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"RULER's {script.name} for {task} at {length} tokens ran past {timeout_s:.0f} s "
                               "and was killed (a retry loop that never ends?)") from None
        out = Path(tmp) / task / "validation.jsonl"
        if proc.returncode or not out.exists():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            missing = "; missing a dependency? run " + INSTALL if "ModuleNotFoundError" in proc.stderr else ""
            raise RuntimeError(f"RULER's {script.name} for {task} failed (exit {proc.returncode}): {last}{missing}")
        rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    if len(rows) != samples:
        raise RuntimeError(f"RULER's {script.name} for {task} wrote {len(rows)} samples, {samples} asked")
    return rows


def generate(model_name_or_tokenizer_dir, length: int, samples: int, tasks=None,
             timeout_s: float | None = None) -> list[dict]:
    """`samples` RULER samples of each task (default: all of TASKS, in order) at `length` tokens (RULER's
    max_seq_length: input tokens + the task's tokens_to_generate, counted by this tokenizer). Rows:
    {"task", "index", "length", "context", "question", "answer_prefix", "answers" (RULER's outputs),
    "max_new_tokens", "ruler_length" (RULER's own count)}. Cached per tokenizer, length, task and count
    (`cache_path`); a generator runs in a subprocess killed after `timeout_s` (default 120 + length/40)."""
    folder = tokenizer_dir(model_name_or_tokenizer_dir)
    out = []
    for task in tasks or TASKS:
        if task not in TASKS:
            raise ValueError(f"unknown RULER task {task!r}; tasks: {', '.join(TASKS)}")
        path = cache_path(folder, length, task, samples)
        if not path.exists():
            cfg = _config()[task]
            rows = []
            for raw in _run(task, folder, length, samples, timeout_s or 120 + length / 40):
                context, question, prefix = split(task, raw["input"])
                rows.append({"task": task, "index": raw["index"], "length": length, "context": context,
                             "question": question, "answer_prefix": prefix, "answers": raw["outputs"],
                             "max_new_tokens": cfg["tokens_to_generate"], "ruler_length": raw["length"]})
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            tmp.replace(path)
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def samples(tokenizer_dir, length: int, samples: int, tasks=None) -> list:
    """`generate`'s rows as `kvmerge_eval.niah.Sample`s: answer = the list of answers, meta = {"task",
    "length", "seed" (the sample's index), "answer_prefix", "max_new_tokens"}."""
    from .niah import Sample

    return [Sample(r["context"], r["question"], r["answers"],
                   {"task": r["task"], "length": r["length"], "seed": r["index"], "answer_prefix": r["answer_prefix"],
                    "max_new_tokens": r["max_new_tokens"]})
            for r in generate(tokenizer_dir, length, samples, tasks)]


def postprocess(prediction: str) -> str:
    """kvpress's RULER post-processing: strip, drop characters \\x00-\\x1f, strip (RULER's evaluate.py
    replaces them by "\\n" instead: the two differ only when such a character splits an answer)."""
    return re.sub(r"[\x00-\x1f]", "", prediction.strip()).strip()


def score(task: str, prediction: str, answers) -> float:
    """One prediction's score in [0, 1]: RULER's per-sample metric of the task (string_match_all: the
    fraction of answers contained; string_match_part for qa: 1 if any is), case-insensitive, after
    `postprocess`."""
    generator = _config()[task]["generator"]
    from long_context_eval.eval.synthetic.constants import TASKS as metrics

    fn = metrics[generator]["metric_fn_per_sample"]
    return fn([postprocess(prediction)], [list(answers)])[0] / 100


def prompt_ids(tokenizer, sample) -> tuple[list[int], list[int]]:
    """(context_ids, question_ids) as kvpress's pipeline builds them, add_special_tokens=False. With a
    chat template: one user turn holding context + question; the context ids are the template's prefix
    and the context, the question ids the question, the rest of the template (end of turn, assistant
    start) and the answer prefix. Without: bos + context, then question + "\\n" + answer prefix."""
    context, prefix = sample.context, sample.meta["answer_prefix"]
    if getattr(tokenizer, "chat_template", None) is None:
        context, suffix = (tokenizer.bos_token or "") + context, "\n"
    else:
        separator = "#" * (len(context) + 10)
        text = tokenizer.apply_chat_template([{"role": "user", "content": context + separator}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
        context, suffix = text.split(separator)
    question = sample.question + suffix + prefix
    return (tokenizer.encode(context, add_special_tokens=False), tokenizer.encode(question, add_special_tokens=False))
