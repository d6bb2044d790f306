"""What a run says while it works, besides its step lines.

A phase that can take longer than a few seconds says each piece of it before starting it, with
the phase's seconds so far (Progress): the warm-up's training steps, captures and validation
forwards, a validation's slices. The step lines' time left (RunClock) covers the whole run:
the training steps left, at the run's time per token so far, and every validation left, at its
time per slice: measured once a validation ran; before that, estimated from the training's time
per token, a validated token costing VAL_TOKEN_SHARE of a trained one.
"""
import time

# What a validated token costs against a trained one, until a validation has been timed: a forward
# without backward or update. Measured: the cpu preset (2 cores beside other work), 8 slices of
# 8,192 tokens in 76 s after 75,776 trained tokens in 314.6 s (0.28); the tests' tiny model 0.33.
VAL_TOKEN_SHARE = 1 / 3
SECONDS_PER_MINUTE = 60
MINUTES_PER_HOUR = 60


def duration_text(seconds):
    """seconds as 45s, 3m05s or 1h02m."""
    minutes, seconds = divmod(round(max(seconds, 0)), SECONDS_PER_MINUTE)
    if minutes >= MINUTES_PER_HOUR:
        return f"{minutes // MINUTES_PER_HOUR}h{minutes % MINUTES_PER_HOUR:02d}m"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class RunClock:
    """The time a run has left, from its schedule: `tokens`, the global tokens trained after each
    of 0..N steps; `validations`, the step of each validation (the final one at N); `slices`,
    this process's validation slices of `slice_tokens` tokens each; `processes`, the run's."""

    def __init__(self, tokens, validations, slices, slice_tokens, processes):
        self.tokens, self.validations = tokens, list(validations)
        self.slices, self.slice_tokens, self.processes = slices, slice_tokens, processes
        self.slice_s = None        # seconds per validation slice, once a validation was timed

    def validated(self, seconds):
        """A validation of this run's slices took `seconds` (wall)."""
        self.slice_s = seconds / max(self.slices, 1)

    def seconds_per_slice(self, train_s_per_token):
        """A validation slice's seconds: measured, or from the training's seconds per global token
        (each process trains 1/processes of them)."""
        if self.slice_s is not None:
            return self.slice_s
        return VAL_TOKEN_SHARE * self.slice_tokens * train_s_per_token * self.processes

    def seconds_left(self, elapsed_ms, step):
        """The run's seconds left after `step` steps in elapsed_ms of train time: the steps left at
        this time per token, and the validations at steps >= `step` (not run yet)."""
        per_token = elapsed_ms / 1000 / max(self.tokens[step], 1)
        training = per_token * (self.tokens[-1] - self.tokens[step])
        validations = sum(1 for at in self.validations if at >= step)
        return training + validations * self.slices * self.seconds_per_slice(per_token)

    def eta_text(self, elapsed_ms, step):
        return duration_text(self.seconds_left(elapsed_ms, step))


class Progress:
    """The lines of one long phase (`what`: "warming up", "validating"), each saying the piece it
    starts and the phase's seconds so far: in the log and on the terminal, or (in_log False) on
    the terminal only. Only the process that writes the log says them."""

    def __init__(self, log, what, in_log=True):
        self.log, self.what, self.in_log = log, what, in_log
        self.started = time.perf_counter()

    def seconds(self):
        return time.perf_counter() - self.started

    def say(self, piece):
        line = f"{self.what}: {piece}, {self.seconds():.1f}s so far"
        if self.in_log:
            self.log.write(line, echo=True)
        elif self.log.active:
            print(line, flush=True)
