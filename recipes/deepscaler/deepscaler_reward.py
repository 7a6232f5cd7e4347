"""DeepScaleR reward for verl (`reward.custom_reward_function.path=<this file>`, `name=compute_score`).

score = FORMAT_WEIGHT * format_ok + (1 - FORMAT_WEIGHT) * correct, where
- format_ok: the response has a final \\boxed{...} answer (after </think> when the model thinks in tags);
- correct: that boxed answer equals the ground truth (any of them, if a list) after light LaTeX normalisation,
  or numerically (integers, decimals, fractions a/b and \\frac{a}{b}).
Pure Python, no third-party imports.
"""

from __future__ import annotations

import re
from fractions import Fraction

FORMAT_WEIGHT = 0.1


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces matched; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0 or text[start:i].strip() not in ("\\boxed", "\\fbox"):
        m = re.match(r"\\boxed\s+([^\s$]+)", text[start:])  # "\boxed 5"
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def normalize(answer: str) -> str:
    s = answer.strip()
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\mbox\{(.*?)\}", r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("dfrac", "frac"),
                     ("tfrac", "frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("%", ""), ("$", "")):
        s = s.replace(old, new)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
    s = s.replace(" ", "").rstrip(".")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+", s):
        s = s.replace(",", "")
    return s


def _as_number(s: str) -> Fraction | None:
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d+/\d+", s) or re.fullmatch(r"-?\d+(\.\d+)?", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def is_equiv(pred: str, truth: str) -> bool:
    p, t = normalize(pred), normalize(truth)
    if p == t:
        return True
    pn, tn = _as_number(p), _as_number(t)
    return pn is not None and tn is not None and pn == tn


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl custom reward: returns {"score", "acc", "format"}."""
    text = solution_str.split("</think>")[-1] if "<think>" in solution_str or "</think>" in solution_str \
        else solution_str
    boxed = last_boxed(text)
    truths = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    correct = boxed is not None and any(is_equiv(boxed, str(t)) for t in truths)
    format_ok = boxed is not None
    score = FORMAT_WEIGHT * float(format_ok) + (1.0 - FORMAT_WEIGHT) * float(correct)
    return {"score": score, "acc": float(correct), "format": float(format_ok)}
