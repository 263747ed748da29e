"""Engine ``verl`` and the verl plugin, one package: verl's ``main_ppo`` with gbmpo's objective.

* the plugin (public path :mod:`gbmpo.integrations.verl`, verl's ``verl.plugins`` entry point):
  :mod:`~gbmpo.engines.verl.plugin` (gbmpo's surrogates as verl policy losses, its regularizers
  as verl's KL loss), :mod:`~gbmpo.engines.verl.build` (verl's actor config -> gbmpo objects),
  :mod:`~gbmpo.engines.verl.internals` (the verl internals hooked and their check),
  :mod:`~gbmpo.engines.verl.objective` (an objective spec -> verl's overrides);
* in verl's processes: :mod:`~gbmpo.engines.verl.driver` (gbmpo's hooks in verl's trainer),
  :mod:`~gbmpo.engines.verl.reward` (the task's reward), :mod:`~gbmpo.engines.verl.cpu` (the CPU
  platform and rollout of a CPU run);
* the engine (``gbmpo train --engine verl``): :mod:`~gbmpo.engines.verl.engine` (the registry's
  entry), :mod:`~gbmpo.engines.verl.args` (a config -> Hydra overrides),
  :mod:`~gbmpo.engines.verl.runner` (the run), :mod:`~gbmpo.engines.verl.check`,
  :mod:`~gbmpo.engines.verl.metrics`.

Importing the package imports neither torch nor verl.
"""
