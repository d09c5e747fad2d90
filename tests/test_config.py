from pathlib import Path

import pytest
from pydantic import BaseModel
from typing import get_args

from whale.config import ConfigError, Config, apply_override, dump_config, load_config
from whale.domains import load_domain
from whale.schedule import Schedule


def test_defaults_validate():
    cfg = Config()
    assert cfg.sampling.top_k == 20 and cfg.weight.accept_threshold == 0.5


def test_unknown_key_names_the_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("weight:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="unknown config key 'weight.learning_rate'"):
        load_config(p)


@pytest.mark.parametrize("override, hint", [("harness.confirm_round=3", "did you mean 'confirm_rounds'"),
                                            ("schedul.kind=gain", "did you mean 'schedule'"),
                                            ("sampling.temprature=1", "did you mean 'temperature'")])
def test_a_misspelt_key_suggests_the_near_one(override, hint):
    with pytest.raises(ConfigError, match=hint):
        load_config(None, [override])


def test_an_unknown_key_with_nothing_near_suggests_nothing():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["weight.zzzz=1"])
    assert "did you mean" not in str(err.value)


def test_bad_value_names_key_and_value():
    with pytest.raises(ConfigError, match=r"config key 'sampling.temperature'.*-1"):
        load_config(None, ["sampling.temperature=-1"])


def test_overrides_parse_yaml_values():
    cfg = load_config(None, ["weight.lr=1e-4", "eval.splits=[test]", "schedule.kind=weight_only", "name=x y"])
    assert cfg.weight.lr == 1e-4 and cfg.eval.splits == ["test"] and cfg.schedule.kind == "weight_only"
    assert cfg.name == "x y"


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_override({}, "weight.lr")


def test_bad_choice_lists_the_value():
    with pytest.raises(ConfigError, match="schedule.kind"):
        load_config(None, ["schedule.kind=sometimes"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_dump_roundtrip(tmp_path):
    cfg = load_config(None, ["seed=3", "domain.name=chess"])
    p = tmp_path / "c.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg


@pytest.mark.parametrize("name", ["demo", "searchqa_cpu", "math_cpu", "chess_cpu", "searchqa_qwen3.5-2b",
                                  "math_qwen3.5-2b", "chess_qwen3.5-4b", "math_qwen3.5-2b_full_8gpu",
                                  "math_qwen3.5-2b_full_1gpu"])
def test_shipped_configs_validate(name):
    path = Path(__file__).parent.parent / "configs" / f"{name}.yaml"
    load_domain(load_config(path))  # the domain reads every setting the config gives (no data loaded yet)


@pytest.mark.parametrize("sets, key", [
    (["model.base_url=http://127.0.0.1:8000/v1"], "model.base_url"),  # the hf backend serves in-process
    (["model.backend=openai", "model.base_url=http://x/v1", "model.vllm_args=[--enforce-eager]"], "model.vllm_args"),
    (["model.api_key_env=MY_KEY"], "model.api_key_env"),
    (["compute.ray_address=ray://head:10001"], "compute.ray_address"),
    (["weight.finetune=full", "weight.lora.r=64"], "weight.lora"),
    (["model.colocate=true"], "model.colocate"),  # sleep mode is vLLM's
])
def test_settings_the_mode_ignores_are_errors(sets, key):
    with pytest.raises(ConfigError, match=f"'{key}' is read only with"):
        load_config(None, sets)


def test_settings_read_in_their_mode_are_accepted():
    cfg = load_config(None, ["model.backend=vllm", "model.base_url=http://x/v1", "model.vllm_args=[--enforce-eager]",
                             "compute.executor=ray", "compute.ray_address=auto", "weight.lora.r=8"])
    assert cfg.model.vllm_args == ["--enforce-eager"] and cfg.compute.ray_address == "auto"
    assert load_config(None, ["model.backend=openai", "model.base_url=http://x/v1", "model.api_key_env=K"])


def test_a_retired_key_loads_from_an_old_run_and_is_an_error_when_set():
    """Run directories saved every key at its value: an old run's config.yaml must still load (for
    `whale eval --run`, `whale matrix`, `--resume`); a config that sets the key is told it is gone."""
    from whale.config import ConfigError, config_from_dict, load_config

    old = {"runner": {"concurrency": 8, "batch_window_ms": 20.0}}
    assert config_from_dict(old).runner.concurrency == 8
    with pytest.raises(ConfigError, match="'runner.batch_window_ms' was removed: continuous batching"):
        load_config(None, ["runner.batch_window_ms=5"])
    nested = {"runner": {"concurrency": 8, "sandbox": {"memory_mb": 512, "output_bytes": 1_000_000}}}
    cfg = config_from_dict(nested)
    assert (cfg.runner.concurrency, cfg.runner.sandbox.memory_mb) == (8, 512)
    assert nested["runner"]["sandbox"]["output_bytes"] == 1_000_000  # the caller's tree is left as it was
    with pytest.raises(ConfigError, match="'runner.sandbox.output_bytes' was removed: it was never read"):
        load_config(None, ["runner.sandbox.output_bytes=10"])
    engine = {"model": {"name": "x", "mixed_forwards": True, "packed_gemm": True}}  # removed 2026-12-06
    assert config_from_dict(engine).model.name == "x"
    for key in ("mixed_forwards", "packed_gemm"):
        with pytest.raises(ConfigError, match=f"'model.{key}' was removed: .* no effect on whole runs"):
            load_config(None, [f"model.{key}=false"])


def test_demo_budget_keeps_its_last_weight_phase():
    """The demo's plan (configs/demo.yaml): W1 of one step, one harness phase (re-score the incoming
    harness, one iteration of M candidates, the winner and the incoming harness re-run on fresh
    seeds with confirm_samples each), then W2 of five steps. Raising the confirmation's samples
    without raising the budget would silently cut W2, the phase that buys most of the gain."""
    cfg = load_config(Path(__file__).parent.parent / "configs" / "demo.yaml")
    harness_n = cfg.domain.splits.harness
    schedule = Schedule.for_config(cfg, steps_per_epoch=1, harness_problems=harness_n)
    step = schedule.weight_step_cost
    rescore = harness_n * cfg.harness.samples_per_example  # the phase's first iteration re-scores the incoming harness
    harness_phase = rescore + (cfg.schedule.harness_iterations - 1) * schedule.harness_iteration_cost \
        + schedule.harness_phase_extra
    assert cfg.harness.confirm_samples >= 3  # one fresh sample per problem missed a true +0.13 (docs/results/demo/README.md)
    assert cfg.schedule.budget_rollouts - step - harness_phase == 5 * step


def test_every_key_is_described_and_docs_config_md_is_current():
    """docs/config.md is `whale config --reference`; a new key without a description, or a changed
    default, fails here until the doc is regenerated (whale config --reference > docs/config.md)."""
    from pydantic import BaseModel

    from whale.config import config_reference

    def undescribed(model, prefix=""):
        for key, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                yield from undescribed(field.annotation, f"{prefix}{key}.")
            elif not field.description:
                yield prefix + key

    assert list(undescribed(Config)) == []
    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    assert doc == config_reference() + "\n", "regenerate: whale config --reference > docs/config.md"
    assert "| `harness.confirm_rounds` | int (>= 1) | `1` |" in doc


def test_whale_config_prints_a_config_that_loads_back_the_same(tmp_path):
    from typer.testing import CliRunner

    from whale.cli import app

    result = CliRunner().invoke(app, ["config", "--set", "seed=7", "--set", "harness.confirm_rounds=3"])
    assert result.exit_code == 0, result.output
    (tmp_path / "c.yaml").write_text(result.stdout)
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.seed, cfg.harness.confirm_rounds) == (7, 3)
    assert cfg.model_dump() == load_config(None, ["seed=7", "harness.confirm_rounds=3"]).model_dump()


# Numbers whose every finite value means something: a reward threshold (verifiers rubrics' rewards
# are unclipped weighted sums, and -1 trains on every rollout). Every other number has a range.
FINITE_ONLY = {"weight.accept_threshold"}


def numeric_fields(model=Config, prefix=""):
    """(key, number type, field) for every int/float field of the config tree, optional ones included."""
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from numeric_fields(ann, f"{prefix}{name}.")
            continue
        kinds = [a for a in (get_args(ann) or (ann,)) if a is not type(None)]
        nested = [a for a in kinds for a in (get_args(a) or (a,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        for sub in nested:  # models inside lists (harness.agent_binds)
            yield from numeric_fields(sub, f"{prefix}{name}.")
        if len(kinds) == 1 and kinds[0] in (int, float):
            yield f"{prefix}{name}", kinds[0], field


def out_of_range(number, field):
    """(value, the words of the range it breaks) for each bound of the field."""
    for bound in field.metadata:
        for attr, step, words in (("ge", -1, "greater than or equal to"), ("gt", 0, "greater than"),
                                  ("le", 1, "less than or equal to"), ("lt", 0, "less than")):
            limit = getattr(bound, attr, None)
            if limit is not None:
                yield number(limit + step), f"{words} {limit:g}"


def test_every_number_in_the_config_tree_has_a_range_and_out_of_range_values_are_refused():
    """A field added without bounds fails here: every count, size, probability, budget and duration
    needs a range, and a value outside it is an error naming the key and the range."""
    fields = list(numeric_fields())
    assert len(fields) > 60 and "schedule.budget_rollouts" in [k for k, _, _ in fields]
    unbounded = [k for k, number, f in fields if not list(out_of_range(number, f)) and k not in FINITE_ONLY]
    assert not unbounded, f"config numbers without a range (add ge/gt/le/lt in whale/config.py): {unbounded}"
    for key, number, field in fields:
        lower = [b for b in field.metadata if getattr(b, "ge", None) is not None or getattr(b, "gt", None) is not None]
        assert lower or key in FINITE_ONLY, f"{key} has no lower bound"
        for value, words in out_of_range(number, field):
            with pytest.raises(ConfigError) as err:
                load_config(None, [f"{key}={value}"])
            message = str(err.value)
            assert f"'{key}'" in message and words in message and "\n" not in message, (key, value, message)
        if number is float:
            with pytest.raises(ConfigError, match=f"'{key}'.*finite"):
                load_config(None, [f"{key}=.nan"])


def test_a_negative_rollout_budget_is_refused_by_the_command_line():
    from typer.testing import CliRunner

    from whale.cli import app

    result = CliRunner().invoke(app, ["run", str(Path(__file__).parents[1] / "configs" / "demo.yaml"),
                                      "--set", "schedule.budget_rollouts=-5", "--out", "/nonexistent/never"])
    assert result.exit_code == 2
    assert "'schedule.budget_rollouts': Input should be greater than or equal to 1 (got -5)" in \
        " ".join(result.output.split()), result.output


@pytest.mark.parametrize("sets, message", [
    (["harness.min_iterations=20"], "config section 'harness': min_iterations (20) must be <= max_iterations (15)"),
    (["sampling.max_tokens=2048"], "config section 'sampling': max_tokens (2048) must be <= max_tokens_cap (1024)"),
])
def test_keys_that_bound_each_other_are_checked_together(sets, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, sets)
    assert str(err.value) == message
