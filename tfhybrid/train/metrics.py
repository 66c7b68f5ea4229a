"""Exact evaluation metrics over gathered predictions: ROC AUC and log loss.

Keras' streaming ``AUC`` bins scores into thresholds, and a per-rank AUC averaged over
ranks is not the global AUC. The app gathers every rank's scores instead and computes
these exactly, so a 1-process and a 4-process run of the same model agree.
"""

from __future__ import annotations

import numpy as np


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The area under the ROC curve: P(score of a positive > score of a negative), ties 1/2.

    Example::

        from tfhybrid.train.metrics import roc_auc
        assert roc_auc([0, 1, 0, 1], [0.1, 0.9, 0.2, 0.2]) == 0.875
    """
    labels = np.asarray(labels).reshape(-1)
    scores = np.asarray(scores, np.float64).reshape(-1)
    if labels.shape != scores.shape:
        raise ValueError(f"labels has {labels.size} values but scores has {scores.size}")
    if not np.all((labels == 0) | (labels == 1)):
        raise ValueError(f"labels must be 0 or 1; got values {np.unique(labels)[:10]}")
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        raise ValueError(f"AUC needs both classes; got {positives} positives and "
                         f"{negatives} negatives")
    # Mann-Whitney U from ranks; tied scores share their average rank
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, np.float64)
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    average_rank = (starts + ends + 1) / 2.0          # 1-based ranks
    ranks[order] = np.repeat(average_rank, ends - starts)
    positive_rank_sum = ranks[labels == 1].sum()
    return float((positive_rank_sum - positives * (positives + 1) / 2.0)
                 / (positives * negatives))


def log_loss(labels: np.ndarray, probabilities: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities (clipped to [eps, 1 - eps]).

    Example::

        from tfhybrid.train.metrics import log_loss
        assert abs(log_loss([1, 0], [0.5, 0.5]) - 0.693147) < 1e-6
    """
    labels = np.asarray(labels, np.float64).reshape(-1)
    p = np.clip(np.asarray(probabilities, np.float64).reshape(-1), eps, 1 - eps)
    if labels.shape != p.shape:
        raise ValueError(f"labels has {labels.size} values but probabilities has {p.size}")
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log1p(-p)))
