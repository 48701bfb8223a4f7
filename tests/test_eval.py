"""Needle task generator, scorer and the resumable runner."""

import json

from kvmerge.eval.niah import make_sample, score
from kvmerge.eval.runner import run_niah, summarize

from .conftest import tiny_model
from .test_semanticache import _sp_tokenizer


class WordTokenizer:
    """Counts whitespace-separated words as tokens (stands in for a real tokenizer in length checks)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


def test_needle_sample_length_depth_and_answer():
    tok = WordTokenizer()
    for depth in (0.1, 0.5, 0.9):
        s = make_sample(tok, 800, depth, seed=7)
        words = s.context.split()
        assert 800 <= len(words) <= 800 + 80  # whole sentences: overshoot < one sentence
        needle_at = s.context.index("The special magic number")
        assert abs(needle_at / len(s.context) - depth) < 0.1
        assert s.answer in s.context and s.meta["city"] in s.question


def test_score():
    assert score("The special magic number for Oslo is 48213.", "48213") == 1.0
    assert score("It is 481.", "48213") == 0.0
    assert score("482131", "48213") == 0.0


def test_runner_resumes_without_redoing_work(tmp_path):
    tok = _sp_tokenizer()
    model = tiny_model(vocab_size=len(tok))
    args = (model, tok, ["full", "streamingllm"], [0.5], [300], 2, tmp_path)
    table = run_niah(*args)
    lines = (tmp_path / "niah.jsonl").read_text().splitlines()
    assert len(lines) == 4 and table[("full", 1.0, 300)][1] == 2
    run_niah(*args)
    assert (tmp_path / "niah.jsonl").read_text().splitlines() == lines
    assert all({"prediction", "correct", "cache_bytes"} <= set(json.loads(x)) for x in lines)
    assert summarize(tmp_path / "niah.jsonl") == table
