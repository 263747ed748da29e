"""The public import paths of gbmpo's objectives inside other training frameworks.

The code lives in the engine packages (:mod:`gbmpo.engines.trl`, :mod:`gbmpo.engines.verl`);
these modules re-export it, and each imports its framework only when imported, so
``import gbmpo.integrations`` stays light:

* :mod:`gbmpo.integrations.trl`: ``GBMPOConfig`` / ``GBMPOTrainer``, drop-in subclasses of TRL's
  ``GRPOConfig`` / ``GRPOTrainer`` (needs the ``trl`` extra: ``pip install 'gbmpo[trl]'``).
* :mod:`gbmpo.integrations.verl`: a verl plugin registering gbmpo's surrogates as verl policy
  losses (``loss_mode=gbmpo_<name>``) and its regularizers as verl's actor KL loss
  (``kl_loss_type=gbmpo_<name>``); verl's entry point and Hydra target name this module. It
  needs the ``verl`` extra in its own environment (``bash scripts/install_verl_env.sh`` builds
  ``.venv-verl``).
"""

__all__: list[str] = []
