"""`--threads auto`, the default: the thread count that decodes fastest now, found by timing.

A parallel kernel waits for its slowest thread, so when another process takes a core, a
thread that shares it stalls every kernel a token runs, and fewer threads decode faster. The
tuner notices that by trying: every PERIOD decode steps it runs TRIAL steps at each candidate
count (half the cores, all but one, all, and on a machine of up to four cores one thread too:
there every count), and keeps the count whose median step was fastest until the next round,
or a larger one within MARGIN of it, so that a noisy moment does not cost a quiet machine its
cores. On a quiet machine the trials of fewer threads cost a few percent of the steps.
The kernels give the same bits at any thread count, so the choice changes speed, never output.
"""

from __future__ import annotations

import statistics

PERIOD = 256  # decode steps between rounds of trials
TRIAL = 4  # steps timed at each count in a round
SMALL_MACHINE = 4  # cores up to which one thread is a candidate too
MARGIN = 0.1  # the most threads whose median step is within this of the fastest are chosen


class ThreadTuner:
    def __init__(self, cores: int, period: int = PERIOD, trial: int = TRIAL):
        cores = max(1, cores)
        self.candidates = sorted({max(1, cores // 2), max(1, cores - 1), cores} | ({1} if cores <= SMALL_MACHINE else set()))
        self.period, self.trial = period, trial
        self.best = cores  # what prompts and untimed steps use
        self.steps = 0
        self.times: dict[int, list[float]] = {}

    @property
    def trial_steps(self) -> int:
        return self.trial * len(self.candidates)

    def count(self) -> int:
        """The threads for the next decode step: a count on trial, else the best found."""
        place = self.steps % self.period
        return self.candidates[place // self.trial] if place < self.trial_steps else self.best

    def timed(self, threads: int, seconds: float) -> None:
        """Record a decode step run with `threads`; at the end of a round of trials, choose."""
        place = self.steps % self.period
        if place < self.trial_steps:
            self.times.setdefault(threads, []).append(seconds)
            if place == self.trial_steps - 1:
                medians = {n: statistics.median(t) for n, t in self.times.items()}
                fastest = min(medians.values())
                self.best = max(n for n, m in medians.items() if m <= fastest * (1 + MARGIN))
                self.times = {}
        self.steps += 1
