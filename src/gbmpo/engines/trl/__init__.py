"""Engine ``trl`` and the TRL drop-in, one package: TRL's ``GRPOTrainer`` with gbmpo's loss.

* the drop-in (public path :mod:`gbmpo.integrations.trl`): :mod:`~gbmpo.engines.trl.config`
  (``GBMPOConfig``), :mod:`~gbmpo.engines.trl.trainer` (``GBMPOTrainer``),
  :mod:`~gbmpo.engines.trl.objective`, :mod:`~gbmpo.engines.trl.formulas`,
  :mod:`~gbmpo.engines.trl.full`, :mod:`~gbmpo.engines.trl.correction`,
  :mod:`~gbmpo.engines.trl.fields`, :mod:`~gbmpo.engines.trl.internals`;
* the engine (``gbmpo train --engine trl``): :mod:`~gbmpo.engines.trl.engine` (the registry's
  entry), :mod:`~gbmpo.engines.trl.args` (a config -> ``GBMPOConfig``, from TRL's table
  :mod:`gbmpo.config.hosts.trl`), :mod:`~gbmpo.engines.trl.runner` (the run, under
  ``accelerate launch``), :mod:`~gbmpo.engines.trl.callbacks`,
  :mod:`~gbmpo.engines.trl.checkpoints`, :mod:`~gbmpo.engines.trl.stop`.

Importing the package imports neither torch nor TRL (the engine registry imports
:mod:`~gbmpo.engines.trl.engine` without them).
"""
