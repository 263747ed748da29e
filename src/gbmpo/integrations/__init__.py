"""Integrations of gbmpo's objectives into other training frameworks.

Each integration lives in its own submodule and imports its framework only when that submodule
is imported, so ``import gbmpo.integrations`` stays light:

* :mod:`gbmpo.integrations.trl`: ``GBMPOConfig`` / ``GBMPOTrainer``, drop-in subclasses of TRL's
  ``GRPOConfig`` / ``GRPOTrainer`` (needs the ``trl`` extra: ``pip install 'gbmpo[trl]'``).
"""

__all__: list[str] = []
