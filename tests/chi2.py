"""The chi-square goodness-of-fit test the sampling tests share (lossless = same distribution)."""
import math

import torch


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at p = 0.001 (z = 3.09)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of observed ``counts`` against ``probs``; outcomes expected
    fewer than 5 times are pooled into one bin so the statistic is valid. An outcome of
    probability 0 that was observed (e.g. outside the top-p nucleus) makes the statistic inf."""
    if counts[probs == 0].sum() > 0:
        return float("inf"), max(int((probs > 0).sum()) - 1, 1)
    expected = probs * counts.sum()
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    nz = exp > 0
    return float(((obs[nz] - exp[nz]) ** 2 / exp[nz]).sum()), int(nz.sum()) - 1
