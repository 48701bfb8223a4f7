"""Mixed attention (kvmerge's own): Expected Attention's estimate averaged with observed attention."""

from dataclasses import dataclass

from ..ops.scores import received_attention
from .expectedattention import ExpectedAttention
from .registry import register


@register
@dataclass
class MixedAttention(ExpectedAttention):
    """Expected Attention whose probabilities are the mean of two estimates of future attention, each a
    distribution over the non-sink entries `(b, hkv, s)`: EA's (from the Gaussian query model) and the
    attention the last `obs_window` prompt queries gave (SnapKV's, normalised). Scores as EA's
    ((p + ε)·‖v‖); `calibrate_with=expected` merges by these probabilities."""

    obs_window: int = 32
    name = "mixedattention"
    experimental = True

    def probabilities(self, keys, log_n, ctx):
        expected = super().probabilities(keys, log_n, ctx)
        observed = received_attention(ctx.queries[:, :, -self.obs_window:], keys, ctx.scaling, log_n)
        observed[..., :min(self.n_sink, keys.shape[2])] = 0.0
        observed = observed / observed.sum(-1, keepdim=True).clamp_min(1e-30)
        return 0.5 * (expected + observed)
