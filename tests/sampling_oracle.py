"""The float64 oracle of sampling's filters, for the tests that check sampled tokens' distribution."""
import numpy as np


def filtered(p: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """float64 top-k then top-p (the smallest set of the most likely tokens whose mass reaches top_p), renormalised."""
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), bool)
    keep[order[:top_k or len(p)]] = True
    p = np.where(keep, p, 0) / p[keep].sum()
    ordered = p[order]
    kept = order[(np.cumsum(ordered) - ordered) < top_p]
    out = np.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()
