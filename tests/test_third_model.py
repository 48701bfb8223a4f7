"""A user's own model, of an architecture kvmerge ships no weights for: a Qwen3 built from a config
with random weights and its own tokenizer, saved to a folder, trains its learned scorer with `kvmerge
train-scorer --model FOLDER` and then compresses with it by default (`kvmerge generate --model
FOLDER`), end to end through the command line. No quality claim: the weights are random."""

import pytest
import torch

from kvmerge.cli import main


def _tokenizer():
    """A byte-level BPE of 512 ids, trained here on a few lines of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = [f"line {i}: the key of box {i % 7} is {i * 37 % 101}; see section {i % 13}." for i in range(400)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("qwen3-tiny")
    tok = _tokenizer()
    config = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.ci_slow
def test_a_third_architecture_trains_its_scorer_and_uses_it_by_default(folder, tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.setenv("KVMERGE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "ctx.txt").write_text(" ".join(f"The key of box {i} is {i * 37 % 101}." for i in range(60)))
    argv = ["generate", "--model", str(folder), "--context", str(tmp_path / "ctx.txt"), "--question", "Which key?",
            "--max-new-tokens", "4", "--no-progress"]
    assert main(argv) == 0  # no weights yet: the fallback, announced in one line naming the command to train
    out = "".join(capsys.readouterr()) + caplog.text
    assert f"kvmerge train-scorer --model {folder}" in out and "[mixedmerge at budget 0.25" in out
    caplog.clear()
    assert main(["train-scorer", "--model", str(folder), "--texts", "4", "--held", "1", "--length", "128"]) == 0
    assert len(list((tmp_path / "cache" / "scorers").glob("*.safetensors"))) == 1
    capsys.readouterr()
    assert main(argv) == 0
    out = "".join(capsys.readouterr()) + caplog.text
    assert "[learnedzip at budget 0.25" in out and "no learned-scorer weights" not in out


def test_a_folder_without_a_tokenizer_is_refused_naming_how_to_save_one(folder, tmp_path):
    import shutil

    import kvmerge
    from kvmerge.errors import InputError

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, bare / name)
    with pytest.raises(InputError, match=r"no tokenizer in .*bare .*tokenizer\.save_pretrained"):
        kvmerge.load_model(bare)


def test_training_again_for_a_model_of_the_same_shapes_says_what_it_replaces(folder, tmp_path, monkeypatch, caplog):
    import shutil

    import kvmerge.train_scorer as ts

    monkeypatch.setenv("KVMERGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ts, "corpus", lambda: [" ".join(f"box {i} holds {i * 37 % 101}." for i in range(300))])
    twin = tmp_path / "twin"
    shutil.copytree(folder, twin)
    small = {"texts": 2, "held": 1, "length": 64}
    first = ts.main(str(folder), **small)
    assert "replaced" not in caplog.text
    assert ts.main(str(twin), **small) == first
    assert f"replaced {first}, trained for {folder}, a model of the same shapes" in caplog.text
