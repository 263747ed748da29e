"""Integrations of gbmpo's objectives into other training frameworks.

Each integration lives in its own submodule and imports its framework only when that submodule
is imported, so ``import gbmpo.integrations`` stays light:

* :mod:`gbmpo.integrations.trl`: ``GBMPOConfig`` / ``GBMPOTrainer``, drop-in subclasses of TRL's
  ``GRPOConfig`` / ``GRPOTrainer`` (needs the ``trl`` extra: ``pip install 'gbmpo[trl]'``).
* :mod:`gbmpo.integrations.verl`: a verl plugin registering gbmpo's surrogates as verl policy
  losses (``loss_mode=gbmpo_<name>``) and its regularizers as verl's actor KL loss
  (``kl_loss_type=gbmpo_<name>``); needs the ``verl`` extra in its own environment
  (``bash scripts/install_verl_env.sh`` builds ``.venv-verl``).
"""

__all__: list[str] = []
