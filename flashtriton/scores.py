"""What decides a score: the softmax scale, the causal mask and the local window, softcap and ALiBi, normalized once.

flash_attn 2.x rewrites (causal, window_size) on the host before any kernel runs (docs/api.md §4.2.3); ALiBi's
bias then depends on the configuration that rewrite leaves (§4.4). Everything that needs either (the reference,
the launchers, the kv-cache path, the tests) calls score_params or normalize_window here. Plain Python: no
triton import (the reference and the fake implementations use it without kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence, Tuple

LOG2E = 1.4426950408889634

__all__ = ["ScoreParams", "score_params", "normalize_window", "is_pure_causal"]


def _bounded_window(window_size: Sequence[int], causal: bool, seqlen_k_star: int) -> Tuple[int, int]:
    """The first half of FA2's rewrite: a side reaching S* or beyond is no bound (-1); causal sets right to 0."""
    left, right = int(window_size[0]), int(window_size[1])
    if left >= seqlen_k_star:
        left = -1
    if right >= seqlen_k_star:
        right = -1
    if causal:
        right = 0
    return left, right


def normalize_window(window_size: Sequence[int], causal: bool, seqlen_k_star: int) -> Tuple[int, int]:
    """FA2's host-side window rewrite (docs/api.md §4.2.3): returns the (left, right) window the mask uses.

    After the rewrite either both sides are negative (no window) or both are >= 0; causal is right == 0 with
    left = S* (a bound that never binds).
    """
    left, right = _bounded_window(window_size, causal, seqlen_k_star)
    if left < 0 and right >= 0:
        left = seqlen_k_star
    if left >= 0 and right < 0:
        right = seqlen_k_star
    return left, right


def is_pure_causal(window_size: Sequence[int], causal: bool, seqlen_k_star: int) -> bool:
    """The configuration in which FA2's ALiBi uses `+slope * j` (docs/api.md §4.2.3, §4.4 quirk): causal (or a
    right bound of 0) with no left bound."""
    left, right = _bounded_window(window_size, causal, seqlen_k_star)
    return left < 0 and right == 0


@dataclass(frozen=True)
class ScoreParams:
    """The scalar semantics of one call, shared by the forward and backward launches and the reference."""

    softmax_scale: float
    window_left: int        # normalized (normalize_window): both sides < 0 (no window) or both >= 0
    window_right: int
    softcap: float          # 0: no softcap
    alibi_pure_causal: bool

    @property
    def is_local(self) -> bool:
        return self.window_left >= 0

    @property
    def causal_like(self) -> bool:
        """No row sees keys after its own position (window_right == 0): tile configs and launch order key on it."""
        return self.window_right == 0

    @property
    def has_softcap(self) -> bool:
        return self.softcap > 0.0

    @property
    def qk_scale_log2(self) -> float:
        """The softmax scale in log2 units: kernels keep their logits in the log2 domain."""
        return self.softmax_scale * LOG2E

    def kernel_scores(self) -> Tuple[float, float, float]:
        """The Triton kernels' `scores` argument: (qk_scale_log2, softcap_in_scale, softcap_out_log2); with softcap,
        the log2-domain logits are softcap_out_log2 * tanh(q.k * softcap_in_scale)."""
        return (
            self.qk_scale_log2,
            self.softmax_scale / self.softcap if self.has_softcap else 0.0,
            self.softcap * LOG2E if self.has_softcap else 0.0,
        )


@lru_cache(maxsize=1024)  # a pure function of its scalars, called on every launch
def score_params(softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                 seqlen_k_star: int) -> ScoreParams:
    """ScoreParams of a call; seqlen_k_star is S* of the window rewrite (seqlen_k, varlen's max_seqlen_k, or the
    kv-cache's capacity)."""
    window = (window_left, window_right)
    left, right = normalize_window(window, causal, seqlen_k_star)
    return ScoreParams(float(softmax_scale), left, right, float(softcap), is_pure_causal(window, causal, seqlen_k_star))
