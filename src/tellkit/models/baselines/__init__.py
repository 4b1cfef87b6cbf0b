"""The baselines that tellkit's systems are measured against, each one readable file:

- ``show_tell``: Show and Tell (Vinyals et al. 2015), image vector -> LSTM;
- ``show_attend_tell``: Show, Attend and Tell (Xu et al. 2015), soft attention over the grid;
- ``lstm_captioner``: the LSTM rows of Transform and Tell's ablation (same contexts as the
  Transformer decoder);
- ``seq2seq``: RNN encoder-decoder with additive attention (Bahdanau et al. 2015) for the
  summarization task.

The Transformer rows of Transform and Tell's ablation are recipes of the Transform and Tell
model itself (``configs/baselines/``), not models here. Importing this package registers the
families with :mod:`tellkit.registry`.
"""
from tellkit.models.baselines import lstm_captioner, seq2seq, show_attend_tell, show_tell  # noqa: F401

__all__ = ["show_tell", "show_attend_tell", "lstm_captioner", "seq2seq"]
