"""Training the learned scorer (`kvmerge train-scorer --model NAME [--kind mlp]`): KVzip's scores as
targets, the prefill's pre-RoPE queries, keys and values as features; per compressed layer a ridge
regression ("linear") or a one-hidden-layer MLP fitted by AdamW on mean squared error ("mlp").

Text: documentation that ships with the system, none of it an evaluation genre: the docstrings of
Python's standard library (its language reference, `pydoc_data`, is the `docs` genre and is left
out, as are tests) and Perl's pod pages where Perl is installed. Each text is cut into pieces of
`length` tokens, each fed after the chat template's opening of a user turn (when the model has one),
as a context is in use. Reproducible where the texts are the same (one Python version, one Perl):
the texts' order and the held-back split come from `seed`; packages installed into Python's own
`site-packages` are not read.
"""

from __future__ import annotations

import ast
import glob
import logging
import os
import random
import time
from pathlib import Path

import torch

from .errors import InputError
from .scorer import (LinearScorer, MLPScorer, Scorer, features, fingerprint, fingerprints, model_label, trained_path,
                     unrotate)

PERL_PODS = ("/usr/share/perl", "/usr/lib/x86_64-linux-gnu/perl")


def corpus() -> list[str]:
    """The training texts, in a fixed order: one per standard-library module (its docstrings of over
    200 characters, joined) and one per Perl pod page (its text without pod commands)."""
    texts = []
    stdlib = Path(os.__file__).parent
    for path in sorted(glob.glob(f"{stdlib}/*.py") + glob.glob(f"{stdlib}/*/*.py")):
        where = str(Path(path).relative_to(stdlib))  # not the folders above it (a Python under .../test/)
        if any(part in where for part in ("pydoc_data", "test", "idlelib", "site-packages", "dist-packages")):
            continue
        try:
            tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docs = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))]
        text = "\n\n".join(d for d in docs if d and len(d) > 200)
        if len(text) > 3000:
            texts.append(text)
    for root in PERL_PODS:
        for path in sorted(glob.glob(f"{root}/**/*.pod", recursive=True)):
            lines = Path(path).read_text(encoding="utf-8", errors="ignore").splitlines()
            texts.append("\n".join(line for line in lines if not line.startswith("=")))
    return texts


def pieces(tokenizer, texts: list[str], length: int, seed: int) -> list[list[int]]:
    """Every text cut into pieces of `length` tokens, shuffled by `seed`."""
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out += [ids[s:s + length] for s in range(0, len(ids) - length, length)]
    random.Random(seed).shuffle(out)
    return out


def _opening(tokenizer) -> list[int]:
    """The chat template's tokens before a user message (none without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    marker = "\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text.split(marker)[0], add_special_tokens=False)["input_ids"]


@torch.no_grad()
def examples(model, tokenizer, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per compressed layer of `model` on the context `ids`: (features `(n, F)`, log KVzip scores
    `(n, h)`), KVzip as kvmerge runs it (`kvzip`, its defaults), features as `learnedzip` reads them."""
    from .methods import get_method
    from .session import Session

    kvzip = get_method("kvzip")
    session = Session(model, 1, kvzip, tokenizer)
    session.feed_prompt([ids], capture=-1)
    layers = list(session.cache.compressible)
    kvzip.prepare_all(session.runtime, [ids], layers)
    cos, sin = session.runtime.rotary(torch.arange(len(ids)))
    out = []
    for i in layers:
        layer = session.cache.layers[i]
        q = unrotate(session.states[i].queries.float(), cos, sin)
        k = unrotate(layer.keys.float(), cos, sin)
        x = features(q, k, layer.values)[0]
        y = session.runtime.scratch(i)["_kvzip_fresh"][0].float().T.clamp_min(1e-12).log()
        out.append((x.cpu(), y.cpu()))
    return out


def fit(sums: list[tuple[torch.Tensor, torch.Tensor]], ridge: float) -> list[torch.Tensor]:
    """Ridge weights `(F + 1, h)` per layer from accumulated (XᵀX, XᵀY) over rows [x, 1]: the penalty
    `ridge` × the mean of XᵀX's diagonal on every weight but the bias."""
    out = []
    for xtx, xty in sums:
        reg = torch.eye(xtx.shape[0], dtype=xtx.dtype) * ridge * xtx.diagonal()[:-1].mean()
        reg[-1, -1] = 0
        out.append(torch.linalg.solve(xtx + reg, xty).float())
    return out


def fit_mlp(rows: list[tuple[torch.Tensor, torch.Tensor]], hidden: int, epochs: int, seed: int) -> list[dict]:
    """Per layer, rows (features `(N, F)`, log scores `(N, h)`) → `MLPScorer` layer parameters: a
    one-hidden-layer GELU network on standardised features, AdamW (weight decay 0.01) with a one-cycle
    learning rate peaking at 2e-3, batches of 512, `epochs` passes; reproducible from `seed`."""
    out = []
    for i, (x, y) in enumerate(rows):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        x, y = x.float(), y.float()
        mu, sd = x.mean(0), x.std(0) + 1e-4
        torch.manual_seed(seed * 1000 + i)
        net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden), torch.nn.GELU(), torch.nn.Linear(hidden, y.shape[1]))
        net[-1].bias.data = y.mean(0)
        z = (x - mu) / sd
        steps = max(1, len(z) // 512)
        opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-2)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, 2e-3, total_steps=epochs * steps)
        for _ in range(epochs):
            order = torch.randperm(len(z), generator=g)
            for j in range(steps):
                batch = order[j * 512:(j + 1) * 512]
                loss = torch.nn.functional.mse_loss(net(z[batch]), y[batch])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
        out.append({"mu": mu, "sd": sd, "w1": net[0].weight.detach().T.contiguous(), "b1": net[0].bias.detach(),
                    "w2": net[2].weight.detach().T.contiguous(), "b2": net[2].bias.detach()})
    return out


def overlap(predicted: torch.Tensor, true: torch.Tensor, fraction: float) -> float:
    """Mean over heads of |top-k(predicted) ∩ top-k(true)| / k, k = `fraction` of the n entries
    (`(..., n)` each)."""
    k = max(1, int(fraction * true.shape[-1]))
    a = predicted.reshape(-1, predicted.shape[-1]).topk(k, -1).indices
    b = true.reshape(-1, true.shape[-1]).topk(k, -1).indices
    hits = torch.zeros(a.shape[0], true.shape[-1], dtype=torch.bool).scatter_(1, a, True).gather(1, b)
    return float(hits.float().mean())


MIN_LENGTH = 64  # tokens a piece needs: 28 of them judged, beyond the 4 sinks and the recent 32
KVZIP_CHUNK, KVZIP_PROMPT = 2048, 64  # KVzip repeats at most a chunk of the piece after it, after its prompt


def positions_needed(opening: int, length: int) -> int:
    """Positions a piece's KVzip targets run at: the opening, the piece, KVzip's prompt and repeat."""
    return opening + length + KVZIP_PROMPT + min(length, KVZIP_CHUNK)


def longest_fitting(opening: int, positions: int) -> int:
    """The longest piece whose KVzip targets fit in `positions` (`positions_needed`; below `MIN_LENGTH`
    when none does)."""
    free = positions - opening - KVZIP_PROMPT
    return max(min(KVZIP_CHUNK, free // 2), free - KVZIP_CHUNK)


DEFAULT_LENGTH = 1024


def piece_length(model, opening: int, length: int | None) -> int:
    """`length`, or by default (None) `DEFAULT_LENGTH` or the longest piece the model's positions fit."""
    from .model import max_positions

    if length is not None:
        return length
    positions = max_positions(model)
    return DEFAULT_LENGTH if positions is None else max(MIN_LENGTH, min(DEFAULT_LENGTH, longest_fitting(opening, positions)))


def check_trainable(model, opening: int, length: int) -> None:
    """Refuse (`InputError`) what training cannot run on: a model with no layer to compress (sliding
    windows only), pieces too short to judge, or longer than the model's positions."""
    from .model import max_positions
    from .sliding import sliding_only

    if sliding_only(model.config):
        raise InputError("this model has sliding-window layers only: its cache is already bounded by the window and "
                         "has no full-attention layer to compress, so there is no scorer to train")
    if length < MIN_LENGTH:
        raise InputError(f"pieces of {length} tokens are too short to train on: --length {MIN_LENGTH} at least")
    positions = max_positions(model)
    if positions is not None and positions_needed(opening, length) > positions:
        fits = longest_fitting(opening, positions)
        raise InputError(f"pieces of {length} tokens need {positions_needed(opening, length):,} positions (the chat "
                         f"opening's {opening}, the piece, then KVzip's prompt and its repeat of the piece), beyond the "
                         f"model's {positions:,}" + (f": --length {fits} at most" if fits >= MIN_LENGTH else ""))


TARGETS = ("log", "rank")
RANK_POWER, LEVELS, CALIBRATION_ROWS = 4, 65, 64


def fitted_target(y: torch.Tensor, target: str) -> torch.Tensor:
    """Log KVzip scores `(n, h)` of one piece → what the scorer is fitted to: the scores themselves
    ("log"), or each head's rank quantile over the piece to the 4th power ("rank": 0 to 1, its spread
    at the top, where a cut is made; the scale across pieces and heads left out)."""
    if target == "log":
        return y
    return (y.argsort(0).argsort(0).float() / max(1, len(y) - 1)) ** RANK_POWER


def calibration(scorer: Scorer, sample: list[tuple[list, list]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer and head, `LEVELS` quantiles of the scorer's outputs and of KVzip's log scores on the
    sampled rows (features, log scores) of each layer → (xs, ys) `(layers, h, LEVELS)` (`Scorer.calibrated`)."""
    levels = torch.linspace(0, 1, LEVELS)
    xs, ys = [], []
    for i, (x, y) in enumerate(sample):
        p = scorer.from_features(i, torch.cat(x).float())
        xs.append(torch.quantile(p, levels, dim=0).T)
        ys.append(torch.quantile(torch.cat(y), levels, dim=0).T)
    return torch.stack(xs).contiguous(), torch.stack(ys).contiguous()


def train(model, tokenizer, texts: int = 100, held: int = 6, length: int | None = None, seed: int = 0, ridge: float = 1e-2,
          kind: str = "linear", hidden: int = 64, epochs: int = 8, rows_per_text: int = 512, target: str = "log",
          progress=None) -> Scorer:
    """Fit the scorer of `kind` on `texts` pieces of `length` tokens (`piece_length`: by default 1,024,
    or the longest the model's positions fit; an MLP on `rows_per_text` random
    tokens of each) to `target` (`fitted_target`; "rank" adds a calibration from `CALIBRATION_ROWS`
    random tokens of each piece); report its agreement with KVzip on `held` other pieces (`meta`: top-10%
    and top-25% overlap per head, away from the sinks and the last 32)."""
    if kind not in ("linear", "mlp"):
        raise ValueError(f"scorer kind must be 'linear' or 'mlp', got {kind!r}")
    if target not in TARGETS:
        raise ValueError(f"the scorer's target must be one of {', '.join(TARGETS)}, got {target!r}")
    if not ridge >= 0:
        raise InputError(f"the ridge penalty must be >= 0, got {ridge}")
    if texts < 1 or held < 1:
        raise InputError(f"training needs at least one piece to fit and one held back, got texts={texts}, held={held}")
    sinks, window = 4, 32
    head = _opening(tokenizer)
    asked, length = length, piece_length(model, len(head), length)
    if asked is None and length != DEFAULT_LENGTH:
        logging.getLogger("kvmerge").warning(f"kvmerge: pieces of {length} tokens, the longest this model's positions "
                                             f"fit ({DEFAULT_LENGTH} where they do)")
    check_trainable(model, len(head), length)
    chosen = pieces(tokenizer, corpus(), length, seed)
    if len(chosen) < texts + held:
        raise InputError(f"only {len(chosen)} pieces of {length} tokens in the training text, {texts + held} needed: "
                         "lower --length, --texts or --held")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    top = max(max(head, default=0), *(max(ids) for ids in chosen[:texts + held]))
    if top >= vocab:
        raise InputError(f"the tokenizer gives token id {top}, outside the model's vocabulary [0, {vocab}): the "
                         "folder's tokenizer is not the model's")
    if progress is not None:
        progress(0, texts + held)
    sums, kept, start = None, None, time.perf_counter()
    sample = None
    g = torch.Generator().manual_seed(seed)
    for j, ids in enumerate(chosen[:texts]):
        logs = examples(model, tokenizer, head + ids)
        rows = [(x, fitted_target(y, target)) for x, y in logs]
        if target != "log":  # judged tokens only: not the opening, the sinks or the recent window
            first = len(head) + sinks
            pick = first + torch.randperm(logs[0][0].shape[0] - first - window, generator=g)[:CALIBRATION_ROWS]
            sample = sample or [([], []) for _ in logs]
            for (xs, ys), (x, y) in zip(sample, logs):
                xs.append(x[pick].half())
                ys.append(y[pick])
        if kind == "mlp":
            pick = sinks + torch.randperm(rows[0][0].shape[0] - sinks, generator=g)[:rows_per_text]
            kept = kept or [([], []) for _ in rows]
            for (xs, ys), (x, y) in zip(kept, rows):
                xs.append(x[pick].half())
                ys.append(y[pick])
        else:
            if sums is None:
                sums = [(torch.zeros(x.shape[1] + 1, x.shape[1] + 1, dtype=torch.float64),
                         torch.zeros(x.shape[1] + 1, y.shape[1], dtype=torch.float64)) for x, y in rows]
            for (xtx, xty), (x, y) in zip(sums, rows):
                x1 = torch.cat([x, torch.ones(x.shape[0], 1)], 1)[sinks:].double()
                xtx += x1.T @ x1
                xty += x1.T @ y[sinks:].double()
        if progress is not None:
            progress(j + 1, texts + held)
    key = fingerprint(model.config)
    if kind == "mlp":
        scorer = MLPScorer(fit_mlp([(torch.cat(xs), torch.cat(ys)) for xs, ys in kept], hidden, epochs, seed), key, {})
    else:
        scorer = LinearScorer(fit(sums, ridge), key, {})
    if sample is not None:
        scorer.calibration = calibration(scorer, sample)
    agreement = {0.1: [], 0.25: []}
    with torch.no_grad():
        for j, ids in enumerate(chosen[texts:texts + held]):
            rows = examples(model, tokenizer, head + ids)
            x = torch.stack([scorer.calibrated(i, scorer.from_features(i, x)) for i, (x, _) in enumerate(rows)])
            y = torch.stack([y for _, y in rows])
            cut = slice(len(head) + sinks, x.shape[1] - window)
            for fraction in agreement:
                agreement[fraction].append(overlap(x[:, cut].transpose(1, 2), y[:, cut].transpose(1, 2), fraction))
            if progress is not None:
                progress(texts + j + 1, texts + held)
    fitted = {"ridge": ridge} if kind == "linear" else {"hidden": hidden, "epochs": epochs, "rows_per_text": rows_per_text}
    fitted["target"] = target
    scorer.meta = {"model_name": model_label(model.config, model.config.model_type), "texts": texts, "held_back": held, "length": length, "seed": seed, **fitted,
                   "tokens": texts * (len(head) + length), "seconds": round(time.perf_counter() - start, 1),
                   "top10_overlap": round(sum(agreement[0.1]) / held, 4),
                   "top25_overlap": round(sum(agreement[0.25]) / held, 4)}
    return scorer


def _same(name: str) -> str:
    """A model's name as compared: a folder's resolved path, else the name."""
    return str(Path(name).expanduser().resolve()) if Path(name).expanduser().exists() else name


def main(model_name: str | None, out: str | None = None, **kwargs) -> Path:
    """Train the scorer for a model and save it (`trained_path`, or `out`); returns the path. Weights
    there trained for another model of the same fingerprint (the same shapes: another checkpoint of
    one architecture) are replaced, saying so in one line; so are weights found elsewhere that these
    now take the place of. An `out` holding another fingerprint's weights is refused before training.
    One run at a time writes a file: a second is refused."""
    import hashlib

    from filelock import FileLock, Timeout

    from .model import load_model

    model, tokenizer = load_model(model_name)
    kind = kwargs.get("kind", "linear")
    path = Path(out) if out else trained_path(model.config, kind)
    if out and path.exists():  # scorer weights (check_destination): this model's, or refused before training
        theirs = Scorer.load(path)
        if theirs.model not in fingerprints(model.config):
            raise InputError(f"--out {path} holds weights made for another model ({theirs.meta.get('model_name') or '?'}, "
                             f"fingerprint {theirs.model}; this one's is {fingerprint(model.config)}): give a new file "
                             "name (they would be overwritten)")
    lock = FileLock(_locks() / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16] + ".lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise InputError(f"another `kvmerge train-scorer` is writing {path}: wait for it to finish, or give "
                         "--out another file") from None
    try:
        return _train_and_save(model, tokenizer, path, shadows=None if out else _elsewhere(model.config, kind),
                               **kwargs)
    finally:
        lock.release()


def _locks() -> Path:
    """The folder of train-scorer's locks, one per destination: the cache's `locks/`, or the system's
    temporary folder's `kvmerge-locks/` where the cache cannot be written (weights written to --out)."""
    import tempfile

    from .model import cache_dir

    for folder in (cache_dir() / "locks", Path(tempfile.gettempdir()) / "kvmerge-locks"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK | os.X_OK):
            return folder
    raise InputError(f"cannot make a folder for train-scorer's lock in the cache ({cache_dir()}) or the "
                     "temporary folder: set KVMERGE_CACHE to a folder you can write")


def _elsewhere(config, kind: str = "linear") -> Path | None:
    """The weights for `config` found outside the cache's own file (shipped, or in $KVMERGE_SCORERS)."""
    from .scorer import locate

    if trained_path(config, kind).exists():
        return None
    try:
        return locate(config, kind)
    except InputError:  # weights there that are not this model's: these take their place all the same
        return None


def _train_and_save(model, tokenizer, path: Path, shadows: Path | None = None, **kwargs) -> Path:
    log = logging.getLogger("kvmerge")
    scorer = train(model, tokenizer, **kwargs)
    if path.exists():
        try:
            before = Scorer.load(path).meta.get("model_name")
        except InputError:
            before = None
        if before and _same(before) != _same(scorer.meta["model_name"]):
            log.warning(f"kvmerge: replaced {path}, trained for {before}, a model of the same shapes (fingerprint "
                        f"{scorer.model}): weights are found by a model's shapes, not by its checkpoint")
    elif shadows is not None:
        log.warning(f"kvmerge: every model of these shapes (fingerprint {scorer.model}) now uses {path} instead of "
                    f"{shadows}; delete {path} to go back to it")
    scorer.save(path)
    return path
