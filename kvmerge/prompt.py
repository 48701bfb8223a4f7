"""A request's input, checked and cut in one place before any forward pass: the prompt's text split
at the context/question boundary (the chat template applied), the ids' types, the vocabulary, the
model's positions, the budget against the context, and the prefill chunk (`check_chunk`, the one
check of a chunk size)."""

from __future__ import annotations

import torch

from .errors import ContextTooLongError, InputError, ParameterTypeError, check_chunk, plural
from .methods import Method
from .model import max_positions
from .params import check_params

PROTOCOLS = ("agnostic", "aware")
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")  # chat templates' end-of-turn tokens


def end_ids(tokenizer, chat_template: bool = True) -> list[int]:
    """The ids that end an answer: the tokenizer's eos and, when its chat template is used, the
    template's end-of-turn token (`<|im_end|>`, `<end_of_turn>`, ...) where the vocabulary has one."""
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    if chat_template and getattr(tokenizer, "chat_template", None):
        vocab = tokenizer.get_vocab()
        ids += [vocab[t] for t in END_OF_TURN if t in vocab]
    return list(dict.fromkeys(ids))


def check_model(model, call: str) -> None:
    """Refuse a `model` that is not a transformers model (the tokenizer in its place, most often), in
    one line naming the call's order."""
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "config")):
        raise ParameterTypeError(f"{call} takes a transformers model first, got {type(model).__name__} "
                                 "(model, tok = kvmerge.load_model(...))")


def check_tokenizer(tokenizer, call: str, model=None) -> None:
    """Refuse a missing tokenizer, something else in its place (the model: the two swapped), or, with
    `model`, another model's tokenizer: over 10% more ids than the model's vocabulary (a few added
    tokens, a padding token say, are common and harmless until used), or over 10% fewer and neither
    its beginning- nor its end-of-text id the model's (each where both sides name one; a base model
    with its instruct tokenizer shares the vocabulary and passes)."""
    if tokenizer is None:
        raise InputError(f"{call} reads text and needs the model's tokenizer: pass the one load_model returned")
    if isinstance(tokenizer, torch.nn.Module) or not callable(tokenizer):
        raise ParameterTypeError(f"{call} takes the model's tokenizer second, got {type(tokenizer).__name__}")
    if model is None:
        return
    config = model.config.get_text_config(decoder=True)
    try:
        size = len(tokenizer)
    except TypeError:
        size = None
    if not size:
        return
    shared = []  # per special id both sides name: whether the tokenizer's is among the model's
    for name in ("bos_token_id", "eos_token_id"):
        own, theirs = getattr(tokenizer, name, None), getattr(config, name, None)
        theirs = set(theirs) if isinstance(theirs, (list, tuple)) else {theirs} - {None}
        if own is not None and theirs:
            shared.append(own in theirs)
    why = f"it has {size:,} ids, the model's vocabulary {config.vocab_size:,}"
    if size < 0.9 * config.vocab_size and len(shared) == 2 and not any(shared):
        why += ", and neither its beginning- nor its end-of-text id is the model's"
    elif size <= 1.1 * config.vocab_size:
        return
    raise InputError(f"{call}: the tokenizer is not this model's ({why}): pass the tokenizer loaded with the model")


def split_prompt(tokenizer, context: str, question: str, chat_template: bool = True):
    """Tokenize the whole prompt once; split it at the context/question boundary by char offsets."""
    if not isinstance(context, str) or not isinstance(question, str):
        raise ParameterTypeError(f"context and question must be strings, got {type(context).__name__} and "
                                 f"{type(question).__name__} (token ids go to generate_ids)")
    if not context.strip():
        raise InputError("empty context: nothing to compress")
    if tokenizer is None:
        raise InputError("text needs a tokenizer: pass the one load_model returned")
    user = f"{context}\n\n{question}"
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        special = False
    else:
        text, special = user, True
    q_start = text.rfind(question) if question else text.rfind(user) + len(user)
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    boundary = sum(1 for (_s, e) in offsets if e <= q_start)
    return ids[:boundary], ids[boundary:]


def check_questions(questions: list[str]) -> None:
    """Refuse an empty or blank question: there would be nothing to answer."""
    if any(isinstance(q, str) and not q.strip() for q in questions):
        raise InputError("a question is empty: ask something about the context")


def check_context_text(contexts: list) -> None:
    """Refuse a context that is the name of an existing file (it would be read as those few words)."""
    import os

    for c in contexts:
        name = c.strip() if isinstance(c, str) else ""
        if not name or "\n" in name or len(name) > 4096 or not os.path.isfile(os.path.expanduser(name)):
            continue
        if name.endswith(".kvz"):
            raise InputError(f"the context {name!r} is a compressed-context file's name, not its text: "
                             "kvmerge.load_context(path, model, tokenizer) reads it, then pass what it returns")
        raise InputError(f"the context {name!r} is a file's name, not its text: pass the text, "
                         f"e.g. open({os.path.expanduser(name)!r}).read()")


def one_row(x) -> bool:
    """Whether token ids `x` are one row given flat (a list of ids, a 1-D tensor), not a list of rows."""
    if isinstance(x, torch.Tensor):
        return x.dim() != 2
    return not (x and isinstance(x[0], (list, tuple)))


def as_rows(x, what: str) -> list[list[int]]:
    if isinstance(x, str) or not isinstance(x, (list, tuple, torch.Tensor)):
        raise ParameterTypeError(f"{what} must be a list of token ids or a list of such lists, got "
                                 f"{type(x).__name__} (text goes to kvmerge.generate / answer_questions)")
    if isinstance(x, torch.Tensor):
        x = x.tolist() if x.dim() == 2 else [x.tolist()]
    if not x:
        return [[]]
    return [list(x)] if one_row(x) else [list(r) for r in x]


def is_ids(x) -> bool:
    return isinstance(x, torch.Tensor) or (isinstance(x, (list, tuple)) and (not x or not isinstance(x[0], str)))


def common_prefix(rows: list[list[int]]) -> list[int]:
    n = min(map(len, rows))
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows):
            return rows[0][:i]
    return rows[0][:n]


def validate(model, context_ids, question_ids, protocol, max_new_tokens, method, prefill_chunk=None):
    """Checked rows → (contexts, questions, protected window); raises a `KVMergeError` on bad input,
    all before any forward pass: types, vocabulary, the method's parameters, the model's positions,
    the budget against the context, and the prefill chunk's size."""
    if not isinstance(method, Method):
        raise ParameterTypeError(f"method must be a kvmerge Method (see kvmerge.get_method), got "
                                 f"{type(method).__name__}")
    check_params(method)
    if protocol not in PROTOCOLS:
        raise InputError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    contexts, questions = as_rows(context_ids, "context_ids"), as_rows(question_ids, "question_ids")
    if len(contexts) != len(questions):
        raise InputError(f"{plural(len(contexts), 'context')} but {plural(len(questions), 'question')}")
    if any(len(c) == 0 for c in contexts):
        raise InputError("empty context: nothing to compress")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    bad = [t for r in contexts + questions for t in r if not (isinstance(t, int) and 0 <= t < vocab)]
    if bad and not isinstance(bad[0], int):
        raise ParameterTypeError(f"token ids must be ints, got {type(bad[0]).__name__} {str(bad[0])[:40]!r}")
    if bad:
        raise InputError(f"token id {bad[0]!r} is outside the model's vocabulary [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    limit = max_positions(model)
    longest = max(len(c) + len(q) for c, q in zip(contexts, questions))
    if limit and longest + max_new_tokens > limit:
        question = longest - max(map(len, contexts))
        room = limit - max_new_tokens - question  # the longest context row that fits
        over = longest + max_new_tokens - limit  # by "at least": a context row may hold a chat template's tokens
        fewer = f"lower max_new_tokens to at most {limit - longest:,}"
        if room >= 1:
            fix = f"shorten the context by at least {plural(over, 'token')}" + (f" or {fewer}" if longest < limit else "")
        elif longest < limit:
            fix = fewer
        elif limit - question > 1:
            fix = (f"shorten the context by at least {plural(longest - limit + 1, 'token')} and lower "
                   "max_new_tokens")
        else:
            fix = f"the question alone is {question:,} tokens: shorten it"
        generated = f" and up to {max_new_tokens:,} more are generated" if max_new_tokens > 1 else ""
        raise ContextTooLongError(f"the prompt is {longest:,} tokens{generated}, over the model's {limit:,} positions "
                                  f"(max_position_embeddings): {fix}")
    if prefill_chunk is not None:
        check_chunk(prefill_chunk)
    if getattr(method, "sliding", None) is not None:
        from .sliding import sliding_layer_count

        if not sliding_layer_count(model.config):
            raise InputError(f"{method.label}: sliding={method.sliding} shortens sliding-window layers, and this model "
                             "has none: leave sliding out")
    if protocol == "aware":
        window = max([method.window] + [len(q) for q in questions])
        contexts, questions = [c + q for c, q in zip(contexts, questions)], [[] for _ in questions]
    else:
        window = method.window
        if any(len(q) == 0 for q in questions):
            raise InputError("empty question: the agnostic protocol needs question tokens to decode from")
    for c in contexts:
        method.target(len(c), window)  # raises early on a budget the context cannot meet
    return contexts, questions, window

