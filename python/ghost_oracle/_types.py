"""The closed vocabularies of the API, as `Literal` types a type checker holds calls to."""
from __future__ import annotations

from typing import Literal

#: A precision, of the judged arithmetic (`precision=`) or of the clippers (`audit`, `mutants`).
Precision = Literal["f64", "f32", "f16", "bf16"]
#: How each example's loss is reduced over its tokens.
Reduction = Literal["mean", "sum"]
#: The clipping rule: flat min(1, C / (n + γ)), or automatic C / (n + γ) (γ > 0).
Clipping = Literal["flat", "automatic"]
#: A verdict; `ghost_oracle.VERDICTS` lists them from the least to the most severe.
Verdict = Literal["pass", "utility-distortion", "cannot-judge", "privacy-violation", "invalid-norm"]
