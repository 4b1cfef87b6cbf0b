"""Writing a tellkit checkpoint out in another form: ``tellkit export SRC --format FORMAT --out OUT``.

One module per format:

- :mod:`tellkit.export.safetensors` (``safetensors``, the default): a compact inference
  checkpoint (float16, float32 or int8 weights, the recipe sections, nothing of the training
  machine); also the weight average of several checkpoints (``tellkit average``).
- :mod:`tellkit.export.onnx` (``onnx``): the checkpoint with its model as ONNX graphs
  (:mod:`tellkit.export.onnx_graphs`) for ``--runtime onnx``.
- :mod:`tellkit.export.reference` (``reference``): the reference implementation's ``.ckpt``.

:func:`tellkit.export.folder.write_checkpoint_folder` puts a written folder in place.
Importing official checkpoints in is :mod:`tellkit.convert` (``tellkit convert``).
"""
from __future__ import annotations

FORMATS = ("safetensors", "onnx", "reference")
