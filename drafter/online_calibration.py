"""Online recalibration of a drafter's confidences from verification outcomes.

Offline temperatures (Sequential Temperature Scaling on held-out training data) drift on live
traffic. Every verified round says, for each verified position k whose earlier drafts were all
accepted, whether draft k survived. Per position we keep a bounded window of (raw confidence
logit, outcome) pairs and refit a Platt scaling c_k = sigmoid(z_k / T_k + b_k) on it from time
to time. Refits only use finished rounds, so a step's confidences never depend on its own
drafts: the policy's choice stays causal (lossless).

Plain Python + numpy (no torch): the fit is two parameters per position on <= `window` points.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from dspark_serve.ops.sampling_params import SamplingParams


@dataclass(frozen=True)
class OnlineCalibrationConfig:
    """How confidences are recalibrated online.

    window: outcomes kept per position (the oldest are dropped): bounds memory and lets the
        fit follow traffic that changes. Replayed on the dev sets served one after another,
        the default window calibrated better than a window four times as long, which lags each
        change of traffic (docs/training.md, "Serving the drafter").
    refit_every: new outcomes at a position between two refits of that position.
    min_samples: outcomes a position needs before its first refit (until then the offline
        temperature applies).
    min_temperature / max_temperature, max_bias: bounds on the fitted T_k and |b_k|, so a
        burst of odd traffic cannot push confidences to 0 or 1 for good.
    ece_bins: equal-width bins of the live expected calibration error.
    """

    window: int = 1024
    refit_every: int = 64
    min_samples: int = 128
    min_temperature: float = 0.25
    max_temperature: float = 8.0
    max_bias: float = 4.0
    ece_bins: int = 10

    def __post_init__(self) -> None:
        for name in ("window", "refit_every", "min_samples", "ece_bins"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.min_samples > self.window:
            raise ValueError(f"min_samples must be <= window ({self.window}), got {self.min_samples!r}")
        if not (0 < self.min_temperature <= 1.0 <= self.max_temperature):
            raise ValueError(
                f"need 0 < min_temperature <= 1 <= max_temperature, got "
                f"({self.min_temperature!r}, {self.max_temperature!r})"
            )
        if self.max_bias < 0:
            raise ValueError(f"max_bias must be >= 0, got {self.max_bias!r}")


@dataclass(frozen=True)
class CalibrationError:
    """One position's calibration over a run.

    ece: expected calibration error of the survival probability against the outcomes.
    samples: verified drafts it is measured on.
    noise_floor: the ECE a perfectly calibrated predictor with these very probabilities would
        show on average (binomial noise of each bin's outcome mean): an ECE near it is as good
        as this many samples can tell; more samples lower it (~1 / sqrt(samples)).
    """

    ece: float
    samples: int
    noise_floor: float


def fit_platt(
    z: np.ndarray,
    y: np.ndarray,
    temperature: float,
    bias: float,
    cfg: OnlineCalibrationConfig,
    iters: int = 25,
) -> tuple[float, float]:
    """Minimize the log-loss of sigmoid(a z + b) against y by damped Newton steps, starting
    from (1 / temperature, bias); returns (T = 1 / a, b) within the configured bounds."""
    a, b = 1.0 / temperature, bias
    lo_a, hi_a = 1.0 / cfg.max_temperature, 1.0 / cfg.min_temperature
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(a * z + b)))
        r = p - y
        w = np.maximum(p * (1.0 - p), 1e-9)
        g = np.array([np.dot(r, z), r.sum()])
        h = np.array([[np.dot(w, z * z), np.dot(w, z)], [np.dot(w, z), w.sum()]]) + 1e-6 * np.eye(2)
        step = np.linalg.solve(h, g)
        a = float(np.clip(a - step[0], lo_a, hi_a))
        b = float(np.clip(b - step[1], -cfg.max_bias, cfg.max_bias))
        if np.abs(step).max() < 1e-6:
            break
    return 1.0 / a, b


def expected_calibration_error(probs: np.ndarray, outcomes: np.ndarray, bins: int) -> float:
    """Equal-width-bin ECE of probabilities against 0/1 outcomes (0 for no data)."""
    if probs.size == 0:
        return 0.0
    idx = np.minimum((probs * bins).astype(int), bins - 1)
    err = 0.0
    for k in range(bins):
        m = idx == k
        if m.any():
            err += m.sum() * abs(probs[m].mean() - outcomes[m].mean())
    return float(err / probs.size)


class OnlineCalibrator:
    """Per-position Platt scaling, refit from verification outcomes.

    `calibrate(raw)` turns raw confidence logits of one block into c_k; `record(...)` takes one
    verified round: the raw logits and the probabilities that were used, how many drafts were
    verified and how many were accepted."""

    def __init__(
        self,
        block_size: int,
        offline_temperatures: tuple[float, ...] | None = None,
        config: OnlineCalibrationConfig | None = None,
    ) -> None:
        self.config = config or OnlineCalibrationConfig()
        temps = list(offline_temperatures or ())[:block_size]
        self.temperatures = temps + [1.0] * (block_size - len(temps))
        self.biases = [0.0] * block_size
        w = self.config.window
        # conditional samples (fit): raw logit z_k, outcome of draft k given k-1 accepted
        self._z: list[deque[float]] = [deque(maxlen=w) for _ in range(block_size)]
        self._y: list[deque[float]] = [deque(maxlen=w) for _ in range(block_size)]
        # live calibration (report): the cumulative survival probability used (a_k = prod c_i)
        # vs the outcome (all of 1..k accepted), per position
        self._a_used: list[deque[float]] = [deque(maxlen=w) for _ in range(block_size)]
        self._a_out: list[deque[float]] = [deque(maxlen=w) for _ in range(block_size)]
        self._since_fit = [0] * block_size
        # the same pairs over every round so far, as per-bin sums (bounded memory)
        # count, sum a_used, sum out, sum a_used^2 (the last sizes the ECE's noise floor)
        self._bins = np.zeros((block_size, self.config.ece_bins, 4))
        self.rounds = 0

    @property
    def block_size(self) -> int:
        return len(self.temperatures)

    def calibrate(self, raw: list[float]) -> list[float]:
        """Raw logits of positions 1..K -> calibrated conditional confidences c_k."""
        return [
            1.0 / (1.0 + math.exp(-(z / self.temperatures[k] + self.biases[k]))) for k, z in enumerate(raw)
        ]

    def record(self, raw: list[float], used: list[float], proposed: int, accepted: int) -> None:
        """One verified round: drafts 1..proposed verified, the first `accepted` kept."""
        if proposed <= 0:
            return
        if not (0 <= accepted <= proposed <= len(raw)):
            raise ValueError(f"need 0 <= accepted <= proposed <= {len(raw)}, got {accepted!r}, {proposed!r}")
        self.rounds += 1
        survival = 1.0
        for k in range(min(proposed, self.block_size)):
            survival *= used[k]
            self._a_used[k].append(survival)
            self._a_out[k].append(1.0 if k < accepted else 0.0)
            b = min(int(survival * self.config.ece_bins), self.config.ece_bins - 1)
            self._bins[k, b] += (1.0, survival, 1.0 if k < accepted else 0.0, survival * survival)
            if k > accepted:
                continue  # not tested under "earlier drafts accepted"
            outcome = 1.0 if k < accepted else 0.0
            self._z[k].append(raw[k])
            self._y[k].append(outcome)
            self._since_fit[k] += 1
            if len(self._z[k]) >= self.config.min_samples and self._since_fit[k] >= self.config.refit_every:
                self._refit(k)

    def _refit(self, k: int) -> None:
        z = np.fromiter(self._z[k], dtype=np.float64)
        y = np.fromiter(self._y[k], dtype=np.float64)
        self.temperatures[k], self.biases[k] = fit_platt(
            z, y, self.temperatures[k], self.biases[k], self.config
        )
        self._since_fit[k] = 0

    def samples(self, k: int) -> int:
        """Verified drafts at position k (0-based) in the window."""
        return len(self._a_used[k])

    def cumulative_ece(self) -> list[CalibrationError]:
        """The cumulative survival probability's ECE per position over every round recorded so
        far, not just the window: what a benchmark over fixed traffic reports."""
        out = []
        for k in range(self.block_size):
            n, a, y, a2 = (self._bins[k, :, j] for j in range(4))
            total = int(n.sum())
            if not total:
                out.append(CalibrationError(0.0, 0, 0.0))
                continue
            # Perfectly calibrated outcomes y_i ~ Bernoulli(a_i) still leave each bin's mean off
            # by N(0, sum a_i (1 - a_i)) / n_b: E|.| = sigma sqrt(2 / pi), summed over the bins.
            sigma = np.sqrt(np.maximum(a - a2, 0.0))
            floor = float(sigma.sum() * math.sqrt(2.0 / math.pi) / total)
            out.append(CalibrationError(float(np.abs(a - y).sum() / total), total, floor))
        return out

    def survival_ece(self) -> list[float]:
        """Live ECE of the cumulative survival probability a_k the policy used, per position."""
        bins = self.config.ece_bins
        return [
            expected_calibration_error(
                np.fromiter(self._a_used[k], dtype=np.float64),
                np.fromiter(self._a_out[k], dtype=np.float64),
                bins,
            )
            for k in range(self.block_size)
        ]


# How survival is calibrated apart: a draft survives greedy verification when it is the target's
# argmax, and sampled verification with probability p(draft) or min(1, p/q) under the request's
# own temperature and truncation, so one fit over mixed traffic would misprice every kind.
SAMPLING_BUCKETS = ("greedy", "sharpened", "full")


def sampling_bucket(sp: SamplingParams) -> str:
    """The calibration a request's outcomes train and its confidences read: greedy (temperature
    0), full (temperature >= 0.9 over the whole distribution: the openai client's default) or
    sharpened (a lower temperature, or top-p / top-k / min-p truncation)."""
    if sp.greedy:
        return "greedy"
    truncated = sp.top_p < 1.0 or sp.top_k > 0 or sp.min_p > 0.0
    return "sharpened" if truncated or sp.temperature < 0.9 else "full"


class BucketedCalibrator:
    """An `OnlineCalibrator` per sampling bucket (`sampling_bucket`), each starting from the
    offline temperatures: greedy and sampled requests in one batch get confidences fitted on
    their own kind's outcomes, so the policy gives each its own verification budget."""

    def __init__(
        self,
        block_size: int,
        offline_temperatures: tuple[float, ...] | None = None,
        config: OnlineCalibrationConfig | None = None,
    ) -> None:
        self.buckets = {
            b: OnlineCalibrator(block_size, offline_temperatures, config) for b in SAMPLING_BUCKETS
        }

    @property
    def block_size(self) -> int:
        return self.buckets[SAMPLING_BUCKETS[0]].block_size

    @property
    def rounds(self) -> int:
        return sum(c.rounds for c in self.buckets.values())

    def calibrate(self, raw: list[float], bucket: str) -> list[float]:
        return self.buckets[bucket].calibrate(raw)

    def record(self, raw: list[float], used: list[float], proposed: int, accepted: int, bucket: str) -> None:
        self.buckets[bucket].record(raw, used, proposed, accepted)
