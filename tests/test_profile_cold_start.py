"""benchmarks/profile_cold_start.py's stage timers (the GPU run is the tool's job; the wrapping runs on CPU): every
Triton stage it names exists, is wrapped inside the context and restored after it, static methods stay static, and
a call through a wrapper adds its time to the stage's total."""

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_cold_start  # noqa: E402


def test_stages_are_wrapped_then_restored():
    targets = profile_cold_start.stage_targets()
    before = [profile_cold_start.stage_function(owner, name) for _, owner, name in targets]
    totals = defaultdict(float)
    with profile_cold_start.timed_stages(totals):
        during = [profile_cold_start.stage_function(owner, name) for _, owner, name in targets]
        assert all(now is not then for now, then in zip(during, before))
        assert all(isinstance(now, staticmethod) == isinstance(then, staticmethod)
                   for now, then in zip(during, before))
        cache = next(owner for label, owner, _ in targets if label.startswith("Triton's cache key"))
        assert cache.triton_key()
    assert [profile_cold_start.stage_function(owner, name) for _, owner, name in targets] == before
    assert totals["Triton's cache key (per process)"] > 0.0
    assert set(totals) == {"Triton's cache key (per process)"}
