"""Compressed contexts as files: the answers from a file equal those of the same compression in
memory (and of `generate_ids`), in this process and in a new one; files are budget-sized; every
unusable file is refused in one line before any forward."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import kvmerge
from kvmerge.context import same_weights, weights_sample
from kvmerge.errors import KVMergeError

from .conftest import TinyTokenizer, random_ids, tiny_model
from .test_hybrid import gemma3

ONE_SHOT = ["full", "snapkv", "snapkv:alloc=head", "mixedmerge", "centroidkv:interval=4", "kvzip", "zipguardmerge",
            "learnedzip", "streamingllm", "semanticache"]
Q = [3, 4]


def _context(build, spec, n=160, **kwargs):
    model = build()
    return model, kvmerge.compress_context(model, TinyTokenizer(), random_ids(n, seed=1), f"{spec}:window=8", 0.25,
                                           **kwargs)


HYBRID = ["snapkv", "snapkv:alloc=head", "mixedmerge", "zipguardmerge"]


@pytest.mark.parametrize("build, spec", [(tiny_model, s) for s in ONE_SHOT] + [(gemma3, s) for s in HYBRID])
def test_answers_from_the_file_equal_the_compression_in_memory(build, spec, tmp_path):
    model, ctx = _context(build, spec)
    method = kvmerge.get_method(f"{spec}:window=8", budget=0.25)
    want = kvmerge.generate_ids(model, random_ids(160, seed=1), Q, method, max_new_tokens=8,
                                tokenizer=TinyTokenizer()).tokens
    assert ctx.generate_ids(Q, 8).tokens == want
    assert ctx.generate_ids(Q, 8).tokens == want  # each question starts from the compressed context again
    back = kvmerge.load_context(ctx.save(tmp_path / "c.kvz"), model, TinyTokenizer())
    assert back.generate_ids(Q, 8).tokens == want
    assert back.nbytes == ctx.nbytes and back.session.cache.entries == ctx.session.cache.entries


def test_a_new_process_answers_the_same(tmp_path):
    model, ctx = _context(tiny_model, "mixedmerge")
    path = ctx.save(tmp_path / "c.kvz")
    code = ("import json, kvmerge; from tests.conftest import TinyTokenizer, tiny_model; "
            f"ctx = kvmerge.load_context({str(path)!r}, tiny_model(), TinyTokenizer()); "
            f"print(json.dumps(ctx.generate_ids({Q}, 8).tokens))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ctx.generate_ids(Q, 8).tokens


def test_the_file_is_the_budgets_bytes(tmp_path):
    model, ctx = _context(tiny_model, "snapkv", n=2000)
    size = ctx.save(tmp_path / "c.kvz").stat().st_size
    ids_bytes = 8 * 2000  # the context's token ids, kept by default
    assert ctx.nbytes <= 0.26 * ctx.meta["full_bytes"]
    assert size - ids_bytes <= 1.1 * 0.25 * ctx.meta["full_bytes"]
    _, hashed = _context(tiny_model, "snapkv", n=2000, keep_ids=False)
    assert hashed.save(tmp_path / "h.kvz").stat().st_size <= 1.1 * 0.25 * ctx.meta["full_bytes"]


def test_kept_entries_name_their_context_positions():
    _, evicted = _context(tiny_model, "snapkv")
    for pos in evicted.kept:  # (heads, slots): every entry a position, the sinks and the recent window among them
        assert bool((pos >= 0).all()) and set(range(4)) | set(range(152, 160)) <= set(pos[0].tolist())
    _, merged = _context(tiny_model, "mixedmerge")
    assert any(bool((pos == -1).any()) for pos in merged.kept)


def test_model_generate_on_a_loaded_context_equals_its_answer(tmp_path):
    model, ctx = _context(tiny_model, "snapkv")
    back = kvmerge.load_context(ctx.save(tmp_path / "c.kvz"), model, TinyTokenizer())
    with kvmerge.compressing(model, "snapkv", budget=0.25) as kv:
        cache = kv.prefill(back)
        got = model.generate(torch.tensor([back.context_ids + Q]), cache=cache, max_new_tokens=8, do_sample=False)
    assert got[0, 160 + len(Q):].tolist() == back.generate_ids(Q, 8).tokens[0]
    stats = back.generate_ids(Q, 8).stats  # this answer's own seconds; its compression's are named so
    assert "prefill_seconds" not in stats and stats["compressed_before"] == ctx.meta["timings"]
    assert "compressed before (prefill" in str(stats)


def _refused(path, model, match, tok=None):
    with pytest.raises(KVMergeError, match=match):
        kvmerge.load_context(path, model, tok or TinyTokenizer())


def _rewrite(path, out, **meta):
    with safe_open(str(path), "pt") as f:
        head, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(out), metadata={**head, **meta})
    return out


def test_a_file_from_another_checkpoint_of_the_same_shapes_is_refused(tmp_path):
    """The fingerprint holds shapes only: a sample of the weights tells a fine-tune from its base (up to a
    dtype's rounding: a bfloat16 run's file loads into the same checkpoint in float32)."""
    model, ctx = _context(tiny_model, "snapkv")
    path = ctx.save(tmp_path / "c.kvz")
    other = tiny_model(seed=1)
    with torch.no_grad():  # a light fine-tune: every weight moved by about 0.1%, below bfloat16's step
        for p, q in zip(other.parameters(), model.parameters()):
            p.copy_(q * (1 + 0.001 * torch.randn_like(q)))
    _refused(path, other, r"made with another checkpoint of this architecture .*compress the context again")
    assert kvmerge.load_context(path, tiny_model(), TinyTokenizer()).tokens == ctx.tokens  # the same weights
    for dtype in (torch.bfloat16, torch.float16):  # the same checkpoint held in 16 bits, both ways round
        half = tiny_model(dtype=dtype)
        kvmerge.compress_context(half, TinyTokenizer(), random_ids(160, seed=1), "snapkv:window=8", 0.25).save(
            tmp_path / "h.kvz")
        assert kvmerge.load_context(tmp_path / "h.kvz", tiny_model(), TinyTokenizer()).tokens == ctx.tokens
        assert same_weights(weights_sample(tiny_model()), weights_sample(half))
    assert same_weights(weights_sample(tiny_model(dtype=torch.bfloat16)), weights_sample(tiny_model(dtype=torch.float16)))
    _refused(_tamper(path, tmp_path / "t.kvz", lambda t, m: m.update(weights_sample="x"), True), model,
             "weights_sample is not a list of numbers")
    assert kvmerge.load_context(_tamper(path, tmp_path / "t.kvz", lambda t, m: m.pop("weights_sample"), True), other,
                                TinyTokenizer()).tokens == ctx.tokens  # a file from before the sample: shapes only


def test_unusable_files_are_refused_in_one_line(tmp_path):
    model, ctx = _context(tiny_model, "snapkv")
    path = ctx.save(tmp_path / "c.kvz")
    data = path.read_bytes()
    (tmp_path / "cut.kvz").write_bytes(data[: len(data) // 2])
    _refused(tmp_path / "cut.kvz", model, "cut off or corrupt")
    (tmp_path / "longer.kvz").write_bytes(data + b"junk")
    _refused(tmp_path / "longer.kvz", model, "has 4 bytes after its end")
    (tmp_path / "junk.kvz").write_bytes(b"\x00" * 64)
    _refused(tmp_path / "junk.kvz", model, "not a compressed-context file")
    _refused(tmp_path / "none.kvz", model, "no compressed-context file")
    _refused(_rewrite(path, tmp_path / "new.kvz", version="99"), model, "newer than this kvmerge reads")
    _refused(_rewrite(path, tmp_path / "other.kvz", format="something"), model, "not a compressed-context file .a safetensors file")
    _refused(path, tiny_model(num_hidden_layers=3), r"made for another model .*fingerprint")

    class OtherTokenizer(TinyTokenizer):
        def get_vocab(self):
            return {"z": 0}
    _refused(path, model, "another tokenizer", OtherTokenizer())
    _refused(path, tiny_model(dtype=torch.bfloat16), "would round them: load the model with dtype=torch.float32")


def _tamper(path, out, change=lambda tensors, meta: None, digest=False):
    """`path` rewritten to `out` with `change(tensors, meta)` applied; its checksum recomputed when
    `digest`, else dropped, as format version 1 wrote files (before checksums)."""
    from kvmerge.context_file import digest as checksum

    with safe_open(str(path), "pt") as f:
        head, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    meta = json.loads(head["meta"])
    change(tensors, meta)
    head = {**head, "meta": json.dumps(meta)}
    head.pop("digest")
    if digest:
        head["digest"] = checksum(head["meta"], tensors)
    else:
        head["version"] = "1"  # a file from before checksums
    save_file(tensors, str(out), metadata=head)
    return out


def test_damaged_files_are_refused_naming_the_damage(tmp_path):
    model, ctx = _context(tiny_model, "mixedmerge")
    path = ctx.save(tmp_path / "c.kvz")
    data = bytearray(path.read_bytes())
    data[-200:-190] = b"\x7f" * 10  # inside the tensors: the file still parses
    (tmp_path / "bytes.kvz").write_bytes(bytes(data))
    _refused(tmp_path / "bytes.kvz", model, "is damaged: its contents changed after it was saved")
    _refused(_rewrite(path, tmp_path / "meta.kvz", meta=json.dumps({**ctx.meta, "budget": 0.5})), model, "checksum")

    def nan(t, m):
        t["l1.keys"][0, 0, 3, 0] = float("nan")

    def short(t, m):
        t["l0.values"] = t["l0.values"][:, :, :-1].contiguous()

    def ids(t, m):
        t["context_ids"][5] += 1

    def dtype(t, m):
        m["dtype"] = "bogus"

    def gone(t, m):
        del t["l1.log_n"], t["l1.keys"]

    for change, match in [(nan, "l1.keys holds a NaN"), (short, r"l0.values has shape \(1, 2, 39, 16\), to match "
                          r"l0.keys it must be \(1, 2, 40, 16\)"), (ids, "context_ids are not the 160 tokens"),
                          (dtype, "dtype 'bogus' is not a floating-point"), (gone, "it has no tensor l1.keys")]:
        for digest in (False, True):  # caught by the checks themselves, not only by the checksum
            _refused(_tamper(path, tmp_path / "t.kvz", change, digest), model, f"is damaged: .*{match}")
    _refused(_tamper(path, tmp_path / "t.kvz", lambda t, m: m.pop("layers"), True), model, "metadata is not")
    _refused(_tamper(path, tmp_path / "t.kvz", lambda t, m: t.pop("seen")), model, "counter seen is not a position")
    with safe_open(str(path), "pt") as f:
        head, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    head.pop("digest")  # a version 2 file with its checksum taken out
    save_file(tensors, str(tmp_path / "stripped.kvz"), metadata=head)
    _refused(tmp_path / "stripped.kvz", model, "its checksum is missing .format version 2 writes one")

    def seen(t, m):
        t["seen"][0] = 10 ** 9

    def kept(t, m):
        t["kept.0"][0, 0] = 10 ** 5

    def template(t, m):
        del m["chat_template"]

    def method(t, m):
        m["method"] = "bogus"

    def scaling(t, m):
        m["states"][0]["scaling"] = "x"
    for change, match in [(seen, "counter seen is not a position within its 160 tokens"),
                          (kept, "kept.0 names positions outside its 160 tokens"),
                          (template, "metadata is not a compressed context's .KeyError: chat_template"),
                          (method, "names a method this kvmerge cannot build: unknown method 'bogus'"),
                          (scaling, "layers do not read back .TypeError: layer state 0's scaling is 'x'")]:
        _refused(_tamper(path, tmp_path / "t.kvz", change), model, match)
    _, ragged = _context(tiny_model, "snapkv:alloc=head")

    def live(t, m):
        t["l0.live"][:] = False
    _refused(_tamper(ragged.save(tmp_path / "r.kvz"), tmp_path / "t.kvz", live), model, "layer 0's heads do not hold the entries its slot map")
    assert kvmerge.load_context(_tamper(path, tmp_path / "old.kvz"), model, TinyTokenizer()).generate_ids(Q, 4).tokens \
        == ctx.generate_ids(Q, 4).tokens  # a file without a checksum still loads


def test_a_lossless_dtype_is_converted_and_long_questions_are_refused(tmp_path):
    model, ctx = _context(lambda: tiny_model(dtype=torch.bfloat16), "snapkv")
    back = kvmerge.load_context(ctx.save(tmp_path / "c.kvz"), tiny_model(), TinyTokenizer())
    assert back.session.cache.layers[0].keys.dtype == torch.float32
    assert back.meta["dtype"] == "float32" and back.meta["full_bytes"] == 2 * ctx.meta["full_bytes"]
    again = back.save(tmp_path / "again.kvz")  # saved as what it now holds: float32, refused by a bfloat16 model
    _refused(again, tiny_model(dtype=torch.bfloat16), "holds float32 entries .* would round them")
    _refused(ctx.save(tmp_path / "c.kvz"), tiny_model(dtype=torch.float16), "holds bfloat16 entries .* float16")
    assert len(back.generate_ids(Q, 4).tokens[0]) == 4
    with pytest.raises(KVMergeError, match="over the model's 4,096 positions"):
        back.generate_ids(Q, 4000)


def test_the_commands_refuse_bad_files_before_any_model_loads(capsys, tmp_path, monkeypatch):
    from kvmerge import model as model_module

    from .test_cli import fails

    monkeypatch.setattr(model_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    (tmp_path / "junk.kvz").write_bytes(b"\x00" * 64)
    (tmp_path / "ctx.txt").write_text("Some text.")
    fails(capsys, ["ask", str(tmp_path / "none.kvz"), "--question", "Why?"], "no compressed-context file")
    fails(capsys, ["ask", str(tmp_path / "junk.kvz"), "--question", "Why?"], "not a compressed-context file")
    fails(capsys, ["inspect", str(tmp_path / "ctx.txt")], "not a compressed-context file", "generate --context")
    fails(capsys, ["compress", "--context", str(tmp_path / "ctx.txt"), "--out", str(tmp_path)], "is a folder")
    fails(capsys, ["compress", "--context", str(tmp_path / "ctx.txt"), "--out", str(tmp_path / "ctx.txt")],
          "is the --context file")
    (tmp_path / "notes.txt").write_text("Keep me: my notes.")
    fails(capsys, ["compress", "--context", str(tmp_path / "ctx.txt"), "--out", str(tmp_path / "notes.txt")],
          "exists and is not a compressed context, which saving will not overwrite")
    fails(capsys, ["inspect", str(tmp_path)], "is a folder, not a compressed-context file")
    _, ctx = _context(tiny_model, "snapkv")
    broken = _rewrite(ctx.save(tmp_path / "b.kvz"), tmp_path / "broken.kvz", meta="{")
    for command in (["ask", str(broken), "--question", "Why?"], ["inspect", str(broken)]):
        fails(capsys, command, "broken.kvz is damaged: its metadata is not a compressed context's")
    fails(capsys, ["compress", "--context", str(tmp_path / "ctx.txt"), "--out", "x.kvz", "--method", "snapkv:nope=1"],
          "nope")
    _, ctx = _context(tiny_model, "snapkv")
    good = ctx.save(tmp_path / "good.kvz")
    fails(capsys, ["inspect", str(good), "--png", str(tmp_path / "nodir" / "k.png")], "--png", "no folder")
    fails(capsys, ["inspect", str(good), "--html", str(tmp_path)], "--html", "is a folder")
    fails(capsys, ["inspect", str(good), "--html", str(good)], "--html", "is the compressed-context file")
    fails(capsys, ["inspect", str(good), "--png", str(tmp_path / "notes.txt")], "--png",
          "exists and is not a .png file, which kvmerge inspect will not overwrite")
    assert (tmp_path / "notes.txt").read_text() == "Keep me: my notes."
    fails(capsys, ["ask", str(good), "--question", "Why?", "--top-k", "5"], "--top-k", "--temperature")
    fails(capsys, ["ask", str(good), "--question", "Why?", "--stop", ","], "--stop", "comma-separated list")
    moved = _tamper(good, tmp_path / "moved.kvz", lambda t, m: m.update(model_name="tiny-llama"), True)
    fails(capsys, ["ask", str(moved), "--question", "Why?"], "made with the model 'tiny-llama', which is neither a "
          "bundled model nor a folder here: give --model with that model's folder")


def test_saving_and_loading_refuse_a_wrong_place_and_order_and_files_read_as_any_others(tmp_path):
    import os
    import stat

    model, ctx = _context(tiny_model, "snapkv")
    with pytest.raises(KVMergeError, match="cannot save to .*: no folder"):
        ctx.save(tmp_path / "nodir" / "c.kvz")
    with pytest.raises(KVMergeError, match="cannot save to .*: it is a folder"):
        ctx.save(tmp_path)
    (tmp_path / "notes.txt").write_text("Keep me: my notes.")
    with pytest.raises(KVMergeError, match="cannot save to .*notes.txt: it exists and is not a compressed context"):
        ctx.save(tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "Keep me: my notes."
    import safetensors.torch

    from kvmerge.context_file import FORMAT, VERSION

    newer = tmp_path / "newer.kvz"
    safetensors.torch.save_file({"x": torch.zeros(1)}, str(newer), metadata={"format": FORMAT, "version": str(VERSION + 1)})
    with pytest.raises(KVMergeError, match=f"it exists and is a compressed context this kvmerge cannot read \\(is format "
                                           f"version {VERSION + 1}, newer"):
        ctx.save(newer)
    (tmp_path / "empty.kvz").touch()  # mktemp's empty file is nothing to lose
    assert kvmerge.load_context(ctx.save(tmp_path / "empty.kvz"), model, TinyTokenizer()).tokens == ctx.tokens
    import safetensors.torch

    def full(tensors, filename, metadata=None):  # a disk that fills up mid-write (root writes anywhere)
        raise OSError(28, "No space left on device")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", full)
        with pytest.raises(KVMergeError, match=r"^cannot save to .*full.kvz: \[Errno 28\] No space left on device"):
            ctx.save(tmp_path / "full.kvz")
    assert not list(tmp_path.glob("*full.kvz*"))  # nothing half-written left beside it
    umask = os.umask(0o022)
    try:
        path = ctx.save(tmp_path / "c.kvz")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    with pytest.raises(KVMergeError, match=r"takes the file's path first, got LlamaForCausalLM"):
        kvmerge.load_context(model, TinyTokenizer(), path)


def test_a_compressed_context_refuses_options_that_would_compress_it_again():
    model, ctx = _context(tiny_model, "snapkv")
    for options in ({"budget": 0.1}, {"method": "full"}, {"prefill_chunk": 64}):
        with pytest.raises(KVMergeError, match="answered as it was compressed: .* goes to compress_context"):
            kvmerge.answer_questions(model, TinyTokenizer(), ctx, ["q"], **options)
    for options, match in [({"protocol": "aware"}, "compressed before any question .* protocol='aware'"),
                           ({"protocol": "bogus"}, "protocol='bogus'"),
                           ({"chat_template": "no"}, "chat_template must be True or False")]:
        with pytest.raises(KVMergeError, match=match):
            kvmerge.generate(model, TinyTokenizer(), ctx, "q", **options)
    ctx.meta["chat_template"] = True
    for answer in (kvmerge.generate, kvmerge.answer_questions):
        with pytest.raises(KVMergeError, match="framed by the chat template, so its questions are too"):
            answer(model, TinyTokenizer(), ctx, "q", chat_template=False)
    with pytest.raises(KVMergeError, match="a Method object carries its own"):
        kvmerge.compress_context(model, TinyTokenizer(), random_ids(160), kvmerge.get_method("snapkv"), 0.1)
    with pytest.raises(KVMergeError, match="give the budget once"):
        kvmerge.compress_context(model, TinyTokenizer(), random_ids(160), "snapkv:budget=0.5", 0.1)


@pytest.mark.parametrize("spec", ["snapkv", "snapkv:alloc=head", "mixedmerge"])
def test_entries_reported_are_the_entries_each_head_holds(spec):
    """The summary's entries per layer and head are what the heads hold (ragged heads at their own
    lengths, not the padded width): the kept positions' count, layer by layer."""
    from kvmerge.context_view import entries_line

    _, ctx = _context(tiny_model, spec)
    cache = ctx.session.cache
    held = [cache.layers[i].mean_entries for i in cache.compressible]
    counted = [int((pos >= -1).sum()) / pos.shape[0] for pos in ctx.kept]
    assert held == pytest.approx(counted)
    assert entries_line(ctx).startswith(f"{min(held):.0f}–{max(held):.0f} (mean ")
    from kvmerge.context_view import summary, survival

    some = int((survival(ctx).amax(0) > 0).sum())  # counted, not rounded: 159 of 160 is not "100%"
    assert f"at least one head: {some:,} of {ctx.tokens:,} ({some / ctx.tokens:.1%})" in summary(ctx)
    if spec == "snapkv:alloc=head":
        assert any(cache.layers[i].mean_entries < cache.layers[i].entries for i in cache.compressible)


@pytest.mark.ci_slow
def test_compress_ask_and_inspect_on_the_bundled_model(capsys, tmp_path):
    from kvmerge.cli import main

    text = "The library opens at nine. The code of the back door is 4721. Visitors sign the book. " * 8
    (tmp_path / "ctx.txt").write_text(text)
    out = tmp_path / "c.kvz"
    assert main(["compress", "--context", str(tmp_path / "ctx.txt"), "--out", str(out), "--method", "snapkv",
                 "--no-progress"]) == 0
    first = capsys.readouterr().out
    assert "of the full cache" in first and "replaced" not in first and out.is_file()
    assert main(["compress", "--context", str(tmp_path / "ctx.txt"), "--out", str(out), "--method", "snapkv",
                 "--no-progress"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("(replaced the compressed context it held)")
    assert main(["ask", str(out), "--question", "What is the code of the back door?", "--max-new-tokens", "12"]) == 0
    answered = capsys.readouterr()
    model, tok = kvmerge.load_model()
    want = kvmerge.generate(model, tok, text, "What is the code of the back door?", "snapkv", max_new_tokens=12)
    assert want.text in answered.out
    sampled = ["--temperature", "0.8", "--top-k", "20", "--seed", "3", "--max-new-tokens", "12"]
    assert main(["ask", str(out), "--question", "Who signs the book?", *sampled, "--stop", "."]) == 0
    want = kvmerge.generate(model, tok, text, "Who signs the book?", "snapkv", max_new_tokens=12, temperature=0.8,
                            top_k=20, seed=3, stop=["."])
    assert capsys.readouterr().out.strip() == want.text.strip() and want.tokens  # the same answer, cut at the stop
    assert main(["inspect", str(out), "--png", str(tmp_path / "k.png"), "--html", str(tmp_path / "k.html")]) == 0
    shown = capsys.readouterr().out
    assert "method snapkv at budget 0.25" in shown and "door" in shown
    assert (tmp_path / "k.png").stat().st_size > 1000 and "<span" in (tmp_path / "k.html").read_text()


@pytest.mark.parametrize("build, spec", [(tiny_model, "snapkv:alloc=head"), (tiny_model, "centroidkv:interval=4"),
                                         (gemma3, "mixedmerge")])
def test_contexts_of_different_lengths_answer_in_one_batch_as_alone(build, spec):
    from kvmerge.context import batch
    from kvmerge.decoding import decode

    model = build()
    contexts = [kvmerge.compress_context(model, TinyTokenizer(), random_ids(n, seed=n), f"{spec}:window=8", 0.25)
                for n in (160, 100, 60)]
    alone = [c.generate_ids(Q, 6).tokens[0] for c in contexts]
    session = batch(contexts)
    with torch.no_grad():
        out = decode(session, session.forward([Q] * 3, decoding=False), {}, 6)
    assert out.tokens == alone
    other = kvmerge.compress_context(model, TinyTokenizer(), random_ids(100), "snapkv:window=8", 0.5)
    with pytest.raises(KVMergeError, match="one model and one method spec"):
        batch([contexts[0], other])


def test_a_compressed_context_reads_as_one_line():
    _, ctx = _context(tiny_model, "snapkv:alloc=head")
    line = str(ctx)
    assert "\n" not in line and line.startswith("160 tokens, snapkv:") and "at budget 0.25" in line
    assert "entries per compressed layer and head" in line and line.endswith("of the full cache")
    assert repr(ctx) == f"CompressedContext({line})"  # not the session, ids and metadata
    _, hybrid = _context(gemma3, "snapkv")
    assert str(hybrid).endswith("of the full cache (sliding-window layers keep their window)")


def test_a_files_name_given_as_the_context_text_points_to_load_context(tmp_path):
    model, ctx = _context(tiny_model, "snapkv")
    path = str(ctx.save(tmp_path / "c.kvz"))
    for call in (lambda: kvmerge.generate(model, TinyTokenizer(), path, "q"),
                 lambda: kvmerge.answer_questions(model, TinyTokenizer(), path, ["q"]),
                 lambda: kvmerge.compress_context(model, TinyTokenizer(), path)):
        with pytest.raises(KVMergeError, match="is a compressed-context file's name, not its text: kvmerge.load_context"):
            call()
    (tmp_path / "notes.txt").write_text("The code of the back door is 4721. " * 40)
    with pytest.raises(KVMergeError, match=r"notes.txt' is a file's name, not its text: pass the text, e.g. open\("):
        kvmerge.generate(model, TinyTokenizer(), str(tmp_path / "notes.txt"), "q")
    from kvmerge.prompt import check_context_text

    check_context_text(["notes.txt", f"{path}\n{path}"])  # no such file here; two lines are text


def test_a_model_folder_is_stored_as_a_full_path(tmp_path, monkeypatch):
    """`kvmerge ask` without --model finds the model a file names from any folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    model = tiny_model()
    model.config.name_or_path = "m"
    ctx = kvmerge.compress_context(model, TinyTokenizer(), random_ids(120, seed=1), "snapkv:window=8", 0.25)
    assert ctx.meta["model_name"] == str((tmp_path / "m").resolve())


class _Decoding(TinyTokenizer):
    def decode(self, ids, skip_special_tokens=True):
        return f"{len(ids)} ids"


def test_a_context_in_memory_answers_only_with_its_own_model_and_tokenizer():
    """Another model object, a tokenizer of other ids or none: refused in one line before any forward (a
    context held by one model answered through another read the first's cache and the second's ids)."""
    model, ctx = _context(tiny_model, "snapkv")

    class Other(TinyTokenizer):
        PIECES = {5: ".", 6: ";"}

    calls = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    for answer in (lambda m, t: kvmerge.generate(m, t, ctx, "q", max_new_tokens=2),
                   lambda m, t: kvmerge.answer_questions(m, t, ctx, ["q"], max_new_tokens=2),
                   lambda m, t: kvmerge.answer_contexts(m, t, [ctx], ["q"], max_new_tokens=2)):
        with pytest.raises(KVMergeError, match=r"^this compressed context is held by another model object .*: answer "
                                               "with the model it was compressed or loaded with"):
            answer(tiny_model(), TinyTokenizer())
        with pytest.raises(KVMergeError, match=r"^this compressed context was made with another tokenizer \(hash "):
            answer(model, Other())
        with pytest.raises(KVMergeError, match="needs the model's tokenizer"):
            answer(model, None)
    hook.remove()
    assert calls == []
    ctx.question_ids = lambda q: [3]  # (TinyTokenizer cannot split a prompt or decode)
    assert kvmerge.generate(model, _Decoding(), ctx, "q", max_new_tokens=2).text == "2 ids"  # the same ids: fine


def test_a_context_compressed_from_ids_is_not_asked_through_the_chat_template():
    """Ids are compressed as they are: a text question framed by the chat template would not close a
    turn the context never opened, so it is refused; chat_template=False appends it as it is."""
    model = tiny_model()
    ctx = kvmerge.compress_context(model, TinyTokenizer(), random_ids(160, seed=1), "snapkv:window=8", 0.25)
    chatty = _Decoding()
    chatty.chat_template = "{{ messages }}"
    ctx.tokenizer = chatty
    with pytest.raises(KVMergeError, match="not framed by the chat template .*: pass chat_template=False"):
        kvmerge.generate(model, chatty, ctx, "q", max_new_tokens=2)
    ctx.question_ids = lambda q: [3]  # (TinyTokenizer cannot split a prompt)
    assert kvmerge.generate(model, chatty, ctx, "q", max_new_tokens=2, chat_template=False).text == "2 ids"
