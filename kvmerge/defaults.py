"""The default method, defined once: what `kvmerge generate` without `--method`, `kvmerge.generate`,
`generate_ids`, `answer_questions`, `answer_questions_ids`, `compress_context` and `kvmerge.compressing(model)`
without a method, and the vLLM plugin without a "method" setting compress with ("full" keeps the whole cache).

`learnedzip` where learned-scorer weights for the model are found (by its fingerprint, as
`kvmerge.scorer.find` looks: trained here, in `$KVMERGE_SCORERS`, or shipped for the bundled SmolLM2
and Gemma-3); on a model with sliding-window layers with the sliding share, `learnedzip:sliding=0.75`,
as its held-out results were measured (docs/results.md, suite `generalise-test`); in vLLM, and for a
batch of rows of different lengths, `surprisezip` (one entry count for every layer and head, which a
global ranking and the sliding share cannot keep to: the most surprising sentences kept whole beside
`learnedzip`'s picks, which alone lose needles there; docs/research-log.md, R42). Without weights,
`mixedmerge`, and one logged line (once per model and process) names the command that fits them. A
model whose every layer attends in a sliding window (Mistral-7B-v0.1's config, Phi-3-mini's) has
nothing to compress or train: `mixedmerge`, unannounced, which the session refuses naming `full`.

Imports nothing heavy at module level: the command line reads `RULE` before torch loads.
"""

from __future__ import annotations

import logging

LEARNED = "learnedzip"
FALLBACK = "mixedmerge"
SLIDING = "learnedzip:sliding=0.75"
UNIFORM = "surprisezip"  # one entry count for every layer and head: vLLM, rows of different lengths
CANDIDATES = (LEARNED, SLIDING, UNIFORM, FALLBACK)  # every spec `default_method` returns
RULE = (f"{LEARNED} where the model has learned-scorer weights (both bundled models; {SLIDING} on models with "
        f"sliding-window layers, {UNIFORM} in vLLM and for a batch of prompts of different lengths), else {FALLBACK}")

logger = logging.getLogger("kvmerge")
_told: set[str] = set()  # fingerprints of the models already told how to train weights


def default_method(model_or_config, runtime: str = "transformers", ragged: bool = False) -> str:
    """The default method's spec for a model (a transformers model or its config): see the module's
    docstring. `runtime`: "transformers" (also chunked) or "vllm"; `ragged`: for a batch of rows of
    different lengths. Without weights, logs one warning line (once per model) naming
    `kvmerge train-scorer --model ...`."""
    from .errors import InputError
    from .model import SUPPORTED_MODEL_TYPES
    from .scorer import TRAINING_TIME, Scorer, fingerprint, locate, model_label
    from .sliding import sliding_layer_count, sliding_only

    config = getattr(model_or_config, "config", model_or_config)
    if sliding_only(config):  # nothing to compress or train for: the session says so, naming `full`
        return FALLBACK
    if config.get_text_config(decoder=True).model_type not in SUPPORTED_MODEL_TYPES:
        return FALLBACK  # nothing to train for either: the session refuses the model, naming what it supports
    why = "no learned-scorer weights for this model"
    try:
        path = locate(config)
        if path is not None:
            Scorer.load(path, config)
    except InputError as e:  # another model's of the same fingerprint (another layer layout, say)
        path, why = None, f"the learned-scorer weights found do not fit this model ({e})"
    if path is not None:
        if runtime == "vllm" or ragged:
            return UNIFORM
        return SLIDING if sliding_layer_count(config) else LEARNED
    key = fingerprint(config)
    if key not in _told:
        _told.add(key)
        name = model_label(config)
        then = UNIFORM if runtime == "vllm" else SLIDING if sliding_layer_count(config) else LEARNED
        logger.warning(f"kvmerge: {why} (fingerprint {key}), so the default method is {FALLBACK}; "
                       f"`kvmerge train-scorer --model {name}` fits them ({TRAINING_TIME}), then the default is "
                       f"{then}")
    return FALLBACK


def resolve(model, method, budget=None, ragged: bool = False):
    """(the method to run, whether it is the default) for the API's `method` and `budget`: None or "default" →
    `default_method(model, ragged=ragged)`, built at `budget`; a name or spec → built at `budget` (a spec's own
    `budget=` must agree); a `Method` as it is, refused with a `budget`, which goes with a name."""
    from .errors import ParameterTypeError
    from .methods import Method, get_method
    from .spec import check_budget_once

    if method is None or method == "default":  # "default": the name eval's method lists use for it
        return get_method(default_method(model, ragged=ragged), budget), True
    if isinstance(method, Method) and budget is not None:
        raise ParameterTypeError("budget= goes with a method name or spec (method='snapkv', budget=0.1); a Method "
                                 "object carries its own (get_method('snapkv', budget=0.1))")
    if isinstance(method, str):
        check_budget_once(method, budget, "budget=")
    return (get_method(method, budget) if isinstance(method, str) else method), False
