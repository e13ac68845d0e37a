"""Is a GRPO run learning? A watch on the share of prompt groups whose rewards are all equal.

A group of equal rewards has zero advantage, so it contributes no gradient. When (almost) every
group is like that for several steps in a row, the run learns nothing while its loss curve still
looks healthy; the watch says so once (and again only after the run recovered and relapsed),
with what to change.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ZeroVarianceWatch:
    """Warn when ``frac_zero_std_groups >= threshold`` for ``patience`` consecutive steps.

    Attributes:
        threshold: share of zero-variance groups (0..1) that counts as "nothing learned".
        patience: consecutive logged steps at or above it before the warning.
    """

    threshold: float = 0.9
    patience: int = 3
    _streak: int = 0
    _warned: bool = False

    def observe(self, step: int, frac_zero_std: float | None, groups: int | None = None) -> str | None:
        """Feed one step's share; returns the warning text when it should be shown, else None."""
        if frac_zero_std is None:
            return None
        if frac_zero_std < self.threshold:
            self._streak, self._warned = 0, False
            return None
        self._streak += 1
        if self._streak < self.patience or self._warned:
            return None
        self._warned = True
        # the trainer logs its group count averaged over logging steps (a float such as 1.0)
        n = round(groups) if groups else 0
        share = f"{frac_zero_std:.0%}" + (f" of {n} group{'s' if n != 1 else ''}" if n
                                          else " of the groups")
        return (f"GRPO is not learning: for {self._streak} steps (up to step {step}) {share} had "
                "equal rewards for every completion, so they give no advantage and no gradient. "
                "Raise num_generations, use a softer (partial-credit) reward such as "
                "text_similarity beside an exact match, or raise the temperature.")
