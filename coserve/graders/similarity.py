"""`text_similarity` scores in [0, 1], each from the maintained library that defines the metric (the ones
OpenAI's graders guide names), never a hand-written metric:

- `fuzzy_match`: RapidFuzz's `fuzz.WRatio` with its default processing (lower case, no punctuation) / 100;
- `bleu`: sacreBLEU's `sentence_bleu` / 100 (its default tokenizer and smoothing);
- `gleu`: NLTK's `sentence_gleu` over whitespace tokens;
- `rouge_1` ... `rouge_5`, `rouge_l`: Google's `rouge-score` F-measure (`rouge1` ... `rougeL`);
- `meteor`: NLTK's `meteor_score`, which needs the WordNet corpus: served only where NLTK finds it;
- `cosine`: needs an embedding model, which coserve does not serve: refused (`unsupported`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from coserve.contract.grader import SimilarityMetric

_ROUGE = {SimilarityMetric.ROUGE_1: "rouge1", SimilarityMetric.ROUGE_2: "rouge2", SimilarityMetric.ROUGE_3: "rouge3",
          SimilarityMetric.ROUGE_4: "rouge4", SimilarityMetric.ROUGE_5: "rouge5", SimilarityMetric.ROUGE_L: "rougeL"}


@cache
def _has_wordnet() -> bool:
    try:
        from nltk.corpus import wordnet

        wordnet.ensure_loaded()
    except LookupError:
        return False
    return True


def unsupported(metric: SimilarityMetric) -> str | None:
    """Why this server cannot compute `metric`; None when it can."""
    if metric == SimilarityMetric.COSINE:
        return ("evaluation_metric 'cosine' compares embeddings from an embedding model, and coserve serves "
                "none; use fuzzy_match, bleu, gleu or a rouge metric")
    if metric == SimilarityMetric.METEOR and not _has_wordnet():
        return ("evaluation_metric 'meteor' needs NLTK's WordNet corpus, which is not installed on this server "
                "(python -m nltk.downloader wordnet); use fuzzy_match, bleu, gleu or a rouge metric")
    return None


@cache
def _rouge_scorer(kind: str) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([kind])


def similarity(metric: SimilarityMetric, text: str, reference: str) -> float:
    """The score of `text` against `reference` (module docstring); ValueError for an unsupported metric."""
    reason = unsupported(metric)
    if reason is not None:
        raise ValueError(reason)
    if metric == SimilarityMetric.FUZZY_MATCH:
        from rapidfuzz import fuzz, utils

        return float(fuzz.WRatio(text, reference, processor=utils.default_process)) / 100.0
    if metric == SimilarityMetric.BLEU:
        import sacrebleu

        return float(sacrebleu.sentence_bleu(text, [reference]).score) / 100.0
    if metric == SimilarityMetric.GLEU:
        from nltk.translate.gleu_score import sentence_gleu

        return float(sentence_gleu([reference.split()], text.split()))
    if metric == SimilarityMetric.METEOR:
        from nltk.translate.meteor_score import meteor_score

        return float(meteor_score([reference.split()], text.split()))
    kind = _ROUGE[metric]
    return float(_rouge_scorer(kind).score(reference, text)[kind].fmeasure)
