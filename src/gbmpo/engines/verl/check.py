"""Run in verl's environment: compose verl's ``ppo_trainer.yaml`` with the overrides of a JSON file
and run what ``verl.trainer.main_ppo`` runs before it starts Ray (``validate_config``, which builds
the actor config through Hydra, i.e. ``GBMPOPolicyLossConfig``), then build the gbmpo objective
the actor config selects; first it checks that verl's trainer has the functions gbmpo's driver
hooks wrap (:func:`gbmpo.engines.verl.driver.check`). Prints one JSON line; exits non-zero
(the error on stderr) if verl rejects the config. Used by ``gbmpo train --engine verl --dry-run``::

    python -m gbmpo.engines.verl.check overrides.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def check(overrides: list[str]) -> dict[str, str]:
    """Compose and validate; returns what the actor's loss selects."""
    # deferred: verl and hydra are optional (this runs in verl's environment)
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from gbmpo.engines.verl import driver as verl_driver
    from gbmpo.engines.verl import plugin as gv

    verl_driver.check()  # the trainer functions the driver hooks wrap (one line if they moved)
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg),
                    use_critic=need_critic(cfg))  # fmt: skip
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    chosen = gv.describe(actor)
    surrogate, regularizer = chosen["surrogate"], chosen["regularizer"]
    return {
        "verl": str(verl.__version__),
        "surrogate": getattr(surrogate, "name", str(actor.policy_loss.loss_mode)),
        "regularizer": getattr(regularizer, "name", "verl kl" if actor.use_kl_loss else "none"),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    overrides = json.loads(Path(args[0]).read_text())
    try:
        result = check(overrides)
    except Exception as err:  # noqa: BLE001 - report any rejection in one line
        print(f"{type(err).__name__}: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
