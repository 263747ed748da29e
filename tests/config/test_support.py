"""The support matrix: every config key has an answer on every engine, and it is applied."""

from __future__ import annotations

import re

import pytest

from gbmpo.config import ConfigError, TrainConfig, load_config
from gbmpo.config.support import (
    ENGINES,
    HONOURED,
    NO_EFFECT,
    REFUSED,
    REQUIRED,
    SUPPORT,
    check_support,
    config_keys,
    probe_settings,
    render_markdown,
)


def test_every_config_key_has_an_entry_for_every_engine() -> None:
    keys = set(config_keys())
    for engine in ENGINES:
        missing = keys - set(SUPPORT[engine])
        assert not missing, f"engine {engine!r} has no support entry for {sorted(missing)}"
        stale = set(SUPPORT[engine]) - keys
        assert not stale, f"engine {engine!r} has entries for keys that do not exist: {stale}"


def test_a_new_key_without_an_entry_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from gbmpo.config import support

    monkeypatch.setattr(support, "config_keys", lambda: [*config_keys(), "run.brand_new_key"])
    with pytest.raises(ConfigError, match="run.brand_new_key"):
        check_support(TrainConfig())


def _base(engine: str, *overrides: tuple[str, object]) -> TrainConfig:
    """The defaults, with what ``engine`` needs where it refuses a default (REQUIRED)."""
    return load_config(overrides=[*REQUIRED[engine].items(), *overrides])


def test_defaults_pass_on_every_engine() -> None:
    """The own engine's defaults pass everywhere except where an engine needs other values
    (verl: a GPU, no time budget), and then those values pass."""
    for engine in ENGINES:
        assert check_support(_base(engine), engine) == []
        for key in REQUIRED[engine]:  # each required value alone: its default is refused
            others = [(k, v) for k, v in REQUIRED[engine].items() if k != key]
            with pytest.raises(ConfigError, match=key):
                check_support(load_config(overrides=others), engine)


@pytest.mark.parametrize(
    ("engine", "key"),
    [(e, k) for e in ENGINES for k, s in SUPPORT[e].items() if s.status == REFUSED],
)
def test_every_refused_entry_refuses_its_probe(engine: str, key: str) -> None:
    entry = SUPPORT[engine][key]
    assert entry.how, f"{engine}/{key}: a refusal says why"
    assert entry.probe is not None, f"{engine}/{key}: a refusal names a refused value (probe)"
    cfg = _base(engine, *probe_settings(key, entry.probe))
    with pytest.raises(ConfigError, match=rf"{key}.*engine {engine!r}"):
        check_support(cfg, engine)


def test_no_effect_key_at_a_non_default_value_gives_one_notice() -> None:
    cfg = load_config(overrides=[("rollout.lean_decoder", "false")])
    notices = check_support(cfg, "gbmpo")
    assert len(notices) == 1 and "rollout.lean_decoder" in notices[0]
    assert SUPPORT["gbmpo"]["rollout.lean_decoder"].status == NO_EFFECT


def test_decode_step_is_checked_and_changes_no_result_on_any_engine() -> None:
    """``rollout.decode_step`` (the own sampler's decode step): an unknown value is refused
    with the valid ones; the own engine and verl list it as a speed key (a notice when set);
    TRL honours it (transformers' static or dynamic cache: tests/engines/test_trl_support.py),
    with no notice."""
    from gbmpo.config import validate

    with pytest.raises(ConfigError, match="'rollout.decode_step': unknown decode step 'graph'; "
                                          "valid: auto, static, lean"):  # fmt: skip
        validate(load_config(overrides=[("rollout.decode_step", "graph")]))
    assert {e: SUPPORT[e]["rollout.decode_step"].status for e in ENGINES} == {
        **{e: NO_EFFECT for e in ENGINES}, "trl": HONOURED}
    static = load_config(overrides=[("rollout.decode_step", "static")])
    notices = check_support(static, "gbmpo")
    assert len(notices) == 1 and "rollout.decode_step" in notices[0]
    assert check_support(static, "trl") == []


def test_decode_buffers_is_checked_and_changes_no_result_on_any_engine() -> None:
    """``rollout.decode_buffers`` (keep or free the static step's buffers between rollouts): an
    unknown value is refused with the valid ones; no engine's results depend on it (a notice
    when set), TRL and verl name the own engine's decoder as the reason."""
    from gbmpo.config import validate

    with pytest.raises(ConfigError, match="'rollout.decode_buffers': unknown choice 'free'; "
                                          "valid: auto, keep, release"):  # fmt: skip
        validate(load_config(overrides=[("rollout.decode_buffers", "free")]))
    assert all(SUPPORT[e]["rollout.decode_buffers"].status == NO_EFFECT for e in ENGINES)
    assert all("own engine's decoder" in SUPPORT[e]["rollout.decode_buffers"].how
               for e in ENGINES if e != "gbmpo")  # fmt: skip
    cfg = load_config(overrides=[("rollout.decode_buffers", "release")])
    notices = check_support(cfg, "gbmpo")
    assert len(notices) == 1 and "rollout.decode_buffers" in notices[0]


def test_own_engine_refuses_several_processes() -> None:
    cfg = load_config(overrides=[("run.num_processes", "2")])
    with pytest.raises(ConfigError, match=r"run.num_processes.*engine 'gbmpo'"):
        check_support(cfg, "gbmpo")


def test_markdown_has_one_table_per_section_and_every_key_once() -> None:
    text = render_markdown()
    keys = config_keys()
    sections = {k.split(".", 1)[0] for k in keys}
    assert text.count("| key | engine | what happens |") == len(sections)
    shown = re.findall(r'^\| <code class="config-key">([^<]*(?:<wbr>[^<]*)*)</code> \|', text, re.M)
    assert [k.replace("<wbr>", "") for k in shown] == keys
    # placeholders outside code spans are escaped, not read as HTML tags
    assert "reg/<name>" not in text.replace("`reg/<name>`", "")
    assert "model.<wbr>dtype</code> | gbmpo | honoured, **some values refused**: float16" in text


def test_validate_refuses_for_the_configured_engine() -> None:
    from gbmpo.config import validate

    with pytest.raises(ConfigError, match=r"run.num_nodes.*engine 'gbmpo'"):
        validate(load_config(overrides=[("run.num_nodes", "2")]))


def test_cli_refuses_before_writing_and_prints_notices_once(
    tmp_path, capsys: pytest.CaptureFixture
) -> None:
    from gbmpo.cli import main

    out = tmp_path / "run"
    assert main(["train", "--run.num_processes", "2", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "run.num_processes" in err and "'gbmpo'" in err and not out.exists()
    argv = ["train", "--dry-run", "--rollout.lean_decoder", "false"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("note: rollout.lean_decoder=False has no effect on results") == 1


def test_docs_page_holds_the_current_matrix() -> None:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "render_support_matrix.py"
    mod = runpy.run_path(str(script))
    text = mod["PAGE"].read_text()
    assert mod["rendered"](text) == text, "run python scripts/render_support_matrix.py"
