r"""The verl plugin's public path: gbmpo's surrogates as verl policy losses, its regularizers as
verl's KL loss (the code: :mod:`gbmpo.engines.verl.plugin`, whose doc says how it loads and what
it registers). verl's ``verl.plugins`` entry point, ``VERL_USE_EXTERNAL_MODULES`` and the Hydra
target ``gbmpo.integrations.verl.GBMPOPolicyLossConfig`` name this module; importing it imports
the plugin (which registers with verl). ``python -m gbmpo.integrations.verl``: the plugin's
:func:`~gbmpo.engines.verl.plugin.main` (without verl: one line naming verl's environment, exit 2).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

__all__ = ["PREFIX", "SUPPORTED_VERL", "GBMPOPolicyLossConfig", "SumPenalty", "VerlInternalsError",
           "build_objective", "build_regularizer", "build_sum", "build_surrogate",
           "check_verl_internals", "configure_kl", "current_objective", "describe",
           "gbmpo_kl_penalty", "install_kl_hook", "kl_loss_types", "main", "objective_overrides",
           "policy_loss_names", "register_policy_losses", "surrogate_params"]  # fmt: skip

try:
    from gbmpo.engines.verl.plugin import (
        PREFIX,
        SUPPORTED_VERL,
        GBMPOPolicyLossConfig,
        SumPenalty,
        VerlInternalsError,
        build_objective,
        build_regularizer,
        build_sum,
        build_surrogate,
        check_verl_internals,
        configure_kl,
        current_objective,
        describe,
        gbmpo_kl_penalty,
        install_kl_hook,
        kl_loss_types,
        main,
        objective_overrides,
        policy_loss_names,
        register_policy_losses,
        surrogate_params,
    )
except ImportError:  # pragma: no cover - exercised only without verl
    if __name__ != "__main__":
        raise
    # `python -m gbmpo.integrations.verl` without verl: one line, exit 2, naming the verl
    # environment of this checkout (or of the current directory) where built
    _found = [p for p in (Path(".venv-verl/bin/python"),
                          Path(__file__).resolve().parents[3] / ".venv-verl/bin/python")
              if p.exists()]  # fmt: skip
    _cmd = "-m gbmpo.integrations.verl " + shlex.join(sys.argv[1:])
    print(
        f"python -m gbmpo.integrations.verl: verl is not installed in {sys.executable}; "
        + (f"run it in verl's environment: {_found[0]} {_cmd}".rstrip()
           if _found else "`make verl` builds verl's environment (.venv-verl; verl needs "
           f"transformers<5.11), then run .venv-verl/bin/python {_cmd}".rstrip()),
        file=sys.stderr,
    )  # fmt: skip
    raise SystemExit(2) from None

if __name__ == "__main__":
    raise SystemExit(main())
