"""Expected Attention (Devoto et al., 2025, arXiv 2510.00636; as kvpress's ExpectedAttentionPress)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.scores import rotate_half
from .base import Needs, ScoringMethod
from .registry import register


@register
@dataclass
class ExpectedAttention(ScoringMethod):
    """Future queries are modelled as a Gaussian: the mean μ and covariance Σ of the prompt's pre-RoPE
    queries (all captured positions but the first `n_sink`), per query head, carried through R̄, the
    mean RoPE rotation over the next `n_future` positions (μ̄ = R̄μ, Σ̄ = R̄ΣR̄ᵀ). A key scores its
    expected attention softmax_j(s·μ̄·k_j + ½s²·k_jᵀΣ̄k_j) over the non-sink entries (s the model's
    attention scale, log-mass added), averaged over the KV group's query heads, then
    (score + `epsilon`) · ‖v_j‖ if `use_vnorm`."""

    n_future: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    name = "expectedattention"
    requires = Needs(queries=-1, rotary=True)

    def __post_init__(self):
        super().__post_init__()
        if self.n_future < 1 or self.n_sink < 0:
            raise ValueError(f"expectedattention needs n_future >= 1 and n_sink >= 0, got n_future={self.n_future}, "
                             f"n_sink={self.n_sink}")

    def setup(self, runtime):
        self._cos_sin = runtime.rotary

    def statistics(self, queries: torch.Tensor, seen: int):
        """Post-RoPE queries `(b, hq, n, d)` of positions seen − n … seen − 1 → (μ̄ `(b, hq, d)`,
        Σ̄ `(b, hq, d, d)`) of their pre-RoPE values, averaged over the next `n_future` rotations."""
        n = queries.shape[2]
        positions = torch.arange(seen - n, seen)
        cos, sin = self._cos_sin(positions)
        q = queries.float()
        pre = (q * cos - rotate_half(q) * sin) / (cos ** 2 + sin ** 2)  # undo each position's rotation
        pre = pre[:, :, positions >= self.n_sink]
        mu = pre.mean(2)
        centred = pre - mu[:, :, None]
        sigma = centred.transpose(-1, -2) @ centred / max(pre.shape[2], 1)
        cos_f, sin_f = self._cos_sin(torch.arange(seen, seen + self.n_future))
        c, s = cos_f.mean(0), sin_f.mean(0)
        d = mu.shape[-1]
        rot = torch.diag(c) + torch.diag(s) @ rotate_half(torch.eye(d, device=mu.device)).T  # R̄ x = c⊙x + s⊙rot(x)
        return mu * c + rotate_half(mu) * s, rot @ sigma @ rot.T

    def probabilities(self, keys, log_n, ctx) -> torch.Tensor:
        """`(b, hkv, s)`: each entry's expected attention (a softmax over the non-sink entries, averaged
        over the KV group's query heads), before the value-norm weighting."""
        if ctx.queries is None:
            raise ValueError("expectedattention needs the prompt's queries (prefill)")
        b, hkv, slots, d = keys.shape
        mu, sigma = self.statistics(ctx.queries, ctx.seen or slots)
        hq = mu.shape[1]
        k = keys.float().repeat_interleave(hq // hkv, dim=1)  # (b, hq, s, d)
        z = ctx.scaling * torch.einsum("bhd,bhsd->bhs", mu, k)
        if self.use_covariance:
            z = z + 0.5 * ctx.scaling ** 2 * torch.einsum("bhsd,bhde,bhse->bhs", k, sigma, k)
        z = z + log_n.float().repeat_interleave(hq // hkv, dim=1)
        z[..., :min(self.n_sink, slots)] = float("-inf")
        return z.softmax(-1).view(b, hkv, hq // hkv, slots).mean(2)

    def scores(self, keys, log_n, ctx):
        return self.weigh(self.probabilities(keys, log_n, ctx), ctx)

    def weigh(self, probs, ctx):
        """Scores from `probabilities`: (p + `epsilon`) · ‖v‖ if `use_vnorm`."""
        if not self.use_vnorm:
            return probs
        if ctx.values is None:
            raise ValueError("expectedattention needs the cached values (prefill)")
        return (probs + self.epsilon) * ctx.values.float().norm(dim=-1)
