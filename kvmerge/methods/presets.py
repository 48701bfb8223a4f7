"""Presets: named method specs, as data. A preset is a registered method with other defaults (its
`params`; `base.x` sets parameter x of the method's `base` part), optionally with parameters tied
together (`ties`: a preset parameter that sets several, e.g. zipguardmerge's `saturated` sets its
own and its base's). `kvmerge methods` lists them beside the methods; `get_method` builds them
(`registry.from_preset`).

`recommended` marks what the README recommends. Older names live in one table, `registry.OLD_NAMES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..spec import spec_text


@dataclass(frozen=True)
class Preset:
    name: str
    method: str
    params: dict
    summary: str
    ties: dict = field(default_factory=dict)
    recommended: bool = False

    @property
    def spec(self) -> str:
        """The preset as a method spec a user could type (`base.x` shown as a nested object)."""
        top = {k: v for k, v in self.params.items() if "." not in k}
        nested = {k.split(".", 1)[1]: v for k, v in self.params.items() if k.startswith("base.")}
        if nested:
            top["base"] = {"name": top["base"], **nested}
        return spec_text(self.method, top)


PRESETS = [
    Preset("surprisemerge", "evictmerge", {"recent": 0.5, "exact": 0.25, "whole": True},
           "the recent window, the most surprising sentences kept exact and SnapKV's picks; the rest merged "
           "into them by attention"),
    Preset("mixedmerge", "evictmerge",
           {"recent": 0.5, "exact": 0.25, "whole": True, "base": "mixedattention", "calibrate_with": "expected"},
           "surprisemerge whose picks and merge weights come from mixed attention (Expected Attention's "
           "estimate averaged with the last prompt queries'); no second pass", recommended=True),
    Preset("zipmerge", "evictmerge", {"base": "kvzip", "alloc": "head", "recent": 0.0, "calibrate_with": "base"},
           "KVzip's global picks kept exact, every other entry merged into them, weighted by KVzip's scores"),
    Preset("learnedmerge", "evictmerge", {"base": "learnedzip", "alloc": "head", "recent": 0.0, "calibrate_with": "base"},
           "learnedzip's global picks (KVzip's scores predicted from the prefill, no second pass) kept exact, every "
           "other entry merged into them, weighted by the predicted scores"),
    Preset("surprisezip", "evictmerge", {"base": "learnedzip", "recent": 0.0, "exact": 0.25, "whole": True,
                                         "absorb": "none"},
           "the most surprising sentences kept whole (a quarter of the budget) beside learnedzip's picks, the rest "
           "evicted; one count for every layer and head (vLLM's layout), no second pass"),
    Preset("zipguardmerge", "evictmerge",
           {"base": "zipguard", "alloc": "head", "recent": 0.0, "calibrate_with": "base", "saturated": 0.25,
            "base.saturated": 0.25, "base.fallback": "surprisal+echo"},
           "zipmerge on zipguard's picks (copy heads ranked by surprisal and echo, where they evict); keeps "
           "facts in the document's own words", ties={"saturated": ("saturated", "base.saturated"),
                                                      "fallback": ("base.fallback",)},
           recommended=True),
]
