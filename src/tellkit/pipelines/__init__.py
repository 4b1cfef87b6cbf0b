"""Inference pipelines: a trained checkpoint in, answers out. The CLI (``tellkit caption``,
``tellkit recognize``, ``tellkit demo``, ...) and the HTTP server both call these; neither holds
model code of its own.

- :mod:`tellkit.pipelines.captioning`: image (+ article) -> caption with per-token attention.
- :mod:`tellkit.pipelines.recognition`: handwritten-math image -> LaTeX (BTTR).
- :mod:`tellkit.pipelines.summarization`: transcript (+ video features) -> summary.
- :mod:`tellkit.pipelines.base`: what every pipeline reports about its model (``info``).

Modules are imported on demand: ``import tellkit.pipelines`` loads no model code.
"""
