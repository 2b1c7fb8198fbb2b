"""Per-request draft control: rolling acceptance, pause and probe, K within bounds."""

from dataclasses import dataclass

# Rolling acceptance is an exponential average over verify steps of (accepted / drafted).
SMOOTHING = 0.25
# Below this fraction of draft tokens accepted, a verify step costs more than it saves: pause drafting.
PAUSE_BELOW = 0.25
# A paused request probes again after this many decode steps; each failed probe doubles the wait.
FIRST_PAUSE, LONGEST_PAUSE = 8, 256


@dataclass
class AcceptanceTracker:
    k: int  # drafts to ask for next
    k_max: int
    adaptive: bool = True
    rate: float = 0.4  # rolling acceptance: two bad verify steps in a row pause a fresh request
    pause_left: int = 0
    next_pause: int = FIRST_PAUSE

    def drafts_wanted(self) -> int:
        """Called once per decode step: 0 while paused."""
        if self.pause_left:
            self.pause_left -= 1
            return 0
        return self.k

    def record(self, drafted: int, accepted: int) -> None:
        if not self.adaptive:
            return
        self.rate += SMOOTHING * (accepted / drafted - self.rate)
        if accepted == drafted:
            self.k = min(self.k + 1, self.k_max)
        elif 2 * accepted < drafted:
            self.k = max(self.k - 1, 1)
        if self.rate >= PAUSE_BELOW:
            self.next_pause = FIRST_PAUSE
            return
        # Pause, then probe: the probe's own result alone decides whether drafting stays on.
        self.pause_left, self.rate = self.next_pause, PAUSE_BELOW
        self.next_pause = min(2 * self.next_pause, LONGEST_PAUSE)
