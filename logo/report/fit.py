"""Saturating power laws L(x) = E + A * x^-alpha (x: training FLOPs or parameters) with bootstrap intervals, and
the compute multiplier between two fitted curves.

Fitting: x is divided by its geometric mean (so A is well scaled), a grid over alpha with non-negative least
squares for (E, A) gives the start, `scipy.optimize.curve_fit` (bounded: E, A >= 0, 1e-4 <= alpha <= 5)
refines it. Intervals: residual bootstrap (residuals rescaled by sqrt(n / (n - 3)) for the three fitted
parameters, resampled onto the fitted curve, refitted; percentile intervals). With exactly three distinct points
and no repeated seeds the fit is exact and has no interval.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np

ALPHA_BOUNDS = (1e-4, 5.0)


class FitError(ValueError):
    pass


def _curve(u, E, a, alpha):
    return E + a * np.power(u, -alpha)


@dataclass
class PowerLaw:
    E: float
    A: float  # in the units of x: L = E + A * x^-alpha
    alpha: float

    def predict(self, x) -> np.ndarray:
        return self.E + self.A * np.power(np.asarray(x, dtype=float), -self.alpha)

    def inverse(self, loss: float) -> float:
        """The x at which the curve reaches `loss` (inf when loss <= E: never)."""
        if loss <= self.E or self.A <= 0:
            return math.inf
        try:
            return float((self.A / (loss - self.E)) ** (1.0 / self.alpha))  # may underflow to 0.0
        except OverflowError:
            return math.inf


@dataclass
class PowerLawFit:
    law: PowerLaw
    x: np.ndarray
    y: np.ndarray
    boot: np.ndarray  # (B, 3): E, A, alpha of the bootstrap refits (empty: no interval)
    level: float

    @property
    def rmse(self) -> float:
        return float(np.sqrt(np.mean((self.law.predict(self.x) - self.y) ** 2)))

    def interval(self, name: str) -> Optional[tuple[float, float]]:
        if len(self.boot) < 2:
            return None
        col = self.boot[:, ("E", "A", "alpha").index(name)]
        q = (1 - self.level) / 2
        return float(np.quantile(col, q)), float(np.quantile(col, 1 - q))

    @property
    def identified(self) -> bool:
        """False when the alpha interval reaches the optimizer's bounds: the points do not pin the curve down."""
        iv = self.interval("alpha")
        return iv is None or not (iv[0] <= ALPHA_BOUNDS[0] * 1.01 or iv[1] >= ALPHA_BOUNDS[1] * 0.99)

    def replicates(self) -> list[PowerLaw]:
        return [PowerLaw(*row) for row in self.boot]


def _start(u: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    from scipy.optimize import nnls

    best = None
    for alpha in np.geomspace(0.01, 3.0, 80):
        design = np.stack([np.ones_like(u), np.power(u, -alpha)], axis=1)
        (E, a), res = nnls(design, y)
        if best is None or res < best[0]:
            best = (res, E, a, alpha)
    _, E, a, alpha = best
    return E, max(a, 1e-12), alpha


def _fit_scaled(u: np.ndarray, y: np.ndarray, p0) -> tuple[float, float, float]:
    from scipy.optimize import OptimizeWarning, curve_fit

    lo, hi = np.array([0.0, 0.0, ALPHA_BOUNDS[0]]), np.array([np.inf, np.inf, ALPHA_BOUNDS[1]])
    p0 = np.clip(np.asarray(p0, dtype=float), lo + 1e-12, hi - 1e-9)
    with warnings.catch_warnings():  # the covariance is not used (intervals come from the bootstrap)
        warnings.simplefilter("ignore", OptimizeWarning)
        popt, _ = curve_fit(_curve, u, y, p0=p0, bounds=(lo, hi), method="trf", maxfev=20000)
    return tuple(float(p) for p in popt)


def fit_power_law(x, y, n_boot: int = 1000, level: float = 0.95, seed: int = 0) -> PowerLawFit:
    """Fit L = E + A x^-alpha to points (x_i, L_i) (several points per x: seeds). Raises FitError when there are
    fewer than 3 distinct x or the optimizer fails."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(np.unique(x)) < 3:
        raise FitError(f"needs points at >= 3 distinct x (has {len(np.unique(x))})")
    if np.any(x <= 0) or not np.all(np.isfinite(y)):
        raise FitError("x must be positive and the losses finite")
    scale = float(np.exp(np.mean(np.log(x))))
    u = x / scale
    try:
        E, a, alpha = _fit_scaled(u, y, _start(u, y))
    except (RuntimeError, ValueError) as e:
        raise FitError(f"the optimizer did not converge ({e})") from None
    law = PowerLaw(E, a * scale ** alpha, alpha)
    boot = []
    n = len(y)
    if n > 3 and n_boot > 0:
        fitted = _curve(u, E, a, alpha)
        resid = (y - fitted) * math.sqrt(n / (n - 3))
        rng = np.random.default_rng(seed)
        for _ in range(n_boot):
            y_b = fitted + rng.choice(resid, size=n, replace=True)
            try:
                Eb, ab, alb = _fit_scaled(u, y_b, (E, a, alpha))
            except (RuntimeError, ValueError):
                continue
            boot.append((Eb, ab * scale ** alb, alb))
    return PowerLawFit(law, x, y, np.array(boot).reshape(-1, 3), level)


@dataclass
class Multiplier:
    x: float  # the baseline's compute
    loss: float  # the baseline curve's loss there
    x_other: float  # the compute at which the other curve reaches that loss (inf: never)
    value: float  # x / x_other: how many times less compute the other needs (0: it never gets there)
    interval: Optional[tuple[float, float]]
    extrapolated: bool  # x_other lies outside the other curve's fitted range


def _ratio(x: float, x_other: float) -> float:
    """x / x_other: 0 when the other curve never reaches the loss (inf), inf when it reaches it at no compute."""
    if math.isinf(x_other):
        return 0.0
    return x / x_other if x_other > 0 else math.inf


def compute_multiplier(base: PowerLawFit, other: PowerLawFit, x: float) -> Multiplier:
    """How many times less compute `other` needs to reach the loss that `base`'s curve has at compute x. The
    interval pairs the i-th bootstrap refits of both curves (independent resamples)."""
    loss = float(base.law.predict(x))
    x_other = other.law.inverse(loss)
    value = _ratio(x, x_other)
    interval = None
    k = min(len(base.boot), len(other.boot))
    if k >= 2:
        pairs = zip(base.replicates()[:k], other.replicates()[:k])
        reps = [_ratio(x, o.inverse(float(b.predict(x)))) for b, o in pairs]
        q = (1 - base.level) / 2  # order statistics (no interpolation): replicates may be 0 or inf
        interval = tuple(float(np.quantile(reps, p, method="inverted_cdf")) for p in (q, 1 - q))
    lo, hi = float(other.x.min()), float(other.x.max())
    return Multiplier(x, loss, x_other, value, interval, not (lo <= x_other <= hi))
