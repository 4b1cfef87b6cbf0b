"""Metrics. Captions: ``caption.score_captions`` (BLEU-1..4, METEOR, ROUGE-L, CIDEr-D with the COCO
caption code), ``ner.entity_scores`` (spaCy entities, names, rare proper nouns),
``linguistic.linguistic_scores`` (length, type-token ratio, Flesch). Other tasks: ``exprate``
(handwritten maths), ``rouge`` (summaries)."""
